"""A forward call compiles (or loads from the JIT cache) what it runs and nothing more:
no backward kernel, and no other mode, rank or dtype variant of its own; a
sampling backward compiles no other mode, rank, dtype or source of positions.

The calls run in turn in one fresh process (over the test session's cache, so that
their compilation is the one the other tests would do anyway); after each, every
numba dispatcher of numba_ops reports the signatures it gained. A kernel's variant
shows in the arguments that select it: ``x`` (the input: rank and dtype), ``tok`` (DeformConv's
spatial shape: the rank), ``mtok`` (GridSample's mode token; the padding is a
run-time code, one variant for all three). Every signature of a function taking
one of those must be the call's variant, and such a function must have one signature once literal arguments count as
their plain types (a helper called with a literal ``1`` and with a variable is one
variant). With an empty cache every function compiled is seen; with a filled one the
entries and the functions they call through their own code (``_opaque``), which hold
the variants: either way a backward kernel or a second variant shows.
"""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
import numpy as np
import numba_ops
from numba import typeof, types
from numba_ops._dtypes import np_dtype
from numba_ops.kernels._modes import MODES

def signatures():
    out = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("numba_ops."):
            continue
        for v in list(vars(mod).values()):
            if hasattr(v, "py_func") and hasattr(v, "signatures") and v.signatures:
                code = v.py_func.__code__
                key = v.py_func.__module__ + "." + v.py_func.__qualname__
                out[key] = (code.co_varnames[:code.co_argcount], {tuple(s) for s in v.signatures})
    return out

def call(spec):
    rng = np.random.default_rng(0)
    op, nd = spec["op"], spec["nd"]
    dt = np_dtype(spec.get("dtype", "float32"))
    back = spec.get("backward", False)  # the backward alone (its forward's variant is another call's)
    if op == "grid_sample":
        x = rng.standard_normal((1, 2) + (5,) * nd).astype(dt)
        g = rng.uniform(-1.2, 1.2, (1,) + (4,) * nd + (nd,)).astype(dt)
        attrs = dict(mode=spec["mode"], padding_mode=spec["padding"], device="cpu")
        if back:
            numba_ops.grid_sample_backward(np.ones((1, 2) + (4,) * nd, dt), x, g, **attrs)
        else:
            numba_ops.grid_sample(x, g, **attrs)
    elif op == "affine_warp":
        x = rng.standard_normal((1, 2) + (5,) * nd).astype(dt)
        theta = np.concatenate([np.eye(nd), np.full((nd, 1), 0.1)], 1)[None].astype(dt)
        attrs = dict(mode=spec["mode"], padding_mode=spec["padding"], device="cpu")
        if back:
            numba_ops.affine_warp_backward(np.ones_like(x), x, theta, **attrs)
        else:
            numba_ops.affine_warp(x, theta, **attrs)
    else:  # deform_conv: spec["o"] output positions per axis (1: the direct loops; more: the tiled path)
        o = spec["o"]
        x = rng.standard_normal((1, 4) + (o + 2,) * nd).astype(dt)
        w = rng.standard_normal((4, 4) + (3,) * nd).astype(dt)
        off = rng.standard_normal((1, 3 ** nd * nd) + (o,) * nd).astype(dt)
        numba_ops.deform_conv(x, w, off, device="cpu")
    # the selecting arguments' types as the call passes them (grid_sample.TOKEN: a tuple as long as the code)
    want = {"x": str(typeof(x)) if dt.kind != "V" else dt.name, "tok": str(typeof(x.shape[2:]))}  # (numba has no bfloat16)
    if "mode" in spec:
        want.update(mtok=str(typeof((0,) * MODES[spec["mode"]])),
                    atok=str(typeof((0,) * (op == "affine_warp"))))  # (the backward's source of positions)
    return want

out = []
for spec in json.loads(sys.argv[1]):  # each call's new signatures, in one process
    before = signatures()
    want = call(spec)
    new = {}
    for key, (params, sigs) in signatures().items():
        sigs = sigs - before.get(key, ((), set()))[1]
        if sigs:
            new[key] = {"params": params, "sigs": sorted([str(t) for t in s] for s in sigs),
                        "plain": sorted({tuple(str(types.unliteral(t)) for t in s) for s in sigs})}
    out.append({"want": want, "compiled": new})
print("@@" + json.dumps(out))
"""

#: ``_sample``'s helpers that only gradients use
GRADIENT_HELPERS = {"unnormalize_scale", "cubic_dweights", "grad_taps_at", "grad_taps", "grad_taps_nearest",
                    "grad_taps_linear", "grad_taps_cubic"}


CALLS = [
    {"op": "grid_sample", "nd": 2, "mode": "linear", "padding": "zeros"},
    {"op": "affine_warp", "nd": 2, "mode": "nearest", "padding": "border"},
    {"op": "deform_conv", "nd": 2, "o": 1},
    {"op": "deform_conv", "nd": 2, "o": 6},
]


def _run(calls):
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(calls)], capture_output=True, text=True,
                       env=dict(os.environ, NUMBA_NUM_THREADS="1"), timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.split("@@")[-1])


def _assert_own_variant(compiled, want):
    """Every function that takes a variant-selecting argument (``want``'s names) compiled
    one variant, the call's."""
    for name, rec in compiled.items():
        chosen = [j for j, p in enumerate(rec["params"]) if p in want]
        if not chosen:
            continue
        assert len(rec["plain"]) == 1, f"{name} compiled {len(rec['plain'])} variants: {rec['plain']}"
        for j in chosen:
            got = rec["plain"][0][j]
            assert got == want[rec["params"][j]], f"{name}: {rec['params'][j]} is {got}, not the call's {want}"


@pytest.fixture(scope="module")
def compiled():
    return _run(CALLS)


@pytest.mark.parametrize("i", range(len(CALLS)), ids=["-".join(str(v) for v in s.values()) for s in CALLS])
def test_forward_compiles_its_own_variant_alone(compiled, i):
    spec, want, compiled = CALLS[i], compiled[i]["want"], compiled[i]["compiled"]
    assert any(k.startswith(f"numba_ops.kernels.cpu.{spec['op']}.") for k in compiled), compiled.keys()
    backward = sorted(k for k in compiled if k.split(".")[-2].endswith("_backward")
                      or (k.startswith("numba_ops.kernels._sample.") and k.split(".")[-1] in GRADIENT_HELPERS))
    assert not backward, f"a {spec['op']} forward compiled backward code: {backward}"
    _assert_own_variant(compiled, want)


BACKWARD_CALLS = [
    {"op": "grid_sample", "nd": 2, "mode": "linear", "padding": "border", "backward": True},
    {"op": "affine_warp", "nd": 3, "mode": "cubic", "padding": "zeros", "backward": True},
]


def test_backward_compiles_its_own_variant_alone():
    """A GridSample or affine_warp backward compiles its own rank, dtype, mode and source
    of positions (grid or theta) alone; the padding is a run-time code there. With an
    empty cache it is also seen that no other mode's taps compile."""
    for spec, rec in zip(BACKWARD_CALLS, _run(BACKWARD_CALLS)):
        want, compiled = rec["want"], rec["compiled"]
        assert any(k.startswith("numba_ops.kernels.cpu.grid_sample_backward.") for k in compiled), compiled.keys()
        others = {"linear": ("grad_taps_nearest", "grad_taps_cubic", "nearest_at", "cubic_at"),
                  "cubic": ("grad_taps_nearest", "grad_taps_linear", "nearest_at", "linear_at")}[spec["mode"]]
        assert not [k for k in compiled if k.split(".")[-1] in others], (spec, sorted(compiled))
        _assert_own_variant(compiled, want)


def test_16bit_forward_compiles_nothing_of_its_own():
    """float16 and bfloat16 calls run the float32 kernels on widened copies: after the
    float32 call of the same variant they compile (or load) nothing but the
    conversions (``kernels/cpu/_copies.py``)."""
    calls = []
    for spec in ({"op": "grid_sample", "nd": 2, "mode": "cubic", "padding": "reflection"},
                 {"op": "affine_warp", "nd": 3, "mode": "linear", "padding": "zeros"},
                 {"op": "deform_conv", "nd": 2, "o": 6}):
        calls += [dict(spec, dtype=dt) for dt in ("float32", "float16", "bfloat16")]
    got = _run(calls)
    for spec, rec in zip(calls, got):
        if spec["dtype"] == "float32":
            assert rec["compiled"], spec  # the float32 call's kernels are there to be reused
        else:
            own = sorted(k for k in rec["compiled"] if not k.startswith("numba_ops.kernels.cpu._copies."))
            assert not own, (spec, own)

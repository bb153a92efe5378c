"""ms_deform_attn and its backward on the CPU: against the float64 oracle
(tests/reference.py), mmcv's pure-PyTorch path and its autograd, central
differences (3-D), and the contract's edge cases and errors. (The CUDA kernels:
tests/test_ms_deform_attn_cuda.py.)"""
import os
import subprocess
import sys

import numpy as np
import pytest

import numba_ops
from numba_ops.benchmark.cases import ms_deform_attn_torch
from helpers import BF16, FLOAT16, FLOAT32, FLOAT64, FULL
from reference import assert_api_close, ms_deform_attn_ref

LEVELS = {2: [(6, 7), (3, 4), (1, 2)], 3: [(3, 4, 5), (2, 2, 3)]}


def starts_of(shapes):
    sizes = [int(np.prod(s)) for s in shapes]
    return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)


def make(rng, r=2, N=2, Lq=5, M=3, Dh=4, P=3, dtype=FLOAT64, spread=0.2, exact=True):
    """Inputs with locations inside, across the edges and far outside every level,
    and (``exact``) points exactly on elements and edges."""
    shapes = LEVELS[r]
    S = sum(int(np.prod(s)) for s in shapes)
    L = len(shapes)
    value = rng.standard_normal((N, S, M, Dh))
    loc = rng.uniform(-spread, 1 + spread, (N, Lq, M, L, P, r))
    if loc.size and exact:
        loc.reshape(-1, r)[::7] = 0.5 / np.array(shapes[0][::-1])  # the centre of element 0 of level 0 ...
        loc.reshape(-1, r)[3::11] = 0.0  # ... the outer edge
        loc.reshape(-1)[5::13] = 1.0
    attn = rng.random((N, Lq, M, L, P))
    return [np.asarray(a, np.float32).astype(dtype) for a in (value, loc, attn)], shapes, starts_of(shapes)


def upcast(arrays):
    return [np.asarray(a, np.float64) for a in arrays]


@pytest.mark.parametrize("r", [2, 3])
@pytest.mark.parametrize("dtype", [FLOAT64, FLOAT32, FLOAT16, BF16])
def test_forward_matches_oracle(rng, r, dtype):
    (value, loc, attn), shapes, starts = make(rng, r, dtype=dtype)
    out = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)
    assert out.shape == (2, 5, 3 * 4) and out.dtype == dtype
    want = ms_deform_attn_ref(*upcast([value]), shapes, *upcast([loc, attn]))
    assert_api_close(out, want, dtype)


@pytest.mark.parametrize("Lq", [5, 80], ids=["few_points", "many_points"])
@pytest.mark.parametrize("r", [2, 3])
def test_matches_pytorch_path_and_autograd(rng, r, Lq):
    """Few points per value row and many (where the CPU backward reads value head-major)."""
    torch = pytest.importorskip("torch")
    from numba_ops.kernels.cpu.ms_deform_attn_backward import HEAD_MAJOR_POINTS
    (value, loc, attn), shapes, starts = make(rng, r, Lq=Lq)
    S, L, P = value.shape[1], loc.shape[3], loc.shape[4]
    assert (Lq * L * P >= HEAD_MAJOR_POINTS * S) == (Lq == 80)
    vt, lt, at = (torch.tensor(a, requires_grad=True) for a in (value, loc, attn))
    ref = ms_deform_attn_torch(vt, shapes, lt, at)
    out = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    go = rng.standard_normal(out.shape)
    ref.backward(torch.tensor(go))
    grads = numba_ops.ms_deform_attn_backward(go, value, shapes, starts, loc, attn)
    for got, t in zip(grads, (vt, lt, at)):
        assert got.shape == t.shape and got.dtype == np.float64
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-10, atol=1e-10)


def test_gradients_central_differences_3d(rng):
    """float64 gradients of 3-D levels against central differences of the forward
    (locations kept off the lattice, where the forward is smooth)."""
    (value, loc, attn), shapes, starts = make(rng, 3, N=1, Lq=2, M=2, Dh=3, P=2, spread=0.1)
    loc = loc + 1e-3  # off the points placed exactly on elements
    go = rng.standard_normal((1, 2, 6))
    grads = numba_ops.ms_deform_attn_backward(go, value, shapes, starts, loc, attn)
    args = [value, loc, attn]
    h = 1e-6
    for k, g in enumerate(grads):
        num = np.zeros_like(args[k])
        for i in range(args[k].size):
            hi, lo = [a.copy() for a in args], [a.copy() for a in args]
            hi[k].reshape(-1)[i] += h
            lo[k].reshape(-1)[i] -= h
            f = [np.sum(go * numba_ops.ms_deform_attn(a[0], shapes, starts, a[1], a[2])) for a in (hi, lo)]
            num.reshape(-1)[i] = (f[0] - f[1]) / (2 * h)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [FLOAT32, BF16])
def test_backward_16bit_and_float32_accuracy(rng, dtype):
    """16-bit gradients are the float32 computation on the upcast inputs, rounded once;
    float32 within the accuracy of the float64 gradient (off the lattice: on it, the
    coordinate's rounding picks the side of the derivative's jump)."""
    (value, loc, attn), shapes, starts = make(rng, 2, dtype=dtype, exact=False)
    go = rng.standard_normal((2, 5, 12)).astype(np.float32).astype(dtype)
    got = numba_ops.ms_deform_attn_backward(go, value, shapes, starts, loc, attn)
    f32 = [np.asarray(a, np.float32) for a in (go, value, loc, attn)]
    want = numba_ops.ms_deform_attn_backward(f32[0], f32[1], shapes, starts, f32[2], f32[3])
    exact = numba_ops.ms_deform_attn_backward(*upcast(f32[:2]), shapes, starts, *upcast(f32[2:]))
    for g, w, e in zip(got, want, exact):
        assert g.dtype == dtype
        if dtype == FLOAT32:
            scale = np.abs(e).max()
            assert np.all(np.abs(g - e) <= 1e-4 * np.abs(e) + 1e-4 * scale)
        else:
            np.testing.assert_array_equal(g, w.astype(dtype))


def test_wrt_computes_only_what_is_asked(rng):
    (value, loc, attn), shapes, starts = make(rng)
    go = rng.standard_normal((2, 5, 12))
    full = numba_ops.ms_deform_attn_backward(go, value, shapes, starts, loc, attn)
    for names in (["value"], ["sampling_locations"], ("attention_weights", "value")):
        got = numba_ops.ms_deform_attn_backward(go, value, shapes, starts, loc, attn, wrt=names)
        for name, g, f in zip(("value", "sampling_locations", "attention_weights"), got, full):
            if name in names:
                np.testing.assert_array_equal(g, f)
            else:
                assert g is None
    with pytest.raises(ValueError, match="wrt"):
        numba_ops.ms_deform_attn_backward(go, value, shapes, starts, loc, attn, wrt=["x"])


def test_non_finite_and_huge_locations(rng):
    (value, loc, attn), shapes, starts = make(rng, N=1, Lq=3, M=2)
    loc[0, 0, 0, 1, 2, 0] = np.nan
    loc[0, 1, 1, 0, 0, 1] = np.inf
    loc[0, 2, 0, :, :, :] = 1e30
    loc[0, 2, 1, :, :, :] = -2.0 ** 63
    out = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)
    assert np.isnan(out[0, 0, :4]).all() and np.isfinite(out[0, 0, 4:]).all()
    assert np.isnan(out[0, 1, 4:]).all() and np.isfinite(out[0, 1, :4]).all()
    assert np.array_equal(out[0, 2], np.zeros(8))
    go = rng.standard_normal(out.shape)
    gv, gl, ga = numba_ops.ms_deform_attn_backward(go, value, shapes, starts, loc, attn)
    assert np.isfinite(gv).all()
    assert np.isnan(gl[0, 0, 0, 1, 2]).all() and np.isnan(gl[0, 1, 1, 0, 0]).all()
    assert np.isnan(gl).sum() == 4 and np.isnan(ga).sum() == 2
    assert np.array_equal(gl[0, 2], np.zeros_like(gl[0, 2])) and np.array_equal(ga[0, 2], np.zeros_like(ga[0, 2]))
    # the non-finite points touch nothing else: value's gradient is that of the call without them
    keep = np.ones_like(attn)
    keep[0, 0, 0, 1, 2] = keep[0, 1, 1, 0, 0] = 0
    clean = np.where(np.isfinite(loc), loc, 0.5)
    gv0, _, _ = numba_ops.ms_deform_attn_backward(go, value, shapes, starts, clean, attn * keep)
    np.testing.assert_allclose(gv, gv0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("N,Lq,P,M,Dh", [(0, 3, 2, 2, 4), (1, 0, 2, 2, 4), (1, 3, 0, 2, 4), (1, 3, 2, 0, 4),
                                         (1, 3, 2, 2, 0)])
def test_empty_sizes(rng, N, Lq, P, M, Dh):
    (value, loc, attn), shapes, starts = make(rng, N=N, Lq=Lq, P=P, M=M, Dh=Dh)
    out = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)
    assert out.shape == (N, Lq, M * Dh) and not out.any()
    grads = numba_ops.ms_deform_attn_backward(np.ones_like(out), value, shapes, starts, loc, attn)
    for g, a in zip(grads, (value, loc, attn)):
        assert g.shape == a.shape and not g.any()


def test_inputs_unchanged_and_strided(rng):
    (value, loc, attn), shapes, starts = make(rng)
    keep = [a.copy() for a in (value, loc, attn)]
    want = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)
    wide = np.zeros(value.shape[:3] + (2 * value.shape[3],))
    wide[..., ::2] = value
    got = numba_ops.ms_deform_attn(wide[..., ::2], np.asarray(shapes)[:, ::-1][:, ::-1], starts, loc[::-1][::-1],
                                   np.asfortranarray(attn))
    np.testing.assert_array_equal(got, want)
    go = np.ones_like(want)
    numba_ops.ms_deform_attn_backward(go, value, shapes, starts, loc, attn)
    for a, k in zip((value, loc, attn), keep):
        np.testing.assert_array_equal(a, k)


def test_bad_input(rng):
    (value, loc, attn), shapes, starts = make(rng)
    call = numba_ops.ms_deform_attn
    with pytest.raises(ValueError, match="value"):
        call(value[0], shapes, starts, loc, attn)
    with pytest.raises(ValueError, match="level_start_index"):
        call(value, shapes, starts + 1, loc, attn)
    with pytest.raises(ValueError, match="level_start_index"):
        call(value, shapes, starts[:2], loc, attn)
    with pytest.raises(ValueError, match="value"):
        call(value[:, :-1], shapes, starts, loc, attn)
    with pytest.raises(TypeError, match="spatial_shapes"):
        call(value, np.asarray(shapes, np.float32), starts, loc, attn)
    with pytest.raises(ValueError, match="spatial_shapes"):
        call(value, [(6, 7, 1, 1)] * 3, starts, loc, attn)
    with pytest.raises(ValueError, match="spatial_shapes"):
        call(value, [(6, 7), (3, 4), (0, 2)], starts, loc, attn)
    with pytest.raises(ValueError, match="sampling_locations"):
        call(value, shapes, starts, loc[..., :1], attn)
    with pytest.raises(ValueError, match="sampling_locations"):
        call(value, shapes, starts, loc[:, :, :2], attn)
    with pytest.raises(ValueError, match="attention_weights"):
        call(value, shapes, starts, loc, attn[..., :2])
    with pytest.raises(TypeError, match="sampling_locations"):
        call(value, shapes, starts, loc.astype(np.float32), attn)
    with pytest.raises(TypeError, match="value"):
        call(value.astype(np.int32), shapes, starts, loc, attn)
    with pytest.raises(ValueError, match="required"):
        call(None, shapes, starts, loc, attn)
    with pytest.raises(ValueError, match="device"):
        call(value, shapes, starts, loc, attn, device="tpu")
    out = call(value, shapes, starts, loc, attn)
    with pytest.raises(ValueError, match="grad_out"):
        numba_ops.ms_deform_attn_backward(out[:, :1], value, shapes, starts, loc, attn)
    with pytest.raises(TypeError, match="grad_out"):
        numba_ops.ms_deform_attn_backward(out.astype(np.float32), value, shapes, starts, loc, attn)


_DETERMINISM = """
import hashlib, sys, numpy as np, numba_ops
rng = np.random.default_rng(7)
shapes = [(40, 50), (20, 25)]
S = 40 * 50 + 20 * 25
value = rng.standard_normal((1, S, 4, 8)).astype(np.float32)
loc = rng.random((1, 3000, 4, 2, 4, 2)).astype(np.float32)
attn = rng.random((1, 3000, 4, 2, 4)).astype(np.float32)
go = rng.standard_normal((1, 3000, 32)).astype(np.float32)
out = numba_ops.ms_deform_attn(value, shapes, [0, 2000], loc, attn)
grads = numba_ops.ms_deform_attn_backward(go, value, shapes, [0, 2000], loc, attn)
sys.stdout.write(":".join(hashlib.sha256(a.tobytes()).hexdigest() for a in (out,) + grads))
"""


@FULL
def test_deterministic_whatever_the_thread_count():
    runs = {}
    for nth in (1, 2, 3, 5, 8):
        env = dict(os.environ, NUMBA_NUM_THREADS=str(nth))
        runs[nth] = subprocess.run([sys.executable, "-c", _DETERMINISM], env=env, check=True,
                                   capture_output=True, text=True).stdout
    assert len(set(runs.values())) == 1, runs


def test_same_bits_every_call(rng):
    """Past the pool's threshold the parallel kernels run; every call gives the same bits."""
    (value, loc, attn), shapes, starts = make(rng, N=2, Lq=600, M=4, Dh=8, dtype=FLOAT32)
    go = rng.standard_normal((2, 600, 32)).astype(np.float32)
    first = numba_ops.ms_deform_attn_backward(go, value, shapes, starts, loc, attn)
    for _ in range(3):
        again = numba_ops.ms_deform_attn_backward(go, value, shapes, starts, loc, attn)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)

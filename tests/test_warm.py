"""numba_ops.warm / ``numba-ops warm`` (the documented contract: "Warm-up (JIT cache)"): after a
warm-up into an empty cache, a fresh process calls every op x dtype x rank
without numba compiling anything, and a second warm-up compiles nothing.

The end-to-end check uses one dtype on the CPU (each dtype compiles its own
kernels; one keeps CI short) in fresh processes with their own empty
NUMBA_CACHE_DIR: AffineGrid alone in the default run, DeformConv too with
``--full`` (and the stamp's every trigger). Only the tests about what an empty
cache gets use one, on the smallest requests that show it; the others warm into
the session's cache.
"""
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import numba_ops
from helpers import FULL
from numba_ops import _warm

ROOT = Path(__file__).resolve().parents[1]
DTYPE = "float32"
#: the ops of the full check, the default run's first (GridSample and affine_warp compile a
#: kernel per rank x x dtype x mode x path, minutes for one dtype: their warm-up
#: calls are checked in test_grid_sample.py / test_affine_warp.py, and a sample of them end
#: to end below)
OPS = ("affine_grid", "deform_conv")

# Calls of every op x rank x path (direct / serial / parallel, with and without B and
# mask) of the ops named on the command line after the dtype, shaped independently of
# the ops' warm_calls; numba's "numba:compile" event fires for every function it
# compiles (loads from the cache fire none).
CALLS = r"""
import importlib.util, json, sys
import numpy as np
from numba.core import event
from numba_ops._dtypes import np_dtype

compiles = event.RecordingListener()
event.register("numba:compile", compiles)
import numba_ops
dt = np_dtype(sys.argv[1])
ops = sys.argv[2:]
rng = np.random.default_rng(0)

def r(*shape):
    return rng.standard_normal(shape).astype(dt)

done = []
for size in [(2, 3, 5, 7), (1, 1, 300, 300), (1, 2, 3, 4, 5), (2, 1, 20, 40, 50)] * ("affine_grid" in ops):
    nd = len(size) - 2
    numba_ops.affine_grid(r(size[0], nd, nd + 1), size, align_corners=len(done) % 2)
    done.append(("affine_grid", size))
for nd, sides in [(1, (3, 20, 2500)), (2, (3, 8, 45)), (3, (3, 5, 14))] * ("deform_conv" in ops):
    for s in sides:
        big = s > 3
        N, C, oC, g, og = (2, 4, 6, 2, 2) if big else (1, 1, 1, 1, 1)
        k, K = (3, 3 ** nd) if big else (2, 2 ** nd)
        o = s - k + 1
        for extra in (False, True):
            x, w, off = r(N, C, *(s,) * nd), r(oC, C // g, *(k,) * nd), r(N, og * K * nd, *(o,) * nd)
            b, m = (r(oC), r(N, og * K, *(o,) * nd)) if extra else (None, None)
            numba_ops.deform_conv(x, w, off, b, m, group=g, offset_group=og)
            done.append(("deform_conv", x.shape, extra))
# a DeformConv node of each rank in numba_ops.onnx.session (its compiled task), where installed
session_ok = all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime", "onnxruntime_extensions"))
for nd in (1, 2, 3) if "deform_conv" in ops and session_ok and dt.itemsize >= 4 else ():
    from onnx import helper
    from numba_ops.onnx import session
    elem = helper.np_dtype_to_tensor_dtype(dt)
    ins = [helper.make_tensor_value_info(n, elem, None) for n in ("X", "W", "offset")]
    g = helper.make_graph([helper.make_node("DeformConv", ["X", "W", "offset"], ["Y"])], "g", ins,
                          [helper.make_tensor_value_info("Y", elem, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)])
    feeds = {"X": r(1, 2, *(4,) * nd), "W": r(2, 2, *(2,) * nd), "offset": r(1, 2 ** nd * nd, *(3,) * nd)}
    session(model).run(None, feeds)
    done.append(("session", nd))
names = sorted({d.py_func.__module__ + "." + d.py_func.__qualname__
                for _, e in compiles.buffer if e.is_start for d in [e.data["dispatcher"]]})
print(json.dumps({"calls": len(done), "compiled": names}))
"""


def _env(cache):
    env = dict(os.environ)
    env["NUMBA_CACHE_DIR"] = str(cache)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


def _cli(*args, env=None, timeout=900):
    p = subprocess.run([sys.executable, "-m", "numba_ops", "warm", *args], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def _compiled(out):
    m = re.search(r"(\d+) functions compiled, (\d+) loaded from the cache", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize("ops", [OPS[:1], pytest.param(OPS, marks=FULL)], ids="+".join)
def test_warm_leaves_nothing_to_compile(ops, tmp_path):
    cache = tmp_path / "jit"
    env = _env(cache)
    rc, out, err = _cli("--op", *ops, "--dtype", DTYPE, "--device", "cpu", env=env)
    assert rc == 0, out + err
    compiled, _ = _compiled(out)
    assert compiled > 0
    assert f"cache: {cache}" in out
    assert re.search(rf"\[\d+/\d+\] +[\d.]+ s +\d+ left +{ops[-1]} float32 cpu", out)  # progress lines
    # a fresh process: every op x rank x path, and numba compiles nothing
    p = subprocess.run([sys.executable, "-c", CALLS, DTYPE, *ops], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    session = _warm._session_installed()
    assert got["calls"] == 4 * ("affine_grid" in ops) + (3 * 3 * 2 + 3 * session) * ("deform_conv" in ops)
    assert got["compiled"] == [], f"compiled after warm: {got['compiled']}"
    # warm again: the cache is as the first left it (its stamp matches): nothing to do
    rc, out, err = _cli("--op", *ops, "--dtype", DTYPE, "--device", "cpu", env=env)
    assert rc == 0, out + err
    assert "up to date:" in out and ": 0 calls, 0 functions compiled" in out, out
    # without the stamp: every call again, everything loads from the cache
    stamps = list(cache.rglob(_warm.STAMP))
    assert len(stamps) == 1
    stamps[0].unlink()
    rc, out, err = _cli("--op", *ops, "--dtype", DTYPE, "--device", "cpu", env=env)
    assert rc == 0, out + err
    compiled, loaded = _compiled(out)
    assert compiled == 0 and loaded > 0 and "up to date" not in out, out


@pytest.mark.full  # nine warm-ups in fresh processes; the default run's stamp check: test_warm_leaves_nothing_to_compile
def test_warm_stamp(tmp_path):
    """A warm-up that finds its stamp matching returns at once; any change to what
    numba's cache depends on (a cache file, a source's stamp, the request) and it
    warms again, compiling what is missing."""
    cache = tmp_path / "jit"
    env = _env(cache)
    args = ("--op", "affine_grid", "--dtype", "float64", "--device", "cpu", "--jobs", "1")
    rc, out, _ = _cli(*args, env=env)
    assert rc == 0 and _compiled(out)[0] > 0 and "up to date" not in out, out
    rc, out, _ = _cli(*args, env=env)
    assert rc == 0 and "up to date:" in out and re.search(r": 0 calls, 0 functions compiled, [1-9]\d* found", out), out
    rc, out, _ = _cli(*args, "--force", env=env)  # every call made: all loads
    assert rc == 0 and "up to date" not in out and _compiled(out)[0] == 0 and _compiled(out)[1] > 0, out
    # the request: another dtype set is warmed as usual
    rc, out, _ = _cli(*args[:3], "float64", "float32", *args[4:], env=env)
    assert rc == 0 and "up to date" not in out and _compiled(out)[0] > 0, out
    rc, out, _ = _cli(*args, env=env)  # the stamp is now the other request's
    assert rc == 0 and "up to date" not in out and _compiled(out)[0] == 0, out
    rc, out, _ = _cli(*args, env=env)
    assert rc == 0 and "up to date:" in out, out
    # a cache file gone: the run notices, and numba compiles its function again
    data = sorted(cache.rglob("*affine_grid*.nbc"))
    assert data
    for f in data:
        f.unlink()
    rc, out, _ = _cli(*args, env=env)
    assert rc == 0 and "up to date" not in out and _compiled(out)[0] > 0, out
    rc, out, _ = _cli(*args, env=env)
    assert rc == 0 and "up to date:" in out, out
    # the stamp records numba_ops' sources: a changed one (here its stamp, as numba reads it) and
    # the run warms again
    state = json.loads(next(cache.rglob(_warm.STAMP)).read_text())
    assert any(p.endswith(os.path.join("numba_ops", "affine_grid.py")) for p, *_ in state["sources"])
    state["sources"][0][2] -= 1
    next(cache.rglob(_warm.STAMP)).write_text(json.dumps(state))
    rc, out, _ = _cli(*args, env=env)
    assert rc == 0 and "up to date" not in out, out


SAMPLE = r"""
import importlib, json, sys
import numpy as np
from numba.core import event
import numba_ops
front = importlib.import_module("numba_ops.grid_sample")  # the module (numba_ops.grid_sample is the function)

xdts = sys.argv[2].split(",")
if sys.argv[1] == "warm":  # the warm-up calls of one mode and padding, 1-D, of the x dtypes asked
    calls = front.warm_calls("float32")
    front.warm_calls = lambda dtype: [(a, k) for a, k in calls if a[0].ndim == 3 and a[0].dtype.name in xdts
                                      and k == {"mode": "nearest", "padding_mode": "reflection"}]
    front.warm_backward_calls = lambda dtype: []  # (the forward's sample alone)
    try:
        from numba_ops.onnx import _capi
        _capi.warm_calls = lambda op, dtype: []  # (nor the session's tasks)
    except ImportError:
        pass
    r = numba_ops.warm("grid_sample", "float32", "cpu", quiet=True)
    print(json.dumps({"calls": r["calls"], "failures": r["failures"]}))
else:  # a user's calls of that mode and padding: shapes, layouts, align, both paths, uint8 x
    compiles = event.RecordingListener()
    event.register("numba:compile", compiles)
    rng = np.random.default_rng(0)
    for xdt, n, align in [(np.float32, 5, False), (np.uint8, 7, True), (np.float32, 40000, True),
                          (np.uint8, 40000, False)]:
        if np.dtype(xdt).name not in xdts:
            continue
        x = (rng.random((2, 6, 9)) * 200).astype(xdt)[:, ::2]
        g = rng.uniform(-1.5, 1.5, (2, n, 1)).astype(np.float32)
        numba_ops.grid_sample(x, g, mode="nearest", padding_mode="reflection", align_corners=align)
    print(json.dumps({"compiled": sorted({e.data["dispatcher"].py_func.__qualname__
                                          for _, e in compiles.buffer if e.is_start})}))
"""


@pytest.mark.parametrize("xdts", [pytest.param("float32", marks=FULL), pytest.param("float32,uint8", marks=FULL)])
def test_warm_grid_sample_sample(xdts, tmp_path):
    """GridSample's warm-up calls (a sample: one mode and padding, 1-D, float32 x, and
    uint8 x with ``--full``) leave a later process's calls of that kind nothing to
    compile."""
    env = _env(tmp_path / "jit")

    def run(what):
        p = subprocess.run([sys.executable, "-c", SAMPLE, what, xdts], capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    assert run("warm") == {"calls": 2 * len(xdts.split(",")), "failures": []}
    assert run("call") == {"compiled": []}


def test_warm_result(capsys):
    front = __import__("numba_ops.affine_grid", fromlist=["warm_calls"])
    calls = len(front.warm_calls(DTYPE)) + len(front.warm_backward_calls(DTYPE))  # the gradients' too
    if _warm._session_installed():  # and the session's compiled tasks
        from numba_ops.onnx import _capi
        calls += len(_capi.warm_calls("affine_grid", DTYPE))
    seen = []
    r = numba_ops.warm("affine_grid", [np.float32], "cpu", progress=lambda *a: seen.append(a), force=True)
    printed = capsys.readouterr().out  # documented: warm returns and prints what it did
    assert f"{r['compiled']} functions compiled" in printed and str(r["cache_dir"]) in printed
    assert r["ops"] == ["affine_grid"] and r["dtypes"] == [DTYPE] and r["devices"] == ["cpu"]
    assert r["calls"] == calls and r["failures"] == [] and r["skipped"] == {}
    # (compiled/loaded count only what this process had not loaded yet: the fresh-process test checks them)
    assert r["compiled"] >= 0 and r["loaded"] >= 0
    assert r["seconds"] > 0 and os.path.isdir(r["cache_dir"]) and r["cache_bytes"] > 0
    assert [a[:2] for a in seen] == [(i, calls) for i in range(calls + 1)]
    assert not r["up_to_date"]
    # again: the cache is as that run left it (its stamp matches), so no call is made
    again = numba_ops.warm("affine_grid", "float32", "cpu", quiet=True)
    assert again["up_to_date"] and again["calls"] == again["compiled"] == 0 and again["failures"] == []
    assert again["loaded"] == r["compiled"] + r["loaded"] and again["cache_dir"] == r["cache_dir"]



def test_warm_ms_deform_attn_and_its_session_task():
    """``ms_deform_attn`` is an op name of warm: its forward and backward warm-up calls,
    and, where onnxruntime is installed, the compiled task of the session's
    MMCVMultiScaleDeformableAttention node."""
    assert "ms_deform_attn" in _warm.ALL_OPS and "ms_deform_attn" in _warm.available_ops()
    front = __import__("numba_ops.ms_deform_attn", fromlist=["warm_calls"])
    calls = len(front.warm_calls(DTYPE)) + len(front.warm_backward_calls(DTYPE))
    seen = []
    r = numba_ops.warm("ms_deform_attn", DTYPE, "cpu", progress=lambda i, n, label, t: seen.append(label),
                       quiet=True, force=True)
    if _warm._session_installed():
        from numba_ops.onnx import _capi
        calls += 1
        assert [x for x in seen if "onnxruntime session" in x and "MMCVMultiScaleDeformableAttention" in x]
        assert ("_ms_deform_attn_task", (DTYPE,)) in _capi._TASK_FNS
    assert r["failures"] == [] and r["calls"] == calls


JOBS = r"""
import json
import numba_ops
seen = []
r = numba_ops.warm("affine_grid", ["float32", "float64"], "cpu", jobs=2, quiet=True,
                   progress=lambda *a: seen.append(a[2]))
print("@@" + json.dumps({"r": r, "seen": seen}))
"""


@pytest.mark.full  # worker processes into an empty cache: seconds of compiling
def test_warm_in_worker_processes(tmp_path):
    """jobs=2 into an empty cache: a worker process per (op, dtype, device), none
    failing, then the pass in this process loads; run again, no worker starts."""
    def run():
        p = subprocess.run([sys.executable, "-c", JOBS], capture_output=True, text=True, cwd=ROOT,
                           env=_env(tmp_path / "jit"), timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.split("@@")[-1])

    got = run()
    r, seen = got["r"], got["seen"]
    front = __import__("numba_ops.affine_grid", fromlist=["warm_calls"])
    calls = 2 * (len(front.warm_calls(DTYPE)) + len(front.warm_backward_calls(DTYPE)))
    if _warm._session_installed():  # and the session's compiled tasks
        from numba_ops.onnx import _capi
        calls += 2 * len(_capi.warm_calls("affine_grid", DTYPE))
    assert r["failures"] == [] and r["calls"] == calls and r["compiled"] > 0
    done = sorted(x for x in seen if ": done (" in x)
    assert [x.split(":")[0] for x in done] == ["affine_grid float32 cpu", "affine_grid float64 cpu"]
    assert all(re.search(r"done \(\d+ compiled\)$", x) for x in done), done  # no worker failed
    got = run()
    # the stamp counts the functions this process ran; it compiles some itself when two workers
    # wrote one function's cache index at once (numba keeps the last writer's entries)
    assert got["r"]["compiled"] == 0 and got["r"]["up_to_date"]
    assert 0 < got["r"]["loaded"] <= r["compiled"] + r["loaded"]
    assert not [x for x in got["seen"] if "worker" in x]


@pytest.mark.parametrize("op", _warm.ALL_OPS)
def test_warm_calls_in_a_fresh_process(op):
    """An op's warm-up calls, built in a fresh process (as in a worker of ``warm``,
    where nothing has imported ml_dtypes yet), for every dtype name, bfloat16 first."""
    code = textwrap.dedent("""
        import importlib, sys
        from numba_ops._dtypes import NAMES
        front = importlib.import_module("numba_ops." + sys.argv[1])
        assert "ml_dtypes" not in sys.modules
        for name in sorted(NAMES):
            calls = front.warm_calls(name)
            assert calls and all(a.dtype.name in (name, "uint8", "int64") for args, _ in calls for a in args
                                 if hasattr(a, "dtype")), name  # (int64: ms_deform_attn's level shapes, starts)
        print("@@ok")
    """)
    p = subprocess.run([sys.executable, "-c", code, op], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0 and "@@ok" in p.stdout, p.stderr[-3000:]


@pytest.mark.parametrize("kw, word", [
    ({"ops": "affine"}, "ops"), ({"ops": ["affine_grid", 3]}, "ops"),
    ({"dtypes": "int8"}, "dtypes"), ({"dtypes": [np.float32, np.int32]}, "dtypes"),
    ({"devices": "tpu"}, "devices"), ({"devices": ["cpu", None]}, "devices"),
    ({"jobs": 0}, "jobs"), ({"jobs": 1.5}, "jobs"),
])
def test_bad_names(kw, word):
    with pytest.raises(ValueError, match=word) as e:
        numba_ops.warm(**kw)
    assert any(w in str(e.value) for w in ("affine_grid", "float32", "cpu", ">= 1"))


def test_an_op_missing_from_the_build(monkeypatch):
    monkeypatch.setattr(_warm, "available_ops", lambda: ("affine_grid",))
    with pytest.raises(ValueError, match="deform_conv is not part of this numba_ops build"):
        numba_ops.warm(ops="deform_conv")
    assert _warm._check_ops(None) == ("affine_grid",)


def test_default_ops_are_the_installed_ones():
    have = _warm.available_ops()
    assert {"affine_grid", "deform_conv"} <= set(have)
    for op in have:
        assert callable(__import__(f"numba_ops.{op}", fromlist=["warm_calls"]).warm_calls)


def test_cuda_unusable_or_simulated(monkeypatch):
    monkeypatch.setattr(_warm, "cuda_usable", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU is usable"):
        numba_ops.warm(ops="affine_grid", dtypes="float32", devices="cuda", quiet=True)
    monkeypatch.setattr(_warm, "cuda_usable", lambda: True)
    monkeypatch.setattr(_warm, "cuda_simulator", lambda: True)
    r = numba_ops.warm(ops="affine_grid", dtypes="float32", devices="cuda", quiet=True)
    assert r["calls"] == 0 and r["devices"] == [] and "simulator" in r["skipped"]["cuda"]


def test_cli_exit_codes(tmp_path):
    env = dict(os.environ)
    rc, out, err = _cli("--op", "nosuch", env=env, timeout=120)
    assert rc == 2 and "ops must name some of affine_grid" in err
    rc, out, err = _cli("--dtype", "int8", env=env, timeout=120)
    assert rc == 2 and "--dtype" in err
    # a call that fails (as a kernel that does not compile would): exit 1, the failure named
    script = tmp_path / "broken_warm.py"
    script.write_text(textwrap.dedent("""
        import sys
        import numba_ops.kernels.cpu.affine_grid as k
        def broken(*args):
            raise RuntimeError("injected compile failure")
        k.launch = broken
        from numba_ops.cli import main
        sys.exit(main(sys.argv[1:]))
    """))
    p = subprocess.run([sys.executable, str(script), "warm", "--op", "affine_grid", "--dtype", "float32",
                        "--device", "cpu"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAILED affine_grid float32 cpu" in p.stdout and "injected compile failure" in p.stdout


def test_import_loads_only_what_is_used():
    """``import numba_ops`` loads neither numba nor ml_dtypes (ml_dtypes alone takes
    ~0.4 s); a float32 call loads numba but not ml_dtypes; bfloat16 arrays still work."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import numba_ops
        print(sorted(m for m in ("numba", "ml_dtypes", "numba.cuda", "scipy") if m in sys.modules))
        numba_ops.affine_grid(np.zeros((1, 2, 3), np.float32), (1, 1, 2, 2))
        print(sorted(m for m in ("numba", "ml_dtypes") if m in sys.modules))
        import ml_dtypes
        print(numba_ops.affine_grid(np.zeros((1, 2, 3), ml_dtypes.bfloat16), (1, 1, 2, 2)).dtype)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split("\n")[:3] == ["[]", "['numba']", "bfloat16"]


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"),
                    reason="the simulator's kernels are Python: nothing to cache")
def test_cuda_kernels_cache_on_disk():
    """Every CUDA kernel (each dtype, rank and variant the launchers pick) is a
    numba-cuda dispatcher with its on-disk cache enabled (``cache=True``); the
    save and load themselves need a GPU (warm, on the usable devices)."""
    pytest.importorskip("numba.cuda")
    from numba.cuda.dispatcher import CUDACache
    from numba_ops.kernels.cuda import _device, affine_grid, deform_conv
    jobs = [job for mod in (_device, affine_grid, deform_conv) for job in mod.compile_jobs()]
    assert jobs
    for label, kernel, _ in jobs:
        assert isinstance(kernel._cache, CUDACache), label


def test_dispatchers_survive_dead_weak_proxies():
    """The dispatcher scan walks gc's objects, which include numba's weak proxies to
    libraries of functions already gone (here: a dropped caller of an opaque call,
    whose callee keeps the caller's module alive): they must not stop ``warm``."""
    import gc as _gc

    from numba import njit

    from numba_ops.kernels.cpu._opaque import opaque

    @njit
    def callee(a):
        a[0] += 1.0

    op = opaque(callee)

    @njit
    def caller(a):
        op(a)

    a = np.zeros(1)
    caller(a)
    assert a[0] == 1.0
    del caller
    _gc.collect()
    assert all(d.py_func.__module__.startswith("numba_ops") for d in _warm._dispatchers())

"""The CPU runtime's threading choices (numba_ops/kernels/cpu/_runtime.py), each in a
fresh process: the layer is picked when numba's pool starts, once per process."""
import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, numpy as np, numba, numba_ops
numba_ops.affine_grid(np.zeros((4, 2, 3), np.float32), (4, 1, 128, 128))  # parallel: starts the pool
print(json.dumps({"layer": numba.threading_layer(), "spin": os.environ.get("GOMP_SPINCOUNT"),
                  "priority": os.environ.get("NUMBA_THREADING_LAYER_PRIORITY")}))
"""
KEYS = ("NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY", "GOMP_SPINCOUNT")


def probe(**env):
    e = {k: v for k, v in os.environ.items() if k not in KEYS}
    e.update(env)
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def omp_loads():
    try:
        from numba.np.ufunc import omppool  # noqa: F401
    except ImportError:
        return False
    return True


def test_default_is_openmp_with_a_long_spin_scoped_to_the_pools_start():
    """numba_ops' GOMP_SPINCOUNT is in the environment only while numba's pool starts
    (no other OpenMP runtime nor child process sees it)."""
    got = probe()
    assert got["layer"] == ("omp" if omp_loads() else "workqueue")
    assert got["spin"] is None
    assert got["priority"] == "omp workqueue tbb"


@pytest.mark.parametrize("layer", ["workqueue", "omp"])
def test_a_users_layer_wins(layer):
    if layer == "omp" and not omp_loads():
        pytest.skip("numba's OpenMP layer does not load here")
    got = probe(NUMBA_THREADING_LAYER=layer, GOMP_SPINCOUNT="1000")
    assert got["layer"] == layer
    assert got["spin"] == "1000"
    assert got["priority"] is None


FORK = """
import json, multiprocessing as mp, warnings, numpy as np, numba, numba_ops
rng = np.random.default_rng(0)
theta = rng.standard_normal((8, 2, 3)).astype(np.float32)
x = rng.standard_normal((1, 16, 24, 24)).astype(np.float32)
w = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
off = rng.standard_normal((1, 18, 24, 24)).astype(np.float32)
kw = dict(pads=[1, 1, 1, 1])
def both():
    return numba_ops.affine_grid(theta, (8, 1, 96, 96)), numba_ops.deform_conv(x, w, off, **kw)
g0, y0 = both()  # large enough for the parallel paths: the pool starts here
def child(q):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g, y = both()
        g, y = both()
    q.put([bool(np.array_equal(g, g0)), bool(np.allclose(y, y0, rtol=1e-5, atol=1e-4)),
           sum("forked" in str(c.message) for c in caught)])
ctx = mp.get_context("fork")
q = ctx.Queue()
p = ctx.Process(target=child, args=(q,))
p.start()
p.join(240)
print(json.dumps({"layer": numba.threading_layer(), "exitcode": p.exitcode,
                  "child": q.get(timeout=5) if p.exitcode == 0 else None}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_after_the_pool_started_still_computes():
    """GNU OpenMP cannot run in a forked child: numba_ops runs serially there (one warning)."""
    e = {k: v for k, v in os.environ.items() if k not in KEYS}
    p = subprocess.run([sys.executable, "-c", FORK], capture_output=True, text=True, env=e, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["exitcode"] == 0, (got, p.stderr[-3000:])
    same_grid, same_y, warned = got["child"]
    assert same_grid and same_y
    assert warned == (1 if got["layer"] == "omp" else 0)


def test_a_copy_under_another_name_runs_its_own_kernels(tmp_path):
    """The kernel table names its modules from the package's own name: a copy of the
    package under another name (vendored, or two versions side by side in one process
    to compare them) runs its own kernels, never the installed package's."""
    import shutil
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "numba_ops")
    shutil.copytree(src, tmp_path / "nbcopy", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import sys, numpy as np, nbcopy\n"
            "from nbcopy._dispatch import LAUNCHERS, launcher\n"
            "mods = {launcher(op, 'cpu', np.dtype(np.float32)).__module__ for op, dev in LAUNCHERS if dev == 'cpu'}\n"
            "print(sorted(mods))\n"
            "print(sorted(m for m in sys.modules if m.startswith('numba_ops')))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path)), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    mods, installed = p.stdout.strip().splitlines()
    assert mods.count("nbcopy.kernels.cpu.") == 10 and "'numba_ops" not in mods, mods
    assert installed == "[]", installed

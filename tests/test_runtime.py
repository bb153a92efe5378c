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


def test_default_is_openmp_with_a_long_spin():
    got = probe()
    assert got["layer"] == ("omp" if omp_loads() else "workqueue")
    assert got["spin"] == "3000000"
    assert got["priority"] == "omp workqueue tbb"


@pytest.mark.parametrize("layer", ["workqueue", "omp"])
def test_a_users_layer_wins(layer):
    if layer == "omp" and not omp_loads():
        pytest.skip("numba's OpenMP layer does not load here")
    got = probe(NUMBA_THREADING_LAYER=layer, GOMP_SPINCOUNT="1000")
    assert got["layer"] == layer
    assert got["spin"] == "1000"
    assert got["priority"] is None

"""Shared fixtures: every test that takes ``device`` runs on each usable device.

CI runs the suite twice: once plainly (CPU; CUDA tests then exercise the
no-GPU error path) and once with NUMBA_ENABLE_CUDASIM=1, where "cuda" runs the
CUDA kernels in numba's simulator on tiny shapes.
"""
import numpy as np
import pytest

import numba_ops

DEVICES = numba_ops.devices()


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pytest_collection_modifyitems(config, items):
    """Mark for ``-m cuda`` every test that runs the CUDA kernels: each one
    parametrised with ``device="cuda"`` (fixture or parametrize) and all of
    test_cuda.py, so the simulator run (``NUMBA_ENABLE_CUDASIM=1 pytest -m cuda``)
    executes every device test on the CUDA kernels. Not ``test_compile_ptx``: it
    compiles PTX in a process of its own without the simulator, the same in both
    runs, so the plain run's pass is the check (minutes of CI time saved)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_cuda = callspec is not None and callspec.params.get("device") == "cuda"
        if on_cuda or (item.path.name == "test_cuda.py" and item.originalname != "test_compile_ptx"):
            item.add_marker(pytest.mark.cuda)

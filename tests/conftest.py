"""Shared fixtures: every test that takes ``device`` runs on each usable device.

Shared constants and helpers (dtypes, modes, ``host``, the sampler matrix's split):
tests/helpers.py.

Two runs (.ci/run makes both, tox too: envs ``py`` and ``full``):

* the default (``python -m pytest``): 10-14 minutes from an empty JIT cache. Each
  op x device path x dtype at least once, the sampler matrix on a covering subset
  (``helpers.in_default``), warm-up tests on the smallest requests;
* ``--full``: everything, the tests marked ``full`` too: the whole sampler matrix,
  warm-ups of every op, PTX and ptxas builds for sm_80/sm_90 (``-m full --full``
  runs the part the default run leaves out).

CUDA tests run in numba's simulator with NUMBA_ENABLE_CUDASIM=1 on tiny shapes
(``-m cuda``); without a GPU or the simulator they exercise the no-GPU error path.
"""
import numpy as np
import pytest

import numba_ops

DEVICES = numba_ops.devices()


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the tests marked full (the exhaustive matrix; minutes more)")


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
    executes every device test on the CUDA kernels. The tests marked ``ptx`` compile
    PTX in a process without the simulator, the same work in both runs: CI's
    simulator pass deselects them (``-m "cuda and not ptx"``; minutes of CI time).

    Without ``--full``, deselect the tests marked ``full``."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_cuda = callspec is not None and callspec.params.get("device") == "cuda"
        if on_cuda or item.path.name == "test_cuda.py":
            item.add_marker(pytest.mark.cuda)
    if not config.getoption("--full"):
        full = [item for item in items if item.get_closest_marker("full")]
        if full:
            config.hook.pytest_deselected(items=full)
            items[:] = [item for item in items if not item.get_closest_marker("full")]

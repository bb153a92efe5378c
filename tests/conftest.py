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

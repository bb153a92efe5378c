"""Fixtures of the benchmark suite.

Every benchmark runs in two modes:

* timed (``tox -e bench``, or ``pytest bench --benchmark-enable``): the full
  benchmark cases, pytest-benchmark's rounds;
* smoke (the default: pyproject's addopts hold ``--benchmark-disable``): each
  benchmark runs once, on a shrunken case of the same structure, so CI proves
  every op × dtype × case path works without paying for the big shapes.
"""
import pytest

import numba_ops
from numba_ops._dispatch import cuda_simulator


def _devices():
    out = ["cpu"]
    if "cuda" in numba_ops.devices():
        out.append(pytest.param("cuda", marks=pytest.mark.cuda))
    return out


@pytest.fixture(params=_devices())
def device(request):
    return request.param


@pytest.fixture
def smoke(benchmark):
    """True when benchmarks are disabled: run once, on small inputs."""
    return bool(benchmark.disabled)


@pytest.fixture
def simulated():
    return cuda_simulator()

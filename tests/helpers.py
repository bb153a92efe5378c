"""What several test files share: dtypes, GridSample's modes and paddings, a device
result on the host, and the split of the sampler matrix into the default run and
the full run (``--full``, tests/conftest.py).

GridSample and affine_warp compile a CPU kernel per rank x mode x padding x dtype
of ``x`` x dtype of the grid (seconds each), so the whole matrix costs most of a
run's time. The default run takes a covering subset of it (``in_default``); the
rest of each product is marked ``full``. DeformConv's kernels: per rank x dtype x
path (``deform_default``).
"""
import itertools

import ml_dtypes
import numpy as np
import pytest

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT32, FLOAT64, FLOAT16 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)
#: the four public float dtypes
FLOATS = [FLOAT32, FLOAT64, FLOAT16, BF16]
MODES = ["linear", "nearest", "cubic"]
PADS = ["zeros", "border", "reflection"]

#: runs only with ``--full`` (tests/conftest.py)
FULL = pytest.mark.full


def host(a):
    """``a`` as a NumPy array (a CUDA device array copied to the host)."""
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


#: (rank, mode, padding) the default run samples with float32 x and grid: those of the
#: ONNX backend cases, which the conformance tests sample anyway (2-D: every mode with
#: zeros, linear with every padding; 3-D: linear and nearest with zeros), and
#: cubic/reflection 1-D
DEFAULT_F32 = {(2, "linear", "zeros"), (2, "nearest", "zeros"), (2, "cubic", "zeros"), (2, "linear", "border"),
               (2, "linear", "reflection"), (3, "linear", "zeros"), (3, "nearest", "zeros"),
               (1, "cubic", "reflection")}


def in_default(r=2, mode="linear", padding="zeros", dtype=FLOAT32, grid=None):
    """Whether the default run samples ``r``-D with ``mode`` and ``padding``, ``x`` of
    ``dtype`` and a grid (or theta) of ``grid`` (``x``'s dtype, float32 for uint8 ``x``,
    when None): float32, ``DEFAULT_F32`` (each rank, mode and padding); float64,
    float16, bfloat16 and uint8 x (with a float32 grid), linear/zeros 2-D (the
    defaults)."""
    x = np.dtype(dtype)
    g = np.dtype(grid if grid is not None else (FLOAT32 if x == np.uint8 else x))
    if x == FLOAT32:
        return (r, mode, padding) in DEFAULT_F32
    return (r, mode, padding) == (2, "linear", "zeros") and (x != np.uint8 or g == FLOAT32)


def matrix(fixed=None, **axes):
    """``@pytest.mark.parametrize(*matrix(r=[1, 2, 3], mode=MODES, ...))``: the product of
    ``axes``, each combination marked ``full`` unless ``in_default`` takes it. ``fixed``
    gives ``in_default``'s arguments that are no axis here (e.g. ``dict(r=2)``); an axis
    named ``gdtype`` or ``tdtype`` is its ``grid``; other axes (``align``, ...) run whole
    with each default combination."""
    names = list(axes)
    keys = {"gdtype": "grid", "tdtype": "grid"}
    sampler = {"r", "mode", "padding", "dtype", "grid"}
    params = []
    for row in itertools.product(*axes.values()):
        v = dict(fixed or {})
        v.update((keys.get(n, n), x) for n, x in zip(names, row))
        keep = in_default(**{k: x for k, x in v.items() if k in sampler})
        params.append(param(keep, *row, id="-".join(map(_id, row))))
    return ",".join(names), params


def deform_default(rank, dtype):
    """Whether the default run convolves ``rank``-D in ``dtype``: DeformConv compiles its
    kernels per rank x dtype x path; every rank in float64 (the oracle's dtype, and the
    Dask tests'), every dtype in 2-D."""
    return rank == 2 or np.dtype(dtype) == FLOAT64


def param(keep, *values, **kw):
    """``pytest.param(*values)``, marked ``full`` unless ``keep``."""
    return pytest.param(*values, marks=() if keep else FULL, **kw)


def _id(value):
    """A dtype by its name (float32, bfloat16), anything else as pytest would show it."""
    if isinstance(value, (type, np.dtype)):
        return np.dtype(value).name
    return str(value)

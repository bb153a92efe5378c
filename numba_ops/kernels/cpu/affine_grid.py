"""AffineGrid on the CPU: ``@njit(parallel=True)`` over rows of the output grid.

Each output row (fixed n and leading spatial indices) is ``grid = a * x + b``
with per-row constants, so the inner loop is a multiply-add over the
precomputed base coordinates that LLVM vectorises, and every output element is
written once, rounded straight into its storage type.
"""
import numpy as np
from numba import njit, prange

from ..._dtypes import compute, storage
from .._scalar import base_coord, store
from . import _runtime

DTYPES = ("float16", "bfloat16", "float32", "float64")


@njit(cache=True)
def _coords(length, align, one):
    c = np.empty(length, dtype=type(one))
    for i in range(length):
        c[i] = base_coord(i, length, align, one)
    return c


@njit(cache=True)
def _rows(theta, out, D, H, W, align, one, r0, r1):
    """Rows ``r0:r1`` of ``out`` viewed as (N * D * H, W * nd), D being 1 in 2-D;
    ``one`` is 1 in the compute type. (Sizes come as ints, not a tuple: numba's
    dispatcher types a tuple argument in Python, a microsecond on small calls.)

    The row's (n, d, h) advance as counters: in 3-D a row is only 192 elements,
    and the three integer divisions that would recover them cost as much as its stores.
    """
    nd = theta.shape[1]
    xs = _coords(W, align, one)
    ys = _coords(H, align, one)
    zs = _coords(D, align, one)
    h = r0 % H
    d = (r0 // H) % D
    n = r0 // (H * D)
    for r in range(r0, r1):
        row = out[r]
        y = ys[h]
        if nd == 2:
            a0, a1 = theta[n, 0, 0], theta[n, 1, 0]
            b0 = theta[n, 0, 1] * y + theta[n, 0, 2]
            b1 = theta[n, 1, 1] * y + theta[n, 1, 2]
            for w in range(W):
                store(row, 2 * w, a0 * xs[w] + b0)
                store(row, 2 * w + 1, a1 * xs[w] + b1)
        else:
            z = zs[d]
            a0, a1, a2 = theta[n, 0, 0], theta[n, 1, 0], theta[n, 2, 0]
            b0 = theta[n, 0, 1] * y + theta[n, 0, 2] * z + theta[n, 0, 3]
            b1 = theta[n, 1, 1] * y + theta[n, 1, 2] * z + theta[n, 1, 3]
            b2 = theta[n, 2, 1] * y + theta[n, 2, 2] * z + theta[n, 2, 3]
            for w in range(W):
                store(row, 3 * w, a0 * xs[w] + b0)
                store(row, 3 * w + 1, a1 * xs[w] + b1)
                store(row, 3 * w + 2, a2 * xs[w] + b2)
        h += 1
        if h == H:
            h = 0
            d += 1
            if d == D:
                d = 0
                n += 1


@njit(cache=True)
def _serial(theta, out, D, H, W, align, one):
    _rows(theta, out, D, H, W, align, one, 0, out.shape[0])


@njit(cache=True, parallel=True)
def _parallel(theta, out, D, H, W, align, one, nchunks):
    rows = out.shape[0]
    nchunks = min(rows, nchunks)
    for c in prange(nchunks):
        _rows(theta, out, D, H, W, align, one, c * rows // nchunks, (c + 1) * rows // nchunks)


def launch(theta, size, align):
    """theta: NumPy (N, nd, nd+1), validated; size: (N, C, [D,] H, W)."""
    dtype = theta.dtype
    nd = len(size) - 2
    shape = (size[0],) + tuple(size[2:])
    out = np.empty(shape + (nd,), dtype=storage(dtype))
    if out.size == 0:
        return out.view(dtype)
    th = np.ascontiguousarray(theta, dtype=compute(dtype))
    rows = out.reshape(-1, shape[-1] * nd)
    D = shape[1] if nd == 3 else 1
    _runtime.run(_serial, _parallel, out.size, th, rows, D, shape[-2], shape[-1], align, th.dtype.type(1))
    return out.view(dtype)

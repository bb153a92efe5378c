"""AffineGrid's backward on the CPU: ``grad_theta[n, i, j] = sum over positions of
grad_grid[n, p, i] * base_j(p)``, the base coordinates ``(x, y[, z], 1)`` of the
position (``_scalar.base_coord``).

``@njit(parallel=True)`` over fixed units of positions (``UNITS`` per image, a
function of the shape alone), each summing in float64 into a partial of its own;
the partials are added in their order afterwards, so the result is the same bits
whatever the thread count. The kernel is compiled once per compute type and rank
is a runtime value (16-bit grads are computed in float32, rounded once).
"""
import numpy as np
from numba import njit, prange

from .._dtypes import NAMES, compute
from .._scalar import base_coord
from . import _runtime
from ._opaque import INTERNAL, opaque

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)

#: units of positions per call at most (each a float64 partial of theta's gradient)
UNITS = 16
MIN_UNIT = 4096


@njit(**INTERNAL)
def _units(gg, part, osz, r, U, align, one, u0, u1):
    """Units ``u0:u1`` of ``gg`` (N*P*r, flat) into ``part`` (N*U*r*(r+1), float64);
    ``osz`` the output's spatial sizes as 3 axes (leading 1s)."""
    P = osz[0] * osz[1] * osz[2]
    btab = np.zeros((3, max(osz[0], osz[1], osz[2])), np.float64)
    for a in range(3):
        for i in range(osz[a]):
            btab[a, i] = np.float64(base_coord(i, osz[a], align, one))
    acc = np.zeros((3, 4), np.float64)
    bc = np.ones(4, np.float64)
    for u in range(u0, u1):
        n = u // U
        k = u - n * U
        acc[:] = 0.0
        for j in range(k * P // U, (k + 1) * P // U):
            t = j // osz[2]
            bc[0] = btab[2, j - t * osz[2]]
            bc[1] = btab[1, t % osz[1]]
            bc[2] = btab[0, t // osz[1]]
            for ci in range(r):
                g = np.float64(gg[(n * P + j) * r + ci])
                for q in range(r):
                    acc[ci, q] += g * bc[q]
                acc[ci, r] += g
        for ci in range(r):
            for q in range(r + 1):
                part[((n * U + k) * r + ci) * (r + 1) + q] = acc[ci, q]


_units_op = opaque(_units)


@njit(cache=True, nogil=True)
def _serial(gg, part, osz, r, U, align, one):
    _units_op(gg, part, osz, r, U, align, one, 0, part.size // (r * (r + 1)))


@njit(cache=True, parallel=True, nogil=True)
def _parallel(gg, part, osz, r, U, align, one, nchunks):
    units = part.size // (r * (r + 1))
    nchunks = min(units, nchunks)
    for c in prange(nchunks):
        _units_op(gg, part, osz, r, U, align, one, c * units // nchunks, (c + 1) * units // nchunks)


def launch(gg, size, align, stream=None):
    """grad_grid (N, [D,] H, W, r) NumPy, validated; size (N, C, [D,] H, W). theta's
    gradient (N, r, r+1) in grad_grid's dtype. ``stream`` is ignored on the CPU."""
    dt = gg.dtype
    ct = compute(dt)
    r = len(size) - 2
    N = int(size[0])
    spatial = tuple(int(s) for s in size[2:])
    P = int(np.prod(spatial, dtype=np.int64))
    if N == 0 or P == 0:
        return np.zeros((N, r, r + 1), dt)
    U = max(1, min(-(-UNITS // N), -(-P // MIN_UNIT)))
    part = np.zeros(N * U * r * (r + 1), np.float64)
    osz = np.array((1,) * (3 - r) + spatial, np.int64)
    _runtime.run(_serial, _parallel, N * P * r, np.ascontiguousarray(gg, dtype=ct).reshape(-1), part, osz,
                 np.int64(r), np.int64(U), bool(align), ct.type(1))
    return part.reshape(N, U, r, r + 1).sum(axis=1).astype(dt)

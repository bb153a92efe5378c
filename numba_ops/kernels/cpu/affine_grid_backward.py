"""AffineGrid's backward on the CPU: ``grad_theta[n, i, j] = sum over positions of
grad_grid[n, p, i] * base_j(p)``, the base coordinates ``(x, y[, z], 1)`` of the
position (``_scalar.base_coord``).

``@njit(parallel=True)`` over fixed units of rows (``UNITS`` per call, a function
of the shape alone), each summing in float64 into a partial of its own (per row
``sum g`` and ``sum g * x``, each in ``LANES`` partial sums, then times the row's y and z);
the partials are added in their order afterwards, so the result is the same bits
whatever the thread count. The kernel is compiled once per compute type and rank
is a runtime value (16-bit grads are computed in float32, rounded once).
"""
import numpy as np
from numba import njit, prange

from .._dtypes import NAMES, compute
from .._scalar import base_coord
from . import _runtime
from ._opaque import INTERNAL, inline, opaque

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)

#: units of rows per call at most (each a float64 partial of theta's gradient), and
#: the positions a unit holds at least
UNITS = 16
MIN_UNIT = 4096


#: partial sums a row's sums keep (``_row_sums``)
LANES = 4


@inline
def _row_sums(gg, xs, b, r, W):
    """``(sum g, sum g * x)`` in float64 over a row's ``W`` values ``gg[b + i * r]`` (x:
    ``xs[i]``): ``LANES`` partial sums each (position ``i`` into partial ``i % LANES``),
    added in a fixed order at the end. A single running sum waits for each addition
    before the next (a 64x64x64 grid's backward took 6x its forward); the partials
    are independent chains, and the order is the same on every call."""
    s0 = s1 = s2 = s3 = 0.0
    t0 = t1 = t2 = t3 = 0.0
    ru = np.uint64(r)  # (unsigned indices: no negative-index wraparound in the loop)
    o = np.uint64(b)
    n4 = np.uint64(W - W % LANES)
    for i in range(np.uint64(0), n4, np.uint64(LANES)):
        g0 = np.float64(gg[o])
        g1 = np.float64(gg[o + ru])
        g2 = np.float64(gg[o + ru + ru])
        g3 = np.float64(gg[o + ru + ru + ru])
        o += ru + ru + ru + ru
        s0 += g0
        s1 += g1
        s2 += g2
        s3 += g3
        t0 += g0 * xs[i]
        t1 += g1 * xs[i + np.uint64(1)]
        t2 += g2 * xs[i + np.uint64(2)]
        t3 += g3 * xs[i + np.uint64(3)]
    for i in range(n4, np.uint64(W)):
        g = np.float64(gg[o])
        o += ru
        s0 += g
        t0 += g * xs[i]
    return (s0 + s1) + (s2 + s3), (t0 + t1) + (t2 + t3)


@njit(**INTERNAL)
def _units(gg, part, osz, r, U, align, one, u0, u1):
    """Units ``u0:u1`` of ``gg`` (N*P*r, flat) into ``part`` (N*U*r*(r+1), float64);
    ``osz`` the output's spatial sizes as 3 axes (leading 1s). A unit is a run of
    rows (the positions of one (n, d, h)): along a row only x changes, so per row
    and coordinate two sums, ``sum g`` and ``sum g * x`` (float64, ``_row_sums``),
    then times y and z."""
    D, H, W = osz[0], osz[1], osz[2]
    rows = D * H
    xs = np.empty(W, np.float64)
    for i in range(W):
        xs[i] = np.float64(base_coord(i, W, align, one))
    acc = np.zeros((3, 4), np.float64)
    for u in range(u0, u1):
        n = u // U
        k = u - n * U
        acc[:] = 0.0
        for row in range(k * rows // U, (k + 1) * rows // U):
            d = row // H
            y = np.float64(base_coord(row - d * H, H, align, one))
            z = np.float64(base_coord(d, D, align, one))
            b = (n * rows + row) * W * r
            for ci in range(r):
                s, sx = _row_sums(gg, xs, b + ci, r, W)
                acc[ci, 0] += sx
                acc[ci, 1] += s * y
                if r == 3:
                    acc[ci, 2] += s * z
                acc[ci, r] += s
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
    rows = P // spatial[-1]
    U = max(1, min(-(-UNITS // N), -(-P // MIN_UNIT), rows))
    part = np.zeros(N * U * r * (r + 1), np.float64)
    osz = np.array((1,) * (3 - r) + spatial, np.int64)
    _runtime.run(_serial, _parallel, N * P * r, np.ascontiguousarray(gg, dtype=ct).reshape(-1), part, osz,
                 np.int64(r), np.int64(U), bool(align), ct.type(1))
    return part.reshape(N, U, r, r + 1).sum(axis=1).astype(dt)

"""AffineGrid's backward on the CPU: ``grad_theta[n, i, j] = sum over positions of
grad_grid[n, p, i] * base_j(p)``, the base coordinates ``(x, y[, z], 1)`` of the
position (``_scalar.base_coord``).

``@njit(parallel=True)`` over fixed units of rows (``UNITS`` per call, a function
of the shape alone), each summing in float64 into a partial of its own (per row
``sum g`` and ``sum g * x``, summed in vector lanes, then times the row's y and z);
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


@inline(fastmath={"reassoc"})
def _row_sums2(gg, xs, b, W, zero):
    """Per coordinate of a 2-D grid row's ``W`` positions from ``gg[b]`` on (x and y
    interleaved), ``sum g`` and ``sum g * x`` in float64 (``xs[i]``: position ``i``'s
    x), as ``(s0, sx0, s1, sx1, 0, 0)``. Compiled with reassociation, so that LLVM reads
    the interleaved row in vectors and sums in vector lanes: one running sum waits for
    each addition before the next (a 64x64x64 grid's backward took 6-10x its forward).
    The order of the sums is the compiled code's: the same on every call and thread
    count. (One function per rank: the stride must be a constant in the loop; one
    function with the rank as an argument took a 2-D grid's backward 1.4-1.8x longer.)"""
    s0 = s1 = t0 = t1 = zero
    o = np.uint64(b)  # (unsigned indices: no negative-index wraparound in the loop)
    for i in range(np.uint64(W)):
        g0 = np.float64(gg[o + np.uint64(2) * i])
        g1 = np.float64(gg[o + np.uint64(2) * i + np.uint64(1)])
        x = xs[i]
        s0 += g0
        s1 += g1
        t0 += g0 * x
        t1 += g1 * x
    return s0, t0, s1, t1, zero, zero


@inline(fastmath={"reassoc"})
def _row_sums3(gg, xs, b, W, zero):
    """``_row_sums2`` for a 3-D grid's rows (x, y and z interleaved): ``(s0, sx0, s1,
    sx1, s2, sx2)``."""
    s0 = s1 = s2 = t0 = t1 = t2 = zero
    o = np.uint64(b)
    for i in range(np.uint64(W)):
        q = o + np.uint64(3) * i
        g0 = np.float64(gg[q])
        g1 = np.float64(gg[q + np.uint64(1)])
        g2 = np.float64(gg[q + np.uint64(2)])
        x = xs[i]
        s0 += g0
        s1 += g1
        s2 += g2
        t0 += g0 * x
        t1 += g1 * x
        t2 += g2 * x
    return s0, t0, s1, t1, s2, t2


@njit(**INTERNAL)
def _units(gg, part, osz, r, U, align, one, u0, u1):
    """Units ``u0:u1`` of ``gg`` (N*P*r, flat) into ``part`` (N*U*r*(r+1), float64);
    ``osz`` the output's spatial sizes as 3 axes (leading 1s). A unit is a run of
    rows (the positions of one (n, d, h)): along a row only x changes, so per row
    and coordinate two sums, ``sum g`` and ``sum g * x`` (float64, ``_row_sums2`` /
    ``_row_sums3``), then times y and z."""
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
            sums = _row_sums3(gg, xs, b, W, 0.0) if r == 3 else _row_sums2(gg, xs, b, W, 0.0)
            for ci in range(r):
                s, sx = sums[2 * ci], sums[2 * ci + 1]
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

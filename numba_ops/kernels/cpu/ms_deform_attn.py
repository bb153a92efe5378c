"""Multi-scale deformable attention on the CPU: ``@njit(parallel=True)`` over the
output's rows ``(n, q)``.

A row is every head's ``Dh`` channels of one query: per head, the query's
``L x P`` points are sampled (``kernels/_msda.py``: GridSample's linear taps with
zeros padding) and their corners' value rows, ``Dh`` contiguous channels each,
are added into a ``Dh`` accumulator with weight ``attention x corner weight``
(a loop over channels that vectorises); the accumulator is then stored once. No
sample is materialised: the work is the corners' reads, from cache for the
pyramid's small levels.

Rows are written by one unit each, so the result does not depend on the thread
count. The rank is a run-time value (``shapes`` holds three sizes per level, 0
for an absent axis), so one compiled kernel serves 1-, 2- and 3-D levels; 16-bit
inputs are widened to float32 by the launcher and the result rounded once.
"""
import numpy as np
from numba import njit, prange

from .._dtypes import NAMES, compute
from .._msda import axis_taps, corner, interior, level_table
from .._sample import as_compute
from . import _runtime
from ._copies import narrowed, widened
from ._opaque import INTERNAL, inline, opaque
from ._views import flat, prefetch

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)

#: 1 in each compute type, made once
ONE = {np.dtype(t): t(1) for t in (np.float32, np.float64)}


#: the longest axis whose points ``plan`` may take as interior (their floors are int32)
_INT32_AXIS = (1 << 31) - 1


@inline
def plan(lf, lb, count, r, size, last, ix, iy, iz, fx, fy, fz, ok, one):
    """The interior plan of ``count`` points whose ``r`` coordinates lie one after
    another from ``lf[lb]`` on: ``ok[j]`` where point ``j`` is 2-D or 3-D and every tap
    of it lies inside its level, with each axis' floor and fraction (``ix``/``fx``,
    ``iy``/``fy``, and ``iz``/``fz`` for 3-D). ``size`` and ``last`` (3, n): each
    point's level's sizes and last indices, innermost first, in the compute type
    (``point_table``); the buffers hold ``n >= count`` points (``plan_buffers``).

    One loop without branches over all the points, which vectorises (LLVM left it
    scalar where a helper wrote the plan's arrays, or where the coordinates were
    indexed at an offset); the kernels then sample the planned points and take the
    others one by one. Point by point, this arithmetic took 49 ns a point on one
    thread (Deformable DETR's encoder), planned 21."""
    pts = lf[lb:lb + count * r]  # (indexed from 0: an offset index kept the loop scalar)
    sx, sy, sz = size[0], size[1], size[2]
    ex, ey, ez = last[0], last[1], last[2]
    if r == 2:
        for j in range(count):
            jj = np.uint64(j)
            o = np.uint64(2 * j)
            ix[jj], fx[jj], okx = interior(pts[o], sx[jj], ex[jj], one)
            iy[jj], fy[jj], oky = interior(pts[o + 1], sy[jj], ey[jj], one)
            ok[jj] = okx & oky
    elif r == 3:
        for j in range(count):
            jj = np.uint64(j)
            o = np.uint64(3 * j)
            ix[jj], fx[jj], okx = interior(pts[o], sx[jj], ex[jj], one)
            iy[jj], fy[jj], oky = interior(pts[o + 1], sy[jj], ey[jj], one)
            iz[jj], fz[jj], okz = interior(pts[o + 2], sz[jj], ez[jj], one)
            ok[jj] = okx & oky & okz
    else:  # 1-D levels: every point by its padded taps
        ok[:count] = False


@inline
def point_table(shapes, lv, size, last, j):
    """Point ``j``'s column of ``plan``'s tables: its level ``lv``'s sizes and last
    indices (-1, never inside, on an axis too long for ``plan``'s int32 floors)."""
    for i in range(3):
        s = shapes[lv, i]
        size[i, j] = s
        last[i, j] = s - 1 if s <= _INT32_AXIS else -1


@inline
def plan_buffers(n, one):
    """``plan``'s tables and results for ``n`` points: ``(size, last, ix, iy, iz, fx,
    fy, fz, ok)``."""
    t = type(one)
    return (np.empty((3, n), t), np.empty((3, n), t), np.empty(n, np.int32), np.empty(n, np.int32),
            np.empty(n, np.int32), np.empty(n, t), np.empty(n, t), np.empty(n, t), np.empty(n, np.bool_))


#: how many points ahead of the one they sample the kernels prefetch a point's corners
AHEAD = 4


@inline
def prefetch_corners(vf, o, sy, sz, row, planes, Dh):
    """Prefetch the rows of ``Dh`` values at a planned point's corners: the first at
    ``vf[o]``, the others ``row`` (x), ``sy`` (y) and, for ``planes`` 2, ``sz`` (z)
    further. Each row's first, middle and last values: every cache line of a row of up
    to 128 bytes (float32 ``Dh`` 32) wherever it starts, the ends of a longer one (a
    loop over a row's lines made the encoder several times slower). The encoder's
    corners are mostly read from beyond L2 (their neighbourhoods over all heads are
    larger), and without the hint the point's reads wait for their lines one after
    another."""
    for cz in range(planes):
        for cy in range(2):
            for cx in range(2):
                c = o + cz * sz + cy * sy + cx * row
                prefetch(vf, c)
                prefetch(vf, c + Dh // 2)
                prefetch(vf, c + Dh - 1)


@njit(**INTERNAL)
def _rows(v, shapes, starts, loc, attn, out, one, u0, u1):
    """Rows ``u0:u1`` (``n * Lq + q``) of ``out`` (N, Lq, M, Dh). ``v`` (N, S, M, Dh),
    ``loc`` (N, Lq, M, L, P, r), ``attn`` (N, Lq, M, L, P); ``shapes`` (L, 3) holds
    each level's (W, H, D), innermost first, 0 for an absent axis.

    A row's ``M x L x P`` points are planned first (``plan``); a 2-D or 3-D point
    whose taps are all inside then adds its four corners of a plane in one pass over
    the channels; others (near an edge, far outside, not finite, 1-D) take every
    axis' padded taps (``axis_taps``)."""
    Lq, M, Dh = out.shape[1], out.shape[2], out.shape[3]
    L, P, r = loc.shape[3], loc.shape[4], loc.shape[5]
    S = v.shape[1]
    vf = flat(v)
    of = flat(out)
    lf = flat(loc)
    af = flat(attn)
    one = as_compute(one, 1)  # a constant where this compiles: LLVM folds the halvings into products
    zero = one - one
    nan = one * np.nan
    acc = np.empty(Dh, type(one))
    row = M * Dh  # a position's stride in value
    J = M * L * P  # a row's points, (m, l, p) row-major
    size, last, ix, iy, iz, fx, fy, fz, ok = plan_buffers(J, one)
    strides = np.empty((3, J), np.int64)  # per point: its level's and head's offset, y and z strides
    for j in range(J):
        lv = (j // P) % L
        point_table(shapes, lv, size, last, j)
        W1 = max(shapes[lv, 0], 1)
        strides[0, j] = (starts[lv] * M + j // (L * P)) * Dh
        strides[1, j] = W1 * row
        strides[2, j] = W1 * max(shapes[lv, 1], 1) * row
    planes = 2 if r > 2 else 1
    for u in range(u0, u1):
        n = u // Lq
        img = n * S * M * Dh  # the image's value
        plan(lf, u * J * r, J, r, size, last, ix, iy, iz, fx, fy, fz, ok, one)
        for m in range(M):
            acc[:] = zero
            finite = True
            for lv in range(L):
                W, H, D = shapes[lv, 0], shapes[lv, 1], shapes[lv, 2]
                W1 = max(W, 1)
                H1 = max(H, 1)
                at = ((n * S + starts[lv]) * M + m) * Dh  # the level's first position, head m
                for p in range(P):
                    j = (m * L + lv) * P + p
                    k = j + AHEAD
                    if k < J and ok[k]:
                        o = img + strides[0, k] + (iz[k] * strides[2, k] if r > 2 else 0) + iy[k] * strides[1, k]
                        prefetch_corners(vf, o + ix[k] * row, strides[1, k], strides[2, k], row, planes, Dh)
                    a = af[np.uint64(u * J + j)]
                    if ok[j]:
                        ax, ay, az = fx[j], fy[j], fz[j]  # the fractions
                        for cz in range(2 if r > 2 else 1):
                            wz = a if r == 2 else (a * (one - az) if cz == 0 else a * az)
                            kz = np.int64(iz[j]) + cz if r > 2 else np.int64(0)
                            o0 = at + ((kz * H1 + iy[j]) * W1 + ix[j]) * row
                            o2 = o0 + W1 * row
                            w0 = wz * (one - ay)
                            w1 = wz * ay
                            c0, c1, c2, c3 = w0 * (one - ax), w0 * ax, w1 * (one - ax), w1 * ax
                            for d in range(Dh):
                                acc[d] += (c0 * vf[np.uint64(o0 + d)] + c1 * vf[np.uint64(o0 + row + d)]
                                           + c2 * vf[np.uint64(o2 + d)] + c3 * vf[np.uint64(o2 + row + d)])
                        continue
                    o = np.uint64((u * J + j) * r)
                    lx = lf[o]
                    ly = lf[o + 1] if r > 1 else zero
                    lz = lf[o + 2] if r > 2 else zero
                    tx, ty, tz = axis_taps(lx, W, one), axis_taps(ly, H, one), axis_taps(lz, D, one)
                    if not (tx[6] and ty[6] and tz[6]):
                        finite = False
                        continue
                    for c in range(8):
                        k, w, inside = corner(c, tx, ty, tz, W1, H1)
                        if inside:
                            w = a * w
                            o = at + k * row
                            for d in range(Dh):
                                acc[d] += w * vf[np.uint64(o + d)]
            o = (u * M + m) * Dh
            for d in range(Dh):
                of[np.uint64(o + d)] = acc[d] if finite else nan


_rows_op = opaque(_rows)


@njit(cache=True, nogil=True)
def _serial(v, shapes, starts, loc, attn, out, one):
    _rows_op(v, shapes, starts, loc, attn, out, one, 0, out.shape[0] * out.shape[1])


@njit(cache=True, parallel=True, nogil=True)
def _parallel(v, shapes, starts, loc, attn, out, one, nchunks):
    units = out.shape[0] * out.shape[1]
    nchunks = min(units, nchunks)
    for c in prange(nchunks):
        _rows_op(v, shapes, starts, loc, attn, out, one, c * units // nchunks, (c + 1) * units // nchunks)


def launch_plan(vshape, lshape):
    """``(output shape (N, Lq, M, Dh), work, rows)`` of a call: the work that decides
    serial or parallel (``_runtime``) and the rows (``_rows``' units) that a pool
    shares out; ``launch`` and numba_ops.onnx's session run by it."""
    N, _, M, Dh = vshape
    Lq, L, P, r = lshape[1], lshape[3], lshape[4], lshape[5]
    return (N, Lq, M, Dh), N * Lq * M * L * P * Dh * (1 << r), N * Lq


@njit(cache=True, inline="always")
def rows_task(v, shapes, starts, loc, attn, out, one, th, items, rows):
    """Pool item ``th`` of ``items``: its share of the ``rows`` (a pool other than
    numba's, as ``_parallel`` deals them)."""
    _rows_op(v, shapes, starts, loc, attn, out, one, th * rows // items, (th + 1) * rows // items)


def launch(value, shapes, starts, loc, attn, stream=None):
    """value (N, S, M, Dh), shapes int (L, r), starts int (L,), loc (N, Lq, M, L, P, r),
    attn (N, Lq, M, L, P): NumPy, validated by the front end. Returns (N, Lq, M * Dh)
    in value's dtype. ``stream`` is ignored on the CPU."""
    dt = value.dtype
    shape, work, _ = launch_plan(value.shape, loc.shape)
    ct = compute(dt)
    out = np.empty(shape, ct)
    if out.size:
        _runtime.run(_serial, _parallel, work, widened(value), level_table(shapes),
                     np.ascontiguousarray(starts, np.int64), widened(loc), widened(attn), out, ONE[ct])
    out = out.reshape(shape[0], shape[1], shape[2] * shape[3])
    return narrowed(out, dt)

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
from ._opaque import INTERNAL, opaque
from ._views import flat

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)

#: 1 in each compute type, made once
ONE = {np.dtype(t): t(1) for t in (np.float32, np.float64)}


@njit(**INTERNAL)
def _rows(v, shapes, starts, loc, attn, out, one, u0, u1):
    """Rows ``u0:u1`` (``n * Lq + q``) of ``out`` (N, Lq, M, Dh). ``v`` (N, S, M, Dh),
    ``loc`` (N, Lq, M, L, P, r), ``attn`` (N, Lq, M, L, P); ``shapes`` (L, 3) holds
    each level's (W, H, D), innermost first, 0 for an absent axis.

    A 2-D or 3-D point whose taps are all inside (``_msda.interior``) adds its four
    corners of a plane in one pass over the channels; others (near an edge, far
    outside, not finite, 1-D) take every axis' padded taps (``axis_taps``)."""
    Lq, M, Dh = out.shape[1], out.shape[2], out.shape[3]
    L, P, r = loc.shape[3], loc.shape[4], loc.shape[5]
    S = v.shape[1]
    vf = flat(v)
    of = flat(out)
    one = as_compute(one, 1)  # a constant where this compiles: LLVM folds the halvings into products
    zero = one - one
    nan = one * np.nan
    acc = np.empty(Dh, type(one))
    row = M * Dh  # a position's stride in value
    for u in range(u0, u1):
        n = u // Lq
        q = u - n * Lq
        for m in range(M):
            acc[:] = zero
            finite = True
            for lv in range(L):
                W, H, D = shapes[lv, 0], shapes[lv, 1], shapes[lv, 2]
                W1 = max(W, 1)
                H1 = max(H, 1)
                at = ((n * S + starts[lv]) * M + m) * Dh  # the level's first position, head m
                for p in range(P):
                    a = attn[n, q, m, lv, p]
                    lx = loc[n, q, m, lv, p, 0]
                    ly = loc[n, q, m, lv, p, 1] if r > 1 else zero
                    lz = loc[n, q, m, lv, p, 2] if r > 2 else zero
                    kx, fx, okx = interior(lx, W, one)
                    ky, fy, oky = interior(ly, H, one)
                    kz, fz, okz = interior(lz, D, one) if r > 2 else (np.int64(0), zero, True)
                    if okx & oky & okz & (r > 1):
                        for cz in range(2 if r > 2 else 1):
                            wz = a if r == 2 else (a * (one - fz) if cz == 0 else a * fz)
                            o0 = at + (((kz + cz) * H1 + ky) * W1 + kx) * row
                            o2 = o0 + W1 * row
                            w0 = wz * (one - fy)
                            w1 = wz * fy
                            c0, c1, c2, c3 = w0 * (one - fx), w0 * fx, w1 * (one - fx), w1 * fx
                            for d in range(Dh):
                                acc[d] += (c0 * vf[np.uint64(o0 + d)] + c1 * vf[np.uint64(o0 + row + d)]
                                           + c2 * vf[np.uint64(o2 + d)] + c3 * vf[np.uint64(o2 + row + d)])
                        continue
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

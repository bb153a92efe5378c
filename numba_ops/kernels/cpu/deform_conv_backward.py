"""DeformConv's backward on the CPU, N-D: two GEMMs per tile of output positions
around two ``@njit(parallel=True)`` sampling passes.

With ``col[(c, k), o] = mask * S(x[n, c], pos(g, k, o))`` (the forward's sampled
columns, never built for a whole layer) and ``gcol = W^T grad_y`` (per group),
per image and per tile of ``tile(...)`` output positions:

1. ``gcol = W_g^T @ grad_y[n, g, :, tile]`` (a GEMM; only when x, offset or mask
   is wanted);
2. ``_columns`` (parallel over units of (offset group, kernel point, positions)):
   each position's 2**n corners (flat index, ``mask * weight``; a corner outside
   the input is skipped) into a table, then channel by channel: ``col`` (for W's
   gradient), ``grad_mask += gcol * S`` and ``grad_offset_i += gcol * mask *
   dS/dpos_i``, the derivative from ``floor`` of the position (``_sample.
   grad_taps_at``, shared with GridSample and the CUDA kernels);
3. ``grad_w_g += grad_y[n, g, :, tile] @ col_g^T`` (a GEMM);
4. ``_scatter`` (parallel over channels): ``grad_x[n, c, corner] += gcol *
   mask * weight`` from the table. Each channel's image is one thread's, so no two
   threads ever add to one element: no atomics, and every sum runs in one fixed
   order (tiles, kernel points, positions, corners).

So the gradients are the same bits on every call, whatever the number of threads
(the tiles depend on the shape alone). ``grad_b`` is ``grad_y``'s sum in float64.
A position that is not finite gets NaN in its own ``grad_offset`` and
``grad_mask`` and adds nothing to ``grad_w`` or ``grad_x``.

Working memory beyond the gradients: ``col`` and ``gcol`` of ``C * K`` rows by a
tile of positions (``TILE_BYTES`` each), the corner table (``og * K * tile *
2**n`` entries), and float32 copies of 16-bit inputs (computed in float32,
rounded once). The kernels compile once per compute type (rank, group counts and
wants are runtime values).
"""
import numpy as np
from numba import njit, prange

from .._dtypes import NAMES, compute
from .._sample import LINEAR, ZEROS, grad_taps_at
from .._scalar import split_position
from . import _runtime

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)

#: bytes of ``col`` (and of ``gcol``) per tile: the tile's positions follow from it
TILE_BYTES = 4 << 20
#: positions of one unit of the sampling pass
UNIT = 64


def tile(P, rows, itemsize):
    """Positions per tile: ``TILE_BYTES`` of ``rows`` columns, at least 64 (a function of the shape alone)."""
    return int(max(1, min(P, max(64, TILE_BYTES // max(1, rows * itemsize)))))


@njit(cache=True, parallel=True, nogil=True)
def _columns(xf, off, msk, gcol, col, gmask, goff, cidx, cw, geo, n, p0, T, want, zero):
    """Pass 2 for positions ``p0:p0+T`` of image ``n``. ``geo`` (int64): nd, C, og, K, P,
    S, then per axis (outermost first) size, stride of x, output size, conv stride,
    pad begin, dilation, kernel size. ``want``: (w, offset, mask). Fills the corner
    table ``cidx``/``cw`` (og*K*T rows of 2**nd: flat index or -1 outside, weight),
    ``col`` (C*K*T) and writes ``gmask`` (N*og*K*P) and ``goff`` (N*og*K*nd*P)."""
    nd, C, og, K, P, S = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    one = zero + 1
    nan = zero + np.nan
    NC = 1 << nd
    Cg = C // og
    nu = (T + UNIT - 1) // UNIT
    for u in prange(og * K * nu):
        gk = u // nu
        q0 = (u - gk * nu) * UNIT
        q1 = min(T, q0 + UNIT)
        g = gk // K
        k = gk - g * K
        fr = np.empty((nd, UNIT), type(zero))  # the upper corner's weight per axis
        mval = np.empty(UNIT, type(zero))
        fin = np.empty(UNIT, np.bool_)
        dwt = np.empty((nd, UNIT * NC), type(zero))  # per corner: d weight / d pos_a
        dacc = np.empty(nd, type(zero))
        for q in range(q0, q1):
            j = q - q0
            p = p0 + q
            mval[j] = msk[((n * og + g) * K + k) * P + p] if msk.size else one
            finite = True
            rem = p
            kr = k
            row = (gk * T + q) * NC
            for cn in range(NC):
                cidx[row + cn] = 0
            # axis by axis from the innermost: output index, kernel index, position, corners
            for a in range(nd - 1, -1, -1):
                b = 6 + 7 * a
                osz = geo[b + 2]
                ks = geo[b + 6]
                oi = rem % osz
                rem //= osz
                ki = kr % ks
                kr //= ks
                base = oi * geo[b + 3] - geo[b + 4] + ki * geo[b + 5]
                i, frac, near, fa = split_position(base, off[(((n * og + g) * K + k) * nd + a) * P + p], zero)
                if not near:  # huge: outside, every corner 0
                    i = np.int64(-2)
                    frac = zero
                t0, t1, _, _, _, _, _, _, _, _, _, _, ok0, ok1, _, _ = grad_taps_at(
                    LINEAR, i, frac, fa, geo[b], np.int64(0), ZEROS, False, zero)
                finite &= fa
                fr[a, j] = frac
                st = geo[b + 1]
                for cn in range(NC):
                    if cidx[row + cn] < 0:
                        continue
                    up = (cn >> (nd - 1 - a)) & 1
                    if (ok1 if up else ok0):
                        cidx[row + cn] += (t1 if up else t0) * st
                    else:
                        cidx[row + cn] = -1
            fin[j] = finite
            for cn in range(NC):
                if not finite:
                    cidx[row + cn] = -1
                inside = cidx[row + cn] >= 0
                wt = one
                for a in range(nd):
                    up = (cn >> (nd - 1 - a)) & 1
                    wt *= fr[a, j] if up else one - fr[a, j]
                    # d weight / d pos_a: the other axes' weights, signed by the corner's side along a
                    dw = one if up else -one
                    for a2 in range(nd):
                        if a2 != a:
                            dw *= fr[a2, j] if (cn >> (nd - 1 - a2)) & 1 else one - fr[a2, j]
                    dwt[a, j * NC + cn] = dw if inside else zero
                cw[row + cn] = wt if inside else zero
        if not (want[0] or want[1] or want[2]):
            continue
        dsum = np.zeros((nd, UNIT), type(zero))
        ssum = np.zeros(UNIT, type(zero))
        for cg in range(Cg):
            c = g * Cg + cg
            xb = (n * C + c) * S
            r = (c * K + k) * T
            for q in range(q0, q1):
                j = q - q0
                row = (gk * T + q) * NC
                s = zero
                if want[1]:
                    for a in range(nd):
                        dacc[a] = zero
                for cn in range(NC):
                    ix = cidx[row + cn]
                    if ix >= 0:
                        v = xf[xb + ix]
                        s += cw[row + cn] * v
                        if want[1]:
                            for a in range(nd):
                                dacc[a] += dwt[a, j * NC + cn] * v
                if want[0]:
                    col[r + q] = mval[j] * s
                if want[1] or want[2]:
                    gv = gcol[r + q]
                    ssum[j] += gv * s
                    if want[1]:
                        for a in range(nd):
                            dsum[a, j] += gv * dacc[a]
        for q in range(q0, q1):
            j = q - q0
            p = p0 + q
            if want[2]:
                gmask[((n * og + g) * K + k) * P + p] = ssum[j] if fin[j] else nan
            if want[1]:
                for a in range(nd):
                    goff[(((n * og + g) * K + k) * nd + a) * P + p] = mval[j] * dsum[a, j] if fin[j] else nan


@njit(cache=True, parallel=True, nogil=True)
def _scatter(gx, gcol, msk, cidx, cw, geo, n, p0, T):
    """Pass 4: ``grad_x[n, c] += gcol * mask * weight`` over the table's corners, one
    channel per thread at a time."""
    nd, C, og, K, P, S = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    NC = 1 << nd
    Cg = C // og
    for c in prange(C):
        g = c // Cg
        xb = (n * C + c) * S
        for k in range(K):
            gk = g * K + k
            r = (c * K + k) * T
            for q in range(T):
                gv = gcol[r + q]
                if msk.size:
                    gv *= msk[((n * og + g) * K + k) * P + p0 + q]
                row = (gk * T + q) * NC
                for cn in range(NC):
                    ix = cidx[row + cn]
                    if ix >= 0:
                        gx[xb + ix] += gv * cw[row + cn]


_columns_serial = njit(cache=True, nogil=True)(_columns.py_func)
_scatter_serial = njit(cache=True, nogil=True)(_scatter.py_func)


def launch(gy, x, w, offset, b, mask, p, wants, stream=None):
    """All NumPy, one float dtype, validated by the front end (``p``: DeformParams;
    ``wants``: x, w, offset, b, mask). ``stream`` is ignored on the CPU."""
    want_x, want_w, want_off, want_b, want_m = wants
    dt = x.dtype
    ct = compute(dt)
    nd, K, og, G = p.nd, p.K, p.offset_group, p.group
    N, C = int(x.shape[0]), int(x.shape[1])
    oC = int(w.shape[0])
    spatial = tuple(int(s) for s in x.shape[2:])
    S = int(np.prod(spatial, dtype=np.int64))
    P = int(np.prod(p.out_spatial, dtype=np.int64))
    gx = np.zeros(N * C * S if want_x else 0, ct)
    gw = np.zeros((G, oC // G, (C // G) * K), ct) if want_w else None
    goff = np.zeros(N * og * K * nd * P if want_off else 0, ct)
    gmask = np.zeros(N * og * K * P if want_m else 0, ct)
    need_gcol = want_x or want_off or want_m
    if N and (need_gcol or want_w):
        flat = lambda a: np.ascontiguousarray(a, dtype=ct).reshape(-1)  # noqa: E731
        xf, off = flat(x), flat(offset)
        msk = flat(mask) if mask is not None else np.zeros(0, ct)
        gyv = np.ascontiguousarray(gy, dtype=ct).reshape(N, G, oC // G, P)
        wg = np.ascontiguousarray(w, dtype=ct).reshape(G, oC // G, (C // G) * K)
        wT = np.ascontiguousarray(wg.transpose(0, 2, 1)) if need_gcol else None
        geo = [nd, C, og, K, P, S]
        for a in range(nd):
            geo += [spatial[a], int(np.prod(spatial[a + 1:], dtype=np.int64)), p.out_spatial[a], p.strides[a],
                    p.pads_begin[a], p.dilations[a], p.kernel_shape[a]]
        geo = np.array(geo, np.int64)
        T = tile(P, C * K, ct.itemsize)
        col_buf = np.empty(C * K * T if want_w else 0, ct)
        gcol_buf = np.empty(C * K * T if need_gcol else 0, ct)
        cidx = np.empty(og * K * T * (1 << nd), np.int64)
        cw = np.empty(og * K * T * (1 << nd), ct)
        want = np.array((want_w, want_off, want_m), np.bool_)
        for n in range(N):
            for p0 in range(0, P, T):
                Tt = min(T, P - p0)
                gcol = gcol_buf[:C * K * Tt]
                col = col_buf[:C * K * Tt]
                if need_gcol:
                    gc3 = gcol.reshape(G, (C // G) * K, Tt)
                    for g in range(G):
                        np.matmul(wT[g], gyv[n, g, :, p0:p0 + Tt], out=gc3[g])
                _runtime.call(_columns_serial, _columns, C * K * Tt, xf, off, msk, gcol, col, gmask, goff, cidx, cw, geo, n, p0, Tt, want, ct.type(0))
                if want_w:
                    c3 = col.reshape(G, (C // G) * K, Tt)
                    for g in range(G):
                        gw[g] += gyv[n, g, :, p0:p0 + Tt] @ c3[g].T
                if want_x:
                    _runtime.call(_scatter_serial, _scatter, C * K * Tt, gx, gcol, msk, cidx, cw, geo, n, p0, Tt)
    gb = None
    if want_b:
        gb = gy.astype(np.float64).sum(axis=tuple(i for i in range(gy.ndim) if i != 1)).astype(dt)
    cast = lambda a, shape: None if a is None else a.reshape(shape).astype(dt, copy=False)  # noqa: E731
    return (cast(gx if want_x else None, x.shape), cast(gw, w.shape), cast(goff if want_off else None, offset.shape),
            gb, cast(gmask if want_m else None, None if mask is None else mask.shape))

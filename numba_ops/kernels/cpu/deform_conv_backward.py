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
from ._blas import ONE_THREAD, gemm_tn

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)

#: bytes of ``col`` (and of ``gcol``) per tile: the tile's positions follow from it
TILE_BYTES = 4 << 20
#: positions of one unit of the sampling pass
UNIT = 64


def tile(P, rows, itemsize):
    """Positions per tile: ``TILE_BYTES`` of ``rows`` columns, at least 64 (a function of the shape alone)."""
    return int(max(1, min(P, max(64, TILE_BYTES // max(1, rows * itemsize)))))


@njit(cache=True, parallel=True, nogil=True)
def _columns(xf, off, msk, gcol, col, gmask, goff, cidx, cw, geo, n, p0, T, ndt, want_w, want_off, want_m, zero):
    """Pass 2 for positions ``p0:p0+T`` of image ``n``. ``geo`` (int64): nd, C, og, K, P,
    S, then per axis (outermost first) size, stride of x, output size, conv stride,
    pad begin, dilation, kernel size; ``ndt`` a tuple of nd entries (nd is a constant
    where this compiles, so the corner loops unroll). Fills the corner
    table ``cidx``/``cw`` (og*K*T rows of 2**nd: flat index or -1 outside, weight),
    ``col`` (C*K*T) and writes ``gmask`` (N*og*K*P) and ``goff`` (N*og*K*nd*P)."""
    nd = len(ndt)
    C, og, K, P, S = geo[1], geo[2], geo[3], geo[4], geo[5]
    one = zero + 1
    nan = zero + np.nan
    NC = 1 << nd
    Cg = C // og
    nu = (T + UNIT - 1) // UNIT
    want_gcol = want_off or want_m
    for u in prange(og * K * nu):
        gk = u // nu
        q0 = (u - gk * nu) * UNIT
        q1 = min(T, q0 + UNIT)
        g = gk // K
        k = gk - g * K
        fr = np.empty((nd, UNIT), type(zero))  # the upper corner's weight per axis
        mval = np.empty(UNIT, type(zero))
        fin = np.empty(UNIT, np.bool_)
        dwt = np.empty(UNIT * NC * nd, type(zero))  # per corner: d weight / d pos_a
        lidx = np.empty(UNIT * NC, np.int64)  # the unit's rows of the table, local
        lw = np.empty(UNIT * NC, type(zero))
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
                    dwt[(j * NC + cn) * nd + a] = dw if inside else zero
                cw[row + cn] = wt if inside else zero
                lidx[j * NC + cn] = cidx[row + cn]
                lw[j * NC + cn] = cw[row + cn]
        if not (want_w or want_gcol):
            continue
        dsum = np.zeros((nd, UNIT), type(zero))
        ssum = np.zeros(UNIT, type(zero))
        for cg in range(Cg):
            c = g * Cg + cg
            xb = (n * C + c) * S
            r = (c * K + k) * T
            for q in range(q0, q1):
                j = q - q0
                s = zero
                d0 = zero  # d S / d pos_a for the first three axes (scalars: registers) ...
                d1 = zero
                d2 = zero
                for a in range(3, nd):  # ... and the rest (more than 3 spatial axes)
                    dacc[a] = zero
                for cn in range(NC):
                    e = j * NC + cn
                    ix = lidx[e]
                    v = xf[xb + max(ix, 0)]
                    v = v if ix >= 0 else zero  # a corner outside counts 0 (selected, never 0 * x)
                    s += lw[e] * v
                    if want_off:
                        d0 += dwt[e * nd] * v
                        if nd > 1:
                            d1 += dwt[e * nd + 1] * v
                        if nd > 2:
                            d2 += dwt[e * nd + 2] * v
                        for a in range(3, nd):
                            dacc[a] += dwt[e * nd + a] * v
                if want_w:
                    col[r + q] = mval[j] * s
                if want_gcol:
                    gv = gcol[r + q]
                    ssum[j] += gv * s
                    if want_off:
                        dsum[0, j] += gv * d0
                        if nd > 1:
                            dsum[1, j] += gv * d1
                        if nd > 2:
                            dsum[2, j] += gv * d2
                        for a in range(3, nd):
                            dsum[a, j] += gv * dacc[a]
        for q in range(q0, q1):
            j = q - q0
            p = p0 + q
            if want_m:
                gmask[((n * og + g) * K + k) * P + p] = ssum[j] if fin[j] else nan
            if want_off:
                for a in range(nd):
                    goff[(((n * og + g) * K + k) * nd + a) * P + p] = mval[j] * dsum[a, j] if fin[j] else nan


@njit(cache=True, parallel=True, nogil=True)
def _scatter(gx, gcol, msk, cidx, cw, geo, n, p0, T, ndt):
    """Pass 4: ``grad_x[n, c] += gcol * mask * weight`` over the table's corners, one
    channel per thread at a time."""
    nd = len(ndt)
    C, og, K, P, S = geo[1], geo[2], geo[3], geo[4], geo[5]
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


@njit(cache=True, parallel=True, nogil=True)
def _gcol(gyf, gyT, wT, gcol, dims, n, p0, T):
    """Pass 1: ``gcol_g = W_g^T grad_y[n, g, :, p0:p0+T]`` per group (rows (c, k), T
    columns), one BLAS call per group and 64 positions. ``dims``: oC, P, G, oCg, RW
    (= Cg * K)."""
    oC, P, G, oCg, RW = dims[0], dims[1], dims[2], dims[3], dims[4]
    for q in prange(T):  # grad_y's tile with the channels innermost (the GEMM's reduction axis)
        for oc in range(oC):
            gyT[q * oC + oc] = gyf[(n * oC + oc) * P + p0 + q]
    nq = (T + 63) // 64
    for u in prange(G * nq):
        g = u // nq
        q0 = (u - g * nq) * 64
        gemm_tn(gyT, q0 * oC + g * oCg, oC, wT, g * RW * oCg, oCg, gcol, g * RW * T + q0, T,
                min(64, T - q0), RW, oCg)


@njit(cache=True, parallel=True, nogil=True)
def _gw(gyf, col, gw, tmp, dims, n, p0, T):
    """Pass 3: ``grad_w_g += grad_y[n, g, :, p0:p0+T] @ col_g^T``, one BLAS call per
    group and 16 output channels into ``tmp``, then added (a fixed order)."""
    oC, P, G, oCg, RW = dims[0], dims[1], dims[2], dims[3], dims[4]
    no = (oCg + 15) // 16
    for u in prange(G * no):
        g = u // no
        o0 = (u - g * no) * 16
        nn = min(16, oCg - o0)
        base = (g * oCg + o0) * RW
        gemm_tn(col, g * RW * T, T, gyf, (n * oC + g * oCg + o0) * P + p0, P, tmp, base, RW, RW, nn, T)
        for i in range(base, base + nn * RW):
            gw[i] += tmp[i]


_columns_serial = njit(cache=True, nogil=True)(_columns.py_func)
_scatter_serial = njit(cache=True, nogil=True)(_scatter.py_func)
_gcol_serial = njit(cache=True, nogil=True)(_gcol.py_func)
_gw_serial = njit(cache=True, nogil=True)(_gw.py_func)


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
        gyf = flat(gy)
        RW = (C // G) * K
        wT = np.ascontiguousarray(np.ascontiguousarray(w, dtype=ct).reshape(G, oC // G, RW).transpose(0, 2, 1)
                                  ).reshape(-1)
        geo = [nd, C, og, K, P, S]
        for a in range(nd):
            geo += [spatial[a], int(np.prod(spatial[a + 1:], dtype=np.int64)), p.out_spatial[a], p.strides[a],
                    p.pads_begin[a], p.dilations[a], p.kernel_shape[a]]
        geo = np.array(geo, np.int64)
        dims = np.array((oC, P, G, oC // G, RW), np.int64)
        T = tile(P, C * K, ct.itemsize)
        col = np.empty(C * K * T if want_w else 0, ct)
        gcol = np.empty(C * K * T if need_gcol else 0, ct)
        gyT = np.empty(T * oC if need_gcol else 0, ct)
        gwf = gw.reshape(-1) if want_w else None
        tmp = np.empty(gwf.size if want_w else 0, ct)
        cidx = np.empty(og * K * T * (1 << nd), np.int64)
        cw = np.empty(og * K * T * (1 << nd), ct)
        ndt = (0,) * nd  # the rank as a token (see _columns)
        work = C * K * T
        with ONE_THREAD:
            for n in range(N):
                for p0 in range(0, P, T):
                    Tt = min(T, P - p0)  # (the buffers' first C*K*Tt elements serve a shorter last tile)
                    if need_gcol:
                        _runtime.call(_gcol_serial, _gcol, work, gyf, gyT, wT, gcol, dims, n, p0, Tt)
                    _runtime.call(_columns_serial, _columns, work, xf, off, msk, gcol, col, gmask, goff, cidx, cw,
                                  geo, n, p0, Tt, ndt, want_w, want_off, want_m, ct.type(0))
                    if want_w:
                        _runtime.call(_gw_serial, _gw, work, gyf, col, gwf, tmp, dims, n, p0, Tt)
                    if want_x:
                        _runtime.call(_scatter_serial, _scatter, work, gx, gcol, msk, cidx, cw, geo, n, p0, Tt, ndt)
    gb = None
    if want_b:
        gb = gy.astype(np.float64).sum(axis=tuple(i for i in range(gy.ndim) if i != 1)).astype(dt)
    cast = lambda a, shape: None if a is None else a.reshape(shape).astype(dt, copy=False)  # noqa: E731
    return (cast(gx if want_x else None, x.shape), cast(gw, w.shape), cast(goff if want_off else None, offset.shape),
            gb, cast(gmask if want_m else None, None if mask is None else mask.shape))

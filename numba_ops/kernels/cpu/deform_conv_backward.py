"""DeformConv's backward on the CPU, N-D: two GEMMs per tile of output positions
around two ``@njit(parallel=True)`` sampling passes, on a channel-last copy of x.

Rows of the GEMMs are ``(kernel point k, channel c)`` of a group, channel innermost
(``RW = K * C/group`` per group), so that every per-sample loop runs over contiguous
channels (it vectorises) as the forward's does. Per image, ``x`` is copied once
channel-last (``xT``, spatial x C), and per tile of ``tile(...)`` output positions:

1. ``gcol[g, q, (k, c)] = sum over oc of grad_y[n, oc, q] W[oc, c, k]`` (a GEMM
   per group; only when x, offset or mask is wanted);
2. ``_columns`` (parallel over units of (offset group, positions), each position
   with every kernel point): each sample's 2**n corners (spatial index, weight; a
   corner outside the input is skipped) go into a table, then over the offset
   group's channels at once: ``col = mask * S`` (for W's gradient) and per corner
   ``gcol . x`` there, of which ``grad_mask = sum_c gcol * S`` and ``grad_offset_i =
   mask * sum_c gcol * dS/dpos_i`` are the sums weighted by the corner weights and by
   their derivatives from ``floor`` of the position (the taps:
   ``_sample.linear_at``, GridSample's, under zeros padding);
3. ``grad_W_g += grad_y[n, g, :, tile] @ col_g`` (a GEMM);
4. ``_scatter`` (parallel over blocks of channels): ``grad_xT[corner, c] += gcol *
   mask * weight`` from the table, each block's channels one thread's, so no two
   threads ever add to one element: no atomics, and every sum runs in one fixed
   order (tiles, positions, kernel points, corners). ``grad_x`` is ``grad_xT``
   transposed back.

So the gradients are the same bits on every call, whatever the number of threads:
the tiles, units and blocks depend on the shape alone, and the GEMMs are BLAS calls
on numba's workers, one per fixed block of the output (SciPy's OpenBLAS held at one
thread: no second thread pool beside numba's). ``grad_b`` is ``grad_y``'s sum in
float64. A position that is not finite gets NaN in its own ``grad_offset`` and
``grad_mask`` and adds nothing to ``grad_w`` or ``grad_x``.

Working memory beyond the gradients: ``col`` and ``gcol`` of ``C * K`` rows by a
tile of positions (``TILE_BYTES`` each), the corner table (``og * K * tile * 2**n``
entries), ``x`` and ``grad_x`` of one image channel-last, and float32 copies of
16-bit inputs (computed in float32, rounded once). The rank is a compile-time
token; groups and wants are runtime values.

Compile time: each pass is a function of its own over a range of its units
(``_gy_rows``, ``_gcol``, ``_columns``, ``_gw``, ``_scatter``), called through its
own compiled code (``_opaque``) by ``_part``, which picks the pass; the serial
entry runs every unit, the parallel one deals them into a few runs per thread in
one ``prange`` loop. So a call compiles each pass once, outside numba's parfor
passes, and one small parallel loop (four parallel kernels, each with a serial
twin, took 13.8 s to compile for a 2-D float32 call; this 6.8 s), and each run
allocates its scratch once.
"""
import numpy as np
from numba import njit, prange

from .._compat import NO_NRT
from .._dtypes import NAMES, compute
from .._sample import ZEROS, as_compute, linear_at
from .._scalar import split_position
from . import _runtime
from ._blas import ONE_THREAD, gemm_nn, gemm_tn
from ._copies import narrowed, widened
from ._opaque import INTERNAL, inline, opaque

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)

#: bytes of ``col`` (and of ``gcol``) per tile: the tile's positions follow from it
TILE_BYTES = 4 << 20
#: positions of one unit of the sampling pass (each with every kernel point)
UNIT = 16
#: channels of one block of the scatter (blocks never cross a group's boundary)
BLOCK = 16
#: positions per GEMM of pass 1
GCOL_POSITIONS = 64
#: rows ``(kernel point, channel)`` of W's gradient per GEMM of pass 3
GW_ROWS = 64


def tile(P, rows, itemsize):
    """Positions per tile: ``TILE_BYTES`` of ``rows`` columns, at least 64 (a function of the shape alone)."""
    return int(max(1, min(P, max(64, TILE_BYTES // max(1, rows * itemsize)))))


@inline(**NO_NRT, fastmath={"reassoc", "nsz"})
def _dot(a, ia, b, ib, n, zero):
    """``sum(a[ia:ia+n] * b[ib:ib+n])`` (unsigned offsets), its additions reassociable so
    that LLVM sums in vector lanes (one chain of dependent adds runs at the adder's
    latency). The order is the compiled code's: the same on every call and thread."""
    t = zero
    for i in range(n):
        t += a[ia + i] * b[ib + i]
    return t


@njit(**INTERNAL)
def _columns(u0, u1, xT, off, msk, gcol, col, gmask, goff, cidx, cw, geo, at, ndt, wants, zero):
    """Pass 2, units ``u0:u1`` (a unit: ``UNIT`` positions of one offset group, each
    with every kernel point) of the tile ``at`` (image ``n``, positions
    ``p0:p0+T``); ``xT`` the image channel-last (S x C). ``geo`` (int64): nd, C, og,
    K, P, S, G, then per axis (outermost first) size, stride of x, output size, conv
    stride, pad begin, dilation, kernel size; ``ndt`` a tuple of nd entries (nd is a
    constant where this compiles, so the corner loops unroll); ``wants``: W's, the
    offsets' and the mask's gradients. Fills the corner table ``cidx``/``cw`` (og*T*K
    rows of 2**nd, position-major: spatial index or -1 outside, weight), ``col``
    (G*T*RW) and writes ``gmask`` (N*og*K*P) and ``goff`` (N*og*K*nd*P)."""
    n, p0, T = at
    want_w, want_off, want_m = wants
    nd = len(ndt)
    C, og, K, P, G = geo[1], geo[2], geo[3], geo[4], geo[6]
    one = as_compute(zero, 1)
    nan = as_compute(zero, np.nan)
    NC = 1 << nd
    Cog = C // og
    Cg = C // G
    RW = K * Cg
    nu = (T + UNIT - 1) // UNIT
    want_gcol = want_off or want_m
    fr = np.empty(nd, type(zero))  # the upper corner's weight per axis
    dwt = np.empty(NC * nd, type(zero))  # per corner: d weight / d pos_a
    s = np.empty(Cog, type(zero))  # per channel: the sample
    dc = np.empty(NC, type(zero))  # per corner: gcol . x there
    rc0 = np.empty(Cog, np.int64)  # runs of channels within one conv group: first, end,
    rc1 = np.empty(Cog, np.int64)
    rb = np.empty(Cog, np.int64)  # and base in col and gcol
    gs = np.empty(nd, type(zero))  # the offsets' gradient sums
    lo = np.empty(nd, np.int64)
    hi = np.empty(nd, np.int64)
    oklo = np.empty(nd, np.bool_)
    okhi = np.empty(nd, np.bool_)
    pre = np.empty(nd, type(zero))
    # per kernel point and axis: its offset from the output position (its index times the
    # dilation, less the pad)
    kofs = np.empty(K * nd, np.int64)
    for k in range(K):
        kr = k
        for a in range(nd - 1, -1, -1):
            b = 7 + 7 * a
            kofs[k * nd + a] = (kr % geo[b + 6]) * geo[b + 5] - geo[b + 4]
            kr //= geo[b + 6]
    oi = np.empty(nd, np.int64)
    for u in range(u0, u1):
        g = u // nu
        q0 = (u - g * nu) * UNIT
        q1 = min(T, q0 + UNIT)
        # the output index of the unit's first position per axis, advanced position by
        # position below (no divisions in the loop)
        rem = p0 + q0
        for a in range(nd - 1, -1, -1):
            b = 7 + 7 * a
            oi[a] = rem % geo[b + 2]
            rem //= geo[b + 2]
        # the runs of the offset group's channels within one conv group (one unless groups
        # cut it): contiguous in col and gcol, channel c of run r at ``rb[r] + qk + c``
        nr = 0
        c0 = 0
        while c0 < Cog:
            cc = g * Cog + c0
            gc = cc // Cg
            c1 = min(Cog, c0 + (gc + 1) * Cg - cc)
            rc0[nr], rc1[nr] = c0, c1
            rb[nr] = gc * T * RW + (cc - gc * Cg) - c0
            nr += 1
            c0 = c1
        for q in range(q0, q1):
            p = p0 + q
            if q > q0:
                a = nd - 1
                oi[a] += 1
                while a > 0 and oi[a] == geo[7 + 7 * a + 2]:
                    oi[a] = 0
                    a -= 1
                    oi[a] += 1
            for k in range(K):  # (the unit's offsets, mask and their gradients stay in cache)
                m = msk[((n * og + g) * K + k) * P + p] if msk.size else one
                finite = True
                row = ((g * T + q) * K + k) * NC
                # axis by axis: the position and its two corners' offsets (lo, hi), flags, fraction
                for a in range(nd):
                    b = 7 + 7 * a
                    base = oi[a] * geo[b + 3] + kofs[k * nd + a]
                    i, frac, near, fa = split_position(base, off[(((n * og + g) * K + k) * nd + a) * P + p], zero)
                    if not near:  # huge: outside, every corner 0
                        i = np.int64(-2)
                        frac = zero
                    # the two linear taps under zeros padding: the forward's (and grad_taps_at's)
                    t0, t1, _, _, ok0, ok1 = linear_at(i, frac, fa, geo[b], np.int64(0), ZEROS, False, zero)
                    finite &= fa
                    fr[a] = frac
                    lo[a] = t0 * geo[b + 1]
                    hi[a] = t1 * geo[b + 1]
                    oklo[a] = ok0
                    okhi[a] = ok1
                # corner by corner (bit a of cn: the upper corner along axis a): spatial index or
                # -1 outside, weight, and d weight / d pos_a = the other axes' weights, signed
                for cn in range(NC):
                    idx = np.int64(0)
                    inside = finite
                    wt = one
                    for a in range(nd):
                        up = (cn >> (nd - 1 - a)) & 1
                        f = fr[a] if up else one - fr[a]
                        pre[a] = wt  # the product of the axes before a
                        wt *= f
                        idx += hi[a] if up else lo[a]
                        inside &= okhi[a] if up else oklo[a]
                    post = one  # the product of the axes after a
                    for a in range(nd - 1, -1, -1):
                        up = (cn >> (nd - 1 - a)) & 1
                        dw = pre[a] * post
                        dwt[cn * nd + a] = (dw if up else -dw) if inside else zero
                        post *= fr[a] if up else one - fr[a]
                    cidx[row + cn] = idx if inside else -1
                    cw[row + cn] = wt if inside else zero
                if not (want_w or want_gcol):
                    continue
                qk = q * RW + k * Cg  # the sample's row and kernel point in col and gcol
                # per corner: the sample's share (W's columns) and gcol . x at the corner, of
                # which the mask's and the offsets' gradients are weighted sums: by the corner
                # weights and by their derivatives
                if want_w:
                    for c in range(Cog):
                        s[c] = zero
                for cn in range(NC):
                    ix = cidx[row + cn]
                    dc[cn] = zero
                    if ix < 0:
                        continue
                    xb = np.uint64(ix * C + g * Cog)  # unsigned: no index pays for negative wraparound (vectorises)
                    if want_w:
                        wv = cw[row + cn]
                        for c in range(np.uint64(Cog)):
                            s[c] += wv * xT[xb + c]
                    if want_gcol:
                        d = zero
                        for r in range(nr):
                            u0c = np.uint64(rc0[r])
                            d += _dot(gcol, np.uint64(rb[r] + qk) + u0c, xT, xb + u0c, np.uint64(rc1[r]) - u0c, zero)
                        dc[cn] = d
                if want_w:
                    for r in range(nr):
                        cb = np.uint64(rb[r] + qk)
                        for c in range(np.uint64(rc0[r]), np.uint64(rc1[r])):
                            col[cb + c] = m * s[c]
                sm = zero
                for a in range(nd):
                    gs[a] = zero
                if want_gcol:
                    for cn in range(NC):
                        sm += cw[row + cn] * dc[cn]
                        for a in range(nd):
                            gs[a] += dwt[cn * nd + a] * dc[cn]
                if want_m:
                    gmask[((n * og + g) * K + k) * P + p] = sm if finite else nan
                if want_off:
                    for a in range(nd):
                        goff[(((n * og + g) * K + k) * nd + a) * P + p] = m * gs[a] if finite else nan


@njit(**INTERNAL)
def _scatter(b0, b1, gxT, gcol, msk, cidx, cw, blocks, geo, at, ndt, one):
    """Pass 4, blocks ``b0:b1``: ``grad_xT[corner, c] += gcol * mask * weight`` over the
    table's corners, a block of channels (``blocks``: starts and ends, at most ``BLOCK``,
    within one conv group and one offset group) at a time."""
    n, p0, T = at
    nd = len(ndt)
    C, og, K, P, G = geo[1], geo[2], geo[3], geo[4], geo[6]
    NC = 1 << nd
    Cog = C // og
    Cg = C // G
    RW = K * Cg
    gv = np.empty(BLOCK, gcol.dtype)
    for bi in range(b0, b1):
        c0 = blocks[2 * bi]
        c1 = blocks[2 * bi + 1]
        g = c0 // Cog
        gc = c0 // Cg
        nbc = np.uint64(c1 - c0)
        for q in range(T):  # position-major: gcol's and the table's rows in memory order
            for k in range(K):
                m = msk[((n * og + g) * K + k) * P + p0 + q] if msk.size else one
                rb = np.uint64((gc * T + q) * RW + k * Cg + c0 - gc * Cg)
                for c in range(nbc):
                    gv[c] = gcol[rb + c] * m
                row = ((g * T + q) * K + k) * NC
                for cn in range(NC):
                    ix = cidx[row + cn]
                    if ix < 0:
                        continue
                    wv = cw[row + cn]
                    xb = np.uint64(ix * C + c0)
                    for c in range(nbc):
                        gxT[xb + c] += wv * gv[c]


@njit(**INTERNAL)
def _gy_rows(q0, q1, gyf, gyT, dims, at):
    """Pass 1's first half, positions ``q0:q1`` of the tile: grad_y with the channels
    innermost (the GEMM's reduction axis). ``dims``: oC, P, G, oCg, RW."""
    n, p0, _ = at
    oC, P = dims[0], dims[1]
    for q in range(q0, q1):
        for oc in range(oC):
            gyT[q * oC + oc] = gyf[(n * oC + oc) * P + p0 + q]


@njit(**INTERNAL)
def _gcol(u0, u1, wTT, gyT, gcol, dims, at):
    """Pass 1, GEMMs ``u0:u1`` (one per group and ``GCOL_POSITIONS`` positions):
    ``gcol[g, q, (k, c)] = sum_oc grad_y[n, g, oc, p0 + q] W[g, oc, c, k]``."""
    T = at[2]
    oC, oCg, RW = dims[0], dims[3], dims[4]
    nq = (T + GCOL_POSITIONS - 1) // GCOL_POSITIONS
    for u in range(u0, u1):
        g = u // nq
        q0 = (u - g * nq) * GCOL_POSITIONS
        gemm_tn(wTT, g * RW * oCg, oCg, gyT, q0 * oC + g * oCg, oC, gcol, (g * T + q0) * RW, RW,
                RW, min(GCOL_POSITIONS, T - q0), oCg)


@njit(**INTERNAL)
def _gw(u0, u1, gyf, col, gw, tmp, dims, at):
    """Pass 3, GEMMs ``u0:u1`` (one per group and ``GW_ROWS`` rows ``(k, c)``):
    ``grad_W[g, oc, (k, c)] += sum_q grad_y[n, g, oc, p0 + q] col[g, q, (k, c)]`` for every
    output channel of the group, into ``tmp``, then added (a fixed order). (Split by
    rows of ``col``, each packed by one GEMM: split by output channels, every GEMM
    packed all of it.)"""
    n, p0, T = at
    oC, P, oCg, RW = dims[0], dims[1], dims[3], dims[4]
    nr = (RW + GW_ROWS - 1) // GW_ROWS
    for u in range(u0, u1):
        g = u // nr
        i0 = (u - g * nr) * GW_ROWS
        m = min(GW_ROWS, RW - i0)
        base = g * oCg * RW + i0
        gemm_nn(col, g * T * RW + i0, RW, gyf, (n * oC + g * oCg) * P + p0, P, tmp, base, RW, m, oCg, T)
        for o in range(oCg):
            for i in range(base + o * RW, base + o * RW + m):
                gw[i] += tmp[i]


_columns_op, _scatter_op, _gy_rows_op, _gcol_op, _gw_op = (opaque(f) for f in (_columns, _scatter, _gy_rows, _gcol,
                                                                              _gw))

#: the passes of a tile, in order (the units each shares out: positions, GEMMs, units of
#: ``_columns``, GEMMs, blocks of channels)
GY_ROWS, GCOL, COLUMNS, GW, SCATTER = range(5)


@njit(**INTERNAL)
def _part(phase, u0, u1, ins, bufs, outs, geo, dims, blocks, at, ndt, wants, zero):
    """Units ``u0:u1`` of the tile's pass ``phase``. ``ins``: xT, offsets, mask, grad_y,
    W as the GEMM's B (all flat); ``bufs``: gyT, gcol, col, tmp, cidx, cw, gxT; ``outs``:
    the flat gradients of W, the mask and the offsets."""
    xT, off, msk, gyf, wTT = ins
    gyT, gcol, col, tmp, cidx, cw, gxT = bufs
    gw, gmask, goff = outs
    if phase == GY_ROWS:
        _gy_rows_op(u0, u1, gyf, gyT, dims, at)
    elif phase == GCOL:
        _gcol_op(u0, u1, wTT, gyT, gcol, dims, at)
    elif phase == COLUMNS:
        _columns_op(u0, u1, xT, off, msk, gcol, col, gmask, goff, cidx, cw, geo, at, ndt, wants, zero)
    elif phase == GW:
        _gw_op(u0, u1, gyf, col, gw, tmp, dims, at)
    else:
        _scatter_op(u0, u1, gxT, gcol, msk, cidx, cw, blocks, geo, at, ndt, as_compute(zero, 1))


#: one compiled pass for every phase (``_part`` through its own code: the entries compile
#: only their loops)
_part_op = opaque(_part)


@njit(cache=True, nogil=True)
def _serial(phase, units, ins, bufs, outs, geo, dims, blocks, at, ndt, wants, zero):
    _part_op(phase, 0, units, ins, bufs, outs, geo, dims, blocks, at, ndt, wants, zero)


@njit(cache=True, parallel=True, nogil=True)
def _parallel(phase, units, ins, bufs, outs, geo, dims, blocks, at, ndt, wants, zero, nchunks):
    """``_serial``'s units dealt into ``nchunks`` runs on numba's pool: every unit writes
    outputs of its own (a GEMM, a unit of positions, a block of channels) in one order,
    so the split changes no bit."""
    nc = min(units, nchunks)
    for c in prange(nc):
        _part_op(phase, c * units // nc, (c + 1) * units // nc, ins, bufs, outs, geo, dims, blocks, at, ndt, wants,
                 zero)


def _blocks(C, Cg, Cog):
    """The scatter's channel blocks: at most ``BLOCK`` channels, never across a conv
    group's or an offset group's boundary (flat starts and ends)."""
    cuts = sorted(set(range(0, C, Cg)) | set(range(0, C, Cog)) | set(range(0, C, BLOCK)) | {C})
    return np.array([v for a, b in zip(cuts, cuts[1:]) for v in (a, b)], np.int64)


def launch(gy, x, w, offset, b, mask, p, wants, stream=None):
    """All NumPy, one float dtype, validated by the front end (``p``: DeformParams;
    ``wants``: x, w, offset, b, mask). ``stream`` is ignored on the CPU."""
    want_x, want_w, want_off, want_b, want_m = wants
    dt = x.dtype
    ct = compute(dt)
    nd, K, og, G = p.nd, p.K, p.offset_group, p.group
    N, C = int(x.shape[0]), int(x.shape[1])
    oC = int(w.shape[0])
    Cg, oCg = C // G, oC // G
    RW = K * Cg
    spatial = tuple(int(s) for s in x.shape[2:])
    S = int(np.prod(spatial, dtype=np.int64))
    P = int(np.prod(p.out_spatial, dtype=np.int64))
    gx = np.zeros((N, C) + spatial if want_x else 0, ct)
    gw = np.zeros(G * oCg * RW if want_w else 0, ct)  # (G, oCg, K, Cg): rows (k, c)
    goff = np.zeros(N * og * K * nd * P if want_off else 0, ct)
    gmask = np.zeros(N * og * K * P if want_m else 0, ct)
    need_gcol = want_x or want_off or want_m
    if N * C * oC and (need_gcol or want_w):  # (no channels in or out: every gradient 0)
        flat = lambda a: widened(a).reshape(-1)  # noqa: E731
        off = flat(offset)
        msk = flat(mask) if mask is not None else np.zeros(0, ct)
        gyf = flat(gy)
        # W as the GEMM's B: (G, K, Cg, oCg), rows (k, c), output channels innermost
        wTT = flat(widened(w).reshape(G, oCg, Cg, K).transpose(0, 3, 2, 1))
        geo = [nd, C, og, K, P, S, G]
        for a in range(nd):
            geo += [spatial[a], int(np.prod(spatial[a + 1:], dtype=np.int64)), p.out_spatial[a], p.strides[a],
                    p.pads_begin[a], p.dilations[a], p.kernel_shape[a]]
        geo = np.array(geo, np.int64)
        dims = np.array((oC, P, G, oCg, RW), np.int64)
        T = tile(P, C * K, ct.itemsize)
        col = np.empty(C * K * T if want_w else 0, ct)
        gcol = np.empty(C * K * T if need_gcol else 0, ct)
        gyT = np.empty(T * oC if need_gcol else 0, ct)
        tmp = np.empty(gw.size, ct)
        cidx = np.empty(og * K * T * (1 << nd), np.int64)
        cw = np.empty(og * K * T * (1 << nd), ct)
        blocks = _blocks(C, Cg, C // og)
        gxT = np.empty(S * C if want_x else 0, ct)
        ndt = (0,) * nd  # the rank as a token (see _columns)
        work = C * K * T
        bufs, outs = (gyT, gcol, col, tmp, cidx, cw, gxT), (gw, gmask, goff)
        wanted, zero = (want_w, want_off, want_m), ct.type(0)
        with ONE_THREAD:
            for n in range(N):
                xT = flat(widened(x[n]).reshape(C, S).T)  # channel-last
                ins = (xT, off, msk, gyf, wTT)
                if want_x:
                    gxT[:] = 0
                for p0 in range(0, P, T):
                    Tt = min(T, P - p0)  # (the buffers' first C*K*Tt elements serve a shorter last tile)
                    at = (n, p0, Tt)
                    nq = (Tt + GCOL_POSITIONS - 1) // GCOL_POSITIONS
                    for phase, units, wanted_here in (
                            (GY_ROWS, Tt, need_gcol), (GCOL, G * nq, need_gcol),
                            (COLUMNS, og * ((Tt + UNIT - 1) // UNIT), True),
                            (GW, G * ((RW + GW_ROWS - 1) // GW_ROWS), want_w),
                            (SCATTER, blocks.size // 2, want_x)):
                        if wanted_here:
                            _runtime.run(_serial, _parallel, work, phase, units, ins, bufs, outs, geo, dims, blocks,
                                         at, ndt, wanted, zero)
                if want_x:
                    gx[n] = gxT.reshape(S, C).T.reshape((C,) + spatial)
    gb = None
    if want_b:
        gb = gy.astype(np.float64).sum(axis=tuple(i for i in range(gy.ndim) if i != 1)).astype(dt)
    cast = lambda a, shape: None if a is None else narrowed(a.reshape(shape), dt)  # noqa: E731
    gw_out = np.ascontiguousarray(gw.reshape(G, oCg, K, Cg).transpose(0, 1, 3, 2)).reshape(w.shape) if want_w else None
    return (cast(gx if want_x else None, x.shape), cast(gw_out, w.shape),
            cast(goff if want_off else None, offset.shape), gb,
            cast(gmask if want_m else None, None if mask is None else mask.shape))

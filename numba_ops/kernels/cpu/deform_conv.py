"""DeformConv on the CPU: zero-bordered channel-last input, per-tile sampling
plans, im2col fill and single-threaded BLAS per tile, all on numba's one pool.

Algorithm, per image (images go in chunks so that scratch stays within
``_SCRATCH_BYTES`` whatever N is):

1. ``xp``: the image in the compute type, channel-last (sites x C), with a
   1-site zero border on every spatial side and a zero tail after the last
   site. A position in ``(-1, D)`` on every axis has all 2**n interpolation
   corners at ``base + coff[corner]``: corners outside the input read the
   border's exact zeros, so "corners outside count 0" (the op's definition) holds without a
   branch, and an Inf/NaN in ``x`` reaches only the samples whose support
   holds it. A position at or beyond -1 or D gets weight 0 and a base in the
   zero tail (every corner it reads is a zero, never an input value); a
   non-finite position gets weight NaN there (the sample is NaN). Positions
   are never rounded: ``border_corner`` adds their integer parts as integers
   and keeps the offset's fraction exactly, and only offsets under 2**30 (the
   32-bit plans) or 2**62 reach an integer conversion, so huge offsets never
   overflow an index; indices are 64-bit (the 2-D/3-D plans use 32 bits per
   axis only when the sizes fit, see ``_State``).
2. Output positions are cut into tiles of ``T``. For each tile and each
   (offset group, kernel point) a plan (base index, 2**n weights; the 2-D and
   3-D plans, vectorised along the last output axis, fold a finite mask in) is
   built. The fill then walks the tile position by position, writing each
   column row front to back; every (kernel point, offset group) is a contiguous
   run of channels in ``xp``, so the innermost loop is a SIMD loop of 2**n
   loads and FMAs.
3. The tile's columns ``(group, T, K, C/group)`` times the weights, reordered
   once to ``(group, oC/group, K, C/group)``, is one single-threaded BLAS GEMM
   per group (numba's ``np.dot`` calls SciPy's BLAS, which ``launch`` holds at
   one thread while numba's workers run, so two pools never fight over the
   cores). Bias and the one rounding to the output dtype happen when the GEMM
   tile is written out.

A parallel run gives each thread whole tiles (the position split), or, where the
positions are few beside the weights (deep channels at small spatial sizes), splits
each tile by output channels (the channel split): the threads fill shares of its
positions, the columns are turned into w's own (channel, kernel point) order, and
each thread multiplies them by its share of w's rows, read where they lie (no
reorder pass) and packed by BLAS once per tile in all instead of once per thread.
``_plan_sizes`` chooses from the elements each thread's GEMMs pack. With one group
and few output channels per thread, the channel split's GEMMs share the reduction
instead (each thread all the output channels over its share of w's columns, through
``_gemm_tn``; the partial sums are added as y is written: ``_reduction_split``).

Calls too small for the pool, and calls at one thread, run on the caller's thread
(``_serial``; with float32/float64 weights and fewer column rows than weight rows it
uses the channel split's order, the weights read where they lie), and
tiny ones (the seed example) skip the scratch and BLAS altogether
(``_direct``: each output straight from the definition). Accumulation is
float32 for float16/bfloat16/float32 (16-bit data is widened on load) and
float64 for float64.

Compile time: numba compiles each jitted function into a module of
its own, links in every jitted function it calls and optimises the whole again,
so each level of ordinary calls re-optimises all the code below it. The large
pieces are therefore called through their own compiled code (``_opaque``): the
tile (``_tile``, with its plan and fill), the padding and weight rows, the column
transpose and the reduction phase are each compiled once, whichever entry calls
them, and the pool rounds are functions of their own (``_pad_round``,
``_round``): the parallel entry's loop bodies, which numba compiles into functions
of their own too, hold one call each, and the serial entry runs the same rounds at
one thread. The small set-up helpers are inlined as numba IR (``inline="always"``:
typed in their caller, never a module of their own). A call compiles its own rank's
code: ``tok``, the input's spatial shape, goes down to ``_plan``/``_fill``, whose
``len(tok)`` branches numba prunes before typing.
"""
import ctypes
import glob
import os
import threading

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic, overload

from ..._dtypes import compute, storage
from .._scalar import border_corner, load, store
from . import _runtime
from ._opaque import INTERNAL, opaque
from ._views import flat, flat3, shaped

DTYPES = ("float16", "bfloat16", "float32", "float64")

#: the scratch budget of one call: padded images plus every thread's tile buffers.
_SCRATCH_BYTES = 192 << 20
#: target bytes of one tile's column buffer (about an L2 cache), and the fewest positions.
_TILE_BYTES = 512 << 10
_TILE_MIN = 256
#: calls with at most this many (sample, output channel, corner) triples take the direct path.
_DIRECT_MAX = 1024
#: the parallel run's split: None chooses from the shape (``_plan_sizes``), True forces the
#: channel split, False the position split (tests, benchmarks; plans made before keep theirs)
_SPLIT = None
#: the channel split's GEMM shares: None chooses (``_reduction_split``), True forces shares of
#: the reduction, False of the output channels (tests)
_KSPLIT = None


# --- compute-type helpers -----------------------------------------------------------

def _empty_like_compute(like, n):
    """np.empty(n) of the compute type of storage array ``like``."""


@overload(_empty_like_compute, jit_options={"inline": "always"})
def _empty_like_compute_ol(like, n):
    if like.dtype == types.float64:
        return lambda like, n: np.empty(n, np.float64)
    return lambda like, n: np.empty(n, np.float32)


def _czero(like):
    """0 in the compute type of storage array ``like``."""


@overload(_czero, jit_options={"inline": "always"})
def _czero_ol(like):
    if like.dtype == types.float64:
        return lambda like: np.float64(0)
    return lambda like: np.float32(0)


def _cast(ref, v):
    """``v`` converted to the type of the float scalar ``ref``."""


@overload(_cast, jit_options={"inline": "always"})
def _cast_ol(ref, v):
    if ref == types.float64:
        return lambda ref, v: np.float64(v)
    return lambda ref, v: np.float32(v)


@intrinsic
def _mutable(typingctx, a):
    """``a`` typed writable: a read-only caller's array (never written) then has the type
    of a workspace slice, so that one call site takes either."""
    if not isinstance(a, types.Array):
        return None
    rt = a.copy(readonly=False)

    def codegen(context, builder, sig, args):
        return impl_ret_borrowed(context, builder, rt, args[0])
    return rt(a), codegen


@intrinsic
def _gemm_tn(typingctx, a, ao, lda, b, bo, ldb, c, co, ldc, m, n, k):
    """``c[co + i + j * ldc] = sum_l a[ao + i * lda + l] * b[bo + j * ldb + l]`` for i < m,
    j < n, l < k: one BLAS GEMM (numba's own ``numba_xxgemm``, the one ``np.dot`` calls)
    on rows of a and b that are any stride apart, so that a share of the reduction
    axis (a column range of w's rows) needs no copy. a, b, c: 1-D arrays of one float
    type; offsets, leading dimensions and sizes: integers."""
    if not all(isinstance(t, types.Array) and t.dtype in (types.float32, types.float64) for t in (a, b, c)) \
            or len({a.dtype, b.dtype, c.dtype}) != 1:
        return None
    sig = types.void(a, ao, lda, b, bo, ldb, c, co, ldc, m, n, k)

    def codegen(context, builder, sig, args):
        from llvmlite import ir
        from numba.np.linalg import ensure_blas, get_blas_kind
        ensure_blas()
        char, vp = ir.IntType(8), ir.IntType(8).as_pointer()
        ip = context.get_value_type(types.intp)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.IntType(32), [char, char, char, ip, ip, ip, vp, vp, ip, vp, ip, vp, vp, ip]), "numba_xxgemm")
        dt = sig.args[0].dtype
        av = [context.cast(builder, v, t, types.intp) for v, t in zip(args, sig.args)]

        def ptr(i):
            data = context.make_array(sig.args[i])(context, builder, args[i]).data
            return builder.bitcast(builder.gep(data, [av[i + 1]]), vp)
        one = cgutils.alloca_once_value(builder, context.get_constant(dt, 1))
        zero = cgutils.alloca_once_value(builder, context.get_constant(dt, 0))
        # column-major C (m x n) = A^T B, A stored (k x m) with lda, B (k x n) with ldb
        builder.call(fn, (ir.Constant(char, ord(get_blas_kind(dt))), ir.Constant(char, ord("t")),
                          ir.Constant(char, ord("n")), av[9], av[10], av[11], builder.bitcast(one, vp), ptr(0),
                          av[2], ptr(3), av[5], builder.bitcast(zero, vp), ptr(6), av[8]))
        return context.get_dummy_value()
    return sig, codegen


# --- phase 1: padded channel-last images and reordered weights ---------------------------

@njit(**INTERNAL)
def _pad_row(x3, n, xp, geo, r):
    """Padded row ``r`` (all leading padded coordinates, flattened) of image ``n``
    into ``xp`` (sites x C, flat): interior copied channel-last, border zeroed."""
    nd = geo.shape[1]
    C = x3.shape[1]
    L = geo[0, nd - 1]
    Lp = L + 2
    zero = _czero(x3)
    src_row = 0
    border = False
    q = r
    mul = 1
    for ax in range(nd - 2, -1, -1):
        dp = geo[0, ax] + 2
        cp = q % dp
        q //= dp
        if cp == 0 or cp == dp - 1:
            border = True
        src_row += (cp - 1) * mul
        mul *= geo[0, ax]
    dst = r * Lp * C
    if border:
        for i in range(Lp * C):
            xp[dst + i] = zero
        return
    for c in range(C):
        xp[dst + c] = zero
        xp[dst + (Lp - 1) * C + c] = zero
    src = src_row * L
    xn = x3[n]
    uC = np.uint64(C)
    c0 = 0
    # 4 channels at a time: 4 contiguous read streams, 4 contiguous writes per site (8
    # streams a power-of-two apart fill one L1 set; unsigned indices skip the
    # negative-index fix-ups)
    while c0 + 4 <= C:
        r0, r1 = xn[c0, src:src + L], xn[c0 + 1, src:src + L]
        r2, r3 = xn[c0 + 2, src:src + L], xn[c0 + 3, src:src + L]
        o = np.uint64(dst + C + c0)
        for j in range(np.uint64(L)):
            xp[o], xp[o + np.uint64(1)] = load(r0, j), load(r1, j)
            xp[o + np.uint64(2)], xp[o + np.uint64(3)] = load(r2, j), load(r3, j)
            o += uC
        c0 += 4
    for c in range(c0, C):
        for j in range(L):
            xp[dst + (j + 1) * C + c] = load(xn, (c, src + j))


@njit(**INTERNAL)
def _reorder_w(w3, wr, K, o):
    """wr[o, kidx, c] = w[o, c, kidx] in the compute type (wr flat, one row of oC;
    flat unsigned indices: no index fix-ups in the strided gather)."""
    uK, uCg = np.uint64(K), np.uint64(w3.shape[1])
    wf = flat(w3)
    base = np.uint64(o) * uK * uCg  # the same in w (o, c, k) and wr (o, k, c)
    for k in range(uK):
        dst = base + k * uCg
        src = base + k
        for c in range(uCg):
            wr[dst + c] = load(wf, src + c * uK)


def _native(w3):
    """True when the storage type of ``w3`` is its compute type (float32, float64): the
    channel split then multiplies by the weights where they lie."""


@overload(_native, jit_options={"inline": "always"})
def _native_ol(w3):
    if w3.dtype in (types.float32, types.float64):
        return lambda w3: True
    return lambda w3: False


def _wmat(w3, wr):
    """The weights as (oC, C/group * K) rows in (channel, kernel point) order, flat: ``w3``
    itself for float32/float64, else ``wr`` (``_convert_w`` fills it)."""


@overload(_wmat, jit_options={"inline": "always"})
def _wmat_ol(w3, wr):
    if w3.dtype in (types.float32, types.float64):
        return lambda w3, wr: flat(w3)
    return lambda w3, wr: wr


@njit(**INTERNAL)
def _convert_w(w3, wr, o):
    """wr's row ``o`` = w's row in the compute type, same order (16-bit weights, channel split)."""
    n = np.uint64(w3.shape[1] * w3.shape[2])
    wf = flat(w3)
    base = np.uint64(o) * n
    for i in range(n):
        wr[base + i] = load(wf, base + i)


@njit(**INTERNAL)
def _to_cmajor(cols, shared, j0, tl, T, K, cpg, group):
    """Column rows 0..tl of ``cols`` ((group, T, K, cpg) order) into rows j0.. of ``shared``
    in (group, T, cpg, K) order: the order of w's own rows, so that the channel split
    multiplies by the weights without reordering them (the columns of a tile are far
    fewer than the weights where the channel split runs)."""
    kc = K * cpg
    uK, ucpg = np.uint64(K), np.uint64(cpg)
    for gi in range(group):
        for j in range(tl):
            src = np.uint64(gi * T * kc + j * kc)
            dst = np.uint64(gi * T * kc + (j0 + j) * kc)
            for k in range(uK):
                for c in range(ucpg):
                    shared[dst + c * uK + k] = cols[src + k * ucpg + c]


# --- phase 2: sampling plans, column fill, GEMM, write-out -------------------------------

@njit(**INTERNAL)
def _plan_row2d(oy, ox, mm, has_mask, by, bx, sx, hw, ys, zsite, C, q0, q1, j0, pidx, pw, pm):
    """2-D plan of output positions q0..q1 of one output row: the hot loop,
    branch-free, 32-bit (the launcher checks the sizes) and on 0-based slices,
    so that it vectorises. ``by``, ``bx + i * sx``: the positions' integer parts."""
    zero = _czero(pw)
    one = zero + 1
    nan = _cast(zero, np.nan)
    Hi, Wi = hw
    n = q1 - q0
    oy, ox, mm = oy[q0:q1], ox[q0:q1], mm[q0:q1] if has_mask else mm[:0]
    pidx, pm = pidx[j0:j0 + n], pm[j0:j0 + n]
    pw0, pw1, pw2, pw3 = pw[0, j0:j0 + n], pw[1, j0:j0 + n], pw[2, j0:j0 + n], pw[3, j0:j0 + n]
    for i in range(n):
        ay, ly, oky, finy = border_corner(by, load(oy, i), Hi, zero)
        ax, lx, okx, finx = border_corner(bx + np.int32(i) * sx, load(ox, i), Wi, zero)
        ok = oky & okx
        s = one if ok else zero
        s = s if (finy & finx) else nan
        m = load(mm, i) if has_mask else one
        mfin = (m - m) == zero
        s = s * m if mfin else s
        site = (ay + 1) * ys + ax + 1
        pidx[i] = np.int64(site if ok else zsite) * C
        hy = (one - ly) * s
        ly = ly * s
        pw0[i] = hy * (one - lx)
        pw1[i] = hy * lx
        pw2[i] = ly * (one - lx)
        pw3[i] = ly * lx
        pm[i] = one if mfin else m


@njit(**INTERNAL)
def _plan_row3d(oz, oy, ox, mm, has_mask, bz, by, bx, sx, dhw, zs, ys, zsite, C, q0, q1, j0, pidx, pw, pm):
    """3-D plan of output positions q0..q1 of one output row (see ``_plan_row2d``)."""
    zero = _czero(pw)
    one = zero + 1
    nan = _cast(zero, np.nan)
    Di, Hi, Wi = dhw
    n = q1 - q0
    oz, oy, ox, mm = oz[q0:q1], oy[q0:q1], ox[q0:q1], mm[q0:q1] if has_mask else mm[:0]
    pidx, pm = pidx[j0:j0 + n], pm[j0:j0 + n]
    w = pw[:, j0:j0 + n]
    for i in range(n):
        az, lz, okz, finz = border_corner(bz, load(oz, i), Di, zero)
        ay, ly, oky, finy = border_corner(by, load(oy, i), Hi, zero)
        ax, lx, okx, finx = border_corner(bx + np.int32(i) * sx, load(ox, i), Wi, zero)
        ok = okz & oky & okx
        s = one if ok else zero
        s = s if (finz & finy & finx) else nan
        m = load(mm, i) if has_mask else one
        mfin = (m - m) == zero
        s = s * m if mfin else s
        site = (az + 1) * zs + (ay + 1) * ys + ax + 1
        pidx[i] = np.int64(site if ok else zsite) * C
        hz = (one - lz) * s
        lz = lz * s
        a00, a01, a10, a11 = hz * (one - ly), hz * ly, lz * (one - ly), lz * ly
        hx = one - lx
        w[0, i], w[1, i] = a00 * hx, a00 * lx
        w[2, i], w[3, i] = a01 * hx, a01 * lx
        w[4, i], w[5, i] = a10 * hx, a10 * lx
        w[6, i], w[7, i] = a11 * hx, a11 * lx
        pm[i] = one if mfin else m


@njit(**INTERNAL)
def _plan(tok, off3, m3, has_mask, n, geo, pstr, C, kidx, g, K, p0, p1, pidx, pw, pm, fast, zsite):
    """Sampling plan of offset group ``g``, kernel point ``kidx`` for output
    positions [p0, p1): ``pidx`` the flat index of the lowest corner in ``xp``,
    ``pw[corner]`` the n-linear weights (NaN for a non-finite position, 0 outside),
    and ``pm`` the mask, applied after the sum as the definition orders it. The
    2-D/3-D plans fold a finite mask into ``pw`` instead (``pm`` is then 1) and
    keep only a non-finite one in ``pm``; the general plan keeps every mask there.

    ``tok`` (the input's spatial shape, a tuple of n) fixes the rank when numba
    compiles: the ``len(tok)`` branches are pruned before typing, so a 2-D call
    compiles the 2-D plan (and the general one, its fallback for sizes past 32
    bits) and never the 3-D one, and a 1-D call neither."""
    nd = geo.shape[1]
    NC = 1 << nd
    oL = geo[5, nd - 1]
    zero = _czero(pw)
    one = zero + 1
    nan = _cast(zero, np.nan)
    ch0 = (g * K + kidx) * nd
    mm = m3[n, g * K + kidx]
    if len(tok) == 2 and fast == 2:
        hw = (np.int32(geo[0, 0]), np.int32(geo[0, 1]))
        sx = np.int32(geo[2, 1])
        ys = np.int32(pstr[0])
        # kernel point coordinates: the constant part of the positions on each axis
        ky = (kidx // geo[1, 1]) * geo[4, 0] - geo[3, 0]
        kx = (kidx % geo[1, 1]) * geo[4, 1] - geo[3, 1]
        p = p0
        while p < p1:
            ol = p % oL
            end = min(p1, p - ol + oL)
            by = np.int32((p // oL) * geo[2, 0] + ky)
            bx = np.int32(ol * geo[2, 1] + kx)
            _plan_row2d(off3[n, ch0], off3[n, ch0 + 1], mm, has_mask, by, bx, sx, hw, ys, np.int32(zsite), C,
                        p, end, p - p0, pidx, pw, pm)
            p = end
        return
    if len(tok) == 3 and fast == 3:
        dhw = (np.int32(geo[0, 0]), np.int32(geo[0, 1]), np.int32(geo[0, 2]))
        sx = np.int32(geo[2, 2])
        zs, ys = np.int32(pstr[0]), np.int32(pstr[1])
        kz = (kidx // (geo[1, 1] * geo[1, 2])) * geo[4, 0] - geo[3, 0]
        ky = ((kidx // geo[1, 2]) % geo[1, 1]) * geo[4, 1] - geo[3, 1]
        kx = (kidx % geo[1, 2]) * geo[4, 2] - geo[3, 2]
        p = p0
        while p < p1:
            ol = p % oL
            end = min(p1, p - ol + oL)
            row = p // oL
            bz = np.int32((row // geo[5, 1]) * geo[2, 0] + kz)
            by = np.int32((row % geo[5, 1]) * geo[2, 1] + ky)
            bx = np.int32(ol * geo[2, 2] + kx)
            _plan_row3d(off3[n, ch0], off3[n, ch0 + 1], off3[n, ch0 + 2], mm, has_mask, bz, by, bx, sx, dhw,
                        zs, ys, np.int32(zsite), C, p, end, p - p0, pidx, pw, pm)
            p = end
        return
    rem = kidx
    kpos = np.empty(nd, np.int64)
    for ax in range(nd - 1, -1, -1):
        kk = rem % geo[1, ax]
        rem //= geo[1, ax]
        kpos[ax] = kk * geo[4, ax] - geo[3, ax]
    lam = np.empty(nd, pw.dtype)
    for q in range(p0, p1):
        rq = q
        ok = True
        fin = True
        base = 0
        for ax in range(nd - 1, -1, -1):
            oq = rq % geo[5, ax]
            rq //= geo[5, ax]
            f, l, okk, finn = border_corner(oq * geo[2, ax] + kpos[ax], load(off3[n, ch0 + ax], q),
                                            geo[0, ax], zero)
            ok = ok & okk
            fin = fin & finn
            base += (f + 1) * pstr[ax]
            lam[ax] = l
        s = one if ok else zero
        s = s if fin else nan
        j = q - p0
        pidx[j] = (base if ok else zsite) * C
        for cr in range(NC):
            wt = s
            for ax in range(nd):
                if (cr >> (nd - 1 - ax)) & 1:
                    wt *= lam[ax]
                else:
                    wt *= one - lam[ax]
            pw[cr, j] = wt
        pm[j] = load(mm, q) if has_mask else one


@njit(cache=True, inline="always")
def _segments(dims):
    """The channel runs of a column row: one per (offset group, conv group) overlap,
    as rows (offset group, first channel, length, offset in the row's tile)."""
    C, K, group, og, T = dims[0], dims[1], dims[2], dims[3], dims[4]
    cpo, cpg = C // og, C // group
    segs = np.empty((og + group, 4), np.int64)
    ns = 0
    for g in range(og):
        c, c1 = g * cpo, (g + 1) * cpo
        while c < c1:
            gi = c // cpg
            ce = min(c1, (gi + 1) * cpg)
            segs[ns, 0], segs[ns, 1], segs[ns, 2] = g, c, ce - c
            segs[ns, 3] = gi * T * K * cpg + c - gi * cpg
            ns += 1
            c = ce
    return segs[:ns]


@njit(**INTERNAL)
def _fill(tok, xp, coff, pidx, pw, pm, cols, segs, tl, K, cpg):
    """Apply the tile's plans: cols[gi, j, kidx, c - gi*cpg] =
    mask * sum_corner w * xp[pidx + coff + c] for every channel c.

    Position by position, so that each column row is written front to back;
    each (kernel point, offset group) is a contiguous run of channels in ``xp``
    (split where a conv group ends). The runs are short (often 32-64 channels), so
    their set-up is kept to a few loads and adds: 2-D (4 corners) has a loop of its
    own, and the mask is not in the runs: what ``_plan`` leaves in ``pm`` (a
    non-finite mask, or every mask of the general plan; else 1) multiplies the
    finished sample afterwards, as the definition orders it."""
    if len(tok) == 2:  # the rank is fixed at compile time (see ``_plan``)
        _fill_bilinear(xp, np.uint64(coff[1]), np.uint64(coff[2]), np.uint64(coff[3]), pidx, pw, cols, segs,
                       tl, K, cpg)
    else:
        _fill_any(tok, xp, coff, pidx, pw, cols, segs, tl, K, cpg)
    one = _czero(pm) + 1
    kc = K * cpg
    for s in range(segs.shape[0]):
        g, L, d = segs[s, 0], segs[s, 2], segs[s, 3]
        for kidx in range(K):
            for j in range(tl):
                m = pm[g * K + kidx, j]
                if m != one:
                    o = j * kc + kidx * cpg + d
                    for i in range(L):
                        cols[o + i] *= m


@njit(fastmath={"contract"}, **INTERNAL)
def _fill_bilinear(xp, u1, u2, u3, pidx, pw, cols, segs, tl, K, cpg):
    """The runs of ``_fill`` in 2-D: 4 loads and FMAs per channel (SIMD), unsigned
    indices (no negative-index fix-ups in the short loops). Apart from ``_fill_any``
    on purpose: in one loop with a branch on the corner count (or a corner count
    fixed by an inlined helper) the 2-D runs measured 3-20 % slower."""
    uKc = np.uint64(K * cpg)
    ucpg = np.uint64(cpg)
    for j in range(tl):
        for kidx in range(K):
            dk = np.uint64(j) * uKc + np.uint64(kidx) * ucpg
            for s in range(segs.shape[0]):
                gk = segs[s, 0] * K + kidx
                ub = np.uint64(pidx[gk, j] + segs[s, 1])
                ud = dk + np.uint64(segs[s, 3])
                w0, w1, w2, w3 = pw[gk, 0, j], pw[gk, 1, j], pw[gk, 2, j], pw[gk, 3, j]
                for i in range(np.uint64(segs[s, 2])):
                    bi = ub + i
                    cols[ud + i] = w0 * xp[bi] + w1 * xp[bi + u1] + w2 * xp[bi + u2] + w3 * xp[bi + u3]


@njit(fastmath={"contract"}, **INTERNAL)
def _fill_any(tok, xp, coff, pidx, pw, cols, segs, tl, K, cpg):
    """The runs of ``_fill`` in 1-D (2 corners), 3-D (8) and beyond (a pass per corner);
    the rank, ``len(tok)``, is fixed at compile time (see ``_plan``)."""
    NC = coff.shape[0]
    u1 = np.uint64(coff[1 % NC])
    u2, u3 = np.uint64(coff[2 % NC]), np.uint64(coff[3 % NC])
    u4, u5 = np.uint64(coff[4 % NC]), np.uint64(coff[5 % NC])
    u6, u7 = np.uint64(coff[6 % NC]), np.uint64(coff[7 % NC])
    uKc = np.uint64(K * cpg)
    ucpg = np.uint64(cpg)
    for j in range(tl):
        for kidx in range(K):
            dk = np.uint64(j) * uKc + np.uint64(kidx) * ucpg
            for s in range(segs.shape[0]):
                gk = segs[s, 0] * K + kidx
                ub = np.uint64(pidx[gk, j] + segs[s, 1])
                ud = dk + np.uint64(segs[s, 3])
                L = np.uint64(segs[s, 2])
                if len(tok) == 3:
                    w0, w1, w2, w3 = pw[gk, 0, j], pw[gk, 1, j], pw[gk, 2, j], pw[gk, 3, j]
                    w4, w5, w6, w7 = pw[gk, 4, j], pw[gk, 5, j], pw[gk, 6, j], pw[gk, 7, j]
                    for i in range(L):
                        bi = ub + i
                        cols[ud + i] = (w0 * xp[bi] + w1 * xp[bi + u1] + w2 * xp[bi + u2] + w3 * xp[bi + u3]
                                        + w4 * xp[bi + u4] + w5 * xp[bi + u5] + w6 * xp[bi + u6]
                                        + w7 * xp[bi + u7])
                elif len(tok) == 1:
                    w0, w1 = pw[gk, 0, j], pw[gk, 1, j]
                    for i in range(L):
                        bi = ub + i
                        cols[ud + i] = w0 * xp[bi] + w1 * xp[bi + u1]
                else:
                    w0, u0 = pw[gk, 0, j], np.uint64(coff[0])
                    for i in range(L):
                        cols[ud + i] = w0 * xp[ub + u0 + i]
                    for cr in range(1, NC):
                        wc = pw[gk, cr, j]
                        uc = np.uint64(coff[cr])
                        for i in range(L):
                            cols[ud + i] += wc * xp[ub + uc + i]


#: the plan and the fill called through their own compiled code (``_opaque``)
_plan_op, _fill_op = opaque(_plan), opaque(_fill)


@njit(**INTERNAL)
def _tile(tok, n, nl, p0, p1, xp, off3, m3, has_mask, wr, b, has_b, y3, geo, pstr, coff, segs, dims,
          cols, outb, pidx, pw, pm, fill, oc0, oc1):
    """Output positions [p0, p1) of image ``n`` (``nl``: its slot in ``xp``): when
    ``fill``, plans and column fill into ``cols`` (its row 0 is position p0); then,
    for output channels [oc0, oc1) (global), one GEMM per group they touch, bias and
    rounding into ``y3``. The position split calls it once per tile (fill, all
    channels); the channel split (``_parallel``) once per thread to fill its share
    of a tile's positions (no channels), then once per thread for its channels."""
    C, K, group, og, T = dims[0], dims[1], dims[2], dims[3], dims[4]
    oC = y3.shape[1]
    cpg, ocg = C // group, oC // group
    kc = K * cpg
    tl = p1 - p0
    if fill:
        for g in range(og):
            for kidx in range(K):
                gk = g * K + kidx
                _plan_op(tok, off3, m3, has_mask, n, geo, pstr, C, kidx, g, K, p0, p1, pidx[gk], pw[gk], pm[gk],
                         dims[7], dims[8])
        _fill_op(tok, xp[nl], coff, pidx, pw, pm, cols, segs, tl, K, cpg)
    zero = _czero(wr)
    blk = outb[ocg * T:ocg * (T + 16)]
    yf = flat(y3)
    P = y3.shape[2]
    for gi in range(group):
        lo, hi = max(oc0, gi * ocg), min(oc1, (gi + 1) * ocg)
        if lo >= hi:
            continue
        ol = hi - lo
        uol = np.uint64(ol)
        outf = outb[:tl * ol]
        # outf (tl x ol, row-major) = cols (tl x kc) @ W^T, W = wr's rows lo..hi (ol x kc): BLAS
        # runs this orientation ~15 % faster than W @ cols^T here (np.dot(cols, W.T, out) makes
        # this very call; its implementation costs a second of compile time)
        wo, co = lo * kc, gi * T * kc
        if ol * tl * kc >= 16384:  # below this, BLAS's call overhead dominates
            _gemm_tn(wr, wo, kc, cols, co, kc, outf, 0, ol, ol, tl, kc)
        else:
            for j in range(tl):
                for o in range(ol):
                    acc = zero
                    for k in range(kc):
                        acc += wr[wo + o * kc + k] * cols[co + j * kc + k]
                    outf[j * ol + o] = acc
        # out^T into y's rows 16 positions at a time, through a small transposed block
        # (contiguous reads of out, then contiguous runs of y; flat unsigned indices
        # keep both loops free of index fix-ups: 2x faster than 2-D indexing)
        for j0 in range(0, tl, 16):
            jl = np.uint64(min(tl, j0 + 16) - j0)
            for j in range(jl):
                src = (np.uint64(j0) + j) * uol
                for o in range(uol):
                    blk[o * np.uint64(16) + j] = outf[src + o]
            for o in range(ol):
                oc = lo + o
                bias = load(b, oc) if has_b else zero
                dst = np.uint64((n * oC + oc) * P + p0 + j0)
                bo = np.uint64(o * 16)
                for j in range(jl):
                    store(yf, dst + j, blk[bo + j] + bias)


#: ``_tile`` called through its own compiled code (``_opaque``): its entries do not
#: compile it again
_tile_op = opaque(_tile)


@njit(**INTERNAL)
def _reduction_phase(phase, th, nth, shared, wmat, outb, fws, base, stride, b, has_b, y3, n, p0, tl):
    """Thread ``th``'s part of the reduction split (one group) for the tile of ``tl``
    positions from ``p0`` of image ``n``, whose columns ``shared`` holds in w's order.
    Phase 1: its GEMM tile ``outb`` (o, j) = the partial sum over its share of w's
    columns (``wmat``'s rows, all output channels), through ``_gemm_tn``. Phase 2: its
    share of y's rows, y[n, o, p0 + j] = bias + the threads' partial sums
    ``fws[base + t * stride + o * tl + j]`` (t = 0..nth-1 in that order: every thread's
    GEMM tile), rounded once to y's dtype."""
    oC, P = y3.shape[1], y3.shape[2]
    if phase == 1:
        kc = wmat.size // oC  # one group: w's rows are (C * K) long
        k0, k1 = th * kc // nth, (th + 1) * kc // nth
        if k1 > k0:
            _gemm_tn(shared, k0, kc, wmat, k0, kc, outb, 0, tl, tl, oC, k1 - k0)
        else:
            for i in range(tl * oC):
                outb[i] = 0
        return
    o0, o1 = th * oC // nth, (th + 1) * oC // nth
    yf = flat(y3)
    zero = _czero(fws)
    for o in range(o0, o1):
        bias = load(b, o) if has_b else zero
        src = np.uint64(base + o * tl)
        dst = np.uint64((n * oC + o) * P + p0)
        for j in range(np.uint64(tl)):
            acc = fws[src + j]
            for t in range(1, nth):
                acc += fws[src + np.uint64(t * stride) + j]
            store(yf, dst + j, acc + bias)


@njit(cache=True, inline="always")
def _padded_extent(geo, pstr):
    """(rows, sites, tail) of a padded image: its rows (bordered axes but the last),
    its sites, and the zero tail after them (at least as long as the corner offsets)."""
    nd = geo.shape[1]
    rows = 1
    sites = 1
    tail = 1
    for ax in range(nd):
        sites *= geo[0, ax] + 2
        tail += pstr[ax]
        if ax < nd - 1:
            rows *= geo[0, ax] + 2
    return rows, sites, tail


@njit(cache=True, inline="always")
def _tile_parts(dims, nd, ocg):
    """Elements of one thread's tile buffers: columns, GEMM tile (and the 16-position
    block its write-out transposes through), plan weights, plan masks (compute type)
    and plan indices (int64)."""
    C, K, og, T = dims[0], dims[1], dims[3], dims[4]
    plans = og * K * T
    return max(1, T * K * C), ocg * (T + 16), plans << nd, plans, plans


@njit(cache=True, inline="always")
def _ws_sizes(C, oC, geo, pstr, dims):
    """Workspace elements: (reordered weights, padded images, one thread's tile
    buffers) in the compute type, and one thread's plan indices in int64."""
    ocg = oC // dims[2]
    _, sites, tail = _padded_extent(geo, pstr)
    ncols, nout, npw, npm, nidx = _tile_parts(dims, geo.shape[1], ocg)
    return max(1, oC * dims[1] * (C // dims[2])), dims[5] * max(1, (sites + tail) * C), \
        ncols + nout + npw + npm, nidx


@njit(cache=True, inline="always")
def _scratch(fws, iws, dims, nd, ocg):
    """One thread's tile buffers, carved from its workspace slices: columns,
    GEMM tile, the plans of every (offset group, kernel point)."""
    K, og, T = dims[1], dims[3], dims[4]
    ncols, nout, npw, npm, nidx = _tile_parts(dims, nd, ocg)
    n1 = ncols + nout
    n2 = n1 + npw
    cols = fws[:ncols]
    outb = fws[ncols:n1]
    pw = shaped(fws[n1:n2], (og * K, 1 << nd, T))
    pm = shaped(fws[n2:n2 + npm], (og * K, T))
    pidx = shaped(iws[:nidx], (og * K, T))
    return cols, outb, pidx, pw, pm


def _ws_sizes_host(C, oC, geo, pstr, dims):
    """``_ws_sizes`` run as Python, for the launcher: sizes need no compile."""
    ocg = oC // dims[2]
    _, sites, tail = _padded_extent.py_func(geo, pstr)
    ncols, nout, npw, npm, nidx = _tile_parts.py_func(dims, geo.shape[1], ocg)
    return max(1, oC * dims[1] * (C // dims[2])), dims[5] * max(1, (sites + tail) * C), \
        ncols + nout + npw + npm, nidx


def _geometry(x3shape, p, origin=None):
    """geo rows: 0 sizes, 1 kernel, 2 strides, 3 pads begin, 4 dilations, 5 outputs.

    ``origin`` (a region's first output index per axis, see ``launch``) is folded into
    row 3: output ``o`` of the region is output ``origin + o`` of the whole, whose
    position base ``(origin + o) * stride - begin`` is ``o * stride - (begin - origin * stride)``."""
    nd = p.nd
    begin = p.pads_begin if origin is None else [pb - o * s for pb, o, s in zip(p.pads_begin, origin, p.strides)]
    geo = np.array([x3shape, p.kernel_shape, p.strides, begin, p.dilations, p.out_spatial],
                   dtype=np.int64).reshape(6, nd)
    pstr = np.ones(nd, np.int64)  # padded site strides
    for ax in range(nd - 2, -1, -1):
        pstr[ax] = pstr[ax + 1] * (geo[0, ax + 1] + 2)
    return geo, pstr


@njit(cache=True, inline="always")
def _padded_buffer(buf, nb, sites, tail, C):
    """nb padded images in ``buf``, each followed by a zero tail at least as long as
    the corner offsets: samples that are 0 (or NaN) point their base there, so that
    every corner they read is an exact zero, never an input value."""
    per = max(1, (sites + tail) * C)
    xp = shaped(buf[:nb * per], (nb, per))
    zero = _czero(buf)
    for i in range(nb):
        for j in range(sites * C, per):
            xp[i, j] = zero
    return xp


@njit(cache=True, inline="always")
def _corner_offsets(pstr, C):
    nd = pstr.shape[0]
    # np.empty and a loop, not np.zeros: inlined into the parallel entry, np.zeros
    # would become a parfor of its own (another parallel function to compile)
    coff = np.empty(1 << nd, np.int64)
    for cr in range(1 << nd):
        coff[cr] = 0
        for ax in range(nd):
            if (cr >> (nd - 1 - ax)) & 1:
                coff[cr] += pstr[ax] * C
    return coff


# --- tiny calls: straight from the definition, no scratch ------------------------------------

@njit(cache=True, nogil=True)
def _direct(x, w, off, m, b, y, meta):
    """Tiny calls: every output straight from the definition; no scratch, no
    pool, no BLAS (samples are recomputed per output channel, which costs less
    than setting up the tiled path when the work is this small). Arrays are
    indexed flat, and each axis's position base ``o * stride - pad`` and kernel
    step ``k * dilation`` are tabulated first (``ib``), so no sample divides."""
    geo, pstr, dims, has_mask, has_b = _unpack(meta)
    xf, wf, of, mf, yf, bb = flat(x), flat(w), flat(off), flat(m), flat(y), b
    nd = geo.shape[1]
    N, C, oC = x.shape[0], x.shape[1], y.shape[1]
    K, group, og = dims[1], dims[2], dims[3]
    S = 1
    P = 1
    for ax in range(nd):
        S *= geo[0, ax]
        P *= geo[5, ax]
    cpg, cpo, ocg = C // group, C // og, oC // group
    zero = _czero(w)
    one = zero + 1
    ib = np.empty((nd, P + K + 1), np.int64)  # per axis: P position bases, K kernel steps, a floor
    lm = _empty_like_compute(w, nd)
    for q in range(P):
        r = q
        for ax in range(nd - 1, -1, -1):
            ib[ax, q] = (r % geo[5, ax]) * geo[2, ax] - geo[3, ax]
            r //= geo[5, ax]
    for k in range(K):
        r = k
        for ax in range(nd - 1, -1, -1):
            ib[ax, P + k] = (r % geo[1, ax]) * geo[4, ax]
            r //= geo[1, ax]
    for n in range(N):
        for oc in range(oC):
            gi = oc // ocg
            for q in range(P):
                acc = load(bb, oc) if has_b else zero
                for cl in range(cpg):
                    c = gi * cpg + cl
                    g = c // cpo
                    xc = (n * C + c) * S
                    for kidx in range(K):
                        # the n-linear sample (the op's definition): corners outside the input count 0, a
                        # position at or beyond -1 or D on any axis gives 0, a non-finite one NaN
                        ok = True
                        fin = True
                        for ax in range(nd):
                            f, lam, okk, finn = border_corner(
                                ib[ax, q] + ib[ax, P + kidx],
                                load(of, ((n * og + g) * K + kidx) * nd * P + ax * P + q), geo[0, ax], zero)
                            ok = ok and okk
                            fin = fin and finn
                            ib[ax, P + K] = f
                            lm[ax] = lam
                        sv = zero
                        if not fin:
                            sv = _cast(zero, np.nan)
                        elif ok:
                            for cr in range(1 << nd):
                                wt = one
                                site = 0
                                inside = True
                                for ax in range(nd):
                                    bit = (cr >> (nd - 1 - ax)) & 1
                                    i = ib[ax, P + K] + bit
                                    if i < 0 or i >= geo[0, ax]:
                                        inside = False
                                    wt *= lm[ax] if bit else one - lm[ax]
                                    site = site * geo[0, ax] + i
                                if inside:
                                    sv += wt * load(xf, xc + site)
                        if has_mask:
                            sv *= load(mf, ((n * og + g) * K + kidx) * P + q)
                        acc += load(wf, (oc * cpg + cl) * K + kidx) * sv
                store(yf, (n * oC + oc) * P + q, acc)


# --- drivers ------------------------------------------------------------------------

#: set-up and reduction helpers of the entries, called through their own compiled code
_pad_row_op, _reorder_w_op, _convert_w_op = opaque(_pad_row), opaque(_reorder_w), opaque(_convert_w)
_to_cmajor_op, _reduction_phase_op = opaque(_to_cmajor), opaque(_reduction_phase)


@njit(cache=True, inline="always")
def _unpack(meta):
    """meta = [nd, geo (6 x nd), pstr (nd), dims...]: one argument instead of five,
    because every argument costs time in numba's dispatcher on tiny calls."""
    nd = meta[0]
    geo = shaped(meta[1:1 + 6 * nd], (6, nd))
    pstr = meta[1 + 6 * nd:1 + 7 * nd]
    dims = meta[1 + 7 * nd:]
    return geo, pstr, dims, dims[9] != 0, dims[10] != 0


@njit(cache=True, inline="always")
def _padded_setup(buf, x3, geo, pstr, nb):
    """Rows of a padded image (its bordered axes but the last), the padded buffer
    for ``nb`` images in ``buf``, and the corners' offsets in it."""
    rows, sites, tail = _padded_extent(geo, pstr)
    C = x3.shape[1]
    return rows, _padded_buffer(buf, nb, sites, tail, C), _corner_offsets(pstr, C)


@njit(cache=True, inline="always")
def _tile_rounds(dims):
    """Pool rounds per tile of the channel split: fill, GEMM (and the reduction's sum)."""
    return 3 if dims[11] == 2 else 2


@njit(**INTERNAL)
def _pad_round(th, nth, x3, n0, nc, rows, wrows, xp, w3, wr, geo, K, csplit):
    """Thread ``th``'s share of a pool round of set-up: padded rows of images ``n0 ..
    n0 + nc`` and ``wrows`` weight rows, dealt out in turn."""
    for i in range(th, nc * rows + wrows, nth):
        if i < nc * rows:
            _pad_row_op(x3, n0 + i // rows, xp[i // rows], geo, i % rows)
        elif csplit:
            _convert_w_op(w3, wr, i - nc * rows)
        else:
            _reorder_w_op(w3, wr, K, i - nc * rows)


@njit(**INTERNAL)
def _round(th, rd, tok, n0, nc, xp, off3, m3, has_mask, wr, wmat, shared, b, has_b, y3, geo, pstr, coff, segs,
           dims, fws, iws):
    """Thread ``th``'s part of pool round ``rd`` over the tiles of images ``n0 ..
    n0 + nc`` (see ``_parallel``): the position split's run of tiles, or its share of
    one tile's phase (fill, GEMM, reduction) in the channel and reduction splits."""
    C, K, group, T, nth = dims[0], dims[1], dims[2], dims[4], dims[6]
    oC, P = y3.shape[1], y3.shape[2]
    nd = geo.shape[1]
    ocg = oC // group
    nw, nxp, ntile_ws, nint = _ws_sizes(C, oC, geo, pstr, dims)
    csplit = dims[11] != 0
    ksplit = dims[11] == 2  # (one group only)
    nr = _tile_rounds(dims)  # pool rounds per tile of the channel (reduction) split
    ncols = _tile_parts(dims, nd, ocg)[0]
    u = 16 if oC >= 64 * nth else 1
    ntile = (P + T - 1) // T
    items = nc * ntile
    f0 = nw + nxp + th * ntile_ws
    cols, outb, pidx, pw, pm = _scratch(fws[f0:f0 + ntile_ws], iws[th * nint:(th + 1) * nint], dims, nd, ocg)
    lo = th * items // nth
    hi = (th + 1) * items // nth
    if csplit:
        lo, hi = rd // nr, rd // nr + 1
    phase = rd % nr
    for it in range(lo, hi):
        nl, t = it // ntile, it % ntile
        p0, p1 = t * T, min(P, t * T + T)
        buf, wm, fill, o0, o1 = cols, wr, True, 0, oC
        if csplit and phase == 0:  # this thread's share of the positions
            p0, p1, o1 = p0 + th * (p1 - p0) // nth, p0 + (th + 1) * (p1 - p0) // nth, 0
        elif ksplit:  # the reduction split
            _reduction_phase_op(phase, th, nth, shared, wmat, outb, fws, nw + nxp + ncols, ntile_ws,
                                b, has_b, y3, n0 + nl, p0, p1 - p0)
            fill, o1 = False, 0  # (nothing left for _tile)
        elif csplit:  # this thread's share of the output channels
            buf, wm, fill = shared, wmat, False
            o0 = min(oC, (th * oC // nth + u // 2) // u * u) if th else 0
            o1 = min(oC, ((th + 1) * oC // nth + u // 2) // u * u) if th < nth - 1 else oC
        if p1 > p0 and (fill or o1 > o0):
            _tile_op(tok, n0 + nl, nl, p0, p1, xp, off3, m3, has_mask, wm, b, has_b, y3, geo, pstr,
                     coff, segs, dims, buf, outb, pidx, pw, pm, fill, o0, o1)
            if csplit and fill:
                _to_cmajor_op(cols, shared, p0 - t * T, p1 - p0, T, K, C // group, group)


#: the pool rounds, called through their own compiled code by both entries: the parallel
#: entry's loop bodies (numba compiles each into a function of its own) hold one call each
_pad_round_op, _round_op = opaque(_pad_round), opaque(_round)


@njit(cache=True, inline="always")
def _entry(x, w, off, m, b, y, meta, fws):
    """What both tiled entries derive from their arguments: the flat arrays, the shapes,
    the padded images, the weights' buffers and the shared columns in ``fws``."""
    geo, pstr, dims, has_mask, has_b = _unpack(meta)
    x3, w3, off3, m3, y3 = flat3(x), flat3(w), flat3(off), flat3(m), flat3(y)
    C, oC = x3.shape[1], y3.shape[1]
    K, T, nb, nth = dims[1], dims[4], dims[5], dims[6]
    nw, nxp, ntile_ws, _ = _ws_sizes(C, oC, geo, pstr, dims)
    wr = fws[:nw]
    rows, xp, coff = _padded_setup(fws[nw:nw + nxp], x3, geo, pstr, nb)
    shared = fws[nw + nxp + nth * ntile_ws:nw + nxp + nth * ntile_ws + T * K * C]  # (channel split only)
    return (geo, pstr, dims, has_mask, has_b, x3, w3, off3, m3, y3, b, x.shape[2:], wr, rows, xp, coff,
            _segments(dims), shared, _mutable(_wmat(w3, wr)))


@njit(cache=True, inline="always")
def _chunk_rounds(dims, n0, nc, ntile, w3, oC):
    """(weight rows of the set-up round, tile rounds) of the chunk of ``nc`` images from
    ``n0`` (see ``_parallel``): the first chunk's set-up reorders or converts the weights
    unless the channel split reads them where they lie; the position split runs one
    tile round, the channel split two per tile, its reduction variant three."""
    csplit = dims[11] != 0
    wrows = oC if n0 == 0 and not (csplit and _native(w3)) else 0
    return wrows, (_tile_rounds(dims) * nc * ntile if csplit else 1)


@njit(cache=True, nogil=True)
def _serial(x, w, off, m, b, y, meta):
    """The tiled path on the caller's thread: the parallel entry's rounds (``_pad_round``,
    ``_round``) at one thread, in scratch of its own (serial calls run side by side,
    e.g. Dask tasks; allocated here: from the launcher it cost small calls ~1 us more).
    ``meta`` is a one-thread plan: its channel split is the weights read in place
    (``_plan_sizes``)."""
    geo, pstr, dims, _, _ = _unpack(meta)
    nw, nxp, ntile_ws, nint = _ws_sizes(x.shape[1], y.shape[1], geo, pstr, dims)
    fws = _empty_like_compute(x, nw + nxp + ntile_ws + (dims[4] * dims[1] * x.shape[1] if dims[11] != 0 else 0))
    iws = np.empty(max(1, nint), np.int64)
    (geo, pstr, dims, has_mask, has_b, x3, w3, off3, m3, y3, b, tok, wr, rows, xp, coff, segs, shared,
     wmat) = _entry(x, w, off, m, b, y, meta, fws)
    N, oC, P = x3.shape[0], y3.shape[1], y3.shape[2]
    K, T, nb = dims[1], dims[4], dims[5]
    ntile = (P + T - 1) // T
    csplit = dims[11] != 0
    for n0 in range(0, N, nb):
        nc = min(nb, N - n0)
        wrows, nrounds = _chunk_rounds(dims, n0, nc, ntile, w3, oC)
        _pad_round_op(0, 1, x3, n0, nc, rows, wrows, xp, w3, wr, geo, K, csplit)
        for rd in range(nrounds):
            _round_op(0, rd, tok, n0, nc, xp, off3, m3, has_mask, wr, wmat, shared, b, has_b, y3, geo, pstr, coff,
                      segs, dims, fws, iws)


@njit(cache=True, parallel=True, nogil=True)
def _parallel(x, w, off, m, b, y, meta, fws, iws):
    """The tiled path on numba's pool: any rank (C-contiguous arrays, as ``launch``
    passes them). ``fws``/``iws``: the caller's workspaces (see ``_ws_sizes``), reused
    across calls: fresh scratch pages cost a page fault each, up to a fifth of a call."""
    (geo, pstr, dims, has_mask, has_b, x3, w3, off3, m3, y3, b, tok, wr, rows, xp, coff, segs, shared,
     wmat) = _entry(x, w, off, m, b, y, meta, fws)
    N, oC, P = x3.shape[0], y3.shape[1], y3.shape[2]
    K, T, nb, nth = dims[1], dims[4], dims[5], dims[6]
    ntile = (P + T - 1) // T
    csplit = dims[11] != 0
    for n0 in range(0, N, nb):
        nc = min(nb, N - n0)
        # round -1: padded rows of this chunk, and (first chunk only) the weights' rows, the
        # items dealt out in turn (a padded row and a weight row differ several-fold in work:
        # contiguous halves would leave one thread waiting for the other) (the channel split
        # reads float32/float64 weights where they lie: no weight rows)
        wrows, nrounds = _chunk_rounds(dims, n0, nc, ntile, w3, oC)
        # the tiles, in rounds: the position split runs one round (each thread a contiguous run
        # of tiles: one image's rows stay in its cache); the channel split two per tile: the
        # threads fill shares of its positions (each in its own column buffer, then turned into
        # w's (channel, kernel point) order in the shared one), then each multiplies the shared
        # columns by its share of the output channels (rows of w, cut at multiples of 16 so
        # that BLAS's panels stay whole): every weight is packed once per tile, not once per
        # thread, each GEMM gets the whole tile's positions, and the weights are not reordered.
        # The reduction split (one group, few output channels per thread) runs three: the fill,
        # each thread's GEMM of all output channels over its share of w's columns into its own
        # GEMM tile, then each thread's share of y's rows summed from those partial sums.
        # (one prange loop for every round: numba compiles each prange loop into a function of its
        # own; np.int64(th): the gufunc's index is unsigned, its typing pass's signed: one signature)
        for rd in range(-1, nrounds):
            for th in prange(nth):
                if rd < 0:
                    _pad_round_op(np.int64(th), nth, x3, n0, nc, rows, wrows, xp, w3, wr, geo, K, csplit)
                else:
                    _round_op(np.int64(th), rd, tok, n0, nc, xp, off3, m3, has_mask, wr, wmat, shared, b, has_b,
                              y3, geo, pstr, coff, segs, dims, fws, iws)


# --- SciPy's BLAS thread count ----------------------------------------------------------

class _BlasThreads:
    """Holds SciPy's OpenBLAS (the BLAS numba's np.dot calls) at one thread while
    numba_ops' kernels call it, from any number of Python threads at once (a count
    of the holders: the first sets 1, the last restores the caller's setting).
    Other BLAS builds are left alone."""

    def __init__(self):
        self._lock = threading.Lock()
        self._get = self._set = None
        self._loaded = False
        self._holders = 0
        self._prev = None

    def _load(self):
        self._loaded = True
        try:
            import scipy
            libdir = os.path.join(os.path.dirname(os.path.dirname(scipy.__file__)), "scipy.libs")
            for path in glob.glob(os.path.join(libdir, "*openblas*.so*")):
                lib = ctypes.CDLL(path)
                for prefix in ("scipy_openblas", "openblas"):
                    get = getattr(lib, prefix + "_get_num_threads", None)
                    put = getattr(lib, prefix + "_set_num_threads", None)
                    if get is not None and put is not None:
                        get.restype = ctypes.c_int
                        put.argtypes = [ctypes.c_int]
                        self._get, self._set = get, put
                        return
        except Exception:  # no SciPy OpenBLAS found: nothing to hold
            pass

    def __enter__(self):
        with self._lock:
            if not self._loaded:
                self._load()
            self._holders += 1
            if self._holders == 1 and self._get is not None:
                prev = self._get()
                if prev != 1:
                    self._set(1)
                    self._prev = prev
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._prev is not None:
                self._set(self._prev)
                self._prev = None


_BLAS = _BlasThreads()


# --- launch -------------------------------------------------------------------------------

#: the 2-D/3-D fast plans compute sites and positions in 32 bits: sizes, sites and the
#: positions' integer parts must stay under this (``border_corner``'s int32 bound)
_I32 = 1 << 29


def _plan_sizes(N, C, K, oC, P, group, og, nd, S, item, nth, split=None, native=False):
    """(tile length T, images per chunk nb, channel split) for ``S`` sites per padded image.

    Tiles hold about ``_TILE_BYTES`` of columns (an L2 cache) but at least
    ``_TILE_MIN`` positions, as every tile's GEMM re-packs the weights; when the
    L2 target is under half that, the columns live in L3 anyway and tiles get
    ``2 * _TILE_MIN``. Tiles never take more than a quarter of
    ``_SCRATCH_BYTES`` over all threads. The padded images of a chunk take the
    rest of the budget (at least one image).

    A parallel run splits the work one of two ways. The position split gives each
    thread whole tiles (a multiple of ``nth`` tiles in all, so that no thread idles
    at the end); each tile's GEMM packs all the weights. The channel split fills
    each tile's columns once (the threads share its positions), then gives each
    thread a share of the output channels, so that each tile's weights are packed
    once in all and each GEMM gets the whole tile. Where positions are few beside
    the weights (deep channels at small spatial sizes: a handful of positions per
    thread, every thread packing megabytes of weights for them) the channel split
    wins. The choice counts the elements each thread's GEMMs pack (weights and
    columns), the work that does not shrink with more threads: the position split
    packs (weights + T columns) per tile, the channel split (weights / nth + T
    columns) per tile; with ``native`` weights (float32/float64: the channel split
    reads them where they lie) the position split also reorders them once per call
    (weights / nth). ``split`` (True/False) forces one way (tests, benchmarks).

    At one thread, True means the same weights-in-place order on the caller's thread
    (``_serial``), chosen for native weights where the column rows (N * P) are fewer
    than the weight rows (oC): each tile's columns are turned into w's order instead
    of all of w into the columns' on every call."""
    kc_all = max(1, K * C)
    per_pos = (kc_all + oC // group) * item + og * K * (((1 << nd) + 1) * item + 8)
    T = _TILE_BYTES // (kc_all * item)
    # columns far too wide for a cache-sized tile live in L3 anyway: fewer, bigger GEMMs win
    T = 2 * _TILE_MIN if 2 * T < _TILE_MIN else max(T, _TILE_MIN)
    T = max(1, min(P, T, (_SCRATCH_BYTES // 4 // nth) // per_pos))
    osplit = False
    if nth > 1:
        wts = oC * kc_all // max(1, group)
        ntile = -(-P // T)
        To = -(-P // ntile)  # the channel split's tiles: as even as T allows
        while (N * ntile) % nth and ntile < P:
            ntile += 1
        Tp = -(-P // ntile)
        cost_p = -(-N * ntile // nth) * (wts + Tp * kc_all) + (wts // nth if native else 0)
        cost_o = N * -(-P // To) * (wts // nth + To * kc_all)
        osplit = cost_o < cost_p if split is None else bool(split)
        T = To if osplit else Tp
    elif native and split is not False:
        # one thread (small calls, Dask tasks): float32/float64 weights read where they lie
        # (the columns turned into w's order: N * P column rows) rather than reordered
        # (oC rows) where the positions are fewer than the weights' rows
        osplit = N * P * group < oC if split is None else True
    img = max(1, S * C * item)
    budget = _SCRATCH_BYTES - nth * (T * per_pos + 16 * (oC // group) * item) - oC * kc_all * item // max(1, group)
    nb = max(1, min(N, budget // img))
    return T, nb, osplit


def _reduction_split(oC, group, nth):
    """Whether a channel split's GEMMs take shares of the reduction (each thread all the
    output channels for its share of w's columns, the partial sums added at the
    write-out) instead of shares of the output channels: with one group, where each
    thread's share of the channels would be under 256 rows. There OpenBLAS's GEMM of a
    thread's rows with a long reduction runs well under its rate (1 x 1024 x 7 x 7 ->
    256: 128 rows of 9216 each, against 256 of 4608 for the reduction split: the pair of
    threads' GEMMs 1.39 ms against 1.04, medians of 7 alternating rounds); at 256 rows and
    more the two measured the same. ``_KSPLIT`` (True/False) forces it (tests)."""
    if group != 1:
        return False
    return oC < 256 * nth if _KSPLIT is None else bool(_KSPLIT)


class _State:
    """Everything ``launch`` derives from a call's geometry, kept per geometry."""
    __slots__ = ("p", "origin", "xshape", "dtype", "oC", "yshape", "view", "empty", "small", "nob", "meta",
                 "ctype")

    def __init__(self, x, w, p, origin=None):
        N, C = x.shape[0], x.shape[1]
        oC = w.shape[0]
        nd, K, group = p.nd, p.K, p.group
        P = 1
        for o in p.out_spatial:
            P *= o
        geo, pstr = _geometry(x.shape[2:], p, origin)
        _, S, tail = _padded_extent.py_func(geo, pstr)  # sites of a padded image, its zero tail
        self.p, self.origin, self.xshape, self.dtype, self.oC = p, origin, x.shape, x.dtype, oC
        self.yshape = (N, oC) + tuple(p.out_spatial)
        view = storage(x.dtype)
        self.view = view if view != x.dtype else None  # 16-bit: their bit patterns
        self.empty = N == 0 or oC == 0
        self.nob = np.empty(0, x.dtype)  # the kernels' B when there is none
        work = N * P * K * (C + oC * (C // group) // 4 + 4)
        dwork = N * P * K * C * max(1, oC // group) << nd  # samples x corners of the direct path
        # small work runs on the caller's thread: the direct loops when tiny, else the tiled path
        self.small = None
        if work < _runtime.PARALLEL_MIN_WORK:
            self.small = _direct if dwork <= _DIRECT_MAX else _serial
        self.ctype = compute(x.dtype)
        item = self.ctype.itemsize
        # 2-D and 3-D plans compute sites and positions in 32 bits: only when they fit (a
        # region's positions are those of the whole output up to origin + out_spatial)
        ends = p.out_spatial if origin is None else [o0 + o for o0, o in zip(origin, p.out_spatial)]
        fits = (S < _I32 and max(x.shape[2:], default=0) < _I32 and max(p.pads_begin) < _I32
                and max(ends) * max(p.strides) + max(p.kernel_shape) * max(p.dilations) < _I32)
        fast = nd if (fits and nd in (2, 3)) else 0
        self.meta = {}
        for nth in {1, _runtime.num_threads()}:
            T, nb, osplit = _plan_sizes(N, C, K, oC, P, p.group, p.offset_group, nd, S + tail, item, nth,
                                        _SPLIT, self.view is None)
            split = int(osplit) + int(osplit and nth > 1 and _reduction_split(oC, p.group, nth))
            dims = [C, K, p.group, p.offset_group, T, nb, nth, fast, S]
            # index has_mask * 2 + has_b: dims[9] has_mask, dims[10] has_b; dims[11] the split: 0 by
            # positions, 1 by output channels, 2 by the reduction (both after a shared fill)
            metas = [np.array([nd] + geo.ravel().tolist() + pstr.tolist() + dims + [hm, hb, split],
                              dtype=np.int64)
                     for hm in (0, 1) for hb in (0, 1)]
            nw, nxp, ntile_ws, nint = _ws_sizes_host(C, oC, geo, pstr, metas[0][1 + 7 * nd:])
            # metas, then the parallel run's workspace elements (compute type, int64); the
            # channel split's shared columns after the threads' tile buffers
            self.meta[nth] = (metas, nw + nxp + nth * ntile_ws + (T * K * C if osplit else 0), nth * nint)


_WORKSPACE = {}


def _workspace(dtype, n):
    """A buffer of at least ``n`` elements kept between parallel calls (used under the
    pool lock only): fresh scratch pages fault once each, up to a fifth of a call."""
    a = _WORKSPACE.get(dtype)
    if a is None or a.size < n:
        _WORKSPACE[dtype] = None  # free the old one first
        a = _WORKSPACE[dtype] = np.empty(max(1, n), dtype)
    return a


_STATES = {}
_STATES_MAX = 256


def launch(x, w, offset, b, mask, p, origin=None):
    """Compute DeformConv for validated inputs (see numba_ops.deform_conv).

    ``origin`` (internal, numba_ops.dask): a tuple of first output indices per spatial
    axis; the call then computes the region ``origin .. origin + p.out_spatial`` of
    the whole output (``offset``/``mask`` hold that region only, ``x`` the whole image)."""
    key = id(p) if origin is None else (id(p), origin)
    st = _STATES.get(key)
    if (st is None or st.p is not p or st.origin != origin or st.xshape != x.shape or st.dtype is not x.dtype
            or st.oC != w.shape[0]):
        st = _State(x, w, p, origin)  # the state holds p, so its id is not reused while it lives
        if len(_STATES) >= _STATES_MAX:
            _STATES.clear()
        _STATES[key] = st
    y = np.empty(st.yshape, x.dtype)
    if st.empty:
        return y
    i = 0
    if mask is None:
        mask = offset  # never read
    else:
        i = 2
    if b is None:
        b = st.nob
    else:
        i += 1
    # the kernels take C-contiguous arrays only (one layout to compile; ``_views``)
    c = np.ascontiguousarray
    args = (c(x), c(w), c(offset), c(mask), c(b), y)
    if st.view is not None:  # 16-bit data as its bit patterns
        args = tuple(a.view(st.view) for a in args)
    if st.small is not None:
        st.small(*args, st.meta[1][0][i])
        return y
    nth = _runtime.num_threads() if _runtime.pool_usable() else 1
    plan = st.meta.get(nth)
    if plan is None:  # the caller changed numba's thread count
        plan = st.meta[nth] = _State(x, w, p, origin).meta[nth]
    metas, nf, ni = plan
    if nth == 1:  # the caller's thread alone: no pool, so no pool lock (Dask tasks run side by side)
        with _BLAS:
            _serial(*args, metas[i])
        return y
    with _runtime.POOL_LOCK, _BLAS:
        _parallel(*args, metas[i], _workspace(st.ctype, nf), _workspace(np.int64, ni))
    return y

"""DeformConv on the CPU: zero-bordered channel-last input, per-tile sampling
plans, im2col fill and single-threaded BLAS per tile, all on numba's one pool.

Algorithm, per image (images go in chunks so that scratch stays within
``_deform_plan.SCRATCH_BYTES`` whatever N is):

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
   axis only when the sizes fit, see ``_deform_plan.State``).
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
   one thread, ``_blas.ONE_THREAD``, while numba's workers run, so two pools never
   fight over the cores). Bias and the one rounding to the output dtype happen
   when the GEMM tile is written out.

A parallel run gives each thread whole tiles (the position split), or, where the
positions are few beside the weights (deep channels at small spatial sizes), splits
each tile by output channels (the channel split): the threads fill shares of its
positions, the columns are turned into w's own (channel, kernel point) order, and
each thread multiplies them by its share of w's rows, read where they lie (no
reorder pass) and packed by BLAS once per tile in all instead of once per thread.
``_deform_plan.plan_sizes`` chooses from the elements each thread's GEMMs pack. With
one group and few output channels per thread, the channel split's GEMMs share the
reduction instead (each thread all the output channels over its share of w's
columns, through ``_blas.gemm_tn``; the partial sums are added as y is written:
``_deform_plan.reduction_split``).

Calls too small for the pool, and calls at one thread, run on the caller's thread
(``_serial``; with float32/float64 weights and fewer column rows than weight rows it
uses the channel split's order, the weights read where they lie), and
tiny ones (the seed example) skip the scratch and BLAS altogether
(``_direct``: each output straight from the definition). Accumulation is
float32 for float16/bfloat16/float32 (16-bit inputs are widened to float32
copies by ``launch``, so the kernels compile for float32 and float64 alone) and
float64 for float64.

Compile time: numba compiles each jitted function into a module of
its own, links in every jitted function it calls and optimises the whole again,
so each level of ordinary calls re-optimises all the code below it. The large
pieces are therefore called through their own compiled code (``_opaque``): the
tile (``_tile``, with its plan and fill), the padding and weight rows, the column
transpose and the reduction phase are each compiled once, whichever entry calls
them, and the pool rounds are functions of their own (``_pad_round``,
``_round``), reached through one thread's round with the call's set-up (``_task``,
called through its own code as ``task``): the parallel entry is a loop over the
rounds whose ``prange`` body (numba compiles it into a function of its own, with
numba's parfor passes over the whole entry) is that one call, the serial entry runs
the same rounds at one thread, and the session's task calls it too (a first
parallel call compiled its entry in 4.3 s with the set-up inlined, this one in
about 1 s). The small set-up helpers are inlined as numba IR (``inline="always"``:
typed in their caller, never a module of their own). A call compiles its own rank's
code: ``tok``, the input's spatial shape, goes down to ``_plan``/``_fill``, whose
``len(tok)`` branches numba prunes before typing.

The modules: this one holds the kernels and ``launch``; ``_deform_plan`` the launch
policy (tile sizes, splits, the per-geometry ``State`` and the workspaces) and the
call's ``Geometry`` and ``Plan`` (named fields, one int64 vector across numba's
dispatcher, unpacked first by every entry); ``_blas`` the BLAS GEMM binding and the
OpenBLAS thread holder. Kernel arguments travel in groups: ``io`` (offsets, mask,
bias, output), ``pad`` (padded images, corner offsets, channel runs), ``bufs`` (a
thread's tile buffers: columns, GEMM tile, plan indices, weights and masks), ``at``
(image and positions of a tile), ``chunk`` (first image, images).
"""
from typing import NamedTuple

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .._compat import impl_ret_borrowed
from .._dtypes import NAMES
from .._sample import as_compute
from .._scalar import border_corner, load, store
from . import _runtime
from ._blas import ONE_THREAD, gemm_tn
from ._copies import narrowed, widened
from ._deform_plan import (padded_extent, state, tile_parts, unpack_geometry, unpack_plan, workspace,
                           ws_sizes)
from ._opaque import INTERNAL, opaque
from ._views import flat, flat3, shaped

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)


# --- compute-type and typing helpers --------------------------------------------------------

def _zero(like):
    """0 in the compute type of array ``like`` (a storage or a compute array): float64
    for float64, else float32."""


@overload(_zero, jit_options={"inline": "always"})
def _zero_ol(like):
    if like.dtype == types.float64:
        return lambda like: np.float64(0)
    return lambda like: np.float32(0)


@intrinsic
def _mutable(typingctx, a):
    """``a`` typed writable: a read-only caller's array (never written) then has the type
    of a workspace slice, so that one call site takes either (numba's
    ``impl_ret_borrowed``: the one numba internal here)."""
    if not isinstance(a, types.Array):
        return None
    rt = a.copy(readonly=False)

    def codegen(context, builder, sig, args):
        return impl_ret_borrowed(context, builder, rt, args[0])
    return rt(a), codegen


# --- phase 1: padded channel-last images and reordered weights ---------------------------

@njit(**INTERNAL)
def _pad_row(x3, n, xp, geo, r):
    """Padded row ``r`` (all leading padded coordinates, flattened) of image ``n``
    into ``xp`` (sites x C, flat): interior copied channel-last, border zeroed."""
    sizes = geo.sizes
    nd = sizes.shape[0]
    C = x3.shape[1]
    L = sizes[nd - 1]
    Lp = L + 2
    zero = _zero(x3)
    src_row = 0
    border = False
    q = r
    mul = 1
    for ax in range(nd - 2, -1, -1):
        dp = sizes[ax] + 2
        cp = q % dp
        q //= dp
        if cp == 0 or cp == dp - 1:
            border = True
        src_row += (cp - 1) * mul
        mul *= sizes[ax]
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


@njit(**INTERNAL)
def _to_cmajor(cols, shared, j0, tl, d):
    """Column rows 0..tl of ``cols`` ((group, T, K, cpg) order) into rows j0.. of ``shared``
    in (group, T, cpg, K) order: the order of w's own rows, so that the channel split
    multiplies by the weights without reordering them (the columns of a tile are far
    fewer than the weights where the channel split runs)."""
    T, K, group = d.T, d.K, d.group
    cpg = d.C // group
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
def _plan_row2d(offs, mm, has_mask, corner, lattice, span, out):
    """2-D plan of output positions q0..q1 of one output row: the hot loop,
    branch-free, 32-bit (the launcher checks the sizes) and on 0-based slices,
    so that it vectorises. ``offs``: the offset rows (y, x); ``corner`` (by, bx, sx):
    the positions' integer parts are ``by``, ``bx + i * sx``; ``lattice`` (Hi, Wi, ys,
    zsite, C): the input's sizes, a padded row's sites, the zero tail's site, channels;
    ``span`` (q0, q1, j0): the positions and the first plan slot; ``out`` (pidx, pw, pm)."""
    oy, ox = offs
    by, bx, sx = corner
    Hi, Wi, ys, zsite, C = lattice
    q0, q1, j0 = span
    pidx, pw, pm = out
    zero = _zero(pw)
    one = zero + 1
    nan = as_compute(zero, np.nan)
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
def _plan_row3d(offs, mm, has_mask, corner, lattice, span, out):
    """3-D plan of output positions q0..q1 of one output row (see ``_plan_row2d``):
    ``offs`` (z, y, x), ``corner`` (bz, by, bx, sx), ``lattice`` (Di, Hi, Wi, zs, ys,
    zsite, C)."""
    oz, oy, ox = offs
    bz, by, bx, sx = corner
    Di, Hi, Wi, zs, ys, zsite, C = lattice
    q0, q1, j0 = span
    pidx, pw, pm = out
    zero = _zero(pw)
    one = zero + 1
    nan = as_compute(zero, np.nan)
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
def _plan(tok, geo, d, off3, m3, n, gk, span, out):
    """Sampling plan of offset group ``g``, kernel point ``kidx`` (``gk``) of image ``n``
    for output positions [p0, p1) (``span``): ``out`` (pidx, pw, pm): ``pidx`` the flat
    index of the lowest corner in ``xp``, ``pw[corner]`` the n-linear weights (NaN for
    a non-finite position, 0 outside), and ``pm`` the mask, applied after the sum as the
    definition orders it. The 2-D/3-D plans fold a finite mask into ``pw`` instead
    (``pm`` is then 1) and keep only a non-finite one in ``pm``; the general plan keeps
    every mask there.

    ``tok`` (the input's spatial shape, a tuple of n) fixes the rank when numba
    compiles: the ``len(tok)`` branches are pruned before typing, so a 2-D call
    compiles the 2-D plan (and the general one, its fallback for sizes past 32
    bits) and never the 3-D one, and a 1-D call neither."""
    g, kidx = gk
    p0, p1 = span
    pidx, pw, pm = out
    C, K, fast, zsite, has_mask = d.C, d.K, d.fast, d.sites, d.has_mask != 0
    sizes, kernel, strides, begin, dil, outs, pstr = geo
    nd = sizes.shape[0]
    NC = 1 << nd
    oL = outs[nd - 1]
    zero = _zero(pw)
    one = zero + 1
    nan = as_compute(zero, np.nan)
    ch0 = (g * K + kidx) * nd
    mm = m3[n, g * K + kidx]
    if len(tok) == 2 and fast == 2:
        lattice = (np.int32(sizes[0]), np.int32(sizes[1]), np.int32(pstr[0]), np.int32(zsite), C)
        sx = np.int32(strides[1])
        # kernel point coordinates: the constant part of the positions on each axis
        ky = (kidx // kernel[1]) * dil[0] - begin[0]
        kx = (kidx % kernel[1]) * dil[1] - begin[1]
        p = p0
        while p < p1:
            ol = p % oL
            end = min(p1, p - ol + oL)
            by = np.int32((p // oL) * strides[0] + ky)
            bx = np.int32(ol * strides[1] + kx)
            _plan_row2d((off3[n, ch0], off3[n, ch0 + 1]), mm, has_mask, (by, bx, sx), lattice, (p, end, p - p0),
                        out)
            p = end
        return
    if len(tok) == 3 and fast == 3:
        lattice = (np.int32(sizes[0]), np.int32(sizes[1]), np.int32(sizes[2]), np.int32(pstr[0]),
                   np.int32(pstr[1]), np.int32(zsite), C)
        sx = np.int32(strides[2])
        kz = (kidx // (kernel[1] * kernel[2])) * dil[0] - begin[0]
        ky = ((kidx // kernel[2]) % kernel[1]) * dil[1] - begin[1]
        kx = (kidx % kernel[2]) * dil[2] - begin[2]
        p = p0
        while p < p1:
            ol = p % oL
            end = min(p1, p - ol + oL)
            row = p // oL
            bz = np.int32((row // outs[1]) * strides[0] + kz)
            by = np.int32((row % outs[1]) * strides[1] + ky)
            bx = np.int32(ol * strides[2] + kx)
            _plan_row3d((off3[n, ch0], off3[n, ch0 + 1], off3[n, ch0 + 2]), mm, has_mask, (bz, by, bx, sx),
                        lattice, (p, end, p - p0), out)
            p = end
        return
    rem = kidx
    kpos = np.empty(nd, np.int64)
    for ax in range(nd - 1, -1, -1):
        kk = rem % kernel[ax]
        rem //= kernel[ax]
        kpos[ax] = kk * dil[ax] - begin[ax]
    lam = np.empty(nd, pw.dtype)
    for q in range(p0, p1):
        rq = q
        ok = True
        fin = True
        base = 0
        for ax in range(nd - 1, -1, -1):
            oq = rq % outs[ax]
            rq //= outs[ax]
            f, l, okk, finn = border_corner(oq * strides[ax] + kpos[ax], load(off3[n, ch0 + ax], q),
                                            sizes[ax], zero)
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
def _segments(d):
    """The channel runs of a column row: one per (offset group, conv group) overlap,
    as rows (offset group, first channel, length, offset in the row's tile)."""
    C, K, group, og, T = d.C, d.K, d.group, d.og, d.T
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
def _fill(tok, pad, plans, cols, cshape):
    """Apply the tile's plans (``plans``: pidx, pw, pm) to the image's padded sites
    (``pad``: xp of the image, coff, segs): cols[gi, j, kidx, c - gi*cpg] =
    mask * sum_corner w * xp[pidx + coff + c] for every channel c, ``cshape`` being
    (tl, K, cpg): the tile's positions, kernel points and channels per group.

    Position by position, so that each column row is written front to back;
    each (kernel point, offset group) is a contiguous run of channels in ``xp``
    (split where a conv group ends). The runs are short (often 32-64 channels), so
    their set-up is kept to a few loads and adds: 2-D (4 corners) has a loop of its
    own, and the mask is not in the runs: what ``_plan`` leaves in ``pm`` (a
    non-finite mask, or every mask of the general plan; else 1) multiplies the
    finished sample afterwards, as the definition orders it."""
    xp, coff, segs = pad
    pidx, pw, pm = plans
    tl, K, cpg = cshape
    if len(tok) == 2:  # the rank is fixed at compile time (see ``_plan``)
        _fill_bilinear(xp, (np.uint64(coff[1]), np.uint64(coff[2]), np.uint64(coff[3])), pidx, pw, cols, segs,
                       cshape)
    else:
        _fill_any(tok, xp, coff, pidx, pw, cols, segs, cshape)
    one = _zero(pm) + 1
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
def _fill_bilinear(xp, u, pidx, pw, cols, segs, cshape):
    """The runs of ``_fill`` in 2-D: 4 loads and FMAs per channel (SIMD), unsigned
    indices (no negative-index fix-ups in the short loops; ``u``: the corners'
    offsets but the first's). Apart from ``_fill_any`` on purpose: in one loop with a
    branch on the corner count (or a corner count fixed by an inlined helper) the 2-D
    runs measured 3-20 % slower."""
    u1, u2, u3 = u
    tl, K, cpg = cshape
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
def _fill_any(tok, xp, coff, pidx, pw, cols, segs, cshape):
    """The runs of ``_fill`` in 1-D (2 corners), 3-D (8) and beyond (a pass per corner);
    the rank, ``len(tok)``, is fixed at compile time (see ``_plan``)."""
    tl, K, cpg = cshape
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
def _tile(tok, geo, d, io, pad, wr, bufs, at, fill, chans):
    """Output positions [p0, p1) of image ``n`` (``at``: n, nl, p0, p1; ``nl``: the
    image's slot in ``xp``): when ``fill``, plans and column fill into ``cols`` (its row
    0 is position p0); then, for output channels [oc0, oc1) (``chans``, global), one
    GEMM per group they touch by the weight rows ``wr``, bias and rounding into ``y3``.
    The position split calls it once per tile (fill, all channels); the channel split
    (``_parallel``) once per thread to fill its share of a tile's positions (no
    channels), then once per thread for its channels."""
    off3, m3, b, y3 = io
    xp, coff, segs = pad
    cols, outb, pidx, pw, pm = bufs
    n, nl, p0, p1 = at
    oc0, oc1 = chans
    C, K, group, og, T = d.C, d.K, d.group, d.og, d.T
    has_b = d.has_b != 0
    oC = y3.shape[1]
    cpg, ocg = C // group, oC // group
    kc = K * cpg
    tl = p1 - p0
    if fill:
        for g in range(og):
            for kidx in range(K):
                gk = g * K + kidx
                _plan_op(tok, geo, d, off3, m3, n, (g, kidx), (p0, p1), (pidx[gk], pw[gk], pm[gk]))
        _fill_op(tok, (xp[nl], coff, segs), (pidx, pw, pm), cols, (tl, K, cpg))
    zero = _zero(wr)
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
            gemm_tn(wr, wo, kc, cols, co, kc, outf, 0, ol, ol, tl, kc)
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
def _reduction_phase(phase, th, d, mats, sums, io, at):
    """Thread ``th``'s part of the reduction split (one group) for the tile of ``tl``
    positions from ``p0`` of image ``n`` (``at``: n, p0, tl), whose columns ``shared``
    holds in w's order (``mats``: shared, wmat, outb). Phase 1: its GEMM tile ``outb``
    (o, j) = the partial sum over its share of w's columns (``wmat``'s rows, all output
    channels), through ``gemm_tn``. Phase 2: its share of y's rows, y[n, o, p0 + j] =
    bias + the threads' partial sums ``fws[base + t * stride + o * tl + j]`` (``sums``:
    fws, base, stride; t = 0..nth-1 in that order: every thread's GEMM tile), rounded
    once to y's dtype."""
    shared, wmat, outb = mats
    fws, base, stride = sums
    _, _, b, y3 = io
    n, p0, tl = at
    nth, has_b = d.nth, d.has_b != 0
    oC, P = y3.shape[1], y3.shape[2]
    if phase == 1:
        kc = wmat.size // oC  # one group: w's rows are (C * K) long
        k0, k1 = th * kc // nth, (th + 1) * kc // nth
        if k1 > k0:
            gemm_tn(shared, k0, kc, wmat, k0, kc, outb, 0, tl, tl, oC, k1 - k0)
        else:
            for i in range(tl * oC):
                outb[i] = 0
        return
    o0, o1 = th * oC // nth, (th + 1) * oC // nth
    yf = flat(y3)
    zero = _zero(fws)
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
def _scratch(ws, th, d, nd, ocg, base, per):
    """Thread ``th``'s tile buffers (``bufs``), carved from the workspaces ``ws`` (fws,
    iws; its share of fws: ``per`` elements from ``base + th * per``): columns, GEMM
    tile, the plans of every (offset group, kernel point)."""
    fws, iws = ws
    K, og, T = d.K, d.og, d.T
    ncols, nout, npw, npm, nidx = tile_parts(d, nd, ocg)
    f0 = base + th * per
    fw = fws[f0:f0 + per]
    n1 = ncols + nout
    n2 = n1 + npw
    cols = fw[:ncols]
    outb = fw[ncols:n1]
    pw = shaped(fw[n1:n2], (og * K, 1 << nd, T))
    pm = shaped(fw[n2:n2 + npm], (og * K, T))
    pidx = shaped(iws[th * nidx:(th + 1) * nidx], (og * K, T))
    return cols, outb, pidx, pw, pm


@njit(cache=True, inline="always")
def _padded_buffer(buf, nb, sites, tail, C, zero_tails):
    """nb padded images in ``buf``, each followed by a zero tail at least as long as
    the corner offsets (written where ``zero_tails``): samples that are 0 (or NaN) point
    their base there, so that every corner they read is an exact zero, never an input
    value."""
    per = max(1, (sites + tail) * C)
    xp = shaped(buf[:nb * per], (nb, per))
    if zero_tails:
        zero = _zero(buf)
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
    geo, d = unpack_geometry(meta), unpack_plan(meta)
    sizes, kernel, strides, begin, dil, outs, _ = geo
    has_mask, has_b = d.has_mask != 0, d.has_b != 0
    xf, wf, of, mf, yf, bb = flat(x), flat(w), flat(off), flat(m), flat(y), b
    nd = sizes.shape[0]
    N, C, oC = x.shape[0], x.shape[1], y.shape[1]
    K, group, og = d.K, d.group, d.og
    S = 1
    P = 1
    for ax in range(nd):
        S *= sizes[ax]
        P *= outs[ax]
    cpg, cpo, ocg = C // group, C // og, oC // group
    zero = _zero(w)
    one = zero + 1
    ib = np.empty((nd, P + K + 1), np.int64)  # per axis: P position bases, K kernel steps, a floor
    lm = np.empty(nd, type(zero))
    for q in range(P):
        r = q
        for ax in range(nd - 1, -1, -1):
            ib[ax, q] = (r % outs[ax]) * strides[ax] - begin[ax]
            r //= outs[ax]
    for k in range(K):
        r = k
        for ax in range(nd - 1, -1, -1):
            ib[ax, P + k] = (r % kernel[ax]) * dil[ax]
            r //= kernel[ax]
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
                                load(of, ((n * og + g) * K + kidx) * nd * P + ax * P + q), sizes[ax], zero)
                            ok = ok and okk
                            fin = fin and finn
                            ib[ax, P + K] = f
                            lm[ax] = lam
                        sv = zero
                        if not fin:
                            sv = as_compute(zero, np.nan)
                        elif ok:
                            for cr in range(1 << nd):
                                wt = one
                                site = 0
                                inside = True
                                for ax in range(nd):
                                    bit = (cr >> (nd - 1 - ax)) & 1
                                    i = ib[ax, P + K] + bit
                                    if i < 0 or i >= sizes[ax]:
                                        inside = False
                                    wt *= lm[ax] if bit else one - lm[ax]
                                    site = site * sizes[ax] + i
                                if inside:
                                    sv += wt * load(xf, xc + site)
                        if has_mask:
                            sv *= load(mf, ((n * og + g) * K + kidx) * P + q)
                        acc += load(wf, (oc * cpg + cl) * K + kidx) * sv
                store(yf, (n * oC + oc) * P + q, acc)


# --- drivers ------------------------------------------------------------------------

#: set-up and reduction helpers of the entries, called through their own compiled code
_pad_row_op, _reorder_w_op = opaque(_pad_row), opaque(_reorder_w)
_to_cmajor_op, _reduction_phase_op = opaque(_to_cmajor), opaque(_reduction_phase)


@njit(cache=True, inline="always")
def _tile_rounds(d):
    """Pool rounds per tile of the channel split: fill, GEMM (and the reduction's sum)."""
    return 3 if d.split == 2 else 2


@njit(**INTERNAL)
def _pad_round(th, chunk, imgs, wts, geo, d):
    """Thread ``th``'s share of a pool round of set-up: padded rows of the chunk's images
    (``chunk``: n0, nc; ``imgs``: x3, xp, rows per padded image) and ``wrows`` weight rows
    (``wts``: w3, wr, wrows), dealt out in turn."""
    n0, nc = chunk
    x3, xp, rows = imgs
    w3, wr, wrows = wts
    nth, K = d.nth, d.K
    for i in range(th, nc * rows + wrows, nth):
        if i < nc * rows:
            _pad_row_op(x3, n0 + i // rows, xp[i // rows], geo, i % rows)
        else:
            _reorder_w_op(w3, wr, K, i - nc * rows)


@njit(**INTERNAL)
def _round(th, rd, chunk, tok, geo, d, io, pad, wts, ws):
    """Thread ``th``'s part of pool round ``rd`` over the tiles of the chunk's images
    (``chunk``: n0, nc; see ``_parallel``): the position split's run of tiles, or its
    share of one tile's phase (fill, GEMM, reduction) in the channel and reduction
    splits. ``wts``: the weight rows (wr), w in its own order (wmat) and the shared
    columns; ``ws``: the workspaces (fws, iws)."""
    n0, nc = chunk
    wr, wmat, shared = wts
    fws = ws[0]
    y3 = io[3]
    group, T, nth = d.group, d.T, d.nth
    oC, P = y3.shape[1], y3.shape[2]
    nd = geo.sizes.shape[0]
    ocg = oC // group
    nw, nxp, ntile_ws, nint = ws_sizes(oC, geo, d)
    csplit = d.split != 0
    ksplit = d.split == 2  # (one group only)
    nr = _tile_rounds(d)  # pool rounds per tile of the channel (reduction) split
    ncols = tile_parts(d, nd, ocg)[0]
    u = 16 if oC >= 64 * nth else 1
    ntile = (P + T - 1) // T
    items = nc * ntile
    bufs = _scratch(ws, th, d, nd, ocg, nw + nxp, ntile_ws)
    cols, outb = bufs[0], bufs[1]
    lo = th * items // nth
    hi = (th + 1) * items // nth
    if csplit:
        lo, hi = rd // nr, rd // nr + 1
    phase = rd % nr
    for it in range(lo, hi):
        nl, t = it // ntile, it % ntile
        p0, p1 = t * T, min(P, t * T + T)
        tb, wm, fill, o0, o1 = bufs, wr, True, 0, oC
        if csplit and phase == 0:  # this thread's share of the positions
            p0, p1, o1 = p0 + th * (p1 - p0) // nth, p0 + (th + 1) * (p1 - p0) // nth, 0
        elif ksplit:  # the reduction split
            _reduction_phase_op(phase, th, d, (shared, wmat, outb), (fws, nw + nxp + ncols, ntile_ws), io,
                                (n0 + nl, p0, p1 - p0))
            fill, o1 = False, 0  # (nothing left for _tile)
        elif csplit:  # this thread's share of the output channels
            tb, wm, fill = (shared, outb, bufs[2], bufs[3], bufs[4]), wmat, False
            o0 = min(oC, (th * oC // nth + u // 2) // u * u) if th else 0
            o1 = min(oC, ((th + 1) * oC // nth + u // 2) // u * u) if th < nth - 1 else oC
        if p1 > p0 and (fill or o1 > o0):
            _tile_op(tok, geo, d, io, pad, wm, tb, (n0 + nl, nl, p0, p1), fill, (o0, o1))
            if csplit and fill:
                _to_cmajor_op(cols, shared, p0 - t * T, p1 - p0, d)


#: the pool rounds, called through their own compiled code by both entries: the parallel
#: entry's loop bodies (numba compiles each into a function of its own) hold one call each
_pad_round_op, _round_op = opaque(_pad_round), opaque(_round)


@njit(cache=True, inline="always")
def _entry(x, w, off, m, y, geo, d, fws, zero_tails):
    """What a pool round derives from the call's arguments: the flat arrays, the weights'
    buffers in ``fws`` (wr, wmat, the shared columns), the padded images (their zero
    tails written where ``zero_tails``: by one thread in a chunk's set-up round, before
    any tile round reads them), the corners' offsets, the channel runs and the rows of
    a padded image."""
    x3, w3, off3, m3, y3 = flat3(x), flat3(w), flat3(off), flat3(m), flat3(y)
    C, oC = x3.shape[1], y3.shape[1]
    K, T, nb, nth = d.K, d.T, d.nb, d.nth
    nw, nxp, ntile_ws, _ = ws_sizes(oC, geo, d)
    wr = fws[:nw]
    rows, sites, tail = padded_extent(geo)
    xp = _padded_buffer(fws[nw:nw + nxp], nb, sites, tail, C, zero_tails)
    shared = fws[nw + nxp + nth * ntile_ws:nw + nxp + nth * ntile_ws + T * K * C]  # (channel split only)
    return (x3, w3, off3, m3, y3, wr, _mutable(flat(w3)), shared, xp, _corner_offsets(geo.pstr, C),
            _segments(d), rows)


@njit(cache=True, inline="always")
def _weight_rows(d, n0, oC):
    """The weight rows of the set-up round of the chunk of images from ``n0`` (see
    ``_parallel``): the first chunk's set-up reorders the weights unless the channel
    split reads them where they lie."""
    return oC if n0 == 0 and d.split == 0 else 0


@njit(**INTERNAL)
def _task(x, w, off, m, b, y, meta, fws, iws, th, rd, n0):
    """Thread ``th``'s share of pool round ``rd`` (-1: the set-up round) of the chunk of
    images from ``n0``: both entries run their rounds by it, and a pool other than
    numba's (onnxruntime's, see ``numba_ops.onnx._capi``: ``task``) too, which runs
    ``schedule``'s rounds in order, each with ``th`` over ``range(d.nth)``, and waits
    for each round to end before the next."""
    geo, d = unpack_geometry(meta), unpack_plan(meta)
    x3, w3, off3, m3, y3, wr, wmat, shared, xp, coff, segs, rows = _entry(x, w, off, m, y, geo, d, fws,
                                                                          rd < 0 and th == 0)
    chunk = (n0, min(d.nb, x3.shape[0] - n0))
    if rd < 0:
        _pad_round_op(th, chunk, (x3, xp, rows), (w3, wr, _weight_rows(d, n0, y3.shape[1])), geo, d)
    else:
        _round_op(th, rd, chunk, x.shape[2:], geo, d, (off3, m3, b, y3), (xp, coff, segs), (wr, wmat, shared),
                  (fws, iws))


#: a pool round through its own compiled code: the entries and the session's task compile a
#: call of it, not the rounds' set-up again
task = opaque(_task)


@njit(cache=True, inline="always")
def _rounds(d, N, P, n0):
    """The tile rounds of the chunk of images from ``n0`` (``N`` images of ``P`` output
    positions): the position split runs one tile round, the channel split two per tile,
    its reduction variant three (``_tile_rounds``)."""
    nc = min(d.nb, N - n0)
    return _tile_rounds(d) * nc * ((P + d.T - 1) // d.T) if d.split != 0 else 1


@njit(cache=True, nogil=True)
def _serial(x, w, off, m, b, y, meta):
    """The tiled path on the caller's thread: the parallel entry's rounds (``task``) at
    one thread, in scratch of its own (serial calls run side by side, e.g. Dask tasks;
    allocated here: from the launcher it cost small calls ~1 us more). ``meta`` is a
    one-thread plan: its channel split is the weights read in place
    (``_deform_plan.plan_sizes``)."""
    geo, d = unpack_geometry(meta), unpack_plan(meta)
    nw, nxp, ntile_ws, nint = ws_sizes(y.shape[1], geo, d)
    fws = np.empty(nw + nxp + ntile_ws + (d.T * d.K * x.shape[1] if d.split != 0 else 0), type(_zero(x)))
    iws = np.empty(max(1, nint), np.int64)
    N, P = x.shape[0], y.size // max(1, y.shape[0] * y.shape[1])
    th = np.int64(0)
    for n0 in range(0, N, d.nb):
        for rd in range(-1, _rounds(d, N, P, n0)):
            task(x, w, off, m, b, y, meta, fws, iws, th, rd, n0)


@njit(cache=True, parallel=True, nogil=True)
def _parallel(x, w, off, m, b, y, meta, fws, iws):
    """The tiled path on numba's pool: any rank (C-contiguous arrays, as ``launch``
    passes them). ``fws``/``iws``: the caller's workspaces (see ``ws_sizes``), reused
    across calls: fresh scratch pages cost a page fault each, up to a fifth of a call.
    Per chunk of images, round -1: padded rows of the chunk, and (first chunk only) the
    weights' rows, the items dealt out in turn (a padded row and a weight row differ
    several-fold in work: contiguous halves would leave one thread waiting for the
    other) (the channel split reads float32/float64 weights where they lie: no weight
    rows). Then the tiles, in rounds: the position split runs one round (each thread a
    contiguous run of tiles: one image's rows stay in its cache); the channel split two
    per tile: the threads fill shares of its positions (each in its own column buffer,
    then turned into w's (channel, kernel point) order in the shared one), then each
    multiplies the shared columns by its share of the output channels (rows of w, cut at
    multiples of 16 so that BLAS's panels stay whole): every weight is packed once per
    tile, not once per thread, each GEMM gets the whole tile's positions, and the
    weights are not reordered. The reduction split (one group, few output channels per
    thread) runs three: the fill, each thread's GEMM of all output channels over its
    share of w's columns into its own GEMM tile, then each thread's share of y's rows
    summed from those partial sums. (One prange loop, its body one call: numba compiles
    a prange loop into a function of its own; np.int64(th): the gufunc's index is
    unsigned, its typing pass's signed: one signature.)"""
    d = unpack_plan(meta)
    N, P = x.shape[0], y.size // max(1, y.shape[0] * y.shape[1])
    for n0 in range(0, N, d.nb):
        for rd in range(-1, _rounds(d, N, P, n0)):
            for th in prange(d.nth):
                task(x, w, off, m, b, y, meta, fws, iws, np.int64(th), rd, n0)


@njit(cache=True, inline="always")
def on_caller(x, w, off, m, b, y, meta, tiny):
    """A call too small for a pool, on the caller's thread: the direct loops if ``tiny``,
    else the tiled path (as ``launch`` runs them)."""
    if tiny:
        _direct(x, w, off, m, b, y, meta)
    else:
        _serial(x, w, off, m, b, y, meta)


def schedule(st, t):
    """``(first image, round)`` of every pool round of a tiled parallel run (``task``) of
    the state ``st`` at the tiling ``t``, in order."""
    d = t.plan
    N = st.xshape[0]
    P = 1
    for o in st.yshape[2:]:
        P *= o
    ntile = (P + d.T - 1) // d.T
    out = []
    for n0 in range(0, N, d.nb):
        nrounds = _tile_rounds.py_func(d) * min(d.nb, N - n0) * ntile if d.split != 0 else 1
        out += [(n0, rd) for rd in range(-1, nrounds)]
    return out


# --- launch -------------------------------------------------------------------------------

#: how a call runs (``plan``): nothing (an empty output), the direct loops or the tiled
#: path on the caller's thread, the tiled rounds on a pool
EMPTY, DIRECT, SERIAL, TILED = range(4)


class LaunchPlan(NamedTuple):
    """How a call of a ``State`` runs on a pool of ``nth`` threads (``plan``): its
    ``mode``, the packed vector the kernels read (``meta``; None when EMPTY) and, when
    TILED, the ``Tiling`` (its thread count, workspace sizes; ``schedule`` gives its
    rounds for a pool other than numba's)."""
    mode: int
    meta: object
    tiling: object


def _meta(tiling, has_mask, has_b):
    """The packed vector of ``tiling`` for a call with or without mask and bias."""
    return tiling.metas[2 * bool(has_mask) + bool(has_b)]


def plan(st, x, w, has_mask, has_b, nth):
    """The ``LaunchPlan`` of a call of state ``st`` (inputs ``x``, ``w``; with or without
    mask and bias) on ``nth`` threads: what ``launch`` runs, and numba_ops.onnx's
    session on onnxruntime's pool (``task``, ``on_caller``)."""
    if st.empty:
        return LaunchPlan(EMPTY, None, None)
    if st.small:
        return LaunchPlan(DIRECT if st.direct else SERIAL, _meta(st.tilings[1], has_mask, has_b), None)
    t = st.tiling(nth, x, w)
    return LaunchPlan(SERIAL if nth == 1 else TILED, _meta(t, has_mask, has_b), t)

def launch(x, w, offset, b, mask, p, origin=None):
    """Compute DeformConv for validated inputs (see numba_ops.deform_conv).

    ``origin`` (internal, numba_ops.dask): a tuple of first output indices per spatial
    axis; the call then computes the region ``origin .. origin + p.out_spatial`` of
    the whole output (``offset``/``mask`` hold that region only, ``x`` the whole image).

    16-bit inputs are computed in float32 on widened copies and the result rounded
    once: the kernels compile for float32 and float64 alone."""
    dt = x.dtype
    if dt.itemsize == 2:  # float16, bfloat16 (of the four dtypes the dispatcher lets through)
        up = lambda a: None if a is None else widened(a)  # noqa: E731
        return narrowed(launch(up(x), up(w), up(offset), up(b), up(mask), p, origin), dt)
    st = state(x, w, p, origin)
    y = np.empty(st.yshape, x.dtype)
    if st.empty:
        return y
    has_mask, has_b = mask is not None, b is not None
    # the kernels take C-contiguous arrays only (one layout to compile; ``_views``); a
    # missing mask is passed as the offsets (never read), a missing bias as an empty array
    c = np.ascontiguousarray
    args = (c(x), c(w), c(offset), c(mask if has_mask else offset), c(b if has_b else st.nob), y)
    if st.small:  # the caller's thread, the one-thread tiling: no pool to ask, no plan to make
        # (each cost a tiny call ~10 %: what ``plan`` would give, taken directly)
        (_direct if st.direct else _serial)(*args, _meta(st.tilings[1], has_mask, has_b))
        return y
    lp = plan(st, x, w, has_mask, has_b, _runtime.num_threads() if _runtime.pool_usable() else 1)
    if lp.mode == SERIAL:  # the caller's thread alone: no pool, so no pool lock (Dask tasks run side by side)
        with ONE_THREAD:
            _serial(*args, lp.meta)
    else:
        with _runtime.POOL_LOCK, ONE_THREAD:
            _parallel(*args, lp.meta, workspace(st.ctype, lp.tiling.nf), workspace(np.int64, lp.tiling.ni))
    return y

"""GridSample's and affine_warp's backward on the CPU: ``@njit(parallel=True)`` over
units of output positions, planned and walked as the forward walks them.

A unit is block ``b`` of the ``B`` blocks of an image's channels
(``channel_blocks``) in tile ``t`` of that image's grad_x (``tiles``; or, when grad_x
is not wanted, part ``t`` of its positions), taken in segments of ``SEG`` positions
(``plan_units`` gives all three). Per segment:

1. positions: the grid's values unnormalised (affine_warp: computed from theta row
   piece by row piece as its forward does, so they are the forward's bit for bit);
2. plan (``_plan``): the forward's vectorised per-axis pass (``grid_sample.fast_axis``:
   every position's ``kind``, and the 32-bit ``base`` and weights of interior ones)
   and, beside it, the weights' derivatives from the same split of the position
   (``_fast_daxis``, branch-free loops that vectorise); a position that is not
   interior takes its padded taps with their derivatives one by one
   (``_sample.grad_taps``, shared with the CUDA kernels), except, under zeros
   padding, one with every tap of an axis outside (it has no gradient to give);
3. channel by channel of the block (a channel image's taps and scatter targets stay in cache,
   ``grad_y`` is read contiguously), every position of the segment:

   - ``d sample / d pos_k``: the sample with axis ``k``'s weights replaced by their
     derivatives; blocks of ``lanes`` interior positions take it from the forward's
     ``_gather.gathered`` (each tap gathered once for every axis' derivative), the
     others from the scalar ``_grad``. Times ``grad_y`` it is summed over the
     channels, in channel order, then times ``d pos / d grid`` (``unnormalize_scale``)
     into the grid's gradient; ``nearest`` has none (0), a non-finite position NaN;
   - ``grad_x[n, c, tap] += grad_y * weight`` over the position's taps (a tap outside
     a zeros-padded input, and a non-finite position, add nothing); a block of interior
     positions that is wholly the unit's in a loop of its own, whose flags are constants,
     an interior position's consecutive taps on the innermost axis written out.

   A block of mostly interior positions and others (``PARTIAL``: a row's clamped
   ends) takes its derivatives from the same gather (the others read at base 0, then
   theirs replaced one by one) and scatters its interior positions as that loop does.

affine_warp's theta gradient is AffineGrid's backward (``affine_grid_backward``: per
row the sums of the positions' gradient and of it times their x base coordinates,
in float64) of the positions' gradients that the units write.

**Deterministic whatever the thread count, split by ownership.** No two units ever
add to one element, and no unit keeps a copy of anything; each zeroes the part of
grad_x it owns before it adds to it (in parallel, and into its own cache):

- channels are independent in grad_x: a block of them is its units' own, so the
  units' count grows with the channels whatever the batch (towards ``TARGET_UNITS``,
  blocks of ``MIN_BLOCK`` channels at least: each block plans its positions again);
  each block writes its share of the grid's gradient (its channels' sum) into a
  partial of its own, summed in block order afterwards (``_sum_buffers``). ``B`` is
  a function of the shape alone;
- where the images and blocks leave threads idle, each channel image's grad_x is
  cut into tiles along its outer spatial axes (the outermost, and the next in 3-D),
  up to ``TILES_PER_THREAD`` a thread on many threads (a 1x1x128^3 volume: 512 tiles
  on 64 threads, 2 on 2). A tile's unit walks the segments whose ``box`` (``_boxes``:
  a pass over the positions, the span of indices their taps can reach on each outer
  axis) meets its tile and adds only the taps inside it; an interior position with
  taps on both sides of a tile edge is taken tap by tap (``kind`` ``TILE``) in each
  tile it reaches, one that reaches none is skipped (``SKIP``). A position's own
  gradient is written by one unit, that of the tile holding its first tap (clamped).
  Each element of grad_x is thus summed over the positions in their order, by the
  one unit that owns it: the same bits for any tiling, so the tiles follow the
  thread count.

Extra memory while a call runs: ``B`` partials of the grid's gradient where
``B > 1`` (``B <= C / MIN_BLOCK``: in all at most ``r / MIN_BLOCK`` times grad_y's
size, and ``B <= TARGET_UNITS``); for affine_warp, the positions' gradient (``r``
values a position); with tiles, four int32 a segment of ``SEG`` positions; per
thread a segment's plan (~60 KiB). The returned gradients own their memory.

The rank and mode reach the kernel as the input's rank and a token (a tuple whose
length numba folds to a constant), so each combination compiles into loops of
constant trip counts. The padding is a run-time code: it changes only the plan of the
positions that are not interior (``grad_taps``, the derivative at the first index) and
whether their taps are masked, not the interior positions' loops, and one compilation
serves all three paddings (a third of the variants to compile; each took 3-4 s).
16-bit inputs are computed in float32 (their gradients rounded once), so the kernels
compile for float32 and float64 only.
"""
import numpy as np
from numba import njit, prange

from .._compat import NO_NRT
from .._dtypes import NAMES, compute
from .._sample import (CUBIC, LINEAR, NEAREST, REFLECTION, TAPS, ZEROS, as_compute, cubic_dweights, grad_taps_cubic,
                       grad_taps_linear, grad_taps_nearest, period, split_coord, unnormalize, unnormalize_scale)
from . import _runtime
from ._copies import narrowed, widened
from ._opaque import INTERNAL, inline, opaque
from ._views import carve, layout
from . import affine_grid_backward
from .affine_grid import base_coords
from .affine_warp import positions
from ._gather import gathered, lanes
from .grid_sample import (AXIS_OUT, GENERIC, PARTIAL, TOKEN, fast_axis, interior_bases, mostly_interior, nearest_index,
                          small_image, split32)

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)

#: where the positions come from, as a token (numba compiles only that source's code):
#: ``SOURCE[False]`` a grid, ``SOURCE[True]`` theta (affine_warp)
SOURCE = {False: (), True: (0,)}
#: positions planned in one pass (the forward's plan arrays: 3 axes x 4 taps x SEG)
SEG = 256
#: units a call is cut into at least where its channels allow (``channel_blocks``)
TARGET_UNITS = 64
#: tiles of grad_x: units per thread at most where images and channel blocks leave
#: threads idle (``per_thread``), indices a tile spans at least on each axis,
#: positions it holds at least on average (``tiles``)
TILES_PER_THREAD = 8
MIN_TILE = 2
MIN_TILE_POSITIONS = 512
#: ``kind`` of an interior position some of whose taps lie outside the unit's tile, and
#: of one that neither reaches the tile nor has its gradient written there
TILE, SKIP = 4, 8
#: channels a unit holds at least: each block plans its positions again (4 images of 64
#: channels of 128x128, one thread: blocks of 16 cost 5% more CPU time than one block,
#: blocks of 4 22%)
MIN_BLOCK = 16


# --- plan: the forward's, with the weights' derivatives ----------------------------------

@inline(**NO_NRT)
def _fast_daxis(pos, m, k, size, mtok, padding, zero, pd):
    """The weights' derivatives ``pd[k, :, j]`` on spatial axis ``k`` of the positions
    ``pos[k, :m]`` that the forward's ``fast_axis`` finds interior (for others the
    values are overwritten by ``_generic_taps``): branch-free loops over the segment,
    as ``fast_axis``'s, so they vectorise. Linear: -1 and +1 (``grad_taps_at``), 0 where
    the position lies exactly on the first element under border or reflection padding
    (PyTorch's clamp); cubic: ``cubic_dweights``."""
    if len(mtok) == LINEAR:
        edge = padding != ZEROS
        for j in range(np.uint64(m)):
            i, t, sc, finite = split32(pos[k, j], zero, size)
            d = zero * sc if edge & (t == zero) & (i == np.int32(0)) else sc
            pd[k, 0, j] = -d
            pd[k, 1, j] = d
    elif len(mtok) == CUBIC:
        one = as_compute(zero, 1)
        for j in range(np.uint64(m)):
            i, t, sc, finite = split32(pos[k, j], zero, size)
            d0, d1, d2, d3 = cubic_dweights(t, one)
            pd[k, 0, j] = d0 * sc
            pd[k, 1, j] = d1 * sc
            pd[k, 2, j] = d2 * sc
            pd[k, 3, j] = d3 * sc


@inline(**NO_NRT)
def _grad_taps(mtok, i, frac, finite, size, per, padding, align, zero):
    """``_sample.grad_taps_at`` of the mode of token ``mtok``: only that mode's taps compile."""
    if len(mtok) == NEAREST:
        return grad_taps_nearest(i, frac, finite, size, per, padding, align, zero)
    if len(mtok) == LINEAR:
        return grad_taps_linear(i, frac, finite, size, per, padding, align, zero)
    return grad_taps_cubic(i, frac, finite, size, per, padding, align, zero)


@inline(**NO_NRT)
def _generic_taps(r, sh, pos, j, mtok, padding, align, zero, pidx, pw, pd, pok):
    """Position ``j``'s padded taps on every axis with their derivatives
    (``_sample.grad_taps``' split and taps, one axis at a time); returns whether it
    is finite."""
    nd = r + 2
    finite = True
    stride = 1
    for q in range(r):
        k = r - 1 - q
        size = sh[nd - 1 - q]
        per = period(size, padding, align)
        i, frac, f = split_coord(pos[k, j], per, zero)
        (i0, i1, i2, i3, w0, w1, w2, w3, d0, d1, d2, d3, ok0, ok1, ok2,
         ok3) = _grad_taps(mtok, i, frac, f, size, per, padding, align, zero)
        finite &= f
        pidx[k, 0, j], pidx[k, 1, j], pidx[k, 2, j], pidx[k, 3, j] = i0 * stride, i1 * stride, i2 * stride, i3 * stride
        pw[k, 0, j], pw[k, 1, j], pw[k, 2, j], pw[k, 3, j] = w0, w1, w2, w3
        pd[k, 0, j], pd[k, 1, j], pd[k, 2, j], pd[k, 3, j] = d0, d1, d2, d3
        pok[k, 0, j], pok[k, 1, j], pok[k, 2, j], pok[k, 3, j] = ok0, ok1, ok2, ok3
        stride *= size
    return finite


@njit(**INTERNAL, **NO_NRT)
def _plan(x, pos, m, mtok, padding, align, zero, deriv, base, pidx, pw, pd, pok, kind, fin):
    """The segment's plan: the forward's vectorised per-axis pass (``fast_axis``:
    ``kind``, ``base`` and weights of interior positions, 32-bit) and the derivatives'
    (``_fast_daxis``), then the padded taps of the others one by one (``grad_taps``);
    ``fin[j]``: whether position ``j`` is finite (an interior one is)."""
    r = x.ndim - 2
    sh = x.shape
    nd = x.ndim
    if small_image(x):
        fast_axis(pos, m, r - 1, sh[nd - 1], 1, mtok, zero, base, pw, kind, True)
        if deriv:
            _fast_daxis(pos, m, r - 1, sh[nd - 1], mtok, padding, zero, pd)
        if r >= 2:
            fast_axis(pos, m, r - 2, sh[nd - 2], sh[nd - 1], mtok, zero, base, pw, kind, False)
            if deriv:
                _fast_daxis(pos, m, r - 2, sh[nd - 2], mtok, padding, zero, pd)
        if r >= 3:
            fast_axis(pos, m, r - 3, sh[nd - 3], sh[nd - 2] * sh[nd - 1], mtok, zero, base, pw, kind, False)
            if deriv:
                _fast_daxis(pos, m, r - 3, sh[nd - 3], mtok, padding, zero, pd)
        interior_bases(m, kind, base)
    else:
        for j in range(np.uint64(m)):
            kind[j] = GENERIC
    for j in range(np.uint64(m)):
        fin[j] = True
    for j in range(m):
        if kind[j] == 0:
            continue
        if padding == ZEROS and (kind[j] & AXIS_OUT):
            # every tap of an axis outside: no taps to take (``_units`` skips it), NaN
            # where another axis is not finite
            f = True
            for k in range(r):
                f &= (pos[k, j] - pos[k, j]) == zero
            fin[j] = f
        else:
            fin[j] = _generic_taps(r, sh, pos, j, mtok, padding, align, zero, pidx, pw, pd, pok)


#: ``_plan`` through its own compiled code (``_opaque``: once a segment), so that ``_units``
#: does not optimise its code again
_plan_op = opaque(_plan)


# --- one position's gradients in one channel ---------------------------------------------

@inline(**NO_NRT)
def _off(k, t, j, interior, stride, pidx):
    """Tap ``t``'s flat offset on axis ``k`` (the forward's ``_off``)."""
    return t * stride if interior else pidx[k, t, j]


@inline(**NO_NRT)
def _mine(k, t, j, interior, stride, ti, pidx, own):
    """Whether tap ``t`` of position ``j`` on outer axis ``k`` lies in the unit's tile
    (``own[k]``: its first and last offsets on that axis, times ``stride``)."""
    off = (ti[k, j] + t) * stride if interior else pidx[k, t, j]
    return (own[k, 0] <= off) & (off < own[k, 1])


@inline(**NO_NRT)
def _scatter_row(gx, b, g, T, masked, interior, k, j, pidx, pw, pok, ok0):
    """``gx[tap] += g * weight`` over position ``j``'s ``T`` taps on the innermost axis
    ``k`` from ``b`` (those inside, under zeros padding: ``pok``, and ``ok0``, the outer
    axes'). An interior position's taps are consecutive: written out for the mode's
    count of them (``T`` a constant where this inlines), as LLVM left the loop over
    them rolled."""
    if interior and not masked:
        q = np.uint64(b)  # (taps are in range: no wraparound)
        gx[q] += g * pw[k, 0, j]
        if T >= 2:
            gx[q + np.uint64(1)] += g * pw[k, 1, j]
        if T >= 4:
            gx[q + np.uint64(2)] += g * pw[k, 2, j]
            gx[q + np.uint64(3)] += g * pw[k, 3, j]
        return
    for tx in range(T):
        if (ok0 & pok[k, tx, j]) if masked else True:
            gx[np.uint64(b + _off(k, tx, j, interior, 1, pidx))] += g * pw[k, tx, j]


@inline(**NO_NRT)
def _g1(xf, gx, xb, j, g, T, masked, interior, scatter, deriv, pidx, pw, pd, pok, zero):
    a = zero
    if deriv:
        for tx in range(T):
            v = xf[np.uint64(xb + _off(0, tx, j, interior, 1, pidx))]  # (taps are in range: no wraparound)
            v = v if (pok[0, tx, j] if masked else True) else zero
            a += pd[0, tx, j] * v
    if scatter:
        _scatter_row(gx, xb, g, T, masked, interior, 0, j, pidx, pw, pok, True)
    return a, zero, zero


@inline(**NO_NRT)
def _g2(xf, gx, xb, j, g, T, masked, interior, scatter, deriv, s1, pidx, pw, pd, pok, zero, tiled, ti, own):
    a0 = zero
    a1 = zero
    for ty in range(T):
        by = xb + _off(0, ty, j, interior, s1, pidx)
        wy = pw[0, ty, j]
        oky = pok[0, ty, j] if masked else True
        sy = scatter and (_mine(0, ty, j, interior, s1, ti, pidx, own) if tiled else True)
        gy = g * wy
        sv = zero
        sd = zero
        if deriv:
            for tx in range(T):
                v = xf[np.uint64(by + _off(1, tx, j, interior, 1, pidx))]  # (taps are in range: no wraparound)
                v = v if ((oky & pok[1, tx, j]) if masked else True) else zero
                sv += pw[1, tx, j] * v
                sd += pd[1, tx, j] * v
        if sy:
            _scatter_row(gx, by, gy, T, masked, interior, 1, j, pidx, pw, pok, oky)
        if deriv:
            a0 += pd[0, ty, j] * sv
            a1 += wy * sd
    return a0, a1, zero


@inline(**NO_NRT)
def _g3(xf, gx, xb, j, g, T, masked, interior, scatter, deriv, s1, s2, pidx, pw, pd, pok, zero, tiled, ti, own):
    a0 = zero
    a1 = zero
    a2 = zero
    for tz in range(T):
        bz = xb + _off(0, tz, j, interior, s2, pidx)
        wz = pw[0, tz, j]
        okz = pok[0, tz, j] if masked else True
        sz = scatter and (_mine(0, tz, j, interior, s2, ti, pidx, own) if tiled else True)
        gz = g * wz
        szv = zero
        szy = zero
        szx = zero
        for ty in range(T):
            by = bz + _off(1, ty, j, interior, s1, pidx)
            wy = pw[1, ty, j]
            oky = (okz & pok[1, ty, j]) if masked else True
            sy = sz and (_mine(1, ty, j, interior, s1, ti, pidx, own) if tiled else True)
            gzy = gz * wy
            sv = zero
            sd = zero
            if deriv:
                for tx in range(T):
                    v = xf[np.uint64(by + _off(2, tx, j, interior, 1, pidx))]  # (taps are in range: no wraparound)
                    v = v if ((oky & pok[2, tx, j]) if masked else True) else zero
                    sv += pw[2, tx, j] * v
                    sd += pd[2, tx, j] * v
            if sy:
                _scatter_row(gx, by, gzy, T, masked, interior, 2, j, pidx, pw, pok, oky)
            if deriv:
                szv += wy * sv
                szy += pd[1, ty, j] * sv
                szx += wy * sd
        if deriv:
            a0 += pd[0, tz, j] * szv
            a1 += wz * szy
            a2 += wz * szx
    return a0, a1, a2


@inline(**NO_NRT)
def _grad(x, xf, gx, xb, j, g, T, masked, interior, scatter, deriv, s1, s2, pidx, pw, pd, pok, zero, tiled, ti,
          own):
    """Position ``j``'s gradients in one channel (the channel image of ``xf`` and of
    ``gx`` at ``xb``), with ``g`` its ``grad_y``: ``gx[tap] += g * weight`` over its taps
    (``scatter``), and returned, per spatial axis ``k``, ``d sample / d pos_k`` (the sum
    over the taps of the other axes' weights times ``d weight_k`` times ``x[tap]``;
    ``deriv``); the taps as the forward's ``_sample`` takes them (``interior``: from
    ``xb``; ``masked``: taps outside read and scatter nothing; ``tiled``: only the
    taps in the unit's tile ``own`` are scattered, ``ti`` the interior taps' first
    indices)."""
    if x.ndim == 3:
        return _g1(xf, gx, xb, j, g, T, masked, interior, scatter, deriv, pidx, pw, pd, pok, zero)
    if x.ndim == 4:
        return _g2(xf, gx, xb, j, g, T, masked, interior, scatter, deriv, s1, pidx, pw, pd, pok, zero, tiled, ti,
                   own)
    return _g3(xf, gx, xb, j, g, T, masked, interior, scatter, deriv, s1, s2, pidx, pw, pd, pok, zero, tiled, ti,
               own)


@inline(**NO_NRT)
def _position(x, xf, gx, xb, j, g, T, masked, want_x, deriv, tiled, s1, s2, r, pidx, pw, pd, pok, zero, ti, own, kind,
              fin, home, base, dv):
    """Position ``j``'s gradients in one channel where its block is not wholly interior
    and the unit's: by its ``kind``, its scatter and its derivatives (``_grad``), the
    latter into ``dv``. (A function of its own, inlined by LLVM, called from the block
    loop and the remainder's: written out in the block loop the backward took 1.3x
    the time, one call site for both 1.13x, at 2 channels of 160x160.)"""
    kd = kind[j]
    if kd == SKIP:
        return
    if kd == 0 or kd == TILE:
        a0, a1, a2 = _grad(x, xf, gx, xb + base[j], j, g, T, False, True, want_x, deriv and (kd == 0 or home[j]),
                           s1, s2, pidx, pw, pd, pok, zero, kd == TILE, ti, own)
    elif masked and (kd & AXIS_OUT):  # every tap of an axis outside: nothing
        a0, a1, a2 = zero, zero, zero  # (NaN later where not finite)
    else:
        a0, a1, a2 = _grad(x, xf, gx, xb, j, g, T, masked, False, want_x and fin[j], deriv and home[j], s1, s2, pidx,
                           pw, pd, pok, zero, tiled, ti, own)
    if deriv:
        dv[j] = a0
        if r >= 2:
            dv[SEG + j] = a1
        if r >= 3:
            dv[2 * SEG + j] = a2


# --- positions, and the tiles of grad_x that their taps reach ------------------------------

@inline(**NO_NRT)
def _positions(x, src, n, s0, m, osz, align, atok, one, xs, ys, zs, pos):
    """Positions ``s0 .. s0 + m`` of image ``n`` unnormalised into ``pos[k, :m]`` (axis
    ``k`` of x's spatial axes, outermost first): from the flat grid ``src``, or, where
    ``atok`` is ``SOURCE[True]``, from the flat theta (affine_warp: its forward's
    ``positions`` over the base coordinates ``xs, ys, zs``, ``_bases``: the same bits)."""
    r = x.ndim - 2
    D, H, W = osz[0], osz[1], osz[2]
    P = D * H * W
    if len(atok):
        positions(x, src, n, s0, m, H, W, align, one, xs, ys, zs, pos)
    else:
        g0 = np.uint64((n * P + s0) * r)
        for j in range(np.uint64(m)):
            for kk in range(r):
                pos[kk, j] = unnormalize(src[g0 + j * np.uint64(r) + np.uint64(r - 1 - kk)], x.shape[2 + kk], align,
                                         one)


@inline
def _bases(atok, osz, align, one, empty):
    """The output's base coordinates on its x, y and z axes (``base_coords``) where the
    positions come from theta (``atok``), else ``empty`` three times."""
    if len(atok):
        return base_coords(osz[2], align, one), base_coords(osz[1], align, one), base_coords(osz[0], align, one)
    return empty, empty, empty


@inline
def _first_tap(p, size, mode, zero):
    """The first tap's index of an interior position ``p`` on its axis, as the forward's
    ``fast_axis`` finds it (``split32``; nearest rounds half to even); ``mode`` a
    code (a constant where the caller has one, so LLVM drops the other modes)."""
    i, t, sc, finite = split32(p, zero, size)
    if mode == NEAREST:
        return nearest_index(i, t, zero)
    if mode == CUBIC:
        return np.int32(i - np.int32(1))
    return i


@njit(**INTERNAL)
def _boxes(x, src, osz, mode, padding, align, atok, zero, box, u0, u1):
    """Segments ``u0:u1`` of all images' positions (segment ``u``: positions
    ``(u % nseg) * SEG`` on of image ``u // nseg``): on each outer axis ``k`` of x the
    first and last index any of its positions' taps can take, clamped (a position's
    first tap clamped is where its own gradient is written), into ``box[u, k]``;
    under reflection padding an axis any position leaves spans the whole axis (the
    reflected taps land anywhere). ``mode`` and ``padding`` are runtime codes: one
    compilation per rank and compute type."""
    r = x.ndim - 2
    D, H, W = osz[0], osz[1], osz[2]
    P = D * H * W
    nseg = (P + SEG - 1) // SEG
    T = TAPS[mode]
    one = as_compute(zero, 1)
    pos = np.zeros((3, SEG), type(zero))
    xs, ys, zs = _bases(atok, osz, align, one, pos[0, :0])
    for u in range(u0, u1):
        n = u // nseg
        s0 = (u - n * nseg) * SEG
        m = min(SEG, P - s0)
        _positions(x, src, n, s0, m, osz, align, atok, one, xs, ys, zs, pos)
        for k in range(r - 1):
            size = x.shape[2 + k]
            lo = np.int32(size)
            hi = np.int32(-1)
            for j in range(np.uint64(m)):
                a = _first_tap(pos[k, j], size, mode, zero)
                lo = min(lo, a)
                hi = max(hi, np.int32(a + np.int32(T - 1)))
            if padding == REFLECTION and ((lo < 0) | (hi >= size)):
                lo, hi = np.int32(0), np.int32(size - 1)
            box[u, k, 0] = min(max(lo, np.int32(0)), np.int32(size - 1))
            box[u, k, 1] = min(max(hi, np.int32(0)), np.int32(size - 1))


_boxes_op = opaque(_boxes)


@njit(cache=True, parallel=True, nogil=True)
def _boxes_parallel(x, src, osz, mode, padding, align, atok, zero, box, nchunks):
    units = box.shape[0]
    nchunks = min(units, nchunks)
    for c in prange(nchunks):
        _boxes_op(x, src, osz, mode, padding, align, atok, zero, box, c * units // nchunks,
                  (c + 1) * units // nchunks)


# --- units: (image, tile of grad_x, block of channels), segment by segment -----------------

@inline(**NO_NRT)
def _zero_own(gx, b0, nc, S, tiled, r, own, s2, zero):
    """Zero the elements of grad_x that a unit owns, before it adds to them: ``nc``
    channel images of ``S`` elements from ``gx[b0]`` on, where ``tiled`` only the
    tile's (offsets ``own[0]`` on the outer axis, and in 3-D ``own[1]`` within each of
    its planes of ``s2`` elements)."""
    for c in range(nc):
        b = np.uint64(b0 + c * S)  # (unsigned: no wraparound, the stores vectorise)
        if not tiled:
            for e in range(b, b + np.uint64(S)):
                gx[e] = zero
        elif r == 3:
            for z in range(own[0, 0], own[0, 1], s2):
                for e in range(b + np.uint64(z + own[1, 0]), b + np.uint64(z + own[1, 1])):
                    gx[e] = zero
        else:
            for e in range(b + np.uint64(own[0, 0]), b + np.uint64(own[0, 1])):
                gx[e] = zero


#: byte offsets of a unit's buffers in its one allocation (``_units``: pos, base, pidx, pw,
#: pd, pok, kind, fin, home, gyv, ti, own, dv, res, bkind, ga, scl; sized for float64),
#: and its bytes
_UNIT_AT, _UNIT_BYTES = layout((3 * SEG, 8), (SEG, 4), (12 * SEG, 8), (12 * SEG, 8), (12 * SEG, 8), (12 * SEG, 1),
                               (SEG, 1), (SEG, 1), (SEG, 1), (SEG, 8), (3 * SEG, 8), (6, 8), (3 * SEG, 8), (16, 8),
                               (SEG // 8 + 1, 1), (3 * SEG, 8), (3, 8))


@njit(**INTERNAL)
def _units(x, xf, gyf, src, gx, gpos, B, K, bounds, box, osz, mtok, padding, align, atok, want_x, want_pos, zero,
           u0, u1):
    """Units ``u0:u1`` (image-major; unit ``(n, t, b)``: tile ``t`` of the ``K`` tiles of
    image ``n``'s grad_x, block ``b`` of its ``B`` blocks of channels). ``x`` (N, C,
    D1..Dr) in the compute type, ``xf`` its flat view; ``osz`` the output's spatial
    sizes as (D, H, W) (D = 1, H = 1 below 3-D); ``src`` the flat grid (N*P*r), or
    theta (N*r*(r+1)) when ``atok`` is ``SOURCE[True]``. Tiles (``tiled``: grad_x wanted, ``K > 1``):
    the unit walks the segments of its image whose ``box`` (``_boxes``) meets its
    tile (``bounds[t]``: the first and last index + 1 on each outer axis) and
    scatters only the taps in the tile (the others are another unit's); a position's
    gradient is written by the tile of its first tap, clamped. Otherwise ``t`` is part
    ``t`` of the ``K`` parts of the image's positions. Writes grad_x into ``gx``
    (block ``b`` into its channels, tile ``t`` into its elements) and block ``b``'s
    share of the grid gradient into ``gpos`` (B*N*P*r: block ``b``'s at ``b*N*P*r``)."""
    r = x.ndim - 2
    N, C = x.shape[0], x.shape[1]
    S = 1
    for q in range(r):
        S *= x.shape[2 + q]
    D, H, W = osz[0], osz[1], osz[2]
    P = D * H * W
    nd = x.ndim
    s1 = x.shape[nd - 1]
    s2 = s1 * x.shape[nd - 2] if r >= 2 else s1
    mode = len(mtok)
    T = 1 if mode == NEAREST else (2 if mode == LINEAR else 4)
    masked = padding == ZEROS
    deriv = want_pos and mode != NEAREST
    tiled = want_x and K > 1
    nseg = (P + SEG - 1) // SEG
    one = as_compute(zero, 1)
    nan = as_compute(zero, np.nan)
    # zeroed (the forward's ``scratch``: masked stores to untouched pages are slow), in one
    # allocation (``_views.carve``: ``np.zeros`` compiles once per dtype and rank)
    buf = np.zeros(_UNIT_BYTES, np.uint8)
    at = _UNIT_AT
    pos = carve(buf, at[0], zero, (3, SEG))
    base = carve(buf, at[1], np.int32(0), (SEG,))
    pidx = carve(buf, at[2], np.int64(0), (3, 4, SEG))
    pw = carve(buf, at[3], zero, (3, 4, SEG))
    pd = carve(buf, at[4], zero, (3, 4, SEG))
    pok = carve(buf, at[5], False, (3, 4, SEG))
    kind = carve(buf, at[6], np.uint8(0), (SEG,))
    fin = carve(buf, at[7], False, (SEG,))
    home = carve(buf, at[8], False, (SEG,))  # whether the unit writes the position's gradient
    for j in range(SEG):
        home[j] = True
    gyv = carve(buf, at[9], zero, (SEG,))  # one channel's grad_y at the segment's positions
    ti = carve(buf, at[10], np.int64(0), (3, SEG))  # tiled: interior positions' first taps, outer axes
    own = carve(buf, at[11], np.int64(0), (3, 2))  # tiled: the tile's offsets on the outer axes
    dv = carve(buf, at[12], zero, (3 * SEG,))  # one channel's d sample / d pos, per axis and position
    res = carve(buf, at[13], zero, (16,))
    wd = (pw, pd)  # (a tuple of arrays built in the loop would count references there)
    V = lanes(pw)
    bkind = carve(buf, at[14], np.uint8(0), (SEG // 8 + 1,))
    ga = carve(buf, at[15], zero, (3, SEG))  # d loss / d pos, per axis and position, summed over channels
    scl = carve(buf, at[16], zero, (3,))
    for q in range(r):
        scl[q] = unnormalize_scale(x.shape[2 + q], align, one)
    xs, ys, zs = _bases(atok, osz, align, one, scl[:0])
    for u in range(u0, u1):
        n = u // (K * B)
        t = (u - n * K * B) // B
        cb = u - (n * K + t) * B
        c0 = cb * C // B
        c1 = (cb + 1) * C // B
        if tiled:
            e0, e1 = 0, P
            for k in range(r - 1):
                stride = s2 if (k == 0 and r == 3) else s1
                own[k, 0] = bounds[t, k, 0] * stride
                own[k, 1] = bounds[t, k, 1] * stride
        else:
            e0, e1 = t * P // K, (t + 1) * P // K
        if want_x:
            _zero_own(gx, (n * C + c0) * S, c1 - c0, S, tiled, r, own, s2, zero)
        for s0 in range(e0, e1, SEG):
            m = min(SEG, e1 - s0)
            if tiled:  # only the segments whose taps can reach the tile
                meets = True
                for k in range(r - 1):
                    meets &= (box[n * nseg + s0 // SEG, k, 0] < bounds[t, k, 1]) & \
                        (box[n * nseg + s0 // SEG, k, 1] >= bounds[t, k, 0])
                if not meets:
                    continue
            _positions(x, src, n, s0, m, osz, align, atok, one, xs, ys, zs, pos)
            _plan_op(x, pos, m, mtok, padding, align, zero, deriv, base, pidx, pw, pd, pok, kind, fin)
            if tiled:  # the unit's share of each position: all, some (tap by tap) or none of its taps
                for k in range(r - 1):
                    for j in range(np.uint64(m)):
                        ti[k, j] = _first_tap(pos[k, j], x.shape[2 + k], mode, zero)
                for j in range(m):
                    inside = True
                    meets = True
                    hm = True
                    for k in range(r - 1):
                        a = ti[k, j]
                        lo, hi = bounds[t, k, 0], bounds[t, k, 1]
                        c = min(max(a, 0), x.shape[2 + k] - 1)
                        hm &= (lo <= c) & (c < hi)
                        inside &= (lo <= a) & (a + T <= hi)
                        meets &= (a < hi) & (a + T > lo)
                    home[j] = hm
                    if kind[j] == 0 and not inside:
                        kind[j] = TILE if meets or hm else SKIP
            if deriv:
                for kk in range(r):
                    for j in range(np.uint64(m)):
                        ga[kk, j] = zero
            # blocks of ``V`` interior positions: their derivatives gathered (the forward's
            # ``gathered``, with every axis' derivative weights at once)
            nblk = m // V
            for q in range(nblk):
                b0 = kind[q * V]
                for l in range(1, V):
                    b0 |= kind[q * V + l]
                bkind[q] = PARTIAL if b0 != 0 and mostly_interior(kind, q * V, V) else b0
            for c in range(c0, c1):  # channel-major: a channel image's taps stay in cache
                xb = (n * C + c) * S
                o = np.uint64((n * C + c) * P + s0)  # (unsigned: no wraparound, the copy vectorises)
                for j in range(np.uint64(m)):  # the segment's grad_y, copied: the position loop
                    gyv[j] = gyf[o + j]  # reads it 12-15 % faster from a small array of its own
                for q in range(nblk):
                    if bkind[q] == 0:  # V interior positions, wholly the unit's
                        if deriv:  # every axis' derivative from one gather of each tap
                            gathered(x, xf, res, dv, q * V, xb, base, pidx, wd, pok, q * V, mtok, s1, s2, True, False)
                        if want_x:  # the scatter, its flags constants: a tight loop (with the others'
                            for j in range(q * V, q * V + V):  # in it, 1.35x the time at 2 channels)
                                _grad(x, xf, gx, xb + base[j], j, gyv[j], T, False, True, True, False, s1, s2, pidx,
                                      pw, pd, pok, zero, False, ti, own)
                    elif bkind[q] == PARTIAL:  # the interior positions as above, the others one by one
                        if deriv:  # (the others gathered at base 0, their derivatives replaced)
                            gathered(x, xf, res, dv, q * V, xb, base, pidx, wd, pok, q * V, mtok, s1, s2, True, False)
                        for j in range(q * V, q * V + V):
                            if kind[j] != 0:
                                _position(x, xf, gx, xb, j, gyv[j], T, masked, want_x, deriv, tiled, s1, s2, r, pidx,
                                          pw, pd, pok, zero, ti, own, kind, fin, home, base, dv)
                            elif want_x:
                                _grad(x, xf, gx, xb + base[j], j, gyv[j], T, False, True, True, False, s1, s2, pidx,
                                      pw, pd, pok, zero, False, ti, own)
                    else:
                        for j in range(q * V, q * V + V):
                            _position(x, xf, gx, xb, j, gyv[j], T, masked, want_x, deriv, tiled, s1, s2, r, pidx, pw,
                                      pd, pok, zero, ti, own, kind, fin, home, base, dv)
                for j in range(nblk * V, m):
                    _position(x, xf, gx, xb, j, gyv[j], T, masked, want_x, deriv, tiled, s1, s2, r, pidx, pw, pd, pok,
                              zero, ti, own, kind, fin, home, base, dv)
                if deriv:
                    for kk in range(r):
                        for j in range(np.uint64(m)):
                            ga[kk, j] += gyv[j] * dv[np.uint64(kk * SEG) + j]
            if not want_pos:
                continue
            for kk in range(r):
                for j in range(np.uint64(m)):  # d loss / d grid
                    gc = ga[kk, j] * scl[kk] if deriv else zero
                    ga[kk, j] = gc if fin[j] else nan
            for j in range(m):  # the positions this unit writes
                if home[j]:
                    for kk in range(r):
                        gpos[((cb * N + n) * P + s0 + j) * r + r - 1 - kk] = ga[kk, j]


_units_op = opaque(_units)


@njit(cache=True, nogil=True)
def _serial(x, xf, gyf, src, gx, gpos, B, K, bounds, box, osz, mtok, padding, align, atok, want_x, want_pos, zero):
    _units_op(x, xf, gyf, src, gx, gpos, B, K, bounds, box, osz, mtok, padding, align, atok, want_x, want_pos, zero,
              0, x.shape[0] * K * B)


@njit(cache=True, parallel=True, nogil=True)
def _parallel(x, xf, gyf, src, gx, gpos, B, K, bounds, box, osz, mtok, padding, align, atok, want_x, want_pos, zero,
              nchunks):
    units = x.shape[0] * K * B
    nchunks = min(units, nchunks)
    for c in prange(nchunks):
        _units_op(x, xf, gyf, src, gx, gpos, B, K, bounds, box, osz, mtok, padding, align, atok, want_x, want_pos,
                  zero, c * units // nchunks, (c + 1) * units // nchunks)


@njit(cache=True, parallel=True, nogil=True)
def _sum_buffers(gxb, U, M, out):
    """``out = sum of the U buffers gxb[k*M:(k+1)*M]`` (``out``: M elements), added in the
    order k = 0, 1, ... (the channel blocks' shares of the grid's gradient)."""
    chunk = 1 << 14
    for c in prange((M + chunk - 1) // chunk):
        for i in range(c * chunk, min(M, (c + 1) * chunk)):
            s = gxb[i]
            for k in range(1, U):
                s += gxb[k * M + i]
            out[i] = s


_sum_buffers_serial = _runtime.serial_twin(_sum_buffers)


def channel_blocks(N, C):
    """Blocks of channels per image: a unit owns its channels' grad_x outright (no
    copies), so the units' count grows with the channels, towards ``TARGET_UNITS``
    over the ``N`` images, none with fewer than ``MIN_BLOCK`` channels. A function of
    the shape alone: the blocks' shares of the grid gradient are summed in block order."""
    return max(1, min(-(-TARGET_UNITS // max(N, 1)), C // MIN_BLOCK))


def _per_image(N, B, P, nth):
    """Units per image and channel block (tiles, or parts of the positions) for ``nth``
    threads: one where the ``N * B`` images and blocks keep the threads busy, else
    enough for ``per_thread(nth)`` units a thread, holding at least
    ``MIN_TILE_POSITIONS`` positions on average."""
    if nth <= 1 or N * B >= nth:
        return 1
    return max(1, min(-(-per_thread(nth) * nth // (N * B)), P // MIN_TILE_POSITIONS))


def tiles(N, B, spatial, P, nth):
    """``(K1, K2)``: the tiles of each channel image's grad_x along its outer spatial
    axes (the outermost, then the next in 3-D; none in 1-D), for ``nth`` threads:
    ``_per_image``'s count, none narrower than ``MIN_TILE`` indices. The gradients do
    not depend on it: each element is summed over the positions in their order
    whatever tile owns it."""
    want = _per_image(N, B, P, nth) if len(spatial) >= 2 else 1
    if want == 1:
        return 1, 1
    K1 = max(1, min(want, spatial[0] // MIN_TILE))
    K2 = max(1, min(-(-want // K1), spatial[1] // MIN_TILE)) if len(spatial) == 3 else 1
    return K1, K2


def per_thread(nth):
    """Tiles (or parts) a thread takes: one on a few threads, where a tile's cost (each
    segment of positions planned by every tile it reaches: 16 tiles of a 128^3 volume
    on one thread cost 1.7x one) outweighs the balance; up to ``TILES_PER_THREAD`` on
    many (``nth // 8``), where idle threads cost more."""
    return max(1, min(TILES_PER_THREAD, nth // 8))


def plan_units(N, C, P, spatial, nth, want_x=True):
    """``(B, K1, K2)`` of a call on ``nth`` threads: the channel blocks
    (``channel_blocks``) and, where grad_x is wanted, the tiles (``tiles``); where
    it is not, ``K1`` parts of the positions (no position's gradient is summed
    across units, so any cut will do). Its units, ``N * B * K1 * K2``, are what a
    pool shares out."""
    B = channel_blocks(N, C)
    if want_x:
        return (B,) + tiles(N, B, spatial, P, nth)
    return B, _per_image(N, B, P, nth), 1


def _tiles(x, src, osz, mode, padding, align, atok, zero, K1, K2):
    """``(bounds, box)``: each tile's first and last index + 1 on the outer axes, and
    each segment's box (``_boxes``)."""
    N, r = int(x.shape[0]), x.ndim - 2
    first = [np.arange(K + 1, dtype=np.int64) * size // K
             for size, K in ((int(x.shape[2]), K1), (int(x.shape[3]) if r == 3 else 1, K2))]
    bounds = np.zeros((K1 * K2, 2, 2), np.int64)
    for t1 in range(K1):
        for t2 in range(K2):
            bounds[t1 * K2 + t2] = ((first[0][t1], first[0][t1 + 1]), (first[1][t2], first[1][t2 + 1]))
    P = int(np.prod(osz))
    box = np.zeros((N * ((P + SEG - 1) // SEG), 2, 2), np.int32)
    with _runtime.POOL_LOCK:  # (tiles are cut for several threads only: no serial twin to compile)
        _boxes_parallel(x, src, osz, np.int64(mode), np.int64(padding), align, atok, zero, box,
                        _runtime.ITEMS_PER_THREAD * _runtime.num_threads())
    return bounds, box


def run(x, gy, src, out_spatial, mode, padding, align, affine, want_x, want_pos):
    """The shared launch: ``(gx, gpos)`` in the compute type, ``gpos`` the grid's
    gradient (N, O1..Or, r), for affine_warp the grid gradient of its positions
    (theta's is AffineGrid's backward of it); either None when not wanted."""
    ct = compute(src.dtype)
    N, C = int(x.shape[0]), int(x.shape[1])
    r = x.ndim - 2
    S = int(np.prod(x.shape[2:], dtype=np.int64))
    P = int(np.prod(out_spatial, dtype=np.int64))
    work = N * P * max(C, 1) * 4 ** r
    nth = _runtime.threads_for(work)
    B, K1, K2 = plan_units(N, C, P, tuple(int(s) for s in x.shape[2:]), nth, want_x)
    K = K1 * K2
    launched = N * P > 0 and (want_x or want_pos)
    # grad_x: each unit zeroes what it owns before it adds to it (np.zeros of a reused
    # block is one thread's memset: 5-15 % of a call's time)
    gx = (np.empty if launched else np.zeros)(N * C * S if want_x else 0, ct)
    # the grid's gradient, or with several channel blocks their shares of it, each
    # position's written once by its units (the one whose tile holds its first tap,
    # clamped), summed in block order afterwards
    gpos = np.empty(B * N * P * r if want_pos else 0, ct)
    if launched:
        osz = np.array((1,) * (3 - r) + tuple(int(s) for s in out_spatial), np.int64)
        zero = ct.type(0)
        srcc = widened(src).reshape(-1)
        xc = widened(x)
        if want_x and K > 1:
            bounds, box = _tiles(xc, srcc, osz, mode, padding, bool(align), SOURCE[bool(affine)], zero, K1, K2)
        else:
            bounds, box = np.zeros((1, 2, 2), np.int64), np.zeros((1, 2, 2), np.int32)
        _runtime.run(_serial, _parallel, work, xc, xc.reshape(-1), widened(gy).reshape(-1), srcc, gx, gpos,
                     np.int64(B), np.int64(K), bounds, box, osz, TOKEN[mode], np.int64(padding), bool(align),
                     SOURCE[bool(affine)], bool(want_x), bool(want_pos), zero)
        if want_pos and B > 1:
            out = np.empty(N * P * r, ct)
            _runtime.call(_sum_buffers_serial, _sum_buffers, B * N * P * r, gpos, B, N * P * r, out)
            gpos = out
    gx = gx.reshape(x.shape) if want_x else None
    if not want_pos:
        return gx, None
    gpos = gpos.reshape((N,) + tuple(out_spatial) + (r,))
    if affine:
        return gx, affine_grid_backward.launch(gpos, (N, C) + tuple(out_spatial), align)
    return gx, gpos


def launch(gy, x, grid, mode, padding, align, want_x, want_grid, stream=None):
    """grad_y (N, C, O1..Or), x (N, C, D1..Dr), grid (N, O1..Or, r): NumPy, one float
    dtype, validated by the front end. ``(gx, ggrid)`` in that dtype (None where not
    wanted). ``stream`` is ignored on the CPU."""
    gx, gg = run(x, gy, grid, tuple(grid.shape[1:-1]), mode, padding, align, False, want_x, want_grid)
    dt = x.dtype
    return (None if gx is None else narrowed(gx, dt)), (None if gg is None else narrowed(gg, dt))

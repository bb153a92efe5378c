"""GridSample on the CPU: ``@njit(parallel=True)`` over segments of output positions.

Each image's output positions, in order, are cut into segments of at most
``SEG``; a segment is the unit of work (``prange`` goes over chunks of them, so
the parallel split is over (image, positions) whatever the shape). Per segment:

1. positions: the segment's grid values unnormalised, axis by axis, into a
   float buffer (``affine_warp``'s kernel fills the same buffer from theta
   instead: the steps below are shared with it);
2. ``plan``: per axis, branch-free loops over the segment (they vectorise: the
   padding and mode are constants in each compiled loop and the indices unsigned,
   so no access pays for negative-index wraparound) give every position its
   ``kind``: interior (every tap of every axis inside and none padded: its taps
   are consecutive from ``base``, the flat index of the first, with the mode's
   weights), GENERIC (some tap outside or padded), or, under zeros padding, every
   tap of some axis outside (the sample is 0, or NaN at a non-finite position).
   Only a segment with GENERIC positions pays for the padded taps (flat offsets,
   weights, inside-flags from the shared per-axis math of ``kernels/_sample.py``).
   A segment with few GENERIC positions plans their padded taps one by one
   (``SPARSE``). Under reflection padding a segment whose first, middle and last
   positions are interior is sorted the same way (interior or GENERIC: no position
   is 0 and no tap masked), under border padding one where fewer than half of every
   8th position are not interior (an image flow's rows); others take the padded taps
   for every position. The interior planning is 32-bit (a channel image has fewer
   than 2**31 elements), so that it vectorises on AVX2;
3. ``accumulate``: channel by channel, every position of the segment in turn (a
   channel's taps and its stores stay in L1: channel images of a power-of-two size
   apart map to the same cache sets, which position-major order over 64 channels
   thrashed), the weights nested as onnxruntime nests them (innermost axis first);
   interior positions read their taps from ``base``, GENERIC ones through the
   padded taps and masks, outside ones nothing (a branch-free pass writes their
   0s first). The rank and the taps per axis are constants in each loop, so the
   tap loops unroll. Runs of ``lanes`` positions of one kind (or of any kinds where
   every position has its padded taps) are sampled a block at a time, each tap of
   a channel gathered for all of them (``_gather``; an interior position's
   consecutive taps on the innermost axis as one word), with the same operations
   in the same order: the same bits as one by one. A block of mostly interior
   positions and others (``PARTIAL``: a row's clamped ends) is gathered whole as
   interior, the others read at base 0 and then sampled one by one over their lanes.

Between the plan and the accumulation, ``prefetch_ahead`` asks for a share of the
next image's ``x`` (a grid's taps land anywhere in an image, so the caches, not the
hardware prefetchers, have to hold it when its turn comes).

Compile time: the mode reaches the kernels as a token (``TOKEN``: a tuple whose
length numba folds to a constant and whose other branches it prunes before typing),
so a call compiles its own mode alone. The padding is a run-time code: one
compilation serves all three (it changes only the plan of the positions that are
not interior, whose vectorised loops ``_generic`` unswitches by hand, and whether
their taps are masked). The per-sample helpers are inlined by LLVM
(``forceinline``), not copied into numba's IR at every call site, so each is typed
once; ``plan``, ``_generic`` and ``accumulate`` are called through their own
compiled code (``_opaque``), as the serial and parallel entries call one compiled
``_units``, so no caller optimises their code again. A first call compiles in
7-9 s (2-D float32, serial), each further mode, dtype or rank in ~3-4 s, the
parallel path after the serial one in ~0.5 s.

A zeros-padded tap outside the input is read at a clamped index and replaced by
an exact 0 (never ``0 * x``, which an Inf in ``x`` would turn into NaN). 16-bit
inputs are widened to float32 copies by the launcher (``kernel_view``) and the
result rounded once, so the kernels compile for float32 and float64 alone; uint8
``x`` is computed in the grid's compute type and stored by ``to_uint8``.
"""
import numpy as np
from numba import njit, prange

from .._compat import NO_NRT
from .._dtypes import NAMES, compute
from .._sample import (BORDER, CUBIC, LINEAR, NEAREST, REFLECTION, TAPS, ZEROS, as_compute, cubic_at, cubic_weights,
                       linear_at, load_sample, nearest_at, period, reflect_near, split_coord, split_near,
                       store_sample, unnormalize)
from .._scalar import load
from . import _runtime
from ._copies import narrowed, widened
from ._gather import direct, gather_safe, gathered, lanes, prefetch
from ._opaque import INTERNAL, inline, opaque
from ._views import carve, layout

#: grid dtypes; ``x`` has the same dtype, or uint8
DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)

#: output positions per segment (the plan's length: 3 axes x 4 taps x SEG entries stay in L1)
SEG = 256


# --- plan: per-axis taps of a segment ---------------------------------------------------

#: ``kind`` of a position: 0, interior (every tap of every axis inside the input, the
#: taps consecutive: read at ``base`` without padding or masks); GENERIC bit: some tap
#: outside or padded (read through ``pidx``/``pok``); AXIS_OUT bit (zeros padding):
#: every tap of some axis outside at a finite position (the sample is 0, or NaN when
#: another axis is not finite).
GENERIC, AXIS_OUT = 1, 2


@inline
def split32(p, zero, size):
    """``(i, t, scale, finite)``: ``floor(p)`` as an int32 and the fraction, of ``p``
    clamped to [-4, size + 2] (far and non-finite positions stay clear of integer
    overflow; no tap of an interior position changes), and the weights' scale (1,
    or NaN for a non-finite position). 32-bit, so that the loops vectorise where
    the CPU has no vector conversion to int64 (AVX2): the caller makes sure that
    ``size + 2 < 2**31`` (``small_image``)."""
    finite = (p - p) == zero
    pmin = as_compute(zero, -4)
    pmax = as_compute(zero, size + 2)
    pc = p if p > pmin else pmin
    pc = pc if pc < pmax else pmax
    f = np.floor(pc)
    return np.int32(f), pc - f, as_compute(zero, 1) if finite else as_compute(zero, np.nan), finite


@inline
def _mark(j, i, lo, hi, size, finite, stride, base, kind, first):
    """``base[j]``'s share (the first tap's index ``i - lo`` times ``stride``) and the
    axis' ``kind`` bits for taps ``i - lo .. i + hi`` (zeros padding). In 32 bits
    (each result cut to int32: LLVM then keeps the vector lanes 32-bit): the channel
    image has fewer than 2**31 elements (``small_image``)."""
    first_tap = np.int32(i - lo)
    last_tap = np.int32(i + hi)
    off = np.int32(first_tap * np.int32(stride))
    base[j] = off if first else np.int32(base[j] + off)
    top = np.int32(size - 1)
    bits = (0 if (first_tap >= 0) & (last_tap <= top) else GENERIC) | \
        (AXIS_OUT if ((last_tap < 0) | (first_tap > top)) & finite else 0)
    kind[j] = bits if first else kind[j] | bits


@inline
def nearest_index(i, t, zero):
    """The nearest tap of a position split as ``(i, t)`` (``split32``): half to even."""
    half = as_compute(zero, 0.5)
    up = (t > half) | ((t == half) & ((i & np.int32(1)) == np.int32(1)))
    return np.int32(i + np.int32(1)) if up else i


@inline
def fast_axis(pos, m, k, size, stride, mtok, zero, base, pw, kind, first):
    """Spatial axis ``k`` of the positions ``pos[k, :m]``: the weights ``pw[k, :, j]``
    of the mode's taps from the position's fraction (NaN for a non-finite position),
    ``base[j]``'s share (the first tap's index times ``stride``) and the axis' bits
    of ``kind`` (``first``: the first axis planned). One branch-free loop per mode
    (``j`` unsigned, so no index pays for negative wraparound): they vectorise."""
    one = as_compute(zero, 1)
    if len(mtok) == NEAREST:
        for j in range(np.uint64(m)):
            i, t, sc, finite = split32(pos[k, j], zero, size)
            i = nearest_index(i, t, zero)
            pw[k, 0, j] = sc
            _mark(j, i, 0, 0, size, finite, stride, base, kind, first)
    elif len(mtok) == LINEAR:
        for j in range(np.uint64(m)):
            i, t, sc, finite = split32(pos[k, j], zero, size)
            pw[k, 0, j] = (one - t) * sc
            pw[k, 1, j] = t * sc
            _mark(j, i, 0, 1, size, finite, stride, base, kind, first)
    else:
        for j in range(np.uint64(m)):
            i, t, sc, finite = split32(pos[k, j], zero, size)
            c0, c1, c2, c3 = cubic_weights(t, one)
            pw[k, 0, j] = c0 * sc
            pw[k, 1, j] = c1 * sc
            pw[k, 2, j] = c2 * sc
            pw[k, 3, j] = c3 * sc
            _mark(j, i, 1, 2, size, finite, stride, base, kind, first)


@inline
def _put(k, t, j, i, w, ok, stride, pidx, pw, pok):
    """Tap ``t`` of position ``j`` on axis ``k``: padded index ``i`` (as a flat offset),
    weight ``w``, inside flag ``ok``."""
    pidx[k, t, j] = i * stride
    pw[k, t, j] = w
    pok[k, t, j] = ok


@inline
def _taps_one(pos, j, k, size, per, stride, mtok, padding, align, zero, near, pidx, pw, pok):
    """Position ``j``'s padded taps on spatial axis ``k`` (``_taps_axis``); ``near``:
    split by ``split_near`` (branch-free: the loop vectorises), else ``split_coord``."""
    if near:
        i, t, finite = split_near(pos[k, j], per, zero)
    else:
        i, t, finite = split_coord(pos[k, j], per, zero)
    if len(mtok) == NEAREST:
        i0, w0, ok0 = nearest_at(i, t, finite, size, per, padding, align, zero)
        _put(k, 0, j, i0, w0, ok0, stride, pidx, pw, pok)
    elif len(mtok) == LINEAR:
        i0, i1, w0, w1, ok0, ok1 = linear_at(i, t, finite, size, per, padding, align, zero)
        _put(k, 0, j, i0, w0, ok0, stride, pidx, pw, pok)
        _put(k, 1, j, i1, w1, ok1, stride, pidx, pw, pok)
    else:
        i0, i1, i2, i3, w0, w1, w2, w3, ok0, ok1, ok2, ok3 = cubic_at(i, t, finite, size, per, padding, align, zero)
        _put(k, 0, j, i0, w0, ok0, stride, pidx, pw, pok)
        _put(k, 1, j, i1, w1, ok1, stride, pidx, pw, pok)
        _put(k, 2, j, i2, w2, ok2, stride, pidx, pw, pok)
        _put(k, 3, j, i3, w3, ok3, stride, pidx, pw, pok)


@inline
def _taps_axis(pos, m, k, size, stride, mtok, padding, align, zero, pidx, pw, pok):
    """The padded taps of spatial axis ``k`` for the positions ``pos[k, :m]``:
    ``pidx[k, t, j]`` the flat offset (padded index times ``stride``), ``pw`` the
    weight, ``pok`` whether the tap is inside (False only for zeros padding). The
    padding is a constant in each copy that LLVM inlines (``_generic``), so the loops
    vectorise; under reflection the positions within a period of the input
    (``reflect_near``) go without a division (``split_near``), the others again one by
    one after them."""
    per = period(size, padding, align)
    if padding == REFLECTION:
        far = 0
        for j in range(np.uint64(m)):
            _taps_one(pos, j, k, size, per, stride, mtok, padding, align, zero, True, pidx, pw, pok)
            far += not reflect_near(pos[k, j], per, zero)
        if far:
            for j in range(np.uint64(m)):
                if not reflect_near(pos[k, j], per, zero):
                    _taps_one(pos, j, k, size, per, stride, mtok, padding, align, zero, False, pidx, pw, pok)
        return
    for j in range(np.uint64(m)):
        _taps_one(pos, j, k, size, per, stride, mtok, padding, align, zero, False, pidx, pw, pok)


@njit(**INTERNAL, **NO_NRT)
def _generic(r, sh, pos, m, mtok, padding, align, zero, pidx, pw, pok):
    """Padded taps (``_taps_axis``) of the segment's positions on every axis, the
    run-time ``padding`` unswitched by hand: each branch passes a constant, so that each
    of the three loops LLVM inlines is the padding's own (they vectorise), while numba
    compiles ``_generic_axes`` and the helpers below it once (``inline``: one plain
    signature). Called through its own compiled code (``_opaque``: once a segment), so
    that ``plan`` and the entries above it do not optimise the three copies again."""
    if padding == ZEROS:
        _generic_axes(r, sh, pos, m, mtok, ZEROS, align, zero, pidx, pw, pok)
    elif padding == BORDER:
        _generic_axes(r, sh, pos, m, mtok, BORDER, align, zero, pidx, pw, pok)
    else:
        _generic_axes(r, sh, pos, m, mtok, REFLECTION, align, zero, pidx, pw, pok)


_generic_op = opaque(_generic)


@inline
def _generic_axes(r, sh, pos, m, mtok, padding, align, zero, pidx, pw, pok):
    nd = r + 2
    _taps_axis(pos, m, r - 1, sh[nd - 1], 1, mtok, padding, align, zero, pidx, pw, pok)
    if r >= 2:
        _taps_axis(pos, m, r - 2, sh[nd - 2], sh[nd - 1], mtok, padding, align, zero, pidx, pw, pok)
    if r >= 3:
        _taps_axis(pos, m, r - 3, sh[nd - 3], sh[nd - 2] * sh[nd - 1], mtok, padding, align, zero, pidx, pw, pok)


@inline
def _generic_at(r, sh, pos, j, mtok, padding, align, zero, pidx, pw, pok):
    """Padded taps (``_taps_one``) of position ``j`` on every axis."""
    nd = r + 2
    sizes = (sh[nd - 1], sh[nd - 2] if r >= 2 else 1, sh[nd - 3] if r >= 3 else 1)
    stride = 1
    for q in range(r):
        size = sizes[q]
        per = period(size, padding, align)
        _taps_one(pos, j, r - 1 - q, size, per, stride, mtok, padding, align, zero, False, pidx, pw, pok)
        stride *= size


#: a segment with fewer than 1 in SPARSE positions GENERIC plans their padded taps one
#: by one, else for every position in vectorised loops (``_generic``); its interior
#: positions keep ``fast_axis``'s weights, which are the padded taps' bit for bit
SPARSE = 8


@inline
def _inside(pos, j, r, sh, lo, hi, zero):
    """Whether position ``j``'s taps ``i - lo .. i + hi`` are inside the input on every axis."""
    nd = r + 2
    inside = True
    for k in range(r):
        size = sh[nd - r + k]
        i, _, _, finite = split32(pos[k, j], zero, size)
        inside &= finite & (i - lo >= 0) & (i + hi <= size - 1)
    return inside


@inline
def _few_padded(pos, m, r, sh, mtok, zero):
    """Whether fewer than half of every 8th of the segment's ``m`` positions are not
    interior: a guess at whether sorting pays under border padding (as where a flow's
    rows reach the input's edges; where most positions are not interior the padded taps
    of every position, clamps, cost less than the sorting: counting them all cost 15% of
    a 3-D call). Either answer gives the same samples. (Fewer than 1 in 8 sent 43% of a
    48^3 registration's segments to the padded taps: a row's first position, every 8th
    of them, clamps half the time; the few GENERIC positions of a sorted segment cost
    little since their blocks are gathered with their interior ones, ``PARTIAL``.)"""
    lo, hi = (1, 2) if len(mtok) == CUBIC else (0, 1)
    n = 0
    for j in range(0, m, 8):
        n += not _inside(pos, j, r, sh, lo, hi, zero)
    return n * 2 < (m + 7) // 8


@inline
def _probe_interior(pos, m, r, sh, mtok, zero):
    """Whether the first, middle and last of the segment's ``m`` positions are all
    interior (every tap of every axis inside the input): a guess at whether sorting
    the segment's positions pays under reflection padding (an affine map's segment
    is a line, the interior convex). Either answer gives the same samples."""
    lo, hi = (1, 2) if len(mtok) == CUBIC else (0, 1)
    for j in (0, m // 2, m - 1):
        inside = _inside(pos, j, r, sh, lo, hi, zero)
        if not inside:
            return False
    return True


@inline
def interior_bases(m, kind, base):
    """``base[j] = 0`` for the segment's positions that are not interior (``kind`` not
    0): a block gathered whole as interior (``PARTIAL``) then reads inside the channel
    image at every lane, the others' values being replaced."""
    for j in range(np.uint64(m)):
        base[j] = base[j] if kind[j] == 0 else np.int32(0)


@inline
def mostly_interior(kind, j, V):
    """Whether at least half of positions ``j .. j + V - 1`` are interior: such a block
    of mixed kinds is gathered whole (``PARTIAL``; a few interior positions cost less
    one by one: a cubic block of mostly edge positions took 1.08x the time gathered)."""
    n = 0
    for l in range(np.uint64(V)):
        n += kind[np.uint64(j) + l] == 0
    return n * 2 >= V


@inline
def small_image(x):
    """Whether a channel image of ``x`` has fewer than 2**31 elements: interior
    positions are planned in 32 bits (``split32``, ``_mark``), others take the padded taps."""
    return x.size // max(x.shape[0] * x.shape[1], 1) < 2 ** 31 - 8


@njit(**INTERNAL, **NO_NRT)
def plan(x, pos, m, mtok, padding, align, zero, base, pidx, pw, pok, kind):
    """The plan of a segment of ``m`` positions (``pos[k, :m]`` on spatial axis ``k``
    of ``x``, shape (N, C, D1..Dr)). Zeros padding: every position's ``kind``, the
    ``base`` and weights of interior ones (``fast_axis``) and, when some are
    GENERIC, every position's padded taps (``_generic``: vectorised, cheaper for all
    than a scalar loop for a few; ``SPARSE``); returns how many are all-outside.
    Border where few positions are not interior (``_few_padded``), and reflection
    where ``_probe_interior`` guesses that the segment is inside: the same, but a
    position is interior or GENERIC (no tap is masked); returns how many are
    interior. Otherwise, and for channel images of 2**31 elements or more
    (``small_image``), every position GENERIC, with its padded taps; returns 0 (border's
    padded taps are clamps, cheaper than sorting where many positions are not
    interior; reflection's reduce each tap by a period: on interior positions sorting
    measured 2-4x faster). Returned with the count: whether every position
    has its padded taps (then a block of mixed kinds is sampled through them,
    ``accumulate``). The axes are unrolled (``x.ndim`` is a constant), innermost
    first; the mode is a token (see ``TOKEN``), so only its code compiles, and the
    padding a run-time code."""
    r = x.ndim - 2
    sh = x.shape
    nd = x.ndim
    if not small_image(x) or (padding == REFLECTION and not _probe_interior(pos, m, r, sh, mtok, zero)) or \
            (padding == BORDER and not _few_padded(pos, m, r, sh, mtok, zero)):
        for j in range(np.uint64(m)):
            kind[j] = GENERIC
        _generic_op(r, sh, pos, m, mtok, padding, align, zero, pidx, pw, pok)
        return 0, True
    fast_axis(pos, m, r - 1, sh[nd - 1], 1, mtok, zero, base, pw, kind, True)
    if r >= 2:
        fast_axis(pos, m, r - 2, sh[nd - 2], sh[nd - 1], mtok, zero, base, pw, kind, False)
    if r >= 3:
        fast_axis(pos, m, r - 3, sh[nd - 3], sh[nd - 2] * sh[nd - 1], mtok, zero, base, pw, kind, False)
    ngeneric = 0
    nout = 0
    if padding != ZEROS:  # every tap is read: a position is interior or GENERIC
        for j in range(np.uint64(m)):
            kind[j] = GENERIC if kind[j] != 0 else 0
            ngeneric += kind[j]
    else:
        for j in range(np.uint64(m)):
            ngeneric += kind[j] == GENERIC
            nout += kind[j] >= AXIS_OUT
    interior_bases(m, kind, base)
    full = ngeneric * SPARSE >= m
    if full:
        _generic_op(r, sh, pos, m, mtok, padding, align, zero, pidx, pw, pok)
    else:  # a few (a segment across the input's edge): one by one, up to the last (a scalar
        # loop: LLVM would vectorise a ``for`` over the segment into every position's taps
        # under masked stores)
        j = np.uint64(0)
        left = ngeneric
        while left:
            if kind[j] == GENERIC:
                _generic_at(r, sh, pos, j, mtok, padding, align, zero, pidx, pw, pok)
                left -= 1
            j += np.uint64(1)
    return (m - ngeneric if padding != ZEROS else nout), full


# --- accumulate: one channel's samples of a segment --------------------------------------

@inline
def _off(k, t, j, interior, stride, pidx):
    """Tap ``t``'s flat offset on axis ``k``: ``t * stride`` for an interior position
    (its taps consecutive from its base), else the planned padded offset."""
    return t * stride if interior else pidx[k, t, j]


@inline
def _s1(xf, xb, j, T, masked, interior, pidx, pw, pok, zero):
    acc = zero
    for tx in range(T):
        v = load_sample(xf, np.uint64(xb + _off(0, tx, j, interior, 1, pidx)), zero)
        if masked:
            v = v if pok[0, tx, j] else zero
        acc += pw[0, tx, j] * v
    return acc


@inline
def _s2(xf, xb, j, T, masked, interior, s1, pidx, pw, pok, zero):
    acc = zero
    for ty in range(T):
        by = xb + _off(0, ty, j, interior, s1, pidx)
        s = zero
        for tx in range(T):
            v = load_sample(xf, np.uint64(by + _off(1, tx, j, interior, 1, pidx)), zero)
            if masked:
                v = v if (pok[0, ty, j] & pok[1, tx, j]) else zero
            s += pw[1, tx, j] * v
        acc += pw[0, ty, j] * s
    return acc


@inline
def _s3(xf, xb, j, T, masked, interior, s1, s2, pidx, pw, pok, zero):
    acc = zero
    for tz in range(T):
        bz = xb + _off(0, tz, j, interior, s2, pidx)
        sz = zero
        for ty in range(T):
            by = bz + _off(1, ty, j, interior, s1, pidx)
            oky = pok[0, tz, j] & pok[1, ty, j]
            s = zero
            for tx in range(T):
                v = load_sample(xf, np.uint64(by + _off(2, tx, j, interior, 1, pidx)), zero)
                if masked:
                    v = v if (oky & pok[2, tx, j]) else zero
                s += pw[2, tx, j] * v
            sz += pw[1, ty, j] * s
        acc += pw[0, tz, j] * sz
    return acc


@inline
def _sample(x, xf, xb, j, T, masked, interior, s1, s2, pidx, pw, pok, zero):
    """Sample ``j`` of the plan (``T`` taps per axis on each of ``x``'s spatial axes:
    ``x`` is passed for its rank alone), the weights nested innermost axis first as
    onnxruntime nests them; ``masked``: taps outside (zeros padding) read as exact
    zeros; ``interior``: the taps are ``xb + tz * s2 + ty * s1 + tx`` (``s1``,
    ``s2``: the strides of the second and third axes from the innermost; ``xb`` the
    position's base), not ``pidx``'s."""
    if x.ndim == 3:
        return _s1(xf, xb, j, T, masked, interior, pidx, pw, pok, zero)
    if x.ndim == 4:
        return _s2(xf, xb, j, T, masked, interior, s1, pidx, pw, pok, zero)
    return _s3(xf, xb, j, T, masked, interior, s1, s2, pidx, pw, pok, zero)


#: ``_block``'s answer for positions of more than one kind; ``PARTIAL``: a whole block of
#: more than one kind, at least half of them interior (``mostly_interior``: ``accumulate``, the backward)
MIXED, PARTIAL = 255, 254


@inline
def _block(kind, j, m, V, blocks):
    """The ``kind`` of positions ``j .. j + V - 1`` of the segment (``m`` of them) when
    they all have the same, else ``MIXED`` (also when the block would pass ``m``, or
    not ``blocks``)."""
    k = kind[j]
    if not blocks or j + np.uint64(V) > m:
        return MIXED
    same = True
    for q in range(np.uint64(1), np.uint64(V)):
        same &= kind[j + q] == k
    return k if same else MIXED


@inline
def _outside(pw, j, r, zero):
    """The sample of position ``j`` with every tap of an axis outside (zeros padding):
    0, or NaN where the position is not finite (its weights are NaN)."""
    acc = pw[0, 0, j] * zero
    for k in range(1, r):
        acc *= pw[k, 0, j]
    return zero if acc == acc else acc


@inline
def _store_block(out, o, res, V):
    """``out[o + l] = res[l]`` for ``l < V``, each rounded or cast as ``store_sample`` does
    (nothing where ``gathered`` stored them itself: ``direct``)."""
    if direct(out, res):
        return
    for q in range(np.uint64(V)):
        store_sample(out, o + q, res[q])


@njit(**INTERNAL)
def accumulate(x, xf, out, xb, xs, ob, os, C, m, mtok, padding, count, full, base, pidx, pw, pok, kind, res,
               bkind, zero):
    """``out[ob + c * os + j] = sample j`` of the segment's plan in channel ``c`` (the
    channel image starting at ``xf[xb + c * xs]``), for ``j < m`` and ``c < C``.
    Interior positions read their taps from ``base`` on, GENERIC ones through their
    padded taps (and masks, under zeros padding), and those with every tap of an axis
    outside store 0 without reading; ``count``: what ``plan`` returned. Blocks of
    ``lanes(pw)`` positions of one kind are sampled together (``_gather.gathered``;
    not in the last image of 16-bit or uint8 ``x``: ``gather_safe``), the others one by
    one; ``full`` (``plan``): every position has its padded taps, so a whole block of
    mixed kinds goes through them. Channel by channel (a channel image's taps and
    stores stay in cache; the blocks' kinds are found once). ``x`` (N, C, D1..Dr) is
    passed for its rank, the mode as a token (see ``TOKEN``): numba compiles only its
    code, with the tap count a constant, so the tap loops unroll; the padding is a
    run-time code (whether GENERIC taps are masked)."""
    r = x.ndim - 2
    nd = x.ndim
    s1 = x.shape[nd - 1]
    s2 = s1 * x.shape[nd - 2] if r >= 2 else s1
    if len(mtok) == NEAREST:
        T = 1
    elif len(mtok) == LINEAR:
        T = 2
    else:
        T = 4
    V = lanes(pw)
    blocks = gather_safe(xf, xb + C * xs, xs)
    mu = np.uint64(m)
    osu = np.uint64(os)
    nblk = (mu + np.uint64(V) - np.uint64(1)) // np.uint64(V)
    for q in range(nblk):  # each block's kind, once for all channels
        bk = _block(kind, q * np.uint64(V), mu, V, blocks)
        if bk == MIXED and blocks and (q + np.uint64(1)) * np.uint64(V) <= mu:
            if full:
                bk = GENERIC  # every position has its padded taps: interior ones' are their taps
            elif mostly_interior(kind, q * np.uint64(V), V):
                bk = PARTIAL
        bkind[q] = bk
    masked = padding == ZEROS
    b = xb
    o = np.uint64(ob)
    for c in range(C):
        if masked and count:  # (zeros: how many positions are all-outside)
            # first every position as if every tap of an axis were outside (0, or NaN at a
            # non-finite position; branch-free, so it vectorises), then the others over it
            # (the channel's stores stay in L1)
            for j in range(mu):
                store_sample(out, o + j, _outside(pw, j, r, zero))
            if count == m:
                b += xs
                o += osu
                continue
        for q in range(nblk):
            j = q * np.uint64(V)
            bk = bkind[q]
            if bk == 0:
                gathered(x, xf, res, out, o + j, b, base, pidx, pw, pok, j, mtok, s1, s2, True, False)
                _store_block(out, o + j, res, V)
            elif bk == GENERIC:
                if masked:  # taps outside read as exact zeros
                    gathered(x, xf, res, out, o + j, b, base, pidx, pw, pok, j, mtok, s1, s2, False, True)
                else:
                    gathered(x, xf, res, out, o + j, b, base, pidx, pw, pok, j, mtok, s1, s2, False, False)
                _store_block(out, o + j, res, V)
            elif bk == PARTIAL:  # gathered as interior (the others at base 0), then the others one by one
                gathered(x, xf, res, out, o + j, b, base, pidx, pw, pok, j, mtok, s1, s2, True, False)
                dr = direct(out, res)
                for jj in range(j, j + np.uint64(V)):
                    kd = kind[jj]
                    if kd == 0:
                        if not dr:
                            store_sample(out, o + jj, res[jj - j])
                    elif kd == GENERIC:
                        store_sample(out, o + jj, _sample(x, xf, b, jj, T, masked, False, s1, s2, pidx, pw, pok, zero))
                    elif dr:  # (its 0 again, where the gather stored over it)
                        store_sample(out, o + jj, _outside(pw, jj, r, zero))
            elif bk == MIXED:
                for jj in range(j, min(j + np.uint64(V), mu)):
                    kd = kind[jj]
                    if kd == 0:
                        v = _sample(x, xf, b + base[jj], jj, T, False, True, s1, s2, pidx, pw, pok, zero)
                        store_sample(out, o + jj, v)
                    elif kd == GENERIC:
                        v = _sample(x, xf, b, jj, T, masked, False, s1, s2, pidx, pw, pok, zero)
                        store_sample(out, o + jj, v)
            # (else all outside: their 0s are stored)
        b += xs
        o += osu


#: the plan and the accumulation through their own compiled code (``_opaque``: once a
#: segment each), so that the entries above them do not optimise their code again
plan_op, accumulate_op = opaque(plan), opaque(accumulate)


#: byte offsets of ``scratch``'s buffers in its one allocation (pos, base, pidx, pw, pok,
#: kind, res, bkind; sized for float64, float32 leaves gaps), and its bytes
_SCRATCH_AT, _SCRATCH_BYTES = layout((3 * SEG, 8), (SEG, 4), (12 * SEG, 8), (12 * SEG, 8), (12 * SEG, 1), (SEG, 1),
                                     (16, 8), (SEG // 8 + 1, 1))


@njit(**INTERNAL)
def scratch(zero):
    """``(pos, base, pidx, pw, pok, kind, res, bkind)``: one thread's segment buffers
    (``res``: a block's samples; ``bkind``: each block's kind, ``_block``), zeroed:
    LLVM turns the plan's conditional stores (a GENERIC position's padded taps) into
    AVX-512 masked stores, and a masked store to a page not yet touched (fresh
    memory, or one that the OS took back) takes a microcode assist even with every
    lane off: with buffers from ``np.empty`` two threads ran 4-8x slower than one on
    a Zen 5 VM. One allocation, carved (``_views.carve``: ``np.zeros`` compiles once
    per dtype and rank)."""
    buf = np.zeros(_SCRATCH_BYTES, np.uint8)
    at = _SCRATCH_AT
    return (carve(buf, at[0], zero, (3, SEG)), carve(buf, at[1], np.int32(0), (SEG,)),
            carve(buf, at[2], np.int64(0), (3, 4, SEG)), carve(buf, at[3], zero, (3, 4, SEG)),
            carve(buf, at[4], False, (3, 4, SEG)), carve(buf, at[5], np.uint8(0), (SEG,)),
            carve(buf, at[6], zero, (16,)), carve(buf, at[7], np.uint8(0), (SEG // 8 + 1,)))


# --- GridSample ------------------------------------------------------------------------

#: images of ``x`` (all channels of one batch entry) up to this size are prefetched
#: (``prefetch_ahead``): it is sampled from the caches, where the one before it left it
PREFETCH_BYTES = 16 << 20


@inline
def prefetch_ahead(xf, N, C, P, n, s, ns, first):
    """While unit ``s`` of the ``ns`` units of image ``n`` is sampled, prefetch the
    ``s``-th of ``ns`` shares of image ``n + 1`` of ``xf`` (the flat ``x``, N images),
    so that the next image's taps are read from the caches; at a thread's ``first``
    unit, the rest of image ``n`` too. A grid's taps land anywhere in an image, where
    hardware prefetchers, which follow streams, do not look: on a Zen 5 VM this made
    32x3x256x256 augmentation affines 1.5-1.6x faster. Only for images of at most
    ``PREFETCH_BYTES`` whose channel images have at most 4x as many elements as the
    channel's outputs (``P``; a small crop of a large image reads a part of it)."""
    L = xf.size // N
    if L * xf.itemsize > PREFETCH_BYTES or L > 4 * P * C:
        return
    step = 64 // xf.itemsize
    if first:
        for q in range(n * L + s * L // ns, (n + 1) * L, step):
            prefetch(xf, q)
    if n + 1 < N:
        for q in range((n + 1) * L + s * L // ns, (n + 1) * L + (s + 1) * L // ns, step):
            prefetch(xf, q)


@njit(**INTERNAL)
def _units(x, xf, gf, out, mtok, padding, align, zero, u0, u1):
    """Segments ``u0:u1`` (image-major) of the output ``out`` (flat, N*C*P); ``x``
    (N, C, D1..Dr) C-contiguous and ``xf`` its flat view; ``gf`` the flat grid."""
    r = x.ndim - 2
    N, C = x.shape[0], x.shape[1]
    P = out.size // (N * C)
    S = xf.size // (N * C)
    nseg = (P + SEG - 1) // SEG
    one = as_compute(zero, 1)
    pos, base, pidx, pw, pok, kind, res, bkind = scratch(zero)
    for u in range(u0, u1):
        n = u // nseg
        j0 = (u - n * nseg) * SEG
        m = min(SEG, P - j0)
        g0 = np.uint64((n * P + j0) * r)
        # one loop over the positions, all their coordinates in it (the grid lists them
        # innermost axis first): LLVM loads them as whole vectors and deinterleaves,
        # where a loop per axis gathers them; unsigned indices, so no index pays for
        # negative wraparound
        for j in range(np.uint64(m)):
            for k in range(r):
                pos[k, j] = unnormalize(load(gf, g0 + j * np.uint64(r) + np.uint64(r - 1 - k)), x.shape[2 + k],
                                        align, one)
        count, full = plan_op(x, pos, m, mtok, padding, align, zero, base, pidx, pw, pok, kind)
        prefetch_ahead(xf, N, C, P, n, u - n * nseg, nseg, u == u0)
        accumulate_op(x, xf, out, n * C * S, S, n * C * P + j0, P, C, m, mtok, padding, count, full, base, pidx, pw,
                      pok, kind, res, bkind, zero)


#: called through its own compiled code (``_opaque``): the serial and parallel entries do
#: not compile it again
_units_op = opaque(_units)


@njit(cache=True, nogil=True)
def _serial(x, xf, gf, out, mtok, padding, align, zero):
    N, C = x.shape[0], x.shape[1]
    P = out.size // (N * C)
    _units_op(x, xf, gf, out, mtok, padding, align, zero, 0, N * ((P + SEG - 1) // SEG))


@njit(cache=True, parallel=True, nogil=True)
def _parallel(x, xf, gf, out, mtok, padding, align, zero, nchunks):
    N, C = x.shape[0], x.shape[1]
    P = out.size // (N * C)
    units = N * ((P + SEG - 1) // SEG)
    nchunks = min(units, nchunks)
    for c in prange(nchunks):
        _units_op(x, xf, gf, out, mtok, padding, align, zero, c * units // nchunks, (c + 1) * units // nchunks)


#: a mode's token: a tuple as long as its code, so that ``len(tok)`` is a constant where
#: numba compiles, which prunes the other modes' code before typing (a call compiles its
#: mode alone)
TOKEN = ((), (0,), (0, 0))

#: 0 in each compute type, made once
ZERO = {np.dtype(t): t(0) for t in (np.float32, np.float64)}


def kernel_view(a):
    """``a`` C-contiguous as the kernels take it: uint8, float32 and float64 as they
    are (a copy only when ``a`` is not C-contiguous), 16-bit floats widened to float32
    (``_copies``: the kernels compile for float32 and float64 alone, and a 16-bit result
    is the float32 computation on the widened inputs, rounded once)."""
    return np.ascontiguousarray(a) if a.dtype == np.uint8 else widened(a)


def output_for(x, shape):
    """An uninitialised result for ``x`` (uint8, or its float compute type)."""
    return np.empty(shape, dtype=np.uint8 if x.dtype == np.uint8 else compute(x.dtype))


def launch_plan(xshape, gshape, mode):
    """``(output shape, work, units)`` of a call on X of shape ``xshape`` and a grid of
    ``gshape``: the work that decides serial or parallel (``_runtime``), and the
    segments (``_units``' units: SEG positions of one image) that a pool shares out.
    ``launch`` and numba_ops.onnx's session both run by it."""
    r = len(xshape) - 2
    shape = tuple(xshape[:2]) + tuple(gshape[1:-1])
    P = 1
    for o in shape[2:]:
        P *= o
    work = P * shape[0] * shape[1] * TAPS[mode] ** r
    return shape, work, shape[0] * ((P + SEG - 1) // SEG)


@njit(cache=True, inline="always")
def units_task(x, xf, gf, out, mtok, padding, align, zero, th, items, units):
    """Pool item ``th`` of ``items``: its share of the ``units`` segments (a pool
    other than numba's, as ``_parallel`` deals them)."""
    _units_op(x, xf, gf, out, mtok, padding, align, zero, th * units // items, (th + 1) * units // items)


def launch(x, grid, mode, padding, align, stream=None):
    """x: NumPy (N, C, D1..Dr), float or uint8; grid: NumPy (N, O1..Or, r), float;
    validated by the front end (``mode``/``padding`` are ``_sample`` codes, ``align``
    a bool). ``stream`` is ignored on the CPU."""
    shape, work, _ = launch_plan(x.shape, grid.shape, mode)
    out = output_for(x, shape)
    if out.size:
        xs = kernel_view(x)
        gs = kernel_view(grid)
        _runtime.run(_serial, _parallel, work, xs, xs.reshape(-1), gs.reshape(-1), out.reshape(-1),
                     TOKEN[mode], np.int64(padding), bool(align), ZERO[compute(grid.dtype)])
    return narrowed(out, x.dtype)

"""GridSample's per-axis sampling math (ONNX GridSample, with onnxruntime's choices),
shared by the CPU and CUDA kernels of ``grid_sample`` and ``affine_warp``.

Like ``_scalar.py`` every helper is an ``@njit`` function that the CPU kernels call
from their ``prange`` loops and numba-cuda compiles as a device function; they use
only scalar arithmetic, comparisons, ``np.floor`` and ``fmod``.

How a sample is taken, axis by axis (the contract follows onnxruntime):

1. ``unnormalize``: the grid value ``g`` in [-1, 1] to a position on an axis of
   ``size`` elements, onnxruntime's ``GsDenormalize`` in the compute type:
   ``(g + 1) / 2 * (size - 1)`` with ``align_corners``, else
   ``((g + 1) * size - 1) / 2``.
2. ``split_coord``: the position split exactly into an integer ``i = floor(pos)``
   and a fraction (``_scalar.split_position``, DeformConv's first step, so a
   huge position never reaches an integer conversion: beyond 2**62 it stands
   for ``±2**62``, which every padding mode handles like any far position).
   Under reflection padding ``i`` is reduced modulo the reflection period
   (``2 * size``, or ``2 * (size - 1)`` with ``align_corners``): padding is
   periodic in it, so the taps and weights are unchanged, and huge positions
   are reduced exactly (``math.fmod`` is exact).
3. The mode's taps on the integer lattice: ``nearest`` one tap, ``i`` rounded
   half to even by the fraction (before padding, as onnxruntime); ``linear`` two
   taps ``i, i + 1`` with weights ``1 - frac, frac``; ``cubic`` four taps
   ``i - 1 .. i + 2`` with Keys' weights, A = -0.75 (``cubic_weights``).
4. ``pad_tap``: each tap's index is padded on its own (for linear and nearest
   that equals padding the position, as the ONNX reference does; for cubic it
   is onnxruntime's rule): ``zeros`` keeps the index (clamped, so a read stays
   in bounds) and says whether it is inside (a tap outside counts 0 exactly,
   never ``0 * x``); ``border`` clamps; ``reflection`` mirrors about the
   borders (-0.5 and size - 0.5, or 0 and size - 1 with ``align_corners``).

A non-finite position gives NaN weights (so the sample is NaN: uint8 outputs
store it as 0). An n-D sample is the product of the axes' weights over the
taps' combinations: for linear, the same n-linear sampling as DeformConv's
``border_corner`` (corners outside the input count 0).
"""
import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._modes import BORDER, CUBIC, LINEAR, MODES, NEAREST, PADDING_MODES, REFLECTION, TAPS, ZEROS  # noqa: F401
from ._compat import SHARED
from ._scalar import load, split_position, store

_HUGE = 1 << 62


def as_compute(ref, v):
    """``v`` converted to the float type of the scalar ``ref`` (float32 or float64).
    (The Python bodies of these overloaded helpers are what numba's CUDA simulator
    runs; compiled code uses the overloads.)"""
    return type(ref)(v)


@overload(as_compute, jit_options={"inline": "always"})
def _as_compute_ol(ref, v):
    if ref == types.float64:
        return lambda ref, v: np.float64(v)
    return lambda ref, v: np.float32(v)


def fmod(a, b):
    """The exact remainder of ``a / b`` (floats of one type): ``np.fmod`` on the CPU
    (numba's CPU target has no ``math.fmod``), ``math.fmod`` elsewhere (CUDA)."""
    return np.fmod(a, b)


@overload(fmod, target="generic", jit_options={"inline": "always"})
def _fmod_generic(a, b):
    return lambda a, b: math.fmod(a, b)


@overload(fmod, target="cpu", jit_options={"inline": "always"})
def _fmod_cpu(a, b):
    return lambda a, b: np.fmod(a, b)


def load_sample(a, i, zero):
    """``a[i]`` in the compute type of ``zero``: 16-bit storage widened (``load``),
    uint8 converted."""
    return as_compute(zero, a[i] if a.dtype == np.uint8 else load(a, i))


@overload(load_sample, jit_options={"inline": "always"})
def _load_sample_ol(a, i, zero):
    if a.dtype == types.uint8:
        return lambda a, i, zero: as_compute(zero, a[i])
    return lambda a, i, zero: load(a, i)


@njit(**SHARED)
def to_uint8(v):
    """A computed sample as ONNX casts it to uint8: NaN -> 0, clamped to 0..255,
    truncated toward zero. Branch-free."""
    zero = as_compute(v, 0)
    top = as_compute(v, 255)
    c = v if v > zero else zero  # NaN and negatives -> 0
    c = c if c < top else top
    return np.uint8(np.int32(c))


def store_sample(out, i, v):
    """``out[i] = v``: rounded once to 16-bit storage (``store``), or cast to uint8 (``to_uint8``)."""
    if out.dtype == np.uint8:
        out[i] = to_uint8(v)
    else:
        store(out, i, v)


@overload(store_sample, jit_options={"inline": "always"})
def _store_sample_ol(out, i, v):
    if out.dtype == types.uint8:
        def impl(out, i, v):
            out[i] = to_uint8(v)
    else:
        def impl(out, i, v):
            store(out, i, v)
    return impl


@njit(**SHARED)
def unnormalize(g, size, align, one):
    """The grid value ``g`` as a position on an axis of ``size`` elements, in the
    compute type of ``one`` (onnxruntime's ``GsDenormalize``)."""
    if align:
        return (g + one) / (one + one) * as_compute(one, size - 1)
    return ((g + one) * as_compute(one, size) - one) / (one + one)


@njit(**SHARED)
def period(size, padding, align):
    """The period of the padded axis: that of reflection padding (0 for a single
    element with ``align_corners``, where every tap reflects onto it), else 0."""
    if padding != REFLECTION:
        return np.int64(0)
    return np.int64(2 * (size - 1) if align else 2 * size)


@njit(**SHARED)
def split_coord(pos, per, zero):
    """``(i, frac, finite)``: ``pos = i + frac`` with ``i`` an int64 and ``frac`` in
    [0, 1), exact; ``i`` reduced into ``[0, per)`` when ``per > 0`` (reflection,
    ``period``). A position beyond 2**62 (or not finite) has ``frac = 0`` and
    ``i = ±2**62``, or under reflection its exact remainder by the period."""
    i, frac, near, finite = split_position(np.int64(0), pos, zero)
    if not near:
        if per > 0 and finite:
            rem = as_compute(zero, fmod(pos, as_compute(zero, per)))
            i, frac, near, finite = split_position(np.int64(0), rem, zero)
        else:
            i = np.int64(_HUGE) if pos > zero else np.int64(-_HUGE)
    if per > 0 and (i < 0 or i >= per):
        i = i % per  # Python's modulo: in [0, per)
    return i, frac, finite


@njit(**SHARED)
def pad_tap(t, size, per, padding, align):
    """``(index, inside)`` for tap ``t`` on an axis of ``size`` (``per``: ``period``;
    under reflection ``t`` is within one tap of ``[0, per)``, as ``split_coord``
    leaves it). ``index`` is always in ``[0, size - 1]``; ``inside`` is False
    only for a zeros-padded tap outside the input."""
    if padding == ZEROS:
        return min(max(t, 0), size - 1), (t >= 0) & (t < size)
    if padding == BORDER or per == 0:
        return min(max(t, 0), size - 1), True
    if t < 0:
        t += per
    elif t >= per:
        t -= per
    if t >= size:
        t = per - t if align else per - 1 - t
    return t, True


@njit(**SHARED)
def cubic_weights(t, one):
    """Keys' cubic convolution weights (A = -0.75, as onnxruntime and PyTorch) of
    the taps at distances ``1 + t, t, 1 - t, 2 - t`` for a fraction ``t`` in [0, 1]."""
    a = as_compute(one, -0.75)
    a2 = a + as_compute(one, 2)
    a3 = a + as_compute(one, 3)
    five, eight, four = as_compute(one, 5), as_compute(one, 8), as_compute(one, 4)
    two = one + one
    x = t + one
    c0 = ((a * x - five * a) * x + eight * a) * x - four * a
    c1 = (a2 * t - a3) * t * t + one
    u = one - t
    c2 = (a2 * u - a3) * u * u + one
    x = two - t
    c3 = ((a * x - five * a) * x + eight * a) * x - four * a
    return c0, c1, c2, c3


@njit(**SHARED)
def split_near(pos, per, zero):
    """``split_coord(pos, per, zero)`` for a position that ``reflect_near`` accepts,
    without its branches (one step of the period instead of a division; the CPU's
    vectorised loops): ``(i, frac, finite)``; for other positions the result is
    meaningless (but no integer conversion overflows)."""
    pc = pos if reflect_near(pos, per, zero) else zero
    f = np.floor(pc)
    i = np.int64(f)
    i = i + per if i < 0 else i
    i = i - per if i >= per else i
    return i, pc - f, (pos - pos) == zero


@njit(**SHARED)
def reflect_near(pos, per, zero):
    """Whether ``pos`` lies in ``[-per, 2 * per)`` (so it is finite and ``per > 0``)."""
    fp = as_compute(zero, per)
    return (pos >= -fp) & (pos < fp + fp)


@njit(**SHARED)
def nearest_at(i, frac, finite, size, per, padding, align, zero):
    """``nearest_tap`` of the split position ``(i, frac, finite)`` (``split_coord``)."""
    half = as_compute(zero, 0.5)
    up = (frac > half) | ((frac == half) & ((i & 1) == 1))
    idx, ok = pad_tap(i + np.int64(1 if up else 0), size, per, padding, align)
    one = as_compute(zero, 1)
    return idx, (one if finite else as_compute(zero, np.nan)), ok


@njit(**SHARED)
def nearest_tap(pos, size, padding, align, zero):
    """``(index, weight, inside)`` of the nearest element (ties to the even index),
    padded; ``weight`` is 1, or NaN for a non-finite position."""
    per = period(size, padding, align)
    i, frac, finite = split_coord(pos, per, zero)
    return nearest_at(i, frac, finite, size, per, padding, align, zero)


@njit(**SHARED)
def linear_at(i, frac, finite, size, per, padding, align, zero):
    """``linear_taps`` of the split position ``(i, frac, finite)`` (``split_coord``)."""
    one = as_compute(zero, 1)
    s = one if finite else as_compute(zero, np.nan)
    i0, in0 = pad_tap(i, size, per, padding, align)
    i1, in1 = pad_tap(i + 1, size, per, padding, align)
    return i0, i1, (one - frac) * s, frac * s, in0, in1


@njit(**SHARED)
def linear_taps(pos, size, padding, align, zero):
    """``(i0, i1, w0, w1, in0, in1)``: the two padded taps around ``pos``, their
    weights (NaN for a non-finite position) and whether each is inside."""
    per = period(size, padding, align)
    i, frac, finite = split_coord(pos, per, zero)
    return linear_at(i, frac, finite, size, per, padding, align, zero)


@njit(**SHARED)
def cubic_at(i, frac, finite, size, per, padding, align, zero):
    """``cubic_taps`` of the split position ``(i, frac, finite)`` (``split_coord``)."""
    one = as_compute(zero, 1)
    s = one if finite else as_compute(zero, np.nan)
    c0, c1, c2, c3 = cubic_weights(frac, one)
    i0, in0 = pad_tap(i - 1, size, per, padding, align)
    i1, in1 = pad_tap(i, size, per, padding, align)
    i2, in2 = pad_tap(i + 1, size, per, padding, align)
    i3, in3 = pad_tap(i + 2, size, per, padding, align)
    return i0, i1, i2, i3, c0 * s, c1 * s, c2 * s, c3 * s, in0, in1, in2, in3


@njit(**SHARED)
def cubic_taps(pos, size, padding, align, zero):
    """``(i0..i3, w0..w3, in0..in3)``: the four padded taps ``floor(pos) - 1 ..
    floor(pos) + 2``, Keys' weights (NaN for a non-finite position) and whether
    each is inside."""
    per = period(size, padding, align)
    i, frac, finite = split_coord(pos, per, zero)
    return cubic_at(i, frac, finite, size, per, padding, align, zero)


# --- gradients (the backward kernels of grid_sample, affine_warp and deform_conv) ---------

@njit(**SHARED)
def unnormalize_scale(size, align, one):
    """``d unnormalize(g) / d g`` on an axis of ``size`` elements: ``(size - 1) / 2``
    with ``align_corners``, else ``size / 2``."""
    return as_compute(one, size - 1 if align else size) / (one + one)


@njit(**SHARED)
def cubic_dweights(t, one):
    """``d/dt`` of ``cubic_weights(t)``: Keys' kernel differentiated at the taps'
    distances ``1 + t, t, 1 - t, 2 - t`` (their sum is 0, as the weights' is 1)."""
    a = as_compute(one, -0.75)
    a2 = a + as_compute(one, 2)
    a3 = a + as_compute(one, 3)
    three, eight, ten = as_compute(one, 3), as_compute(one, 8), as_compute(one, 10)
    two = one + one
    x = t + one  # c0 = f(1 + t), f(x) = ((a x - 5a) x + 8a) x - 4a on 1 <= x <= 2
    d0 = (three * a * x - ten * a) * x + eight * a
    d1 = (three * a2 * t - two * a3) * t  # c1 = g(t), g(x) = (a2 x - a3) x^2 + 1 on 0 <= x <= 1
    u = one - t
    d2 = -(three * a2 * u - two * a3) * u  # c2 = g(1 - t)
    x = two - t
    d3 = -((three * a * x - ten * a) * x + eight * a)  # c3 = f(2 - t)
    return d0, d1, d2, d3


@njit(**SHARED)
def grad_taps_nearest(i, frac, finite, size, per, padding, align, zero):
    """``grad_taps_at`` in nearest mode: one tap, derivative 0 (NaN at a non-finite position)."""
    s = as_compute(zero, 1) if finite else as_compute(zero, np.nan)
    i0, w0, ok0 = nearest_at(i, frac, finite, size, per, padding, align, zero)
    return (i0, i0, i0, i0, w0, zero, zero, zero, zero * s, zero, zero, zero, ok0, False, False, False)


@njit(**SHARED)
def grad_taps_linear(i, frac, finite, size, per, padding, align, zero):
    """``grad_taps_at`` in linear mode (PyTorch's bilinear derivative; see there)."""
    one = as_compute(zero, 1)
    s = one if finite else as_compute(zero, np.nan)
    # PyTorch reflects the coordinate first and takes floor after: at an integer in a
    # mirrored stretch (i in [size, per), reduced) those are the taps i - 1, i with
    # weights 0, 1 (the same sample, the mirrored side's derivative)
    back = (padding == REFLECTION) & (frac == zero) & (i >= size)
    if back:
        i0, i1, w0, w1, ok0, ok1 = linear_at(i - 1, one, finite, size, per, padding, align, zero)
    else:
        i0, i1, w0, w1, ok0, ok1 = linear_at(i, frac, finite, size, per, padding, align, zero)
    # clamped (PyTorch's clip_coordinates_set_grad): two taps padded onto one element
    # (a border clamp, a reflection's edge), whose derivatives cancel, exactly 0 (not
    # -1 + 1 after rounding in the other axes' weights); and, under border and
    # reflection, a position exactly on an edge element (the first index under
    # border; the first or last one, or a mirror of them, under reflection)
    at = i1 if back else i0  # the element the position is on when frac is 0
    on_edge = (padding != ZEROS) & (frac == zero) & ((at == 0) | (at == size - 1))
    d = zero * s if ((i0 == i1) & ok0 & ok1) | on_edge else s
    return (i0, i1, i1, i1, w0, w1, zero, zero, -d, d, zero, zero, ok0, ok1, False, False)


@njit(**SHARED)
def grad_taps_cubic(i, frac, finite, size, per, padding, align, zero):
    """``grad_taps_at`` in cubic mode: each padded tap's weight differentiated, unclamped."""
    one = as_compute(zero, 1)
    s = one if finite else as_compute(zero, np.nan)
    i0, i1, i2, i3, w0, w1, w2, w3, ok0, ok1, ok2, ok3 = cubic_at(i, frac, finite, size, per, padding, align, zero)
    d0, d1, d2, d3 = cubic_dweights(frac, one)
    return (i0, i1, i2, i3, w0, w1, w2, w3, d0 * s, d1 * s, d2 * s, d3 * s, ok0, ok1, ok2, ok3)


@njit(**SHARED)
def grad_taps_at(mode, i, frac, finite, size, per, padding, align, zero):
    """The taps of one axis with their weights' derivatives, for the backward kernels:
    ``(i0..i3, w0..w3, d0..d3, ok0..ok3)`` for the split position ``(i, frac,
    finite)`` (``split_coord``) in ``mode`` (a runtime code: one function serves
    every mode; a kernel whose mode is a constant calls ``grad_taps_nearest``,
    ``grad_taps_linear`` or ``grad_taps_cubic`` and compiles that mode alone). The mode's ``TAPS[mode]`` taps come first (``nearest_at``,
    ``linear_at``, ``cubic_at``: the forward's taps and weights); the rest have
    weight 0 and ``ok`` False. ``d`` is the derivative of each weight with respect
    to the position (PyTorch's: taken from ``floor``, so the right-hand one at an
    integer; 0 for nearest); a padded tap keeps its own weight's derivative, so a
    border-clamped position gets 0 and a reflected one the mirrored sign, as the
    derivative of the padded sum. Linear mode follows PyTorch's bilinear, which pads
    the coordinate before taking ``floor``: under border and reflection a position
    exactly on the first or last index (or a reflection of one) counts as clamped,
    derivative 0 (``clip_coordinates_set_grad``; identity grids land exactly there),
    and under reflection an integer position in a mirrored stretch takes the taps
    ``i - 1, i`` (weights 0, 1: the reflected coordinate's right-hand derivative).
    Cubic differentiates each padded tap's weight, unclamped, as PyTorch's bicubic
    does. Weights and derivatives are NaN at a non-finite position."""
    if mode == NEAREST:
        return grad_taps_nearest(i, frac, finite, size, per, padding, align, zero)
    if mode == LINEAR:
        return grad_taps_linear(i, frac, finite, size, per, padding, align, zero)
    return grad_taps_cubic(i, frac, finite, size, per, padding, align, zero)


@njit(**SHARED)
def grad_taps(mode, pos, size, padding, align, zero):
    """``grad_taps_at`` of the position ``pos`` on an axis of ``size`` (GridSample's
    taps: ``split_coord`` first, with the padding's period), then whether ``pos`` is
    finite: a 17-tuple."""
    per = period(size, padding, align)
    i, frac, finite = split_coord(pos, per, zero)
    i0, i1, i2, i3, w0, w1, w2, w3, d0, d1, d2, d3, ok0, ok1, ok2, ok3 = grad_taps_at(
        mode, i, frac, finite, size, per, padding, align, zero)
    return i0, i1, i2, i3, w0, w1, w2, w3, d0, d1, d2, d3, ok0, ok1, ok2, ok3, finite

"""Per-element math shared by the CPU (``@njit``) and CUDA (``@cuda.jit``) kernels.

Every helper here is an ``@njit`` function: the CPU kernels call it from their
``prange`` loops and numba-cuda compiles the same function as a device function
when a CUDA kernel calls it. In the CUDA simulator they run as plain Python on
NumPy scalars, which is why they only use operations NumPy scalars have too.

16-bit storage
--------------
Numba's CPU target has no float16 arithmetic, so the kernels see 16-bit data as
its bit pattern: float16 as ``int16`` and bfloat16 as ``uint16`` (two integer
types, so a kernel's signature alone tells which it is; see ``_dtypes.py``).
``load`` widens an element to the compute type and ``store`` rounds a computed
value once, to nearest even, into the output element. Compiled, float16 goes
through LLVM's ``half`` type (F16C ``vcvtps2ph``/``vcvtph2ps`` on x86, PTX
``cvt.rn.f16.f32`` on GPUs: 2.4x faster than the integer route on the CPU); the
integer routes below are the simulator's path and the tests' second opinion.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from ._compat import SHARED

_F16_DENORM_MAGIC = np.int64(((127 - 15) + (23 - 10) + 1) << 23)


@njit(cache=True)
def bf16_bits_to_f32(h):
    """bfloat16 bit pattern (uint16) -> float32, exact."""
    return np.uint32((np.int64(h) & 0xFFFF) << 16).view(np.float32)


@njit(cache=True)
def f32_to_bf16_bits(x):
    """float32 -> bfloat16 bit pattern, round to nearest even; NaN stays NaN."""
    b = np.int64(np.float32(x).view(np.uint32))
    if x != x:
        return np.uint16(((b >> 16) | 0x40) & 0xFFFF)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return np.uint16((b >> 16) & 0xFFFF)


@njit(cache=True, inline="always")
def f32_to_bf16_bits_rne(x):
    """``f32_to_bf16_bits`` without its NaN branch, for CPU kernels whose NaNs all
    come from bfloat16 data: exact for every non-NaN, and for every NaN whose low
    16 bits are zero, which is every NaN a CPU computes from bfloat16 inputs (an
    input's NaN, quieted, or the default NaN 0x7FC00000 / 0xFFC00000). A NaN with
    low bits set could round to an infinity or a zero; GPUs' default NaN
    (0x7FFFFFFF) is one, so CUDA kernels keep ``store``. The branch keeps a
    vectorised loop from unrolling: 1.7x slower on a write-bound kernel."""
    b = np.float32(x).view(np.uint32)
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(cache=True)
def f16_bits_to_f32(h):
    """IEEE half bit pattern (int16) -> float32, exact (subnormals, inf, NaN)."""
    v = np.int64(h) & 0xFFFF
    sign = (v & 0x8000) << 16
    exp = (v >> 10) & 0x1F
    mant = v & 0x3FF
    if exp == 0:  # zero or subnormal: mant * 2**-24 is exact in float32
        mag = np.float32(mant) * np.float32(5.9604644775390625e-08)
        return -mag if sign else mag
    if exp == 31:
        bits = sign | 0x7F800000 | (mant << 13)
    else:
        bits = sign | ((exp + 112) << 23) | (mant << 13)
    return np.uint32(bits).view(np.float32)


@njit(cache=True)
def f32_to_f16_bits(x):
    """float32 -> IEEE half bit pattern, round to nearest even (F. Giesen's
    branch-light method: subnormals by a float add, normals by integer rounding)."""
    f = np.int64(np.float32(x).view(np.uint32))
    sign = (f >> 16) & 0x8000
    f = f & 0x7FFFFFFF
    if f >= 0x47800000:  # >= 65536, inf or NaN (anything >= 65520 rounds to inf below)
        o = 0x7E00 if f > 0x7F800000 else 0x7C00
    elif f < 0x38800000:  # result is subnormal or zero
        s = np.uint32(f).view(np.float32) + np.uint32(_F16_DENORM_MAGIC).view(np.float32)
        o = np.int64(np.float32(s).view(np.uint32)) - _F16_DENORM_MAGIC
    else:
        mant_odd = (f >> 13) & 1
        f = f + ((15 - 127) << 23) + 0xFFF + mant_odd
        o = f >> 13
    return np.int16(np.int32(o | sign) - (65536 if (o | sign) >= 32768 else 0))


@intrinsic
def f16_bits_to_f32_hw(typingctx, h):
    """int16 half bit pattern -> float32 by LLVM ``fpext`` (exact)."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def f32_to_f16_bits_hw(typingctx, x):
    """float32 -> int16 half bit pattern by LLVM ``fptrunc`` (round to nearest even)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.int16(types.float32), codegen


def load(a, i):
    """``a[i]`` widened to float32 (16-bit storage) or as it is (float32/float64)."""
    v = a[i]
    if a.dtype == np.int16:
        return f16_bits_to_f32(v)
    if a.dtype == np.uint16:
        return bf16_bits_to_f32(v)
    return v


def store(out, i, v):
    """``out[i] = v`` rounded once to the storage type of ``out``."""
    if out.dtype == np.int16:
        out[i] = f32_to_f16_bits(v)
    elif out.dtype == np.uint16:
        out[i] = f32_to_bf16_bits(v)
    else:
        out[i] = v


@overload(load, jit_options={"inline": "always"})
def _load(a, i):
    if a.dtype == types.int16:
        return lambda a, i: f16_bits_to_f32_hw(a[i])
    if a.dtype == types.uint16:
        return lambda a, i: bf16_bits_to_f32(a[i])
    return lambda a, i: a[i]


@overload(store, jit_options={"inline": "always"})
def _store(out, i, v):
    if out.dtype == types.int16:
        def impl(out, i, v):
            out[i] = f32_to_f16_bits_hw(np.float32(v))
    elif out.dtype == types.uint16:
        def impl(out, i, v):
            out[i] = f32_to_bf16_bits(v)
    else:
        def impl(out, i, v):
            out[i] = v
    return impl


# --- AffineGrid ---------------------------------------------------------------

@njit(**SHARED)
def base_coord(i, length, align_corners, one):
    """ONNX AffineGrid base coordinate of index ``i`` on an axis of ``length``.

    ``one`` is 1 in the compute type, so the arithmetic stays in it. An axis of
    length 1 has the single coordinate 0 under both settings (as PyTorch).
    """
    if length <= 1:
        return one - one
    if align_corners:
        return -one + (one + one) * i / (length - 1)
    return ((one + one) * i + one) / length - one


# --- DeformConv -----------------------------------------------------------------

def _int_like(ref, x):
    """The float ``x`` (holding an integer) as the integer type of ``ref``."""


@overload(_int_like, jit_options={"inline": "always"})
def _int_like_ol(ref, x):
    if ref == types.int32:
        return lambda ref, x: np.int32(x)
    return lambda ref, x: np.int64(x)


def _offset_limit(base, zero):
    """Offsets at least this large put a position outside the input (see
    ``border_corner``), in the compute type of ``zero``."""


@overload(_offset_limit, jit_options={"inline": "always"})
def _offset_limit_ol(base, zero):
    lim = 2.0 ** 30 if base == types.int32 else 2.0 ** 62
    if zero == types.float32:
        return lambda base, zero: np.float32(lim)
    return lambda base, zero: np.float64(lim)


@njit(**SHARED)
def border_corner(base, off, size, zero):
    """Linear-interpolation support of the position ``base + off`` (``base`` an
    integer, ``off`` a float of the compute type) on an axis of ``size`` stored
    with a 1-element zero border on each side (element ``i`` at index ``i + 1``).

    Returns ``(i, lam, ok, finite)``: ``i = floor(base + off)`` in ``base``'s
    integer type, so the bordered index of the lower corner is ``i + 1`` and of
    the upper one ``i + 2``; ``lam`` the weight of the upper corner; ``ok``
    whether the position is inside ``(-1, size)`` (otherwise the sample is 0,
    and ``i = lam = 0``); ``finite`` whether it is finite (otherwise the sample
    is NaN). Corners outside ``[0, size - 1]`` land on the border's zeros, so
    they count 0 exactly (the op's definition) without a branch.

    The position is never rounded: ``floor(off)`` and ``off - floor(off)`` are
    exact in floating point, the integer parts add as integers, and the bounds
    test is on integers. So the weight keeps every bit of the offset's fraction
    however far along the axis, and axes longer than 2**24 index exactly.
    An offset of magnitude at least 2**30 (int32 ``base``) or 2**62 (int64)
    puts the position outside the input, since the callers keep ``|base|`` and
    ``size`` under 2**29 (int32) or 2**61 (int64: the front end keeps
    ``D + pads`` under 2**60); so huge offsets never reach an integer conversion.
    Branch-free, so a loop of calls vectorises. ``zero`` is 0 in the compute type.
    """
    i, lam, near, finite = split_position(base, off, zero)
    ok = near & (i >= -1) & (i < size) & ((i >= 0) | (lam > zero))
    return (i if ok else base - base), (lam if ok else zero), ok, finite


@njit(**SHARED)
def split_position(base, off, zero):
    """The position ``base + off`` split exactly into ``(i, frac, near, finite)``:
    ``i = base + floor(off)`` in ``base``'s integer type and ``frac = off -
    floor(off)`` in the compute type of ``zero`` (both exact), when ``near``:
    ``|off|`` under 2**30 (int32 ``base``) or 2**62 (int64); otherwise (huge or
    not finite) ``i = base`` and ``frac = 0``, so no huge value ever reaches an
    integer conversion. ``finite`` tells whether ``off`` is finite. Branch-free.

    The first step of ``border_corner`` (DeformConv) and of GridSample's
    per-axis taps (``kernels/_sample.py``)."""
    finite = (off - off) == zero
    lim = _offset_limit(base, zero)
    near = (off > -lim) & (off < lim)
    oc = off if near else zero
    fo = np.floor(oc)
    return base + _int_like(base, fo), oc - fo, near, finite

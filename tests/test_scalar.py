"""The shared 16-bit conversions (kernels/_scalar.py) against NumPy and ml_dtypes:
the compiled paths (LLVM half for float16) and the integer paths the simulator runs."""
import ml_dtypes
import numpy as np
import pytest
from numba import njit

from numba_ops.kernels import _scalar as s


@njit(cache=True)
def _widen(bits, out):
    for i in range(bits.size):
        out[i] = s.load(bits, i)


@njit(cache=True)
def _round(x, out):
    for i in range(x.size):
        s.store(out, i, x[i])


def _specials_and_random():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-12, 9, 20000)).astype(np.float32)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, -65520, 6e-8, 2.98e-8,
               2.99e-8, 5.96e-8, 3.4e38, 3.39e38, 1e-45, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11]
    return np.concatenate([np.array(special, np.float32), x])


@pytest.mark.parametrize("dtype,bits", [(np.float16, np.int16), (ml_dtypes.bfloat16, np.uint16)])
def test_widen_every_bit_pattern(dtype, bits):
    allbits = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(bits)
    want = allbits.view(dtype).astype(np.float32)
    got = np.empty(65536, np.float32)
    _widen(allbits, got)  # compiled
    np.testing.assert_array_equal(got, want)
    py = s.f16_bits_to_f32 if dtype == np.float16 else s.bf16_bits_to_f32
    sample = allbits[::97]
    np.testing.assert_array_equal([py.py_func(b) for b in sample], want[::97])  # the simulator's path


@pytest.mark.parametrize("dtype,bits", [(np.float16, np.int16), (ml_dtypes.bfloat16, np.uint16)])
def test_round_once_to_nearest_even(dtype, bits):
    x = _specials_and_random()
    with np.errstate(over="ignore"):
        want = x.astype(dtype).view(bits)
    got = np.empty(x.size, bits)
    _round(x, got)  # compiled
    np.testing.assert_array_equal(got, want)
    py = s.f32_to_f16_bits if dtype == np.float16 else s.f32_to_bf16_bits
    sample = x[::41]
    got_py = np.array([py.py_func(v) for v in sample], dtype=bits)
    np.testing.assert_array_equal(got_py, want[::41])  # the simulator's path
    np.testing.assert_array_equal(np.array([py(v) for v in sample[:50]], dtype=bits), want[::41][:50])


@njit(cache=True)
def _round_rne(x, out):
    for i in range(x.size):
        out[i] = s.f32_to_bf16_bits_rne(x[i])


def test_bf16_rounding_without_nan_branch():
    """The CPU kernels' branch-free bfloat16 rounding: equal to ml_dtypes for every
    non-NaN, and NaN for every NaN a CPU computes from bfloat16 data (its low 16 bits zero)."""
    x = _specials_and_random()
    x = x[~np.isnan(x)]
    got = np.empty(x.size, np.uint16)
    _round_rne(x, got)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    bits = np.arange(65536, dtype=np.uint32)
    nans = (bits[(bits & 0x7FFF) > 0x7F80] << 16).view(np.float32)  # every bfloat16 NaN, widened
    with np.errstate(invalid="ignore"):  # quieted by arithmetic, as in a kernel
        nans = np.concatenate([nans, nans * np.float32(2), np.array([np.inf - np.inf], np.float32)])
    got = np.empty(nans.size, np.uint16)
    _round_rne(nans, got)
    assert ((got & 0x7FFF) > 0x7F80).all()

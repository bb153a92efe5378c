"""The CPU kernels' view intrinsics (numba_ops/kernels/cpu/_views.py): arrays that
re-describe memory without numba's ``reshape`` or one ``np.zeros`` per dtype, and the
prefetch hint."""
import numpy as np
from numba import njit

from numba_ops.kernels.cpu._views import carve, flat, layout, prefetch, shaped


@njit
def _carved(nbytes, at):
    buf = np.zeros(nbytes, np.uint8)
    a = carve(buf, at[0], np.float32(0), (3, 4))
    b = carve(buf, at[1], np.int64(0), (2, 2, 2))
    c = carve(buf, at[2], False, (5,))
    a[1, 2] = 7.5
    b[1, 0, 1] = -3
    c[4] = True
    return a, b, c, buf


def test_carve_views_one_allocation():
    at, nbytes = layout((12, 4), (8, 8), (5, 1))
    assert at == (0, 64, 128) and nbytes == 192
    a, b, c, buf = _carved(nbytes, at)
    assert (a.dtype, a.shape, a.strides) == (np.float32, (3, 4), (16, 4))
    assert (b.dtype, b.shape, b.strides) == (np.int64, (2, 2, 2), (32, 16, 8))
    assert (c.dtype, c.shape) == (np.bool_, (5,))
    assert a.flags.c_contiguous and b.flags.c_contiguous
    # each view is the allocation's bytes at its offset, and holds it alive on its own
    assert buf[:48].view(np.float32)[6] == 7.5 and buf[64:128].view(np.int64)[5] == -3 and buf[132] == 1
    del buf
    assert a[1, 2] == 7.5 and a.sum() == 7.5 and b.sum() == -3 and c.sum() == 1


@njit
def _reviewed(x):
    f = flat(x)
    return f, shaped(f, (x.shape[0] * x.shape[1], x.shape[2]))


def test_flat_and_shaped_share_the_memory():
    x = np.arange(24.0).reshape(2, 3, 4)
    f, s = _reviewed(x)
    np.testing.assert_array_equal(f, x.ravel())
    np.testing.assert_array_equal(s, x.reshape(6, 4))
    f[5] = -1.0
    assert x[0, 1, 1] == -1.0 and s[1, 1] == -1.0


@njit
def _prefetched_sum(a, at):
    s = a[0] - a[0]
    for i in at:
        prefetch(a, i)
    for v in a:
        s += v
    return s


def test_prefetch_is_a_hint_that_never_faults():
    """The hint compiles on this numba's LLVM (its intrinsic's name and types), changes
    nothing and never faults, even far outside the array (the kernels only ask for
    lines they then read, but a hint must be harmless either way)."""
    a = np.arange(1000, dtype=np.float32)
    at = np.array([0, 999, 1000, -1, 1 << 40, -(1 << 40)], np.int64)
    assert _prefetched_sum(a, at) == a.sum()
    assert (a == np.arange(1000, dtype=np.float32)).all()

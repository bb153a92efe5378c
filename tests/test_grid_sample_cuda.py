"""GridSample and affine_warp on CUDA (numba's simulator in CI): the same results as
the CPU kernels, bit for bit, for every rank, mode, padding, align_corners and dtype
(uint8 x too); device inputs give device results. Streams: tests/test_streams.py;
compile_ptx and register spills: tests/test_cuda.py."""
import numpy as np
import pytest

import numba_ops
from helpers import BF16, MODES, PADS, matrix

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif("cuda" not in numba_ops.devices(), reason="no GPU and no CUDA simulator here")]

DTYPES = [np.float16, BF16, np.float32, np.float64, np.uint8]


def _x(rng, shape, dtype):
    if dtype == np.uint8:
        return rng.integers(0, 256, shape, dtype=np.uint8)
    return (4 * rng.standard_normal(shape)).astype(dtype)


def _float(dtype, rng):
    """The grid's (theta's) dtype for x of ``dtype``: its own, or any float for uint8."""
    return [np.float16, np.float32, np.float64][rng.integers(3)] if dtype == np.uint8 else dtype


def _equal(got, want):
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # bits: NaN and -0 too


@pytest.mark.parametrize(*matrix(r=[1, 2, 3], mode=MODES, padding=PADS, dtype=DTYPES))
def test_grid_sample_cuda_equals_cpu(r, mode, padding, dtype):
    rng = np.random.default_rng([r, MODES.index(mode), PADS.index(padding)])
    x = _x(rng, (2, 2) + (4, 3, 5)[3 - r:], dtype)
    grid = 1.4 * rng.standard_normal((2,) + (3, 2, 4)[3 - r:] + (r,))
    flat = grid.reshape(-1)
    flat[:6] = [np.nan, 1e30, -np.inf, 1.0, -1.0, 0.5]  # not finite, huge, borders
    with np.errstate(over="ignore"):  # 1e30 is Inf in 16 bits
        grid = grid.astype(_float(dtype, rng))
    for align in (0, 1):
        kw = dict(mode=mode, padding_mode=padding, align_corners=align)
        _equal(numba_ops.grid_sample(x, grid, device="cuda", **kw), numba_ops.grid_sample(x, grid, **kw))


@pytest.mark.parametrize(*matrix(r=[2, 3], mode=MODES, padding=PADS, dtype=DTYPES))
def test_affine_warp_cuda_equals_cpu(r, mode, padding, dtype):
    rng = np.random.default_rng([10 + r, MODES.index(mode), PADS.index(padding)])
    x = _x(rng, (2, 2) + (4, 3, 5)[3 - r:], dtype)
    theta = (np.eye(r, r + 1) + 0.7 * rng.standard_normal((2, r, r + 1))).astype(_float(dtype, rng))
    size = (2, 2) + (3, 2, 4)[3 - r:]
    for align in (0, 1):
        kw = dict(mode=mode, padding_mode=padding, align_corners=align)
        _equal(numba_ops.affine_warp(x, theta, size, device="cuda", **kw),
               numba_ops.affine_warp(x, theta, size, **kw))
    _equal(numba_ops.affine_warp(x, theta, device="cuda", mode=mode), numba_ops.affine_warp(x, theta, mode=mode))


def _is_device(a):
    from numba_ops.kernels._arrays import is_numba_device_array
    return is_numba_device_array(a)


@pytest.mark.parametrize("dtype", [np.float32, np.uint8], ids=["float32", "uint8"])
def test_device_inputs_give_device_results(dtype, rng):
    from numba import cuda
    x = _x(rng, (2, 3, 5, 6), dtype)
    grid = rng.standard_normal((2, 4, 3, 2)).astype(np.float32)
    theta = rng.standard_normal((2, 2, 3)).astype(np.float32)
    want = numba_ops.grid_sample(x, grid, mode="cubic")
    for args in ((cuda.to_device(x), cuda.to_device(grid)), (x, cuda.to_device(grid)), (cuda.to_device(x), grid)):
        got = numba_ops.grid_sample(*args, mode="cubic")  # device=None follows the device input
        assert _is_device(got) and got.dtype == want.dtype
        _equal(got.copy_to_host(), want)
    # a device result even when forced onto the CPU
    got = numba_ops.grid_sample(cuda.to_device(x), grid, mode="cubic", device="cpu")
    assert _is_device(got)
    _equal(got.copy_to_host(), want)
    want = numba_ops.affine_warp(x, theta, (2, 3, 4, 7))
    got = numba_ops.affine_warp(cuda.to_device(x), cuda.to_device(theta), (2, 3, 4, 7))
    assert _is_device(got)
    _equal(got.copy_to_host(), want)
    # strided device inputs (packed on the device), uint8 too
    want = numba_ops.grid_sample(np.ascontiguousarray(x[:, ::-1, :, ::2]), grid)
    for device in ("cuda", "cpu"):
        got = numba_ops.grid_sample(cuda.to_device(x)[:, ::-1, :, ::2], grid, device=device)
        assert _is_device(got)
        _equal(got.copy_to_host(), want)


def test_empty_and_unchanged_on_cuda(rng):
    for r in (2, 3):
        x = rng.standard_normal((0, 2) + (3,) * r).astype(np.float32)
        got = numba_ops.grid_sample(x, np.zeros((0,) + (2,) * r + (r,), np.float32), device="cuda")
        assert isinstance(got, np.ndarray) and got.shape == (0, 2) + (2,) * r
        got = numba_ops.affine_warp(x, np.zeros((0, r, r + 1), np.float32), device="cuda")
        assert got.shape == x.shape
    x = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
    theta = rng.standard_normal((1, 2, 3)).astype(np.float32)
    x0, t0 = x.copy(), theta.copy()
    numba_ops.affine_warp(x, theta, device="cuda")
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(theta, t0)

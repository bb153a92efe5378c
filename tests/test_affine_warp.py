"""affine_warp: equal to grid_sample(affine_grid(...)), 16-bit without a rounded
grid, sizes, errors — written once for every device."""
import numpy as np
import pytest

import numba_ops
from helpers import BF16, FULL, MODES, PADS, host, in_default, matrix
from reference import affine_grid_ref, assert_api_close, grid_sample_ref, ulp_diff


def _theta(rng, n, r, dtype=np.float32):
    """Near-identity transforms with some rotation, scale and shift, so most of the
    output samples inside and some outside."""
    t = np.zeros((n, r, r + 1))
    t[:, :, :r] = np.eye(r) * 1.1 + rng.standard_normal((n, r, r)) * 0.4
    t[:, :, r] = rng.standard_normal((n, r)) * 0.3
    return t.astype(dtype)


CASES = [((2, 3, 5, 6), None), ((2, 3, 5, 6), (2, 3, 7, 4)), ((1, 2, 1, 5), (1, 2, 3, 1)),
         ((2, 2, 3, 4, 5), None), ((1, 1, 4, 3, 2), (1, 1, 2, 5, 3))]


#: the fused kernel compiles per rank, mode and padding like GridSample's; the default
#: run composes it with the two steps on linear and nearest with zeros padding (the
#: other modes and paddings of affine_warp are covered by default in the tests below)
AW_DEFAULT = {("linear", "zeros"), ("nearest", "zeros")}


@pytest.mark.parametrize("xs,size,mode,padding,align,dtype", [
    pytest.param(xs, size, *p.values, marks=p.marks if tuple(p.values[:2]) in AW_DEFAULT else FULL,
                 id=f"{i}-{p.id}") for i, (xs, size) in enumerate(CASES)
    for p in matrix(dict(r=len(xs) - 2), mode=MODES, padding=PADS, align=[0, 1], dtype=[np.float32, np.float64])[1]])
def test_equals_grid_sample_of_affine_grid(xs, size, mode, padding, align, dtype, device, rng):
    r = len(xs) - 2
    x = rng.standard_normal(xs).astype(dtype)
    theta = _theta(rng, xs[0], r, dtype)
    out_size = tuple(xs) if size is None else size
    attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
    got = host(numba_ops.affine_warp(x, theta, size, device=device, **attrs))
    grid = numba_ops.affine_grid(theta, out_size, align, device="cpu")
    two_step = numba_ops.grid_sample(x, grid, device="cpu", **attrs)
    assert got.dtype == dtype and got.shape == out_size
    assert_api_close(got, two_step, dtype)
    if device == "cpu":  # the CPU kernel computes the grid as the CPU AffineGrid does: bit for bit
        np.testing.assert_array_equal(got, two_step)


@pytest.mark.parametrize(*matrix(dict(dtype=np.float64), r=[2, 3], mode=MODES, padding=PADS))
def test_float64_oracle(r, mode, padding, device, rng):
    """Against the float64 composition of the two oracles."""
    xs = (2, 2, 4, 5) if r == 2 else (1, 2, 3, 4, 3)
    x = rng.standard_normal(xs)
    theta = _theta(rng, xs[0], r, np.float64)
    want = grid_sample_ref(x, affine_grid_ref(theta, xs, 0), mode=mode, padding_mode=padding)
    got = host(numba_ops.affine_warp(x, theta, mode=mode, padding_mode=padding, device=device))
    assert_api_close(got, want, np.float64)


@pytest.mark.parametrize(*matrix(dtype=[np.float16, BF16], r=[2, 3], mode=MODES, padding=PADS))
def test_16bit_grid_never_rounded(dtype, r, mode, padding, device, rng):
    """16-bit: the float32 composition on upcast inputs (grid in float32), rounded once."""
    xs = (2, 3, 6, 7) if r == 2 else (1, 2, 3, 4, 5)
    x = rng.standard_normal(xs).astype(dtype)
    theta = _theta(rng, xs[0], r, np.float32).astype(dtype)
    x32, t32 = x.astype(np.float32), theta.astype(np.float32)
    want32 = numba_ops.grid_sample(x32, numba_ops.affine_grid(t32, xs), mode=mode, padding_mode=padding)
    got = host(numba_ops.affine_warp(x, theta, mode=mode, padding_mode=padding, device=device))
    assert got.dtype == np.dtype(dtype)
    assert ulp_diff(got, want32, dtype).max() <= 1


@pytest.mark.parametrize(*matrix(dict(dtype=np.uint8), tdtype=[np.float16, np.float32, np.float64], mode=MODES))
def test_uint8(tdtype, mode, device, rng):
    x = rng.integers(0, 256, (2, 3, 6, 7)).astype(np.uint8)
    theta = _theta(rng, 2, 2, tdtype)
    got = host(numba_ops.affine_warp(x, theta, (2, 3, 5, 8), mode=mode, device=device))
    grid = numba_ops.affine_grid(theta.astype(np.float32) if tdtype == np.float16 else theta, (2, 3, 5, 8))
    want = numba_ops.grid_sample(x, grid, mode=mode)
    assert got.dtype == np.uint8
    if tdtype == np.float16:  # the two-step rounds the grid to float16; one off at most
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(*matrix(dict(padding="reflection"), mode=MODES))
def test_long_rows_and_parallel(mode, rng):
    """Rows longer than a segment, partial segments, and the parallel path (CPU)."""
    x = rng.standard_normal((3, 2, 9, 40)).astype(np.float32)
    theta = _theta(rng, 3, 2)
    size = (3, 2, 30, 700)
    got = numba_ops.affine_warp(x, theta, size, padding_mode="reflection", mode=mode)
    want = numba_ops.grid_sample(x, numba_ops.affine_grid(theta, size), padding_mode="reflection", mode=mode)
    np.testing.assert_array_equal(got, want)


def test_empty_and_unchanged(device, rng):
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    theta = _theta(rng, 2, 2)
    x0, t0 = x.copy(), theta.copy()
    assert host(numba_ops.affine_warp(x, theta, (2, 3, 0, 5), device=device)).shape == (2, 3, 0, 5)
    assert host(numba_ops.affine_warp(x[:0], theta[:0], device=device)).shape == (0, 3, 4, 5)
    assert host(numba_ops.affine_warp(x[:, :0], theta, device=device)).shape == (2, 0, 4, 5)
    # non-contiguous and negative strides
    xv, tv = x[::-1, :, ::-1], theta[::-1]
    got = host(numba_ops.affine_warp(xv, tv, [2, 3, 3, 6], device=device))
    want = host(numba_ops.affine_warp(np.ascontiguousarray(xv), np.ascontiguousarray(tv), np.array([2, 3, 3, 6]),
                                       device=device))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(theta, t0)


def test_bad_input(rng):
    x = np.zeros((2, 3, 4, 5), np.float32)
    theta = np.zeros((2, 2, 3), np.float32)
    aw = numba_ops.affine_warp
    with pytest.raises(ValueError, match="size"):
        aw(x, theta, (2, 4, 4, 5))  # C differs
    with pytest.raises(ValueError, match="size"):
        aw(x, theta, (3, 3, 4, 5))  # N differs
    with pytest.raises(ValueError, match="size"):
        aw(x, theta, (2, 3, 4))  # length
    with pytest.raises(ValueError, match="size"):
        aw(x, theta, (2, 3, -1, 5))
    with pytest.raises((ValueError, TypeError), match="size"):
        aw(x, theta, (2, 3, 4.5, 5))
    with pytest.raises(ValueError, match="theta"):
        aw(x, np.zeros((2, 3, 4), np.float32))  # 3-D theta for 2-D x
    with pytest.raises(ValueError, match="theta"):
        aw(x, np.zeros((1, 2, 3), np.float32))
    with pytest.raises(ValueError, match="X"):
        aw(np.zeros((2, 3, 4), np.float32), theta)  # 1-D: affine_grid has no 1-D
    with pytest.raises(ValueError, match="mode"):
        aw(x, theta, mode="area")
    with pytest.raises(ValueError, match="padding_mode"):
        aw(x, theta, padding_mode="circular")
    with pytest.raises(ValueError, match="align_corners"):
        aw(x, theta, align_corners="yes")
    with pytest.raises(ValueError, match="theta is required"):
        aw(x, None)
    with pytest.raises(TypeError, match="theta"):
        aw(x, theta.astype(np.float64))
    with pytest.raises(TypeError, match="X"):
        aw(x.astype(np.int32), theta)
    with pytest.raises(ValueError, match="X"):
        aw(np.zeros((2, 3, 0, 5), np.float32), theta, (2, 3, 4, 5))  # nothing to sample from
    assert aw(np.zeros((2, 3, 0, 5), np.float32), theta).shape == (2, 3, 0, 5)  # nothing to sample


@pytest.mark.parametrize("every_rank", [False, pytest.param(True, marks=FULL)])
def test_warm_calls(every_rank):
    """The warm-up hook: for each dtype, 2-D and 3-D calls on both x dtypes, every
    mode and padding mode, both paths; some bfloat16 ones run (each variant
    compiles, so one dtype here): the linear/zeros ones of both ranks and x dtypes,
    or (the default run) those of bfloat16 x that the default run samples anyway."""
    from numba_ops.affine_warp import warm_calls
    from numba_ops.kernels.cpu._runtime import PARALLEL_MIN_WORK
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        seen = set()
        for args, kwargs in warm_calls(dtype):
            x, theta, size = args
            assert theta.dtype.name == dtype and set(kwargs) == {"mode", "padding_mode"}
            seen.add((x.ndim, x.dtype.name, np.prod(size) >= PARALLEL_MIN_WORK,
                      kwargs["mode"], kwargs["padding_mode"]))
            if every_rank:
                run = dtype == "bfloat16" and kwargs == {"mode": "linear", "padding_mode": "zeros"}
            else:
                run = x.dtype == theta.dtype == BF16 and in_default(x.ndim - 2, kwargs["mode"],
                                                                   kwargs["padding_mode"], x.dtype)
            if run:
                y = numba_ops.affine_warp(*args, **kwargs)
                assert y.dtype == x.dtype and y.shape == tuple(size)
        assert seen == {(nd, xd, big, mode, pad) for nd in (4, 5) for xd in (dtype, "uint8")
                        for big in (False, True) for mode in MODES for pad in PADS}

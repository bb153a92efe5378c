"""The CUDA backward kernels (numba's simulator in CI): ``grid_sample_backward``,
``affine_warp_backward``, ``affine_grid_backward`` and ``deform_conv_backward`` on
"cuda" equal the CPU backward within float tolerance (the CUDA kernels add with
atomics in another order, and the CPU's column gradients are GEMMs) for every rank,
mode, padding, ``align_corners``, dtype and ``wrt`` subset; device inputs give
device results; a non-finite position gives NaN in its own gradients and nothing
elsewhere. The shapes are tiny: the simulator runs every thread in Python.

Every kernel of the four modules' ``compile_jobs()`` is built for sm_80 and sm_90
(libNVVM and ptxas, no GPU) by tests/test_resources.py.
"""
import numpy as np
import pytest

import numba_ops
from numba_ops import _dispatch
from helpers import BF16, FLOAT16, FLOAT32, FLOAT64, FULL, MODES, PADS, host, matrix

pytestmark = pytest.mark.cuda

SIMULATOR = _dispatch.cuda_simulator()
needs_cuda = pytest.mark.skipif("cuda" not in numba_ops.devices(),
                                reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1 (CI's second pass)")
#: tolerance per dtype, relative to an array's largest magnitude: float32 and float64
#: sums in another order; 16-bit results rounded once from such float32 sums (2 ulps)
TOL = {FLOAT64: 1e-10, FLOAT32: 1e-4, FLOAT16: 2e-3, BF16: 1.6e-2}


def _is_device(a):
    from numba_ops.kernels._arrays import is_numba_device_array
    return is_numba_device_array(a)


def _close(got, want, on_device=False):
    """``got`` (CUDA) equals ``want`` (CPU) within ``TOL``: the same kind of array (a
    numba device array for device inputs), shape, dtype and NaNs."""
    if want is None:
        assert got is None
        return
    assert got is not None
    assert _is_device(got) if on_device else isinstance(got, np.ndarray), type(got)
    got = host(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    g, w = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    finite = np.isfinite(w)
    scale = max(1.0, float(np.abs(w[finite]).max())) if finite.any() else 1.0
    tol = TOL[np.dtype(want.dtype)]
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale, equal_nan=True)


def _all_close(got, want, on_device=False):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        _close(g, w, on_device)


def _data(rng, shape, dtype, scale=1.0):
    with np.errstate(over="ignore"):
        return (scale * rng.standard_normal(shape)).astype(dtype)


# --- grid_sample -------------------------------------------------------------------

def _sample_inputs(rng, r, dtype, n_out=(3, 2, 2)):
    x = _data(rng, (2, 2) + (4, 3, 5)[3 - r:], dtype)
    grid = _data(rng, (2,) + n_out[3 - r:] + (r,), dtype, 1.3)
    gy = _data(rng, (2, 2) + n_out[3 - r:], dtype)
    return gy, x, grid


@needs_cuda
@pytest.mark.parametrize(*matrix(r=[1, 2, 3], mode=MODES, padding=PADS))
def test_grid_sample_backward(r, mode, padding):
    rng = np.random.default_rng([r, MODES.index(mode), PADS.index(padding)])
    gy, x, grid = _sample_inputs(rng, r, np.float32)
    grid.reshape(-1)[:3] = [1.0, -1.0, 0.5]  # borders and a tap on the lattice
    for align in (0, 1):
        kw = dict(mode=mode, padding_mode=padding, align_corners=align)
        _all_close(numba_ops.grid_sample_backward(gy, x, grid, device="cuda", **kw),
                   numba_ops.grid_sample_backward(gy, x, grid, **kw))


@needs_cuda
@pytest.mark.parametrize("dtype", [FLOAT64, FLOAT16, pytest.param(BF16, marks=FULL)], ids=lambda d: d.name)
@pytest.mark.parametrize("mode", ["linear", pytest.param("cubic", marks=FULL)])
def test_grid_sample_backward_dtypes(dtype, mode):
    rng = np.random.default_rng(3)
    gy, x, grid = _sample_inputs(rng, 2, dtype)
    kw = dict(mode=mode, padding_mode="border")
    _all_close(numba_ops.grid_sample_backward(gy, x, grid, device="cuda", **kw),
               numba_ops.grid_sample_backward(gy, x, grid, **kw))


@needs_cuda
@pytest.mark.parametrize("wrt", [["x"], ["grid"], []], ids=["x", "grid", "none"])
def test_grid_sample_backward_wrt(wrt):
    rng = np.random.default_rng(4)
    gy, x, grid = _sample_inputs(rng, 2, np.float32)
    got = numba_ops.grid_sample_backward(gy, x, grid, mode="cubic", wrt=wrt, device="cuda")
    want = numba_ops.grid_sample_backward(gy, x, grid, mode="cubic", wrt=wrt)
    assert [g is None for g in got] == [name not in wrt for name in ("x", "grid")]
    _all_close(got, want)


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_grid_sample_backward_not_finite(mode):
    """A non-finite (or huge) grid position: NaN in all its own grid gradient's
    coordinates (nearest too), nothing scattered into grad_x; the others unchanged."""
    rng = np.random.default_rng(5)
    gy, x, grid = _sample_inputs(rng, 2, np.float32)
    grid[0, 0, 0] = [np.nan, 0.2]
    grid[0, 1, 1] = [0.1, np.inf]
    grid[1, 1, 0] = [1e30, -0.3]  # huge but finite: outside
    got = numba_ops.grid_sample_backward(gy, x, grid, mode=mode, device="cuda")
    want = numba_ops.grid_sample_backward(gy, x, grid, mode=mode)
    _all_close(got, want)
    gg = got[1]
    assert np.isnan(gg[0, 0, 0]).all() and np.isnan(gg[0, 1, 1]).all()
    assert np.isfinite(gg[1]).all() and np.isfinite(got[0]).all()
    # the same as leaving those positions' grad_y at zero, for grad_x
    gy0 = gy.copy()
    gy0[0, :, 0, 0] = 0
    gy0[0, :, 1, 1] = 0
    np.testing.assert_allclose(got[0], numba_ops.grid_sample_backward(gy0, x, grid, mode=mode, wrt=["x"])[0],
                               rtol=1e-5, atol=1e-5)


# --- affine_warp -------------------------------------------------------------------

def _warp_inputs(rng, r, dtype):
    x = _data(rng, (2, 2) + (4, 3, 5)[3 - r:], dtype)
    theta = (np.eye(r, r + 1) + 0.4 * rng.standard_normal((2, r, r + 1))).astype(dtype)
    size = (2, 2) + (3, 2, 4)[3 - r:]
    gy = _data(rng, size, dtype)
    return gy, x, theta, size


@needs_cuda
@pytest.mark.parametrize(*matrix(r=[2, 3], mode=MODES, padding=PADS))
def test_affine_warp_backward(r, mode, padding):
    rng = np.random.default_rng([20 + r, MODES.index(mode), PADS.index(padding)])
    gy, x, theta, size = _warp_inputs(rng, r, np.float32)
    for align in (0, 1):
        kw = dict(mode=mode, padding_mode=padding, align_corners=align)
        _all_close(numba_ops.affine_warp_backward(gy, x, theta, size, device="cuda", **kw),
                   numba_ops.affine_warp_backward(gy, x, theta, size, **kw))


@needs_cuda
@pytest.mark.parametrize("dtype", [FLOAT64, pytest.param(FLOAT16, marks=FULL), BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("r", [2, pytest.param(3, marks=FULL)])
def test_affine_warp_backward_dtypes(dtype, r):
    rng = np.random.default_rng(6)
    gy, x, theta, size = _warp_inputs(rng, r, dtype)
    _all_close(numba_ops.affine_warp_backward(gy, x, theta, size, mode="cubic", device="cuda"),
               numba_ops.affine_warp_backward(gy, x, theta, size, mode="cubic"))


@needs_cuda
def test_affine_warp_backward_many_units():
    """More positions than one block's threads, more units than blocks: theta's
    per-block sums and the grid-stride loop over units."""
    rng = np.random.default_rng(7)
    x = _data(rng, (3, 1, 6, 7), np.float64)
    theta = (np.eye(2, 3) + 0.3 * rng.standard_normal((3, 2, 3))).astype(np.float64)
    size = (3, 1, 9, 11)
    gy = _data(rng, size, np.float64)
    _all_close(numba_ops.affine_warp_backward(gy, x, theta, size, device="cuda"),
               numba_ops.affine_warp_backward(gy, x, theta, size))


@needs_cuda
@pytest.mark.parametrize("wrt", [["x"], ["theta"]])
def test_affine_warp_backward_wrt_and_not_finite(wrt):
    """``wrt`` subsets; theta with a NaN in one image and an Inf in another: NaN
    positions (theta's gradient of the image NaN), nothing scattered from them."""
    rng = np.random.default_rng(8)
    gy, x, theta, size = _warp_inputs(rng, 2, np.float32)
    bad = theta.copy()
    bad[0, 1, 2] = np.nan
    bad[1, 0, 0] = np.inf
    for t in (theta, bad):
        got = numba_ops.affine_warp_backward(gy, x, t, size, wrt=wrt, device="cuda")
        want = numba_ops.affine_warp_backward(gy, x, t, size, wrt=wrt)
        assert [g is None for g in got] == [name not in wrt for name in ("x", "theta")]
        _all_close(got, want)
    if "theta" in wrt:
        assert np.isnan(got[1][0]).all()


# --- affine_grid -------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT64, FLOAT16, pytest.param(BF16, marks=FULL)], ids=lambda d: d.name)
@pytest.mark.parametrize("nd", [2, 3])
def test_affine_grid_backward(nd, dtype):
    rng = np.random.default_rng([nd, 1])
    # more positions than one block's threads and units than blocks (grid-stride)
    size = (3, 1) + ((2, 5, 7) if nd == 3 else (9, 8))
    gg = _data(rng, (3,) + size[2:] + (nd,), dtype)
    gg.reshape(-1)[5] = np.nan  # its image's row: NaN
    for align in (0, 1):
        _close(numba_ops.affine_grid_backward(gg, size, align, device="cuda"),
               numba_ops.affine_grid_backward(gg, size, align))


# --- deform_conv -------------------------------------------------------------------

def _deform_inputs(rng, nd, dtype, C=4, oC=4, group=2, offset_group=2, k=2, stride=1, pad=0, dil=1, mask=True,
                   bias=True):
    spatial = (5, 4, 4)[3 - nd:]
    out = tuple((s + 2 * pad - ((k - 1) * dil + 1)) // stride + 1 for s in spatial)
    K = k ** nd
    x = _data(rng, (2, C) + spatial, dtype)
    w = _data(rng, (oC, C // group) + (k,) * nd, dtype)
    offset = _data(rng, (2, offset_group * K * nd) + out, dtype, 1.5)
    m = _data(rng, (2, offset_group * K) + out, dtype) if mask else None
    b = _data(rng, (oC,), dtype) if bias else None
    gy = _data(rng, (2, oC) + out, dtype)
    kw = dict(kernel_shape=(k,) * nd, strides=(stride,) * nd, pads=(pad,) * 2 * nd, dilations=(dil,) * nd,
              group=group, offset_group=offset_group)
    return (gy, x, w, offset, b, m), kw


@needs_cuda
@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT64], ids=lambda d: d.name)
def test_deform_conv_backward(nd, dtype):
    rng = np.random.default_rng([nd, 2])
    args, kw = _deform_inputs(rng, nd, dtype)
    _all_close(numba_ops.deform_conv_backward(*args, device="cuda", **kw), numba_ops.deform_conv_backward(*args, **kw))


@needs_cuda
@pytest.mark.parametrize("case", [
    dict(stride=2, pad=1, dil=1, group=1, offset_group=1),
    dict(stride=1, pad=1, dil=2, group=1, offset_group=2, mask=False),
    pytest.param(dict(stride=2, pad=0, dil=1, group=4, offset_group=1, bias=False), marks=FULL),
    pytest.param(dict(stride=1, pad=2, dil=2, group=2, offset_group=4, k=1), marks=FULL),
], ids=["stride-pad", "dilation-no-mask", "depthwise", "k1-og4"])
@pytest.mark.parametrize("nd", [2, pytest.param(1, marks=FULL), pytest.param(3, marks=FULL)])
def test_deform_conv_backward_params(nd, case):
    rng = np.random.default_rng([nd, 3])
    args, kw = _deform_inputs(rng, nd, np.float64, **case)
    _all_close(numba_ops.deform_conv_backward(*args, device="cuda", **kw), numba_ops.deform_conv_backward(*args, **kw))


@needs_cuda
@pytest.mark.parametrize("dtype", [FLOAT16, pytest.param(BF16, marks=FULL)], ids=lambda d: d.name)
def test_deform_conv_backward_16bit(dtype):
    rng = np.random.default_rng(9)
    args, kw = _deform_inputs(rng, 2, dtype)
    _all_close(numba_ops.deform_conv_backward(*args, device="cuda", **kw), numba_ops.deform_conv_backward(*args, **kw))


@needs_cuda
@pytest.mark.parametrize("wrt", [["x"], ["w"], ["offset", "mask"], ["b"], ["w", "b", "mask"]],
                         ids=lambda w: "-".join(w))
def test_deform_conv_backward_wrt(wrt):
    rng = np.random.default_rng(10)
    args, kw = _deform_inputs(rng, 2, np.float64)
    got = numba_ops.deform_conv_backward(*args, wrt=wrt, device="cuda", **kw)
    assert [g is None for g in got] == [name not in wrt for name in ("x", "w", "offset", "b", "mask")]
    _all_close(got, numba_ops.deform_conv_backward(*args, wrt=wrt, **kw))


@needs_cuda
def test_deform_conv_backward_not_finite():
    """Non-finite offsets: NaN in the sample's own offset and mask gradients, nothing
    added to grad_x or grad_w; a huge finite offset samples outside (0)."""
    rng = np.random.default_rng(11)
    args, kw = _deform_inputs(rng, 2, np.float64)
    gy, x, w, offset, b, mask = args
    offset[0, 0, 1, 1] = np.nan  # group 0, kernel point 0, axis 0
    offset[1, 9, 0, 2] = np.inf  # group 1, kernel point 0, axis 1 (K = 4, nd = 2)
    offset[1, 12, 2, 0] = 1e30  # group 1, kernel point 2: huge, finite
    got = numba_ops.deform_conv_backward(gy, x, w, offset, b, mask, device="cuda", **kw)
    _all_close(got, numba_ops.deform_conv_backward(gy, x, w, offset, b, mask, **kw))
    gx, gw, goff, gb, gm = got
    assert np.isfinite(gx).all() and np.isfinite(gw).all() and np.isfinite(gb).all()
    assert np.isnan(goff[0, 0:2, 1, 1]).all() and np.isnan(gm[0, 0, 1, 1])
    assert np.isnan(goff[1, 8:10, 0, 2]).all() and np.isnan(gm[1, 4, 0, 2])  # offset channel (g*K + k)*nd + i
    assert np.isnan(goff).sum() == 4 and np.isnan(gm).sum() == 2
    assert (goff[1, 12:14, 2, 0] == 0).all() and gm[1, 6, 2, 0] == 0  # outside: the sample is 0


@needs_cuda
def test_deform_conv_backward_image_chunks(monkeypatch):
    """grad_w summed over chunks of images when ``col`` would exceed ``COL_BYTES``."""
    from numba_ops.kernels.cuda import deform_conv_backward as mod
    rng = np.random.default_rng(12)
    args, kw = _deform_inputs(rng, 1, np.float64)
    want = numba_ops.deform_conv_backward(*args, **kw)
    monkeypatch.setattr(mod, "COL_BYTES", 1)  # one image per chunk
    _all_close(numba_ops.deform_conv_backward(*args, device="cuda", **kw), want)


# --- device inputs, streams, empty calls -------------------------------------------------

@needs_cuda
def test_device_inputs_give_device_results():
    from numba import cuda
    rng = np.random.default_rng(13)
    dev = lambda arrays: [None if a is None else cuda.to_device(a) for a in arrays]  # noqa: E731
    stream = cuda.stream()
    gy, x, grid = _sample_inputs(rng, 2, np.float32)
    want = numba_ops.grid_sample_backward(gy, x, grid, mode="cubic")
    _all_close(numba_ops.grid_sample_backward(*dev((gy, x, grid)), mode="cubic", stream=stream), want, True)
    # one device input is enough; a strided one is packed first
    wide = np.zeros(x.shape[:3] + (2 * x.shape[3],), x.dtype)
    wide[..., ::2] = x
    _all_close(numba_ops.grid_sample_backward(gy, cuda.to_device(wide)[..., ::2], grid, mode="cubic"), want, True)
    gy, x, theta, size = _warp_inputs(rng, 3, np.float32)
    _all_close(numba_ops.affine_warp_backward(*dev((gy, x, theta)), size, stream=stream),
               numba_ops.affine_warp_backward(gy, x, theta, size), True)
    gg = _data(rng, (2, 3, 4, 2), np.float32)
    _close(numba_ops.affine_grid_backward(cuda.to_device(gg), (2, 1, 3, 4), stream=stream),
           numba_ops.affine_grid_backward(gg, (2, 1, 3, 4)), True)
    args, kw = _deform_inputs(rng, 2, np.float32)
    _all_close(numba_ops.deform_conv_backward(*dev(args), stream=stream, **kw),
               numba_ops.deform_conv_backward(*args, **kw), True)
    stream.synchronize()


@needs_cuda
def test_empty_calls():
    """No images (or no positions): zero gradients of the right shapes, as on the CPU."""
    rng = np.random.default_rng(14)
    x = _data(rng, (0, 2, 3, 4), np.float32)
    grid = np.zeros((0, 2, 2, 2), np.float32)
    gy = np.zeros((0, 2, 2, 2), np.float32)
    _all_close(numba_ops.grid_sample_backward(gy, x, grid, device="cuda"), numba_ops.grid_sample_backward(gy, x, grid))
    x = _data(rng, (2, 2, 3, 4), np.float32)
    theta = _data(rng, (2, 2, 3), np.float32)
    size = (2, 2, 0, 3)
    gy = np.zeros(size, np.float32)
    _all_close(numba_ops.affine_warp_backward(gy, x, theta, size, device="cuda"),
               numba_ops.affine_warp_backward(gy, x, theta, size))
    _close(numba_ops.affine_grid_backward(np.zeros((2, 0, 3, 2), np.float32), size, device="cuda"),
           numba_ops.affine_grid_backward(np.zeros((2, 0, 3, 2), np.float32), size))
    args, kw = _deform_inputs(rng, 2, np.float32)
    gy, x, w, offset, b, mask = args
    args = (gy[:0], x[:0], w, offset[:0], b, mask[:0])
    _all_close(numba_ops.deform_conv_backward(*args, device="cuda", **kw), numba_ops.deform_conv_backward(*args, **kw))

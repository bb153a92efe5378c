"""ms_deform_attn and its backward on CUDA (numba's simulator in CI): the same results
as the CPU kernels within float tolerance (the CUDA kernels sum the corners in
another order than the CPU's interior path, and the value gradient with atomics) for
1-, 2- and 3-D levels, every dtype and ``wrt`` subset; non-finite and huge
locations; device inputs give device results; streams; empty sizes. The shapes are
tiny: the simulator runs every thread in Python.

Every kernel of the two modules' ``compile_jobs()`` is built for sm_80 and sm_90
(libNVVM and ptxas, no GPU) by tests/test_resources.py, which finds no spills.
"""
import numpy as np
import pytest

import numba_ops
from numba_ops import _dispatch
from helpers import BF16, FLOAT16, FLOAT32, FLOAT64, FULL, host

pytestmark = pytest.mark.cuda

SIMULATOR = _dispatch.cuda_simulator()
needs_cuda = pytest.mark.skipif("cuda" not in numba_ops.devices(),
                                reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1 (CI's second pass)")
#: tolerance per dtype, relative to an array's largest magnitude: float32 and float64
#: summed in another order; 16-bit results rounded once from such float32 sums
TOL = {FLOAT64: 1e-10, FLOAT32: 1e-5, FLOAT16: 2e-3, BF16: 1.6e-2}
#: the gradients: sums over more terms (atomic adds in any order)
GRAD_TOL = {**TOL, FLOAT32: 1e-4}
#: the levels per rank: (H, W), (D, H, W), and 1-D (W,)
LEVELS = {1: [(5,), (2,)], 2: [(3, 4), (2, 2)], 3: [(2, 3, 2), (1, 2, 2)]}


def _starts(shapes):
    sizes = [int(np.prod(s)) for s in shapes]
    return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)


def _inputs(rng, r=2, dtype=FLOAT32, N=2, Lq=2, M=2, Dh=3, P=2):
    """(value, shapes, starts, loc, attn): locations inside, across the edges and
    outside every level, a few exactly on an element's centre and on the edges."""
    shapes = np.array(LEVELS[r], np.int64)
    S = int(np.prod(shapes, axis=1).sum())
    L = len(shapes)
    value = rng.standard_normal((N, S, M, Dh))
    loc = rng.uniform(-0.3, 1.3, (N, Lq, M, L, P, r))
    if loc.size:
        flat = loc.reshape(-1, r)
        flat[::5] = 0.5 / shapes[0][::-1]  # the centre of element 0 of level 0
        flat[2::7] = 0.0  # the outer edge
        loc.reshape(-1)[4::9] = 1.0
    attn = rng.standard_normal((N, Lq, M, L, P))
    value, loc, attn = (np.asarray(a, np.float32).astype(dtype) for a in (value, loc, attn))
    return value, shapes, _starts(shapes), loc, attn


def _with_bad_locations(loc):
    """NaN, Inf and huge (finite, far outside) locations at a few points."""
    loc = loc.copy()
    with np.errstate(over="ignore"):  # 1e30 is Inf in 16 bits
        loc[0, 0, 0, 0, 0, 0] = np.nan
        loc[1, 1, 1, 1, 1, -1] = np.inf
        loc[0, 1, 1, 0, 1, 0] = 1e30
        loc[1, 0, 0, 1, 0, -1] = -1e30
    return loc


def _is_device(a):
    from numba_ops.kernels._arrays import is_numba_device_array
    return is_numba_device_array(a)


def _close(got, want, tol, on_device=False):
    """``got`` (CUDA) equals ``want`` (CPU) within ``tol[dtype]`` relative plus that
    times the largest finite magnitude: the same kind of array (a numba device array
    for device inputs), shape, dtype and NaNs."""
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
    t = tol[np.dtype(want.dtype)]
    np.testing.assert_allclose(g, w, rtol=t, atol=t * scale, equal_nan=True)


def _all_close(got, want, on_device=False):
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        _close(g, w, GRAD_TOL, on_device)


def _grad_out(rng, value, loc):
    N, _, M, Dh = value.shape
    return rng.standard_normal((N, loc.shape[1], M * Dh)).astype(np.float32).astype(value.dtype)


# --- forward ----------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT64], ids=lambda d: d.name)
def test_forward_equals_cpu(r, dtype):
    rng = np.random.default_rng([r, 1])
    value, shapes, starts, loc, attn = _inputs(rng, r, dtype)
    got = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn, device="cuda")
    want = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)
    _close(got, want, TOL)
    assert np.isfinite(want).all()


@needs_cuda
@pytest.mark.parametrize("dtype", [FLOAT16, pytest.param(BF16, marks=FULL)], ids=lambda d: d.name)
def test_forward_16bit(dtype):
    """16-bit inputs: computed in float32 and rounded once, as on the CPU."""
    rng = np.random.default_rng(2)
    value, shapes, starts, loc, attn = _inputs(rng, 2, dtype)
    got = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn, device="cuda")
    _close(got, numba_ops.ms_deform_attn(value, shapes, starts, loc, attn), TOL)


@needs_cuda
@pytest.mark.parametrize("r", [2, 3])
def test_forward_bad_locations(r):
    """A non-finite location makes its head's channels NaN (only those); a huge one samples 0."""
    rng = np.random.default_rng([r, 3])
    value, shapes, starts, loc, attn = _inputs(rng, r)
    loc = _with_bad_locations(loc)
    got = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn, device="cuda")
    want = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)
    _close(got, want, TOL)
    Dh = value.shape[3]
    assert np.isnan(got[0, 0, :Dh]).all() and np.isnan(got[1, 1, Dh:]).all()
    assert np.isnan(got).sum() == 2 * Dh
    # a huge location's point adds nothing: as the same point inside with weight 0
    loc0, attn0 = loc.copy(), attn.copy()
    for idx in ((0, 1, 1, 0, 1), (1, 0, 0, 1, 0)):
        loc0[idx] = 0.5
        attn0[idx] = 0
    finite = ~np.isnan(got)
    np.testing.assert_array_equal(
        got[finite], numba_ops.ms_deform_attn(value, shapes, starts, loc0, attn0, device="cuda")[finite])


# --- backward ---------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT64], ids=lambda d: d.name)
def test_backward_equals_cpu(r, dtype):
    rng = np.random.default_rng([r, 4])
    value, shapes, starts, loc, attn = _inputs(rng, r, dtype)
    gy = _grad_out(rng, value, loc)
    got = numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn, device="cuda")
    want = numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn)
    _all_close(got, want)
    assert all(np.isfinite(w).all() for w in want)


@needs_cuda
@pytest.mark.parametrize("dtype", [FLOAT16, pytest.param(BF16, marks=FULL)], ids=lambda d: d.name)
def test_backward_16bit(dtype):
    """16-bit: the value gradient accumulated in float32 (atomics) and rounded once."""
    rng = np.random.default_rng(5)
    value, shapes, starts, loc, attn = _inputs(rng, 3, dtype)
    gy = _grad_out(rng, value, loc)
    _all_close(numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn, device="cuda"),
               numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn))


@needs_cuda
@pytest.mark.parametrize("wrt", [["value"], ["sampling_locations"], ["attention_weights"],
                                 ["sampling_locations", "attention_weights"], []],
                         ids=["value", "loc", "attn", "loc+attn", "none"])
def test_backward_wrt(wrt):
    rng = np.random.default_rng(6)
    value, shapes, starts, loc, attn = _inputs(rng, 2)
    gy = _grad_out(rng, value, loc)
    got = numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn, wrt=wrt, device="cuda")
    want = numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn, wrt=wrt)
    assert [g is None for g in got] == [name not in wrt for name in
                                        ("value", "sampling_locations", "attention_weights")]
    _all_close(got, want)


@needs_cuda
@pytest.mark.parametrize("r", [2, 3])
def test_backward_bad_locations(r):
    """A non-finite location: NaN for its own location (every coordinate) and weight
    gradients, nothing scattered into value's; a huge one: zero gradients of its own."""
    rng = np.random.default_rng([r, 7])
    value, shapes, starts, loc, attn = _inputs(rng, r)
    loc = _with_bad_locations(loc)
    gy = _grad_out(rng, value, loc)
    got = numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn, device="cuda")
    want = numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn)
    _all_close(got, want)
    gv, gl, ga = got
    assert np.isfinite(gv).all()
    for idx in ((0, 0, 0, 0, 0), (1, 1, 1, 1, 1)):
        assert np.isnan(gl[idx]).all() and np.isnan(ga[idx])
    assert np.isnan(gl).sum() == 2 * r and np.isnan(ga).sum() == 2
    for idx in ((0, 1, 1, 0, 1), (1, 0, 0, 1, 0)):
        assert (gl[idx] == 0).all() and ga[idx] == 0
    # the value gradient: as if the non-finite points' weights were 0
    attn0 = attn.copy()
    attn0[0, 0, 0, 0, 0] = 0
    attn0[1, 1, 1, 1, 1] = 0
    _close(gv, numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn0, wrt=["value"])[0],
           GRAD_TOL)


@needs_cuda
def test_more_work_than_threads():
    """More output elements and points than the launch has threads (the simulator
    launches few): the grid-stride loops cover the rest."""
    from numba_ops.kernels.cuda import _device
    rng = np.random.default_rng(11)
    value, shapes, starts, loc, attn = _inputs(rng, 2, Lq=9)
    assert value.shape[0] * loc.shape[1] * value.shape[2] * value.shape[3] > _device.MAX_BLOCKS * _device.THREADS \
        or not SIMULATOR
    gy = _grad_out(rng, value, loc)
    _close(numba_ops.ms_deform_attn(value, shapes, starts, loc, attn, device="cuda"),
           numba_ops.ms_deform_attn(value, shapes, starts, loc, attn), TOL)
    _all_close(numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn, device="cuda"),
               numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn))


# --- device inputs, streams, empty calls ------------------------------------------------

@needs_cuda
def test_device_inputs_give_device_results():
    from numba import cuda
    rng = np.random.default_rng(8)
    value, shapes, starts, loc, attn = _inputs(rng, 2)
    gy = _grad_out(rng, value, loc)
    want = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)
    want_g = numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn)
    dv, dl, da, dg = (cuda.to_device(a) for a in (value, loc, attn, gy))
    # device=None follows the device inputs; shapes and starts may be NumPy or device arrays
    _close(numba_ops.ms_deform_attn(dv, shapes, starts, dl, da), want, TOL, True)
    _close(numba_ops.ms_deform_attn(dv, cuda.to_device(shapes), cuda.to_device(starts), dl, da), want, TOL, True)
    _all_close(numba_ops.ms_deform_attn_backward(dg, dv, shapes, starts, dl, da), want_g, True)
    # one device input is enough; a strided one is packed first
    wide = np.zeros(value.shape[:3] + (2 * value.shape[3],), value.dtype)
    wide[..., ::2] = value
    _close(numba_ops.ms_deform_attn(cuda.to_device(wide)[..., ::2], shapes, starts, loc, attn), want, TOL, True)
    _all_close(numba_ops.ms_deform_attn_backward(gy, cuda.to_device(wide)[..., ::2], shapes, starts, loc, attn),
               want_g, True)


@needs_cuda
def test_streams():
    """A numba stream with device inputs (asynchronous on it: synchronised before
    reading) and with NumPy inputs (the call returns after the copy back), and an
    integer handle (0: the legacy default stream)."""
    from numba import cuda
    rng = np.random.default_rng(9)
    value, shapes, starts, loc, attn = _inputs(rng, 3, FLOAT64)
    gy = _grad_out(rng, value, loc)
    want = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)
    want_g = numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn)
    stream = cuda.stream()
    dv, dl, da, dg = (cuda.to_device(a, stream=stream) for a in (value, loc, attn, gy))
    out = numba_ops.ms_deform_attn(dv, shapes, starts, dl, da, stream=stream)
    grads = numba_ops.ms_deform_attn_backward(dg, dv, shapes, starts, dl, da, stream=stream)
    stream.synchronize()
    _close(out, want, TOL, True)
    _all_close(grads, want_g, True)
    for s in (stream, 0):
        _close(numba_ops.ms_deform_attn(value, shapes, starts, loc, attn, device="cuda", stream=s), want, TOL)
        _all_close(numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn, device="cuda", stream=s),
                   want_g)
    with pytest.raises(TypeError, match="stream"):
        numba_ops.ms_deform_attn(value, shapes, starts, loc, attn, device="cuda", stream="fast")


@needs_cuda
@pytest.mark.parametrize("empty", ["N", "Lq", "P", "M", "Dh", "L"])
def test_empty_sizes(empty):
    """A zero size: results of the right shapes, as on the CPU (zeros where something is
    left to differentiate)."""
    rng = np.random.default_rng(10)
    sizes = dict(N=2, Lq=2, M=2, Dh=3, P=2)
    if empty == "L":
        value = np.zeros((2, 0, 2, 3), np.float32)
        shapes, starts = np.zeros((0, 2), np.int64), np.zeros(0, np.int64)
        loc = np.zeros((2, 2, 2, 0, 2, 2), np.float32)
        attn = np.zeros((2, 2, 2, 0, 2), np.float32)
    else:
        sizes[empty] = 0
        value, shapes, starts, loc, attn = _inputs(rng, 2, **sizes)
        loc = _with_bad_locations(loc) if loc.size else loc  # no channels: no NaN either, as on the CPU
    gy = _grad_out(rng, value, loc)
    want = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)
    _close(numba_ops.ms_deform_attn(value, shapes, starts, loc, attn, device="cuda"), want, TOL)
    _all_close(numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn, device="cuda"),
               numba_ops.ms_deform_attn_backward(gy, value, shapes, starts, loc, attn))
    from numba import cuda
    got = numba_ops.ms_deform_attn(cuda.to_device(value), shapes, starts, loc, attn)
    assert _is_device(got) and got.shape == want.shape

"""AffineGrid: conformance, oracles, dtypes, edges, errors, threads — on every device."""
import threading

import numpy as np
import pytest

import numba_ops
from helpers import BF16, host
from reference import affine_grid_ref, assert_api_close, ulp_diff
from seed_examples import AFFINE_GRID_EXAMPLES

SHAPES = [(1, 1, 1, 1), (2, 3, 1, 5), (2, 1, 4, 1), (3, 2, 5, 7), (1, 1, 2, 3, 4), (2, 1, 1, 3, 1), (2, 2, 3, 4, 5)]


def _theta(rng, n, nd, dtype=np.float64):
    return rng.standard_normal((n, nd, nd + 1)).astype(dtype)


@pytest.mark.parametrize("name", sorted(AFFINE_GRID_EXAMPLES))
def test_seed_examples(name, device):
    theta, size, align, expected = AFFINE_GRID_EXAMPLES[name]
    got = numba_ops.affine_grid(theta, size, align, device=device)
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert_api_close(host(got), expected, np.float32)


def test_onnx_backend_cases(device):
    from numba_ops.benchmark.cases import onnx_backend_cases
    cases = [c for c in onnx_backend_cases() if c.op == "AffineGrid"]
    assert len(cases) >= 4
    for case in cases:
        got = numba_ops.affine_grid(*case.inputs, device=device, **case.attrs)
        want = case.expected
        assert_api_close(host(got), want, want.dtype)


@pytest.mark.parametrize("size", SHAPES)
@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_float64_oracle(size, align, dtype, device, rng):
    theta = _theta(rng, size[0], len(size) - 2, dtype) * 3
    want = affine_grid_ref(theta, size, align)
    got = numba_ops.affine_grid(theta, size, align_corners=align, device=device)
    assert got.dtype == dtype and got.shape == want.shape
    assert_api_close(got, want, dtype)


@pytest.mark.parametrize("size", [(2, 1, 2, 3, 1100), (3, 1, 5, 7, 1100)])
@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_3d_long_rows(size, align, dtype, rng):
    """The oracle test on long 3-D rows (3300 elements), few to a slab, CPU only
    (too large for the simulator): serial (first size) and parallel (second) runs,
    chunks starting inside a slab."""
    test_float64_oracle(size, align, dtype, "cpu", rng)


@pytest.mark.parametrize("size", [(2, 3, 4, 6), (2, 1, 3, 4, 5), (3, 1, 33, 17)])
@pytest.mark.parametrize("align", [0, 1])
def test_onnxruntime(size, align, rng):
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper
    for dtype, tp, rtol in ((np.float32, TensorProto.FLOAT, 1e-5), (np.float64, TensorProto.DOUBLE, 1e-12)):
        theta = _theta(rng, size[0], len(size) - 2, dtype)
        node = helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=align)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("theta", tp, theta.shape),
                                               helper.make_tensor_value_info("size", TensorProto.INT64, [len(size)])],
                                  [helper.make_tensor_value_info("grid", tp, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        want = sess.run(None, {"theta": theta, "size": np.array(size, np.int64)})[0]
        got = numba_ops.affine_grid(theta, size, align)
        np.testing.assert_allclose(got, want, rtol=max(rtol, 1e-6), atol=max(rtol, 1e-6) * np.abs(want).max())


@pytest.mark.parametrize("dtype", [np.float16, BF16])
@pytest.mark.parametrize("size", [(2, 1, 5, 7), (2, 1, 3, 4, 5)])
@pytest.mark.parametrize("align", [0, 1])
def test_16bit_is_float32_rounded_once(dtype, size, align, device, rng):
    theta = _theta(rng, size[0], len(size) - 2, np.float32).astype(dtype)
    want32 = numba_ops.affine_grid(theta.astype(np.float32), size, align, device="cpu")
    got = numba_ops.affine_grid(theta, size, align, device=device)
    assert got.dtype == np.dtype(dtype) and got.shape == want32.shape
    assert ulp_diff(host(got), want32, dtype).max() <= 1


@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_16bit_specials(dtype):
    """Overflow to inf, NaN propagation and subnormals survive the in-kernel rounding."""
    big = 60000.0 if dtype == np.float16 else 3e38
    theta = np.array([[[big, 0, big], [np.nan, 0, 1e-6]]], np.float32).astype(dtype)
    got = numba_ops.affine_grid(theta, [1, 1, 1, 2], True).astype(np.float32)
    with np.errstate(over="ignore"):
        want = affine_grid_ref(theta.astype(np.float32), [1, 1, 1, 2], True).astype(np.float32).astype(dtype)
    np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("nd", [2, 3])
def test_bf16_every_nan_payload_stays_nan(nd):
    """Each bfloat16 NaN payload in theta gives NaN (the CPU rounding has no NaN branch)."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    nans = bits[(bits & 0x7FFF) > 0x7F80].view(BF16)
    theta = np.zeros((nans.size, nd, nd + 1), BF16)
    theta[:, 0, 0] = nans
    size = [nans.size, 1] + [2] * nd
    got = numba_ops.affine_grid(theta, size, True).astype(np.float32)
    assert np.isnan(got[..., 0]).all() and (got[..., 1:] == 0).all()


def test_large_16bit_matches_upcast(rng):
    """A parallel-sized grid: exercises the prange path for 16-bit stores."""
    theta = _theta(rng, 4, 2, np.float32).astype(np.float16)
    got = numba_ops.affine_grid(theta, [4, 1, 96, 128], False)
    want = numba_ops.affine_grid(theta.astype(np.float32), [4, 1, 96, 128], False)
    assert ulp_diff(got, want, np.float16).max() <= 1


@pytest.mark.parametrize("size", [(0, 3, 4, 5), (2, 3, 0, 5), (2, 3, 4, 0), (0, 1, 2, 3, 4), (1, 1, 2, 0, 4)])
def test_zero_sizes(size, device):
    nd = len(size) - 2
    theta = np.zeros((size[0], nd, nd + 1), np.float32)
    got = numba_ops.affine_grid(theta, size, device=device)
    assert got.shape == (size[0],) + tuple(size[2:]) + (nd,) and got.dtype == np.float32
    if size[0] == 0:  # N = 0 asks for an empty grid, whatever the count of matrices
        got = numba_ops.affine_grid(np.ones((2, nd, nd + 1), np.float32), size, device=device)
        assert got.shape == (0,) + tuple(size[2:]) + (nd,) and got.dtype == np.float32


def test_length_one_axes_are_zero(device):
    theta = np.array([[[1.0, 2.0, 0.5], [3.0, 4.0, -0.5]]])
    for align in (0, 1):
        got = numba_ops.affine_grid(theta, [1, 1, 1, 1], align, device=device)
        np.testing.assert_array_equal(got, [[[[0.5, -0.5]]]])


@pytest.mark.parametrize("size_like", [[1, 1, 2, 3], (1, 1, 2, 3), np.array([1, 1, 2, 3]),
                                       np.array([1, 1, 2, 3], np.int32), np.array([1, 1, 2, 3], np.uint8),
                                       [np.uint64(1), np.int64(1), 2, np.int8(3)]])  # NumPy mixes these to float
def test_size_forms(size_like):
    theta = np.eye(2, 3)[None]
    assert numba_ops.affine_grid(theta, size_like).shape == (1, 2, 3, 2)


def test_align_corners_forms():
    theta = np.eye(2, 3)[None]
    ref = numba_ops.affine_grid(theta, [1, 1, 2, 3], True)
    for v in (1, np.int64(1), np.bool_(True)):
        np.testing.assert_array_equal(numba_ops.affine_grid(theta, [1, 1, 2, 3], v), ref)
    for bad in (2, -1, 0.5, 1.0, "1", None, [1]):
        with pytest.raises(ValueError, match="align_corners"):
            numba_ops.affine_grid(theta, [1, 1, 2, 3], bad)


def test_non_contiguous_and_not_modified(device, rng):
    base = rng.standard_normal((4, 3, 6))
    theta = base[::-2, ::-1, ::2][:, 1:, :]  # (2, 2, 3), negative strides
    assert not theta.flags.c_contiguous
    before = theta.copy()
    got = numba_ops.affine_grid(theta, [2, 1, 3, 4], device=device)
    np.testing.assert_array_equal(theta, before)
    assert_api_close(host(got), affine_grid_ref(before, [2, 1, 3, 4], 0), np.float64)



@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_non_native_byte_order(dtype, device, rng):
    """A big-endian theta is its dtype: the same grid (in native order), twice (the
    second call is a validated shape); theta untouched."""
    theta = rng.standard_normal((2, 2, 3)).astype(dtype)
    want = host(numba_ops.affine_grid(theta, [2, 1, 3, 4], device=device))
    swapped = theta.astype(theta.dtype.newbyteorder(">"))
    for _ in range(2):
        got = host(numba_ops.affine_grid(swapped, [2, 1, 3, 4], device=device))
        assert got.dtype == np.dtype(dtype) and got.dtype.isnative
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(swapped, theta)

@pytest.mark.parametrize("theta_shape,size,match", [
    ((1, 2, 3), [1, 1, 2], "size"),
    ((1, 2, 3), [1, 1, 2, 3, 4, 5], "size"),
    ((1, 2, 3), [1, 1, -2, 3], "size"),
    ((1, 2, 3), [[1, 1, 2, 3]], "size"),
    ((1, 2, 3), [1, 1, 2.5, 3], "size"),
    ((1, 2, 3), "1123", "size"),
    ((1, 2, 3), [2, 1, 2, 3], "theta"),
    ((0, 2, 3), [2, 1, 2, 3], "theta"),
    ((1, 2, 3), [0, 1, 2, 3, 4], "theta"),  # N = 0, but 2-D matrices for a 3-D size
    ((1, 3, 4), [1, 1, 2, 3], "theta"),
    ((1, 2, 3), [1, 1, 2, 3, 4], "theta"),
    ((2, 3), [1, 1, 2, 3], "theta"),
    ((1, 2, 4), [1, 1, 2, 3], "theta"),
    ((1, 2, 3), [1, 1, 2 ** 40, 2 ** 40], "size"),  # too large to allocate
    ((1, 2, 3), [np.uint64(1), 1, 2.5, 3], "size"),
    ((1, 2, 3), [1, 1, 2, 2 ** 70], "size.*too large"),  # an integer past 64 bits is still an integer
    ((1, 2, 3), None, "size.*got NoneType None"),
    ((1, 2, 3), 4, "size.*got int 4"),
    ((1, 2, 3), {1, 2, 3, 4}, "size.*got set"),
])
def test_bad_shapes(theta_shape, size, match):
    with pytest.raises(ValueError, match=match):
        numba_ops.affine_grid(np.zeros(theta_shape, np.float32), size)


@pytest.mark.parametrize("size,align,match", [
    ([1, 1, 2.0, 3], 0, "size"), ((1, 1, 2, np.float64(3)), 0, "size"), ([1, 1, 2, True], 0, "size"),
    ([1, 1, 2, [3]], 0, "size"), ([1, 1, 2, 3], 1.0, "align_corners"), ([1, 1, 2, 3], 2, "align_corners"),
    (np.array([1, 1, 2, 3.0]), 0, "size"), (np.array([1, 1, 2, 3], np.float32), 1, "size"),
    (np.array([[1, 1, 2, 3]]), 0, "size"), (np.array([1, 1, 2, 3]), 1.0, "align_corners"),
    (np.array([1, 1, 2, 3.0], object), 0, "size"), (np.array([1, 1, 2, True], object), 0, "size"),
])
def test_bad_call_after_valid_call(size, align, match):
    """A call cached as valid (same shapes, equal values) does not make a float, bool or
    nested size, or a float align_corners, valid."""
    theta = np.zeros((1, 2, 3), np.float32)
    numba_ops.affine_grid(theta, [1, 1, 2, 3], 0)
    numba_ops.affine_grid(theta, (1, 1, 2, 3), 1)
    numba_ops.affine_grid(theta, np.array([1, 1, 2, 3]), 0)
    numba_ops.affine_grid(theta, np.array([1, 1, 2, 3], object), 0)  # Python ints, as objects
    with pytest.raises(ValueError, match=match):
        numba_ops.affine_grid(theta, size, align)


def test_missing_or_ragged_theta():
    with pytest.raises(ValueError, match="theta"):
        numba_ops.affine_grid(None, [1, 1, 2, 3])
    with pytest.raises(ValueError, match="theta"):
        numba_ops.affine_grid([[[1, 0, 0], [0, 1]]], [1, 1, 2, 3])


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.complex64, np.bool_, np.float128 if hasattr(np, "float128") else np.int8])
def test_bad_dtype(dtype):
    with pytest.raises(TypeError, match="theta"):
        numba_ops.affine_grid(np.zeros((1, 2, 3), dtype), [1, 1, 2, 3])


def test_dispatcher_takes_the_kernels_dtypes(monkeypatch):
    """The kernel table reads the dtypes each kernel module declares: a backend that
    does not take a dtype is a TypeError naming the ones it does."""
    import numba_ops.kernels.cpu.affine_grid as kernels
    from numba_ops._dispatch import launcher
    monkeypatch.setattr(kernels, "DTYPES", ("float32", "float64"))
    launcher.cache_clear()
    try:
        with pytest.raises(TypeError, match="affine_grid on cpu takes float32, float64; got float16"):
            numba_ops.affine_grid(np.zeros((1, 2, 3), np.float16), [1, 1, 2, 3])
        assert numba_ops.affine_grid(np.zeros((1, 2, 3), np.float32), [1, 1, 2, 3]).shape == (1, 2, 3, 2)
    finally:
        launcher.cache_clear()  # the next call reads the real table again


def test_bad_device():
    theta = np.zeros((1, 2, 3), np.float32)
    for bad in ("gpu", "CPU", 0, "cuda:0"):
        with pytest.raises(ValueError, match="device"):
            numba_ops.affine_grid(theta, [1, 1, 2, 3], device=bad)


def test_nan_inf_theta(device):
    theta = np.array([[[np.nan, 0, 0], [np.inf, 1, 0]]], np.float32)
    got = host(numba_ops.affine_grid(theta, [1, 1, 2, 2], device=device))
    assert np.isnan(got[..., 0]).all() and np.isinf(got[..., 1]).all()


def test_threads_match_serial(rng):
    thetas = [_theta(rng, 2, 2 + (i % 2), np.float32) for i in range(16)]
    sizes = [(2, 1, 64 + i, 96) if i % 2 == 0 else (2, 1, 8, 16 + i, 24) for i in range(16)]
    serial = [numba_ops.affine_grid(t, s, i % 2) for i, (t, s) in enumerate(zip(thetas, sizes))]
    results = [None] * 16

    def work(i):
        for _ in range(3):
            results[i] = numba_ops.affine_grid(thetas[i], sizes[i], i % 2)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for want, got in zip(serial, results):
        np.testing.assert_array_equal(got, want)

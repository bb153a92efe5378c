"""GridSample: the ONNX reference, onnxruntime, a float64 oracle, dtypes, edges,
errors, threads — written once for every device."""

import numpy as np
import pytest

import numba_ops
from helpers import BF16, FULL, MODES, PADS, host, in_default, matrix
from reference import assert_api_close, grid_sample_ref, in_threads, to_uint8_ref, ulp_diff

#: (x shape, output spatial shape) per number of spatial axes, with axes of size 1
SHAPES = {1: [((2, 3, 7), (5,)), ((1, 2, 1), (4,))],
          2: [((2, 3, 5, 6), (4, 3)), ((1, 2, 1, 4), (2, 5)), ((1, 1, 3, 1), (1, 1))],
          3: [((1, 2, 3, 4, 5), (2, 3, 2)), ((2, 1, 1, 3, 2), (3, 1, 2))]}


def _grid(rng, n, outs, r, dtype=np.float32, spread=1.3):
    """Random grid, most positions inside, some outside, plus exact -1, 0, 1."""
    g = rng.standard_normal((n,) + tuple(outs) + (r,)) * spread
    flat = g.reshape(-1)
    flat[: min(3, flat.size)] = [-1.0, 0.0, 1.0][: min(3, flat.size)]
    return g.astype(dtype)


def _ct(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def gs(x, grid, device, **kw):
    return host(numba_ops.grid_sample(x, grid, device=device, **kw))


# --- peers -----------------------------------------------------------------------------

def _onnx_reference(x, grid, **attrs):
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator
    tp = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE}[x.dtype]
    node = helper.make_node("GridSample", ["X", "grid"], ["Y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", tp, x.shape),
                                           helper.make_tensor_value_info("grid", tp, grid.shape)],
                              [helper.make_tensor_value_info("Y", tp, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    return ReferenceEvaluator(model).run(None, {"X": x, "grid": grid})[0]


@pytest.mark.parametrize(*matrix(r=[1, 2, 3], mode=MODES, padding=PADS, align=[0, 1]))
def test_onnx_reference(r, mode, padding, align, device, rng):
    """onnx's ReferenceEvaluator. It clamps/reflects the position itself before
    cubic's taps, where the contract (onnxruntime's) pads each tap: for cubic with
    border/reflection the grid stays inside, where both agree."""
    pytest.importorskip("onnx")
    xs, outs = {1: ((1, 2, 6), (7,)), 2: ((1, 2, 4, 5), (3, 4)), 3: ((1, 2, 3, 4, 3), (2, 2, 3))}[r]
    x = rng.standard_normal(xs).astype(np.float32)
    if mode == "cubic" and padding != "zeros":
        grid = rng.uniform(-1, 1, (1,) + outs + (r,)).astype(np.float32)
    else:
        grid = _grid(rng, 1, outs, r)
    attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
    want = _onnx_reference(x, grid, **attrs)
    got = gs(x, grid, device, **attrs)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert_api_close(got, want, np.float32)


@pytest.mark.parametrize(*matrix(r=[2, 3], mode=MODES, padding=PADS, align=[0, 1], dtype=[np.float32, np.float64]))
def test_onnxruntime(r, mode, padding, align, dtype, device, rng):
    """onnxruntime (float32 and float64): 2-D every mode, 3-D linear and nearest
    (it has no 3-D cubic); grids reaching well outside."""
    ort = pytest.importorskip("onnxruntime")
    if r == 3 and mode == "cubic":
        pytest.skip("onnxruntime has no 3-D cubic GridSample")
    from onnx import TensorProto, helper
    xs, outs = ((2, 3, 5, 6), (4, 5)) if r == 2 else ((2, 2, 3, 4, 5), (3, 2, 4))
    tp = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    x = rng.standard_normal(xs).astype(dtype)
    grid = _grid(rng, xs[0], outs, r, dtype, spread=2.0)
    node = helper.make_node("GridSample", ["X", "grid"], ["Y"], mode=mode, padding_mode=padding,
                            align_corners=align)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", tp, x.shape),
                                           helper.make_tensor_value_info("grid", tp, grid.shape)],
                              [helper.make_tensor_value_info("Y", tp, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"X": x, "grid": grid})[0]
    got = gs(x, grid, device, mode=mode, padding_mode=padding, align_corners=align)
    assert got.dtype == dtype
    assert_api_close(got, want, dtype)


# --- the float64 oracle --------------------------------------------------------------------

@pytest.mark.parametrize(*matrix(r=[1, 2, 3], mode=MODES, padding=PADS, align=[0, 1],
                                dtype=[np.float32, np.float64]))
def test_float64_oracle(r, mode, padding, align, dtype, device, rng):
    """Every mode x padding x align_corners in 1-D, 2-D and 3-D (3-D cubic and 1-D
    have no peer), with axes of size 1 in x and in the output."""
    for xs, outs in SHAPES[r]:
        x = rng.standard_normal(xs).astype(dtype)
        grid = _grid(rng, xs[0], outs, r, dtype, spread=2.0)
        attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
        want = grid_sample_ref(x, grid, coord_dtype=_ct(dtype), **attrs)
        got = gs(x, grid, device, **attrs)
        assert got.dtype == dtype and got.shape == want.shape
        assert_api_close(got, want, dtype)


@pytest.mark.parametrize(*matrix(dict(dtype=np.float64), mode=MODES, padding=PADS, align=[0, 1]))
def test_coordinates_not_rounded_to_float32(mode, padding, align, device, rng):
    """float64 positions are unnormalised in float64: against the oracle's float64
    positions on a long axis (where float32 would move them)."""
    x = rng.standard_normal((1, 2, 3, 3000))
    grid = rng.uniform(-1.2, 1.2, (1, 2, 40, 2))
    attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
    want = grid_sample_ref(x, grid, **attrs)
    assert_api_close(gs(x, grid, device, **attrs), want, np.float64)


@pytest.mark.parametrize(*matrix(dict(dtype=np.float64), mode=MODES, padding=PADS))
def test_nonfinite_x(mode, padding, device, rng):
    """Inf/NaN in x reach only the samples whose taps read them: a zeros-padded tap
    outside counts an exact 0 even where its clamped index holds an Inf, and a
    position wholly outside is 0."""
    x = rng.standard_normal((1, 2, 4, 5))
    x[0, 0, 0, :] = np.inf  # the first row: where clamped taps above the image read
    x[0, 1, :, -1] = np.nan  # the last column: where clamped taps right of it read
    grid = _grid(rng, 1, (6, 7), 2, np.float64, spread=1.5)
    attrs = dict(mode=mode, padding_mode=padding)
    with np.errstate(invalid="ignore"):
        want = grid_sample_ref(x, grid, **attrs)
    got = gs(x, grid, device, **attrs)
    assert_api_close(got, want, np.float64)
    if padding == "zeros":
        far = gs(x, np.full((1, 1, 1, 2), 5.0), device, **attrs)
        assert (far == 0).all()


# --- special positions ---------------------------------------------------------------------

SPECIALS = [np.nan, np.inf, -np.inf, 1e30, -1e30, 3e38, -3e38, 2.0 ** 63, -(2.0 ** 62), 1.0, -1.0, 0.0,
            1e-30, -1.0000001, 1.0000001, 7.5, -7.5]


@pytest.mark.parametrize(*matrix(mode=MODES, padding=PADS, align=[0, 1], dtype=[np.float32, np.float64]))
def test_special_positions(mode, padding, align, dtype, device, rng):
    """NaN/Inf positions sample NaN, huge finite ones never read out of bounds (and
    under reflection are reduced exactly), borders and far values, in each axis."""
    vals = np.array(SPECIALS)
    pairs = np.array([(a, b) for a in vals for b in vals[:: 3]])  # each special against others, both axes
    pairs = np.concatenate([pairs, pairs[:, ::-1]])
    grid = pairs.reshape(1, 2, -1, 2).astype(dtype)
    x = rng.standard_normal((1, 2, 4, 5)).astype(dtype)
    attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
    with np.errstate(over="ignore", invalid="ignore"):
        want = grid_sample_ref(x, grid, coord_dtype=_ct(dtype), **attrs)
    got = gs(x, grid, device, **attrs)
    assert_api_close(got, want, dtype)
    g64 = grid.astype(np.float64)
    nonfinite = ~np.isfinite(g64).all(-1)
    assert np.isnan(got[:, :, nonfinite[0]]).all()


@pytest.mark.parametrize(*matrix(dict(mode="nearest"), padding=PADS, align=[0, 1], r=[1, 2, 3]))
def test_nearest_ties_round_to_even(padding, align, r, device):
    """Positions exactly half-way between two elements go to the even one (before
    padding): position p = k + 0.5 reads element 2 * round(p / 2)."""
    L = 5 if align else 4  # so that the grid values below are exact in binary
    pos = np.arange(-3, 2 * L + 3) + 0.5  # every half-integer, inside and out
    g = 2 * pos / (L - 1) - 1 if align else (2 * pos + 1) / L - 1  # exact in binary
    grid = np.zeros((1, g.size) + (1,) * (r - 1) + (r,), np.float32)
    grid[..., 0] = g.reshape(grid.shape[:-1])
    x = np.zeros((1, 1) + (1,) * (r - 1) + (L,), np.float32)
    x[..., :] = np.arange(L) + 10
    got = gs(x, grid, device, mode="nearest", padding_mode=padding, align_corners=align).reshape(-1)
    want = grid_sample_ref(x, grid, mode="nearest", padding_mode=padding, align_corners=align,
                           coord_dtype=np.float32).reshape(-1)
    np.testing.assert_array_equal(got, want)
    inside = (pos > 0) & (pos < L - 1)
    np.testing.assert_array_equal(got[inside], 10 + 2 * np.round(pos[inside] / 2))


# --- dtypes -----------------------------------------------------------------------------------

@pytest.mark.parametrize(*matrix(dtype=[np.float16, BF16], mode=MODES, r=[1, 2, 3], padding=PADS))
def test_16bit_is_float32_rounded_once(dtype, mode, r, padding, device, rng):
    xs, outs = SHAPES[r][0]
    x = rng.standard_normal(xs).astype(dtype)
    grid = _grid(rng, xs[0], outs, r, dtype)
    want32 = numba_ops.grid_sample(x.astype(np.float32), grid.astype(np.float32), mode=mode,
                                   padding_mode=padding, device="cpu")
    got = gs(x, grid, device, mode=mode, padding_mode=padding)
    assert got.dtype == np.dtype(dtype) and got.shape == want32.shape
    assert ulp_diff(got, want32, dtype).max() <= 1


@pytest.mark.parametrize(*matrix(dict(dtype=np.uint8), gdtype=[np.float16, BF16, np.float32, np.float64], mode=MODES,
                                padding=PADS))
def test_uint8(gdtype, mode, padding, device, rng):
    """uint8 x: computed in float, truncated toward zero, clamped to 0..255 (cubic
    overshoots both ends here); a non-finite position gives 0."""
    x = rng.integers(0, 256, (2, 3, 4, 5)).astype(np.uint8)
    x[0, 0] = np.tile([0, 255], 10).reshape(4, 5)  # sharp edges: cubic overshoots
    grid = _grid(rng, 2, (3, 6), 2, gdtype)
    grid[1, 0, 0, 0] = np.nan
    got = gs(x, grid, device, mode=mode, padding_mode=padding)
    assert got.dtype == np.uint8
    v = grid_sample_ref(x, grid, mode=mode, padding_mode=padding, coord_dtype=_ct(gdtype))
    want = to_uint8_ref(v)
    assert got[1, :, 0, 0].tolist() == [0, 0, 0]
    # float32 vs float64 arithmetic may move a value across an integer: one off, only there
    near_int = np.abs(v - np.round(v)) < 1e-3 * np.maximum(1, np.abs(v))
    diff = np.abs(got.astype(int) - want.astype(int))
    assert diff.max() <= 1 and (diff[~near_int] == 0).all()
    if mode == "cubic":
        assert ((v < 0) | (v > 255)).any()  # the clamp is exercised


# --- shapes, layouts, paths ---------------------------------------------------------------------

@pytest.mark.parametrize("r", [1, 2, 3])
def test_empty(r, device):
    for n, outs, c in ((0, (2,) * r, 3), (2, (0,) + (2,) * (r - 1), 3), (2, (2,) * r, 0)):
        xx = np.ones((n, c) + (4,) * r, np.float32)
        g = np.zeros((n,) + outs + (r,), np.float32)
        got = numba_ops.grid_sample(xx, g, device=device)
        assert got.shape == (n, c) + outs and got.dtype == np.float32
    # an empty input spatial axis is fine when there is nothing to sample
    got = numba_ops.grid_sample(np.ones((2, 3) + (0,) * r), np.zeros((2,) + (0,) * r + (r,)), device=device)
    assert got.shape == (2, 3) + (0,) * r


def test_noncontiguous_and_unchanged(device, rng):
    x = rng.standard_normal((3, 4, 6, 10)).astype(np.float32)
    grid = _grid(rng, 3, (5, 8), 2)
    want = gs(np.ascontiguousarray(x[::-1, :, :, ::2].transpose(0, 1, 3, 2)),
              np.ascontiguousarray(grid[:, ::-1, ::2]), device)
    xv = x[::-1, :, :, ::2].transpose(0, 1, 3, 2)  # negative and permuted strides
    gv = grid[:, ::-1, ::2]
    x0, g0 = x.copy(), grid.copy()
    got = gs(xv, gv, device)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(grid, g0)
    big_endian = gs(x.astype(">f4"), grid.astype(">f4"), device)
    np.testing.assert_array_equal(big_endian, gs(x, grid, device))


@pytest.mark.parametrize(*matrix(dict(padding="reflection"), mode=MODES))
def test_parallel_equals_serial(mode, rng):
    """A call above the pool's threshold (parallel segments, some partial) equals
    the same images sampled one call each (serial), CPU."""
    x = rng.standard_normal((6, 2, 20, 30)).astype(np.float32)
    grid = _grid(rng, 6, (37, 100), 2)
    whole = numba_ops.grid_sample(x, grid, mode=mode, padding_mode="reflection")
    parts = [numba_ops.grid_sample(x[i:i + 1], grid[i:i + 1, :5], mode=mode, padding_mode="reflection")
             for i in range(6)]
    np.testing.assert_array_equal(whole[:, :, :5], np.concatenate(parts))
    want = grid_sample_ref(x[:1, :, :, :], grid[:1, :2], mode=mode, padding_mode="reflection",
                           coord_dtype=np.float32)
    assert_api_close(whole[:1, :, :2], want, np.float32)


@pytest.mark.parametrize(*matrix(dict(padding="reflection"), r=[1, 2, 3], mode=MODES, align=[0, 1],
                                dtype=[np.float32, np.float64]))
def test_reflection_sorted_segments(r, mode, align, dtype, rng):
    """Reflection padding sorts a segment into interior and padded positions where its
    first, middle and last positions are interior (CPU): such segments, holding also
    positions outside, on the borders, huge and non-finite, give every other position
    the same bits as when the probes are outside (every position padded), and match
    the float64 oracle."""
    def probes(s0, m):
        return (s0, s0 + m // 2, s0 + m - 1)
    _check_sorted_segments(r, mode, "reflection", align, dtype, 0.2, probes, rng)


@pytest.mark.parametrize(*matrix(dict(padding="border"), r=[1, 2, 3], mode=MODES, dtype=[np.float32, np.float64],
                                special=[0.2, 0.02]))
def test_border_sorted_segments(r, mode, dtype, special, rng):
    """Border padding sorts a segment into interior and padded positions where few of
    every 8th position are not interior (CPU); its padded positions get their taps one
    by one where they are few (``special`` 0.02), else all positions get them and
    blocks of mixed kinds go through them (0.2). Either way every other position has
    the same bits as when the probes are outside (every position padded), and the
    result matches the float64 oracle."""
    def probes(s0, m):
        return range(s0, s0 + m, 8)
    _check_sorted_segments(r, mode, "border", 0, dtype, special, probes, rng)


def _check_sorted_segments(r, mode, padding, align, dtype, special, probes_of, rng):
    """Positions mostly interior, a share ``special`` of coordinates special; the
    positions ``probes_of(s0, m)`` of each segment interior (sorted) or outside (every
    position padded): the other positions' bits agree, and the oracle's values."""
    from numba_ops.kernels.cpu.grid_sample import SEG
    n, P = 2, 2 * SEG + 88  # per image: two whole segments and a part
    x = rng.standard_normal((n, 2) + (6,) * r).astype(dtype)
    g = rng.uniform(-0.7, 0.7, (n, P, r))  # mostly interior
    specials = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 1.0, -1.0, 1.3, -2.9, 0.9999, 17.25])
    pick = rng.random((n, P, r)) < special
    g[pick] = rng.choice(specials, pick.sum())
    probes = [j for s0 in range(0, P, SEG) for j in probes_of(s0, min(SEG, P - s0))]
    others = np.setdiff1d(np.arange(P), probes)
    shape = (n, P) + (1,) * (r - 1) + (r,)
    attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
    sorted_, padded = g.copy(), g.copy()
    sorted_[:, probes] = 0.0  # interior: the segments are sorted
    padded[:, probes] = 5.0  # outside: every position padded
    with np.errstate(over="ignore", invalid="ignore"):
        a = numba_ops.grid_sample(x, sorted_.reshape(shape).astype(dtype), **attrs).reshape(n, 2, P)
        b = numba_ops.grid_sample(x, padded.reshape(shape).astype(dtype), **attrs).reshape(n, 2, P)
        want = grid_sample_ref(x, sorted_.reshape(shape).astype(dtype), coord_dtype=_ct(dtype), **attrs)
    np.testing.assert_array_equal(np.ascontiguousarray(a[:, :, others]).view(np.uint8),
                                  np.ascontiguousarray(b[:, :, others]).view(np.uint8))
    assert_api_close(a.reshape(want.shape), want, dtype)


@pytest.mark.parametrize(*matrix(r=[1, 2, 3], mode=MODES, padding=PADS,
                                dtype=[np.float32, np.float64, np.float16, BF16, np.uint8]))
def test_blocks_equal_single_positions(r, mode, padding, dtype, rng):
    """Positions in runs of one kind (interior, outside, padded) are sampled a block
    at a time with gathers (CPU): the same grid with its positions shuffled (no runs:
    one at a time) gives the shuffled result, bit for bit (for every dtype of ``x``;
    uint8 with a float32 grid), and float32/float64 match the float64 oracle.
    Positions sweep from outside across the input and out again (image 0 in waves
    whose segments reflection padding sorts), with specials (NaN, Inf, huge, the
    borders) in some runs."""
    from numba_ops.kernels.cpu.grid_sample import SEG
    n, P = 2, 2 * SEG + 88
    shape_x = (n, 3) + (5, 7, 9)[:r]
    if dtype == np.uint8:
        x, gdt = rng.integers(0, 256, shape_x).astype(np.uint8), np.float32
    else:
        x, gdt = rng.standard_normal(shape_x).astype(dtype), dtype
    sweep = np.linspace(-1.6, 1.6, P)
    wave = 1.6 * np.sin(np.arange(P) * (4 * np.pi / SEG))  # each segment's first, middle and last inside
    g = np.stack([np.stack([wave * (1 - 0.1 * k), np.roll(sweep, 37 * k) * (1 - 0.1 * k)]) for k in range(r)], -1)
    g[1, 300:340] = [np.nan, np.inf, -np.inf][:r]
    g[1, 300:340:3, 0] = [np.nan, np.inf, -np.inf, 1e30, -1e30, 1.0, -1.0, 0.5, 0.25, 2.0, -3.0, 0.0, 0.1, 0.2][:14]
    perm = rng.permutation(P)
    shape = (n, P) + (1,) * (r - 1) + (r,)
    attrs = dict(mode=mode, padding_mode=padding, align_corners=0)
    with np.errstate(over="ignore", invalid="ignore"):
        runs = numba_ops.grid_sample(x, g.reshape(shape).astype(gdt), **attrs).reshape(n, 3, P)
        shuffled = numba_ops.grid_sample(x, g[:, perm].reshape(shape).astype(gdt), **attrs).reshape(n, 3, P)
    np.testing.assert_array_equal(np.ascontiguousarray(runs[:, :, perm]).view(np.uint8), shuffled.view(np.uint8))
    if dtype in (np.float32, np.float64):
        with np.errstate(over="ignore", invalid="ignore"):
            want = grid_sample_ref(x, g.reshape(shape).astype(gdt), coord_dtype=_ct(gdt), **attrs)
        assert_api_close(runs.reshape(want.shape), want, dtype)


def test_threads(device, rng):
    x = rng.standard_normal((4, 2, 30, 40)).astype(np.float32)
    grid = _grid(rng, 4, (50, 60), 2)
    want = gs(x, grid, device)
    for res in in_threads(lambda i: gs(x, grid, device), 4):
        np.testing.assert_array_equal(res, want)


# --- bad input -------------------------------------------------------------------------------

def test_bad_input():
    x = np.zeros((2, 3, 4, 5), np.float32)
    g = np.zeros((2, 3, 3, 2), np.float32)
    gsf = numba_ops.grid_sample
    for kw, match in ((dict(mode="bilinear"), "mode"), (dict(mode=1), "mode"),
                      (dict(padding_mode="wrap"), "padding_mode"), (dict(padding_mode=None), "padding_mode"),
                      (dict(align_corners=2), "align_corners"), (dict(device="tpu"), "device")):
        with pytest.raises(ValueError, match=match):
            gsf(x, g, **kw)
    with pytest.raises(ValueError, match="'linear', 'nearest', 'cubic'"):
        gsf(x, g, mode="Linear")
    with pytest.raises(ValueError, match="'zeros', 'border', 'reflection'"):
        gsf(x, g, padding_mode="Zeros")
    with pytest.raises(ValueError, match="grid"):
        gsf(x, np.zeros((2, 3, 3, 3), np.float32))  # last axis != r
    with pytest.raises(ValueError, match="grid"):
        gsf(x, np.zeros((2, 3, 2), np.float32))  # rank
    with pytest.raises(ValueError, match="batch size"):
        gsf(x, np.zeros((3, 3, 3, 2), np.float32))
    with pytest.raises(ValueError, match="X"):
        gsf(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="X"):
        gsf(np.zeros((1, 1, 2, 2, 2, 2), np.float32), np.zeros((1, 1, 1, 1, 1, 4), np.float32))
    with pytest.raises(ValueError, match="X"):
        gsf(np.zeros((2, 3, 0, 5), np.float32), g)  # nothing to sample from
    with pytest.raises(ValueError, match="X is required"):
        gsf(None, g)
    with pytest.raises(ValueError, match="grid is required"):
        gsf(x, None)
    with pytest.raises(TypeError, match="grid"):
        gsf(x, g.astype(np.float64))  # mixed float dtypes
    with pytest.raises(TypeError, match="grid"):
        gsf(x.astype(np.uint8), g.astype(np.int32))
    with pytest.raises(TypeError, match="X"):
        gsf(x.astype(np.int16), g)
    with pytest.raises(TypeError, match="X"):
        gsf(x.astype(np.complex64), g)


def test_cuda_without_gpu_is_a_clear_error():
    x = np.zeros((1, 1, 2, 2), np.float32)
    g = np.zeros((1, 1, 1, 2), np.float32)
    if "cuda" in numba_ops.devices():
        pytest.skip("a CUDA device (or the simulator) is usable here")
    with pytest.raises(RuntimeError, match="CUDA"):
        numba_ops.grid_sample(x, g, device="cuda")


@pytest.mark.parametrize("every_rank", [False, pytest.param(True, marks=FULL)])
def test_warm_calls(every_rank):
    """The warm-up hook: for each dtype, calls on both x dtypes, every rank, mode and
    padding mode, both paths; some float16 ones run (each variant compiles, so one
    dtype here): the linear/zeros ones of every rank and x dtype, or (the default
    run) those of float16 x that the default run samples anyway."""
    from numba_ops.grid_sample import warm_calls
    from numba_ops.kernels.cpu._runtime import PARALLEL_MIN_WORK
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        seen = set()
        for args, kwargs in warm_calls(dtype):
            x, grid = args
            assert grid.dtype.name == dtype and set(kwargs) == {"mode", "padding_mode"}
            n_out = grid.size // grid.shape[-1] * x.shape[1]
            seen.add((x.ndim - 2, x.dtype.name, n_out >= PARALLEL_MIN_WORK, kwargs["mode"],
                      kwargs["padding_mode"]))
            if every_rank:
                run = dtype == "float16" and kwargs == {"mode": "linear", "padding_mode": "zeros"}
            else:
                run = x.dtype == grid.dtype == np.float16 and in_default(x.ndim - 2, kwargs["mode"],
                                                                       kwargs["padding_mode"], x.dtype)
            if run:
                y = numba_ops.grid_sample(*args, **kwargs)
                assert y.dtype == x.dtype and y.shape == x.shape[:2] + grid.shape[1:-1]
        assert seen == {(r, xd, big, mode, pad) for r in (1, 2, 3) for xd in (dtype, "uint8")
                        for big in (False, True) for mode in MODES for pad in PADS}

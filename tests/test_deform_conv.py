"""numba_ops.deform_conv against the documented contract (deform_conv, dtypes, Bad input) and the
ONNX DeformConv page: worked examples, ONNX backend cases, onnxruntime and
torchvision as 2-D oracles, tests/reference.py (float64, any rank) for the rest."""
import threading

import numpy as np
import pytest

import numba_ops
from numba_ops.benchmark import cases as _cases
from numba_ops.kernels.cpu import _deform_plan as dc_plan
from helpers import BF16, deform_default, param
from reference import assert_api_close, deform_conv_ref



def out_sizes(D, k, pads, strides, dil):
    nd = len(D)
    return tuple((D[i] + pads[i] + pads[nd + i] - ((k[i] - 1) * dil[i] + 1)) // strides[i] + 1
                 for i in range(nd))


def make_case(rng, N=1, C=2, D=(4, 5), oC=2, k=(2, 2), pads=None, strides=None, dil=None, group=1,
              og=1, bias=True, mask=True, spread=1.5):
    nd = len(D)
    pads = list(pads or [0] * (2 * nd))
    strides = list(strides or [1] * nd)
    dil = list(dil or [1] * nd)
    outs = out_sizes(D, k, pads, strides, dil)
    K = int(np.prod(k))
    ins = dict(
        x=rng.standard_normal((N, C) + tuple(D)),
        w=rng.standard_normal((oC, C // group) + tuple(k)),
        offset=spread * rng.standard_normal((N, og * K * nd) + outs),
        b=rng.standard_normal(oC) if bias else None,
        mask=rng.random((N, og * K) + outs) if mask else None,
    )
    att = dict(kernel_shape=list(k), pads=pads, strides=strides, dilations=dil, group=group, offset_group=og)
    return ins, att


def cast(ins, dtype):
    return {k: (None if v is None else v.astype(dtype)) for k, v in ins.items()}


def call(ins, att, device=None, **kw):
    return numba_ops.deform_conv(ins["x"], ins["w"], ins["offset"], ins["b"], ins["mask"],
                                 device=device, **att, **kw)


def ref(ins, att):
    a = {k: v for k, v in att.items() if k != "kernel_shape"}
    a["offset_group"] = att["offset_group"]
    return deform_conv_ref(ins["x"], ins["w"], ins["offset"], ins["b"], ins["mask"], **a)


# --- the ONNX page's worked examples and ONNX's backend cases ------------------------------

SEEDS = [c for c in _cases.seed_cases() if c.op == "DeformConv"]
BACKEND = [c for c in _cases.onnx_backend_cases() if c.op == "DeformConv"]


def test_conformance_cases_found():
    assert len(SEEDS) == 4 and len(BACKEND) >= 4


@pytest.mark.parametrize("case", SEEDS + BACKEND, ids=[f"{c.source}-{c.name}" for c in SEEDS + BACKEND])
def test_conformance(case, device):
    """The ONNX page's worked examples and ONNX's backend cases."""
    y = numba_ops.deform_conv(*case.inputs, device=device, **case.attrs)
    assert y.dtype == np.float32 and y.shape == case.expected.shape
    np.testing.assert_allclose(y, case.expected, rtol=1e-6, atol=1e-6)


# --- 2-D against onnxruntime and torchvision ------------------------------------------------

CASES_2D = [
    dict(),
    dict(N=2, C=4, D=(5, 6), oC=4, k=(3, 3), pads=[1, 1, 1, 1]),
    dict(N=1, C=4, D=(7, 6), oC=6, k=(3, 2), pads=[1, 0, 2, 1], strides=[2, 1], dil=[1, 2], group=2, og=2),
    dict(N=3, C=6, D=(5, 5), oC=3, k=(2, 3), pads=[0, 2, 1, 0], strides=[1, 2], group=3, og=3, mask=False),
    dict(N=2, C=4, D=(6, 4), oC=4, k=(1, 3), dil=[3, 1], group=1, og=4, bias=False),
    dict(N=1, C=2, D=(3, 3), oC=2, k=(3, 3), pads=[2, 2, 2, 2], strides=[3, 3], bias=False, mask=False,
         spread=4.0),
    dict(N=2, C=6, D=(4, 4), oC=6, k=(2, 2), pads=[1, 1, 0, 0], group=2, og=3),
]


def _ort_deform(ins, att):
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper
    names = ["X", "W", "offset", "B", "mask"]
    vals = [ins["x"], ins["w"], ins["offset"], ins["b"], ins["mask"]]
    feeds, node_in = {}, []
    for n, v in zip(names, vals):
        if v is None:
            node_in.append("")
        else:
            node_in.append(n)
            feeds[n] = v
    while node_in and node_in[-1] == "":
        node_in.pop()
    node = helper.make_node("DeformConv", node_in, ["Y"], **att)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in feeds],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)])
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)[0]


@pytest.mark.parametrize("i", range(len(CASES_2D)))
def test_2d_vs_onnxruntime(i, device):
    ins, att = make_case(np.random.default_rng(i), **CASES_2D[i])
    ins32 = cast(ins, np.float32)
    want = _ort_deform(ins32, att)
    assert_api_close(call(ins32, att, device), want, np.float32)


@pytest.mark.parametrize("i", range(len(CASES_2D)))
def test_2d_vs_torchvision(i, device):
    torch = pytest.importorskip("torch")
    tvo = pytest.importorskip("torchvision.ops")
    ins, att = make_case(np.random.default_rng(100 + i), **CASES_2D[i])
    # torchvision pads symmetrically: give it the zero-padded input and no padding (sampling
    # the zero-extended image either way, so the boundary rule is the same)
    p = att["pads"]
    t = {k: (None if v is None else torch.from_numpy(v)) for k, v in ins.items()}
    t["x"] = torch.from_numpy(np.pad(ins["x"], ((0, 0), (0, 0), (p[0], p[2]), (p[1], p[3]))))
    want = tvo.deform_conv2d(t["x"], t["offset"], t["w"], t["b"], stride=att["strides"], padding=(0, 0),
                             dilation=att["dilations"], mask=t["mask"]).numpy()
    assert_api_close(call(ins, att, device), want, np.float64)


def _force_path(monkeypatch, path):
    """Make every CPU call take ``path`` ("direct" loops or the "tiled" path), whatever
    its size would pick; plans made before are dropped."""
    monkeypatch.setattr(dc_plan, "DIRECT_MAX", 1 << 62 if path == "direct" else -1)
    monkeypatch.setattr(dc_plan, "STATES", {})


# --- 1-D, 2-D, 3-D against the float64 oracle -------------------------------------------------

CASES_ND = [
    dict(N=2, C=2, D=(7,), oC=3, k=(3,), pads=[1, 2], strides=[2], dil=[1]),
    dict(N=1, C=4, D=(9,), oC=2, k=(2,), pads=[0, 0], dil=[3], group=2, og=2, mask=False),
    dict(N=1, C=2, D=(3, 4, 4), oC=2, k=(2, 2, 2), pads=[1, 0, 1, 0, 1, 1], strides=[1, 2, 1]),
    dict(N=2, C=4, D=(3, 3, 4), oC=4, k=(2, 1, 3), pads=[0, 1, 1, 1, 0, 0], dil=[2, 1, 1], group=2, og=4,
         bias=False),
] + CASES_2D[1:4]


@pytest.mark.parametrize("i,dtype", [param(deform_default(len(CASES_ND[i]["D"]), dt), i, dt)
                                     for i in range(len(CASES_ND)) for dt in (np.float64, np.float32)])
def test_vs_float64_reference(i, dtype, device):
    ins, att = make_case(np.random.default_rng(200 + i), **CASES_ND[i])
    want = ref(ins, att)
    y = call(cast(ins, dtype), att, device)
    assert y.dtype == dtype
    assert_api_close(y, want, dtype)


@pytest.mark.parametrize("i,path,dtype", [param(deform_default(len(CASES_ND[i]["D"]), dt), i, path, dt)
                                          for i in range(len(CASES_ND)) for path in ("direct", "tiled")
                                          for dt in (np.float64, np.float32, np.float16)])
def test_cpu_paths_vs_reference(i, path, dtype, monkeypatch):
    """The CPU's tiny-call path (straight loops) and its tiled path both, whatever
    size would pick."""
    _force_path(monkeypatch, path)
    ins, att = make_case(np.random.default_rng(200 + i), **CASES_ND[i])
    lo = cast(ins, dtype)
    want = ref(lo, att)
    y = call(lo, att)
    if dtype == np.float16:
        assert np.abs(_ordered_bits(y) - _ordered_bits(want.astype(np.float32).astype(dtype))).max() <= 1
    else:
        assert_api_close(y, want, dtype)


def test_4d_spatial():
    ins, att = make_case(np.random.default_rng(7), N=1, C=2, D=(2, 3, 2, 3), oC=2, k=(2, 1, 2, 2),
                         pads=[0, 1, 0, 1, 1, 0, 0, 0])
    assert_api_close(call(ins, att), ref(ins, att), np.float64)


# --- the parallel path, tiling and chunking ---------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16])
def test_parallel_path_vs_reference(dtype, monkeypatch):
    """The parallel path (forced on this small case), with tiny tiles and a tiny scratch
    budget (several tiles per image, one image per chunk: the workspace is re-carved
    chunk by chunk), then with the whole batch in one chunk; then the serial path.
    Offsets spread far enough that samples fall outside the input (the zero tail)."""
    rng = np.random.default_rng(11)
    ins, att = make_case(rng, N=3, C=8, D=(9, 11), oC=6, k=(3, 3), pads=[1, 1, 1, 1], group=2, og=2,
                         spread=4.0)
    ins = cast(cast(ins, dtype), np.float64)  # the inputs as the dtype holds them
    want = ref(ins, att)
    monkeypatch.setattr(numba_ops.kernels.cpu._runtime, "PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(dc_plan, "TILE_BYTES", 4096)
    monkeypatch.setattr(dc_plan, "SCRATCH_BYTES", 1)
    monkeypatch.setattr(dc_plan, "STATES", {})
    assert dc_plan.plan_sizes(3, 8, 9, 6, 99, 2, 2, 2, 11 * 13, 4, 2)[1] == 1
    for _ in range(2):  # the second call reuses the workspace the first one left
        assert_api_close(call(cast(ins, dtype), att), want, dtype)
    monkeypatch.setattr(dc_plan, "SCRATCH_BYTES", 192 << 20)
    monkeypatch.setattr(dc_plan, "STATES", {})
    assert_api_close(call(cast(ins, dtype), att), want, dtype)
    monkeypatch.setattr(dc_plan, "STATES", {})
    monkeypatch.setattr(numba_ops.kernels.cpu._runtime, "PARALLEL_MIN_WORK", 1 << 62)
    assert_api_close(call(cast(ins, dtype), att), want, dtype)


#: shapes with few positions beside large weights, for the channel split: 1-D (oC past
#: 64 per thread: channel shares cut at multiples of 16), 2-D with groups and offset groups,
#: 3-D with offset groups and no bias
SPLIT_CASES = [
    dict(N=1, C=4, D=(5,), oC=130, k=(3,), pads=[1, 1], spread=2.0),
    dict(N=2, C=12, D=(4, 3), oC=18, k=(3, 3), pads=[1, 1, 1, 1], strides=[1, 2], group=3, og=2, spread=3.0),
    dict(N=1, C=8, D=(2, 3, 3), oC=20, k=(2, 2, 2), pads=[1, 0, 1, 1, 1, 0], group=2, og=4, bias=False,
         spread=2.0),
]


@pytest.mark.parametrize("i,dtype", [param(deform_default(len(SPLIT_CASES[i]["D"]), dt), i, dt)
                                     for i in range(len(SPLIT_CASES)) for dt in (np.float64, np.float32, np.float16, BF16)])
def test_channel_split_vs_reference(i, dtype, monkeypatch):
    """The parallel run's channel split (threads share a tile's positions for the fill,
    then each takes a share of the output channels), forced: one tile per image, then
    several tiles per image with one image per chunk; against the float64 oracle and the
    position split; then the serial path (one thread)."""
    import numba
    ins, att = make_case(np.random.default_rng(300 + i), **SPLIT_CASES[i])
    ins = cast(cast(ins, dtype), np.float64)  # the inputs as the dtype holds them
    want = ref(ins, att)
    lo = cast(ins, dtype)
    monkeypatch.setattr(numba_ops.kernels.cpu._runtime, "PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(dc_plan, "SPLIT", True)
    monkeypatch.setattr(dc_plan, "STATES", {})
    y = call(lo, att)
    assert_api_close(y, want, dtype)
    nth = numba.get_num_threads()
    one_group = att["group"] == 1
    if nth > 1:  # the plan took the channel split, by the reduction in one group here
        (st,) = dc_plan.STATES.values()
        assert all(dc_plan.unpack_plan.py_func(m).split == (2 if one_group else 1) for m in st.tilings[nth].metas)
    if one_group:  # the GEMMs' shares forced the other way: the output channels, then the reduction again
        for ks in (False, True):
            monkeypatch.setattr(dc_plan, "KSPLIT", ks)
            monkeypatch.setattr(dc_plan, "STATES", {})
            assert_api_close(call(lo, att), want, dtype)
    monkeypatch.setattr(dc_plan, "TILE_BYTES", 64)
    monkeypatch.setattr(dc_plan, "TILE_MIN", 5)
    monkeypatch.setattr(dc_plan, "SCRATCH_BYTES", 1)
    monkeypatch.setattr(dc_plan, "STATES", {})
    for _ in range(2):  # the second call reuses the workspace the first one left
        assert_api_close(call(lo, att), want, dtype)
    monkeypatch.setattr(dc_plan, "SPLIT", False)
    monkeypatch.setattr(dc_plan, "STATES", {})
    pos = call(lo, att)
    assert_api_close(pos, want, dtype)
    if dtype == np.float64:
        np.testing.assert_allclose(y, pos, rtol=1e-13, atol=1e-13)
    full = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        monkeypatch.setattr(dc_plan, "SPLIT", True)
        monkeypatch.setattr(dc_plan, "STATES", {})
        assert_api_close(call(lo, att), want, dtype)
    finally:
        numba.set_num_threads(full)


def test_reduction_split_short_reduction(monkeypatch):
    """The reduction split where a thread's share of the reduction is empty (C * K = 1
    below the thread count): its partial sums are zeros, not stale workspace."""
    ins, att = make_case(np.random.default_rng(7), N=2, C=1, D=(6, 5), oC=5, k=(1, 1))
    want = ref(ins, att)
    lo = cast(ins, np.float32)
    monkeypatch.setattr(numba_ops.kernels.cpu._runtime, "PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(dc_plan, "SPLIT", True)
    monkeypatch.setattr(dc_plan, "KSPLIT", True)
    monkeypatch.setattr(dc_plan, "STATES", {})
    dc_plan.workspace(np.float32, 1 << 16)[:] = np.nan  # what a previous call may leave
    assert_api_close(call(lo, att), want, np.float32)


def test_plan_vector_round_trip():
    """The one int64 vector the kernels' entries take (numba's dispatcher types it
    fastest) reads back as the named geometry and plan that were packed into it."""
    geo = dc_plan.Geometry(*(np.arange(3) + 10 * i for i in range(7)))
    plan = dc_plan.Plan(*range(1, 13))
    meta = dc_plan.pack(geo, plan)
    for unpack_geometry, unpack_plan in ((dc_plan.unpack_geometry.py_func, dc_plan.unpack_plan.py_func),
                                         (dc_plan.unpack_geometry, dc_plan.unpack_plan)):
        back = unpack_geometry(meta)
        assert back._fields == geo._fields and all(np.array_equal(a, b) for a, b in zip(back, geo))
        assert tuple(unpack_plan(meta)) == plan


def test_reduction_split_choice():
    """The channel split's GEMMs share the reduction in one group where a thread's share
    of the output channels would be under 256 rows."""
    assert dc_plan.reduction_split(256, 1, 2) and dc_plan.reduction_split(130, 1, 2)
    assert not dc_plan.reduction_split(512, 1, 2) and not dc_plan.reduction_split(256, 2, 2)
    assert dc_plan.reduction_split(512, 1, 4)


@pytest.mark.parametrize("name, split", [
    ("dc_c512_7", True), ("dc_c1024_7", True), ("dc_c512_14", True), ("dc_c256_14", True),
    ("dc_b2_c512_14", True), ("dc_c512_25x42", False), ("dc3d_c256_8x14", False),
    ("dc_r50_c64_56", False), ("dc_b8_c32_32", False), ("dc_c256_28", False), ("dc_s2_g2", False)])
def test_split_choice(name, split):
    """The cost model (float32): the channel split where a thread's positions are few
    beside the weights, the position split elsewhere (the existing bench cases keep
    theirs); one thread never splits. 16-bit weights (converted either way) move
    the 2 x 512 x 14 x 14 case to the position split."""
    N, C, spatial, oC, k, pad, stride, dil, group, og, _ = _cases.deform_params(name)
    P = int(np.prod([(s + 2 * pad - dil * (k - 1) - 1) // stride + 1 for s in spatial]))
    S = int(np.prod([s + 2 for s in spatial]))
    args = (N, C, k ** len(spatial), oC, P, group, og, len(spatial), S, 4)
    T, nb, osplit = dc_plan.plan_sizes(*args, 2, None, True)
    assert osplit == split and 1 <= T <= P and nb >= 1
    assert dc_plan.plan_sizes(*args, 2, None, False)[2] == (split and name != "dc_b2_c512_14")
    assert dc_plan.plan_sizes(*args, 1)[2] is False
    # one thread: native weights in place where the column rows are fewer than the weight rows
    assert dc_plan.plan_sizes(*args, 1, None, True)[2] is (N * P * group < oC)
    assert dc_plan.plan_sizes(*args, 1, False, True)[2] is False
    assert dc_plan.plan_sizes(*args, 2, True)[2] is True and dc_plan.plan_sizes(*args, 2, False)[2] is False


@pytest.mark.parametrize("case", [
    dict(N=2, C=4, D=(6, 7), oC=3, k=(3, 2), pads=[1, 0, 1, 1], strides=[2, 1], group=1, og=2, spread=3.0),
    dict(N=1, C=4, D=(4, 5, 3), oC=2, k=(2, 3, 2), pads=[1, 0, 1, 0, 1, 1], strides=[1, 2, 1], group=2, og=2,
         spread=2.0)])
def test_fast_plans_match_generic_plan(case, monkeypatch):
    """The 32-bit 2-D/3-D plans and the generic N-D plan agree, on the tiled path."""
    _force_path(monkeypatch, "tiled")
    ins, att = make_case(np.random.default_rng(12), **case)
    fast = call(ins, att)
    assert_api_close(fast, ref(ins, att), np.float64)
    monkeypatch.setattr(dc_plan, "I32", 0)
    monkeypatch.setattr(dc_plan, "STATES", {})
    slow = call(ins, att)
    np.testing.assert_allclose(slow, fast, rtol=1e-13, atol=1e-13)


# --- dtypes ----------------------------------------------------------------------------------

def _ordered_bits(a):
    b = a.view(np.int16).astype(np.int32)
    return np.where(b < 0, -(b & 0x7FFF), b)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16])
@pytest.mark.parametrize("i", [0, 2, 3])
def test_16bit_is_float32_rounded_once(i, dtype, device):
    ins, att = make_case(np.random.default_rng(300 + i), **(CASES_2D + CASES_ND)[i])
    lo = cast(ins, dtype)
    y = call(lo, att, device)
    assert y.dtype == dtype
    up = cast(lo, np.float32)
    exact = ref(up, att).astype(np.float32)
    want = exact.astype(dtype)
    assert np.abs(_ordered_bits(y) - _ordered_bits(want)).max() <= 1


def test_mixed_and_bad_dtypes():
    ins, att = make_case(np.random.default_rng(0))
    bad = dict(ins, w=ins["w"].astype(np.float32))
    with pytest.raises(TypeError, match="W"):
        call(bad, att)
    bad = dict(ins, mask=ins["mask"].astype(np.float16))
    with pytest.raises(TypeError, match="mask"):
        call(bad, att)
    bad = {k: (None if v is None else v.astype(np.int32)) for k, v in ins.items()}
    with pytest.raises(TypeError, match="X"):
        call(bad, att)

    class Unreadable:  # e.g. a torch bfloat16 tensor: NumPy cannot read it, and says why
        def __array__(self, *args, **kwargs):
            raise RuntimeError("no NumPy view of this one")

    with pytest.raises(TypeError, match="offset must be an array .* Unreadable .*no NumPy view of this one"):
        call(dict(ins, offset=Unreadable()), att)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_non_native_byte_order(dtype, device):
    """Big-endian arrays are their dtype: the same result (in native order), twice
    (the second call is a validated shape), mixed with native ones too; inputs untouched."""
    ins, att = make_case(np.random.default_rng(4))
    ins = cast(ins, dtype)
    want = call(ins, att, device)
    swapped = {k: v.astype(v.dtype.newbyteorder(">")) for k, v in ins.items()}
    before = {k: v.copy() for k, v in swapped.items()}
    for _ in range(2):
        y = call(swapped, att, device)
        assert y.dtype == np.dtype(dtype) and y.dtype.isnative
        np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(call(dict(ins, w=swapped["w"]), att, device), want)
    for k in swapped:
        np.testing.assert_array_equal(swapped[k], before[k])
        assert swapped[k].dtype.byteorder == ">"

# --- boundary rule, non-finite values, huge offsets -------------------------------------------

def test_integer_and_border_positions(device):
    """Offsets that put samples exactly on integers, on the first/last pixel,
    at -1 and at D (both sample 0), and just inside them."""
    rng = np.random.default_rng(5)
    ins, att = make_case(rng, N=1, C=2, D=(4, 5), oC=2, k=(2, 2), pads=[1, 1, 1, 1])
    vals = np.array([0.0, 1.0, -1.0, 2.0, -2.0, 3.0, 4.0, -4.0, 5.0, 0.5, -0.999, 3.999, 4.999, -1.0001])
    ins["offset"] = rng.choice(vals, ins["offset"].shape)
    assert_api_close(call(ins, att, device), ref(ins, att), np.float64)
    ins32 = cast(ins, np.float32)
    assert_api_close(call(ins32, att, device), ref(ins32, att), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_far_offsets_sample_zero(dtype, device):
    ins, att = make_case(np.random.default_rng(6), N=1, C=2, D=(3, 4), oC=2, k=(2, 2), pads=[1, 1, 1, 1])
    ins = cast(ins, dtype)
    big = np.array([1e30, -1e30, 2.0 ** 63, -(2.0 ** 63), 2.0 ** 31, -(2.0 ** 31), 2.0 ** 32 + 0.5,
                    np.finfo(dtype).max, -np.finfo(dtype).max], dtype)
    for v in big:
        ins["offset"] = np.full_like(ins["offset"], v)
        y = call(ins, att, device)
        np.testing.assert_array_equal(y, np.broadcast_to(ins["b"][None, :, None, None], y.shape))
    # one axis far out, the other in range: still 0
    off = np.zeros_like(ins["offset"])
    off[:, 0::2] = 1e30
    ins["offset"] = off
    y = call(ins, att, device)
    np.testing.assert_array_equal(y, np.broadcast_to(ins["b"][None, :, None, None], y.shape))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("where", ["x", "x0", "w", "offset", "mask", "b"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("path", ["direct", "tiled"])
def test_non_finite_inputs(where, bad, dtype, path, device, monkeypatch):
    """Never a crash; NaN/Inf reach exactly the outputs the definition says
    (the float64 oracle), e.g. an Inf in x[0] does not leak into samples whose
    support does not hold it, and a non-finite position gives NaN."""
    _force_path(monkeypatch, path)
    rng = np.random.default_rng(8)
    ins, att = make_case(rng, N=2, C=4, D=(4, 5), oC=4, k=(2, 2), pads=[1, 1, 1, 1], group=2, og=2)
    ins = cast(ins, dtype)
    key = "x" if where == "x0" else where
    a = ins[key]
    if where == "x0":
        a.flat[0] = bad
        ins["offset"][:] = np.round(ins["offset"])  # integer positions: zero-weight corners too
    else:
        idx = tuple(rng.integers(0, s) for s in a.shape)
        a[idx] = bad
        a.flat[-1] = bad
    y = call(ins, att, device)
    want = ref(ins, att)
    assert_api_close(y, want, dtype)
    if where == "offset":
        assert np.isnan(y).any()


@pytest.mark.parametrize("path", ["direct", "tiled"])
def test_random_geometries_with_special_values(path, device, monkeypatch):
    """20 random 1-D/2-D/3-D geometries (groups, offset groups, pads, strides,
    dilations, optional mask and bias) with NaN, +-Inf, +-1e30 and 0 scattered over
    every input, integer and half-integer offsets among them: the float64 oracle."""
    _force_path(monkeypatch, path)
    rng = np.random.default_rng(21)
    done = 0
    while done < 20:
        nd = int(rng.integers(1, 4))
        group, og = int(rng.choice([1, 2])), int(rng.choice([1, 2]))
        D = tuple(int(v) for v in rng.integers(1, 5, nd))
        k = tuple(int(v) for v in rng.integers(1, 3, nd))
        pads, strides, dil = [int(v) for v in rng.integers(0, 2, 2 * nd)], [int(v) for v in rng.integers(1, 3, nd)], \
            [int(v) for v in rng.integers(1, 3, nd)]
        if min(out_sizes(D, k, pads, strides, dil)) < 1:
            continue
        ins, att = make_case(rng, N=int(rng.integers(1, 3)), C=2 * group * og // np.gcd(group, og), D=D,
                             oC=2 * group, k=k, pads=pads, strides=strides, dil=dil, group=group, og=og,
                             mask=bool(rng.random() < 0.7), bias=bool(rng.random() < 0.7))
        off = ins["offset"]
        off[:] = np.where(rng.random(off.shape) < 0.5, rng.choice([0.0, 0.5, 1.0, -1.0], off.shape), off)
        for a in ins.values():
            if a is not None and rng.random() < 0.6:
                n = max(1, a.size // 10)
                a.flat[rng.integers(0, a.size, n)] = rng.choice([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0], n)
        with np.errstate(all="ignore"):
            assert_api_close(call(ins, att, device), ref(ins, att), np.float64)
        done += 1

@pytest.mark.parametrize("D, k", [((7,), (3,)), ((3, 4, 4), (2, 2, 2)), ((2, 3, 2, 3), (2, 1, 2, 2))])
@pytest.mark.parametrize("path", ["direct", "tiled"])
def test_non_finite_mask_every_rank(D, k, path, monkeypatch):
    """1-D, 3-D and 4-D (the 2-, 8- and 16-corner fills): a non-finite mask multiplies
    its finished sample, as the definition orders it (0 * Inf is NaN), on both paths."""
    _force_path(monkeypatch, path)
    rng = np.random.default_rng(12)
    ins, att = make_case(rng, N=2, C=4, D=D, oC=2, k=k, pads=[1] * (2 * len(D)), og=2)
    m = ins["mask"]
    m.flat[::7] = np.inf
    m.flat[3::11] = -np.inf
    m.flat[5::13] = np.nan
    m.flat[1::17] = 0.0
    y = call(ins, att)
    assert_api_close(y, ref(ins, att), np.float64)
    assert np.isnan(y).any()



@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_non_finite_mask_times_the_sample(dtype, device):
    """An Inf mask times the finished sample, on every device: Inf at an integer position
    (corner weights exactly 0: no 0 * Inf) and under corners of mixed signs (no Inf - Inf)."""
    x = np.array([[[1.0, -1.0, 2.0]]], dtype)
    w = np.ones((1, 1, 1), dtype)
    off = np.array([[[0.0, 0.25, 0.5]]], dtype)  # positions 0, 1.25, 2.5: samples 1, -0.25, 1
    mask = np.array([[[np.inf, np.inf, -np.inf]]], dtype)
    y = numba_ops.deform_conv(x, w, off, None, mask, device=device)
    np.testing.assert_array_equal(y, np.array([[[np.inf, -np.inf, -np.inf]]], dtype))
    rng = np.random.default_rng(13)
    ins, att = make_case(rng, N=1, C=2, D=(3, 4), oC=2, k=(2, 2), pads=[1, 1, 1, 1], og=2)
    ins["offset"] = rng.integers(-1, 2, ins["offset"].shape) + rng.choice([0.0, 0.5], ins["offset"].shape)
    m = ins["mask"]
    m.flat[::3] = np.inf
    m.flat[1::5] = -np.inf
    m.flat[2::7] = np.nan
    ins = cast(ins, dtype)
    assert_api_close(call(ins, att, device), ref(ins, att), dtype)

def test_non_finite_offset_is_nan_even_if_far_on_other_axis():
    ins, att = make_case(np.random.default_rng(9), N=1, C=1, D=(3, 3), oC=1, k=(1, 1), bias=False, mask=False)
    ins["offset"][:] = 0.0
    ins["offset"][0, 0, 0, 0] = np.nan
    ins["offset"][0, 1, 0, 0] = 1e30
    ins["offset"][0, 0, 1, 1] = np.inf
    y = call(ins, att)
    assert np.isnan(y[0, 0, 0, 0]) and np.isnan(y[0, 0, 1, 1])
    assert np.isfinite(np.delete(y.ravel(), [0, 4])).all()


# --- positions far along an axis: never rounded -------------------------------------------

@pytest.mark.parametrize("path", ["direct", "tiled"])
@pytest.mark.parametrize("D", [param(deform_default(len(D), np.float32), D) for D in [(700,), (2, 700), (2, 1, 700)]])
def test_far_positions_keep_the_offset_fraction(D, path, device, monkeypatch):
    """A position o*stride - pad + k*dil + offset in the hundreds: in a float32 sum
    its fraction (the interpolation weight) would lose bits beyond the documented 1e-5.
    Strides put the outputs hundreds of elements apart, on every plan (1-D general,
    2-D/3-D 32-bit) and path."""
    _force_path(monkeypatch, path)
    nd = len(D)
    rng = np.random.default_rng(21)
    strides = [1] * (nd - 1) + [333]
    ins, att = make_case(rng, N=1, C=3, D=D, oC=2, k=(1,) * (nd - 1) + (2,), strides=strides,
                         pads=[0] * (2 * nd - 1) + [1], spread=0.0)
    ins["offset"] = rng.uniform(-0.5, 0.5, ins["offset"].shape) + rng.choice([0.1, 0.3, 0.7], ins["offset"].shape)
    ins32 = cast(ins, np.float32)
    assert_api_close(call(ins32, att, device), ref(ins32, att), np.float32)
    # the audit's case: positions 0 and 500.1 of a 502-long axis, x one-hot at 501
    x = np.zeros((1, 1, 502), np.float32)
    x[0, 0, 501] = 1
    y = numba_ops.deform_conv(x, np.ones((1, 1, 1), np.float32), np.array([[[0.0, 0.1]]], np.float32),
                              strides=[500], device=device)
    np.testing.assert_allclose(y[0, 0], [0.0, float(np.float32(0.1))], rtol=1e-7)


@pytest.mark.full  # float32 1-D (helpers.deform_default)
@pytest.mark.parametrize("path", ["direct", "tiled"])
def test_axis_longer_than_2_24(path, monkeypatch):
    """Sizes and positions past 2**24 (where float32 stops counting integers) index
    exactly: the last element of a 2**24 + 4 long axis, and the one before it."""
    _force_path(monkeypatch, path)
    L = 2 ** 24 + 4
    x = np.zeros((1, 1, L), np.float32)
    x[0, 0, 0], x[0, 0, L - 2], x[0, 0, L - 1] = 1, 5, 7
    w = np.ones((1, 1, 1), np.float32)
    y = numba_ops.deform_conv(x, w, np.zeros((1, 1, 2), np.float32), strides=[L - 1])
    np.testing.assert_array_equal(y[0, 0], [1, 7])
    y = numba_ops.deform_conv(x, w, np.array([[[0.0, -1.0]]], np.float32), strides=[L - 1])
    np.testing.assert_array_equal(y[0, 0], [1, 5])
    y = numba_ops.deform_conv(x, w, np.array([[[0.0, -0.5]]], np.float32), strides=[L - 1])
    np.testing.assert_array_equal(y[0, 0], [1, 6])


# --- shapes and layouts ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_empty_batch(dtype, device):
    ins, att = make_case(np.random.default_rng(0), N=0, C=2, D=(4, 5), oC=3, k=(2, 2))
    y = call(cast(ins, dtype), att, device)
    assert y.shape == (0, 3, 3, 4) and y.dtype == dtype


def test_zero_length_spatial_axis(device):
    """D = 0 with pads large enough for an output: every corner is outside."""
    rng = np.random.default_rng(1)
    ins, att = make_case(rng, N=1, C=2, D=(0, 3), oC=2, k=(2, 2), pads=[1, 0, 1, 0])
    ins["offset"][:] = rng.uniform(-0.99, 0.99, ins["offset"].shape)
    y = call(ins, att, device)
    assert y.shape == (1, 2, 1, 2)
    np.testing.assert_array_equal(y, np.broadcast_to(ins["b"][None, :, None, None], y.shape))


def test_scratch_stays_bounded():
    """Whatever N is, the chunk of padded images and the tiles fit the budget."""
    for N in (1, 64, 10 ** 6):
        T, nb, _ = dc_plan.plan_sizes(N, 64, 9, 64, 56 * 56, 1, 1, 2, 58 * 58, 4, 2)
        scratch = nb * 58 * 58 * 64 * 4 + 2 * T * (9 * 64 + 64) * 4
        assert scratch <= 256 << 20 and T >= 1 and nb >= 1
    T, nb, _ = dc_plan.plan_sizes(1, 4096, 27, 64, 10 ** 5, 1, 4096, 3, 10 ** 5, 4, 2)
    assert 2 * T * (27 * 4096 * 4 + 4096 * 27 * 44) <= 256 << 20


def test_no_input_channels():
    ins, att = make_case(np.random.default_rng(1), N=1, C=0, D=(3, 3), oC=2, k=(2, 2))
    y = call(ins, att)
    np.testing.assert_array_equal(y, np.broadcast_to(ins["b"][None, :, None, None], y.shape))


def test_inputs_not_modified_and_any_layout(device):
    rng = np.random.default_rng(2)
    ins, att = make_case(rng, N=2, C=4, D=(5, 6), oC=4, k=(2, 3), pads=[1, 0, 0, 1], group=2, og=2)
    want = call(ins, att, device)
    # non-contiguous (every other element of a bigger array) and negative strides
    views = {}
    for k, v in ins.items():
        big = np.zeros(tuple(2 * s for s in v.shape), v.dtype)
        big[tuple(slice(None, None, 2) for _ in v.shape)] = v
        views[k] = big[tuple(slice(None, None, 2) for _ in v.shape)]
    flipped = {k: np.ascontiguousarray(v[..., ::-1])[..., ::-1] for k, v in ins.items()}
    fortran = {k: np.asfortranarray(v) for k, v in ins.items()}
    for variant in (views, flipped, fortran):
        before = {k: v.copy() for k, v in variant.items()}
        y = call(variant, att, device)
        np.testing.assert_array_equal(y, want)
        for k in variant:
            np.testing.assert_array_equal(variant[k], before[k])
    for dt in (np.float16, BF16):  # 16-bit data reaches the kernels as bit patterns: views of views
        lo = cast(ins, dt)
        strided = {k: np.repeat(v, 2, axis=-1)[..., ::-2][..., ::-1] for k, v in lo.items()}
        np.testing.assert_array_equal(call(strided, att, device), call(lo, att, device))
    ro = {k: v.copy() for k, v in ins.items()}
    for v in ro.values():
        v.flags.writeable = False
    np.testing.assert_array_equal(call(ro, att, device), want)


def test_threads_match_serial(device):
    """8 threads at once (serial- and parallel-path shapes) give the serial results."""
    big = device == "cpu"
    rng = np.random.default_rng(3)
    cases = [make_case(rng, N=2, C=8, D=(12, 12), oC=8, k=(3, 3), pads=[1, 1, 1, 1], group=2) if big else
             make_case(rng, N=1, C=2, D=(3, 4), oC=2, k=(2, 2)),
             make_case(rng, N=1, C=2, D=(4, 4), oC=2, k=(2, 2), og=2)]
    cases = [(cast(i, np.float32), a) for i, a in cases]
    want = [call(i, a, device) for i, a in cases]
    errors = []

    def work(t):
        try:
            for r in range(4):
                i, a = cases[(t + r) % 2]
                np.testing.assert_array_equal(call(i, a, device), want[(t + r) % 2])
        except Exception as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_thread_count_change(dtype, monkeypatch):
    """A tiled call planned under one numba thread count, then called under another
    (16-bit data included, which the kernels see as bit patterns)."""
    import numba
    monkeypatch.setattr(numba_ops.kernels.cpu._runtime, "PARALLEL_MIN_WORK", 0)
    _force_path(monkeypatch, "tiled")
    ins, att = make_case(np.random.default_rng(11), N=2, C=4, D=(6, 6), oC=4, k=(3, 3), pads=[1, 1, 1, 1])
    ins = cast(ins, dtype)
    full = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = call(ins, att)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        np.testing.assert_array_equal(call(ins, att), one)
    finally:
        numba.set_num_threads(full)


def test_attribute_defaults_and_sequences():
    ins, att = make_case(np.random.default_rng(4), N=1, C=2, D=(4, 4), oC=2, k=(2, 2))
    y = call(ins, dict(kernel_shape=None, group=1))
    np.testing.assert_array_equal(y, call(ins, att))
    y2 = numba_ops.deform_conv(ins["x"], ins["w"], ins["offset"], ins["b"], ins["mask"],
                               kernel_shape=np.array([2, 2]), pads=(0, 0, 0, 0), strides=np.array([1, 1]),
                               dilations=(1, 1), group=np.int64(1), offset_group=np.int32(1))
    np.testing.assert_array_equal(y2, y)
    y3 = call(ins, dict(att, dilations=[np.uint64(1), np.int64(1)]))  # NumPy mixes these to float
    np.testing.assert_array_equal(y3, y)


# --- bad input ----------------------------------------------------------------------------------

def _bad_calls():
    rng = np.random.default_rng(0)
    ins, att = make_case(rng, N=1, C=4, D=(5, 5), oC=4, k=(3, 3), pads=[1, 1, 1, 1], group=2, og=2)
    x, w, off, b, m = ins["x"], ins["w"], ins["offset"], ins["b"], ins["mask"]
    A = att
    return [
        ("X", (x[0], w, off, b, m), A),
        ("X", (x[0, 0, 0], w, off, b, m), A),
        ("W", (x, w[0], off, b, m), A),
        ("kernel_shape", (x, w, off, b, m), dict(A, kernel_shape=[3, 2])),
        ("kernel_shape", (x, w, off, b, m), dict(A, kernel_shape=[3])),
        ("strides", (x, w, off, b, m), dict(A, strides=[1])),
        ("strides", (x, w, off, b, m), dict(A, strides=[0, 1])),
        ("strides", (x, w, off, b, m), dict(A, strides=[1.5, 1])),
        ("dilations", (x, w, off, b, m), dict(A, dilations=[1, 1, 1])),
        ("dilations", (x, w, off, b, m), dict(A, dilations=[1, -1])),
        ("pads", (x, w, off, b, m), dict(A, pads=[1, 1])),
        ("pads", (x, w, off, b, m), dict(A, pads=[1, 1, -1, 1])),
        ("pads", (x, w, off, b, m), dict(A, pads=[1, 1, 2 ** 60, 1])),
        ("group", (x, w, off, b, m), dict(A, group=0)),
        ("group", (x, w, off, b, m), dict(A, group=3)),
        ("group", (x, w[:3], off, b[:3], m), A),
        ("W", (x, np.concatenate([w, w], 1), off, b, m), A),
        ("offset_group", (x, w, off, b, m), dict(A, offset_group=3)),
        ("offset_group", (x, w, off, b, m), dict(A, offset_group=0)),
        ("offset", (x, w, off[:, :-1], b, m), A),
        ("offset", (x, w, off[..., :-1], b, m), A),
        ("offset", (x, w, off[0], b, m), A),
        ("mask", (x, w, off, b, m[:, :-1]), A),
        ("mask", (x, w, off, b, np.concatenate([m, m], 1)), A),
        ("mask", (x, w, off, b, m[..., :-1, :]), A),
        ("B", (x, w, off, b[:-1], m), A),
        ("B", (x, w, off, b[None], m), A),
        ("output", (x[..., :1, :1], w, off, b, m), dict(A, pads=[0, 0, 0, 0])),
        ("offset", (x, w, None, b, m), A),
        ("X", (None, w, off, b, m), A),
        ("W", (x, w[:, :, :0], off, b, m), dict(A, kernel_shape=None)),
        ("strides.*got int 1", (x, w, off, b, m), dict(A, strides=1)),
        ("dilations.*got \\[None, 1\\]", (x, w, off, b, m), dict(A, dilations=[None, 1])),
        ("dilations", (x, w, off, b, m), dict(A, dilations=[2 ** 64, 1])),
    ]


@pytest.mark.parametrize("i", range(len(_bad_calls())))
def test_bad_input_names_the_culprit(i):
    name, args, att = _bad_calls()[i]
    with pytest.raises((ValueError, TypeError), match=name):
        numba_ops.deform_conv(*args, **att)
    # the same shapes once valid, then invalid again: the call cache must not let it through
    with pytest.raises((ValueError, TypeError), match=name):
        numba_ops.deform_conv(*args, **att)


def test_bad_attribute_after_valid_call():
    """A call cached as valid does not make a float or bool attribute valid."""
    ins, att = make_case(np.random.default_rng(0), N=1, C=2, D=(4, 4), oC=2, k=(2, 2))
    call(ins, att)
    with pytest.raises((ValueError, TypeError), match="strides"):
        call(ins, dict(att, strides=[1.0, 1.0]))
    with pytest.raises((ValueError, TypeError), match="strides"):
        call(ins, dict(att, strides=[True, 1]))
    with pytest.raises((ValueError, TypeError), match="group"):
        call(ins, dict(att, group=True))



def test_attributes_past_64_bits():
    """A stride along an axis with one output and a dilation of a 1-long kernel axis never
    move a sample: any integer works there, even past 64 bits; elsewhere it is a ValueError."""
    ins, att = make_case(np.random.default_rng(6), N=1, C=2, D=(1, 5), oC=2, k=(1, 2))
    y = call(ins, att)
    np.testing.assert_array_equal(call(ins, dict(att, strides=[2 ** 64, 1], dilations=[2 ** 70, 1])), y)
    with pytest.raises(ValueError, match="dilations"):
        call(ins, dict(att, dilations=[1, 2 ** 64]))
    with pytest.raises(ValueError, match="pads"):
        call(ins, dict(att, pads=[0, 2 ** 64, 0, 0]))

def test_bad_device():
    ins, att = make_case(np.random.default_rng(0))
    with pytest.raises(ValueError, match="device"):
        call(ins, att, device="tpu")

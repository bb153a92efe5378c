"""numba_ops.onnx: whole ONNX models through onnx's ReferenceEvaluator with our
operators, against onnxruntime (the documented contract: ONNX)."""
import subprocess
import sys

import numpy as np
import pytest

import numba_ops
from helpers import FULL, in_default, param

onnx = pytest.importorskip("onnx")  # test dependency ([test] extra); absent only in a bare install
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from numba_ops.onnx import (AffineGrid, AffineWarp, DeformConv, GridSample,  # noqa: E402
                             MMCVMultiScaleDeformableAttention, fuse, ops)

ELEM = {np.float32: TP.FLOAT, np.float64: TP.DOUBLE}


def _model(nodes, inputs, outputs, opset=22):
    """inputs/outputs: [(name, elem_type)]; shapes left open."""
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, None) for n, t in inputs],
                          [helper.make_tensor_value_info(n, t, None) for n, t in outputs])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _ours(model, feeds, device=None):
    sess = ReferenceEvaluator(model, new_ops=ops(device))
    ours = [n for n in sess.rt_nodes_ if isinstance(n, (AffineGrid, DeformConv))]
    assert ours, "the evaluator did not pick numba_ops' operators"
    return sess.run(None, feeds)


def _ort(model, feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _close(got, want, dtype):
    tol = 1e-5 if dtype == np.float32 else 1e-11
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * max(1.0, np.abs(w).max()))


def _deform_inputs(rng, dtype, N=2, C=4, H=7, W=6, oC=6, k=(3, 2), og=2, group=2, stride=(2, 1),
                   pads=(1, 0, 1, 1), dil=(1, 2)):
    nd = len(k)
    outs = [(d + pads[i] + pads[i + nd] - ((k[i] - 1) * dil[i] + 1)) // stride[i] + 1
            for i, d in enumerate((H, W))]
    K = int(np.prod(k))
    feeds = {
        "X": rng.standard_normal((N, C, H, W)).astype(dtype),
        "W": rng.standard_normal((oC, C // group) + tuple(k)).astype(dtype),
        "offset": (1.5 * rng.standard_normal((N, og * K * nd, *outs))).astype(dtype),
        "B": rng.standard_normal((oC,)).astype(dtype),
        "mask": rng.random((N, og * K, *outs)).astype(dtype),
    }
    attrs = dict(kernel_shape=list(k), strides=list(stride), pads=list(pads), dilations=list(dil),
                 group=group, offset_group=og)
    return feeds, attrs


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size,align", [((2, 3, 5, 7), 0), ((2, 3, 5, 7), 1), ((2, 1, 3, 4, 5), 0),
                                        ((1, 1, 2, 4, 3), 1), ((1, 1, 1, 4, 1), 0)])
def test_affine_grid_model(rng, dtype, size, align):
    nd = len(size) - 2
    node = helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=align)
    m = _model([node], [("theta", ELEM[dtype]), ("size", TP.INT64)], [("grid", ELEM[dtype])], opset=20)
    feeds = {"theta": rng.standard_normal((size[0], nd, nd + 1)).astype(dtype),
             "size": np.array(size, dtype=np.int64)}
    _close(_ours(m, feeds), _ort(m, feeds), dtype)


def test_affine_grid_default_align_corners(rng):
    node = helper.make_node("AffineGrid", ["theta", "size"], ["grid"])  # align_corners defaults to 0
    m = _model([node], [("theta", TP.FLOAT), ("size", TP.INT64)], [("grid", TP.FLOAT)], opset=20)
    feeds = {"theta": rng.standard_normal((2, 2, 3)).astype(np.float32), "size": np.array([2, 1, 4, 5])}
    got = _ours(m, feeds)[0]
    np.testing.assert_allclose(got, numba_ops.affine_grid(feeds["theta"], [2, 1, 4, 5], 0), rtol=0, atol=0)
    _close([got], _ort(m, feeds), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("optional", ["B+mask", "none", "mask only (B empty-named)", "B only"])
def test_deform_conv_model(rng, dtype, optional):
    feeds, attrs = _deform_inputs(rng, dtype)
    names = {"B+mask": ["X", "W", "offset", "B", "mask"], "none": ["X", "W", "offset"],
             "mask only (B empty-named)": ["X", "W", "offset", "", "mask"], "B only": ["X", "W", "offset", "B"]}[optional]
    feeds = {n: feeds[n] for n in names if n}
    node = helper.make_node("DeformConv", names, ["Y"], **attrs)
    m = _model([node], [(n, ELEM[dtype]) for n in names if n], [("Y", ELEM[dtype])])
    _close(_ours(m, feeds), _ort(m, feeds), dtype)


def test_deform_conv_attribute_defaults(rng):
    """No strides/pads/dilations/group/offset_group/kernel_shape on the node: ONNX defaults."""
    feeds, _ = _deform_inputs(rng, np.float32, k=(2, 3), og=1, group=1, stride=(1, 1), pads=(0, 0, 0, 0),
                              dil=(1, 1))
    feeds = {n: feeds[n] for n in ("X", "W", "offset")}
    node = helper.make_node("DeformConv", ["X", "W", "offset"], ["Y"])
    m = _model([node], [(n, TP.FLOAT) for n in feeds], [("Y", TP.FLOAT)], opset=19)
    _close(_ours(m, feeds), _ort(m, feeds), np.float32)


def test_affine_grid_length_one_axis_align_corners():
    """An axis of length 1 has the single coordinate 0 under both settings
    (as PyTorch); onnxruntime 1.x gives -1 there with align_corners=1, so this edge
    is checked against the definition, not against onnxruntime."""
    node = helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=1)
    m = _model([node], [("theta", TP.FLOAT), ("size", TP.INT64)], [("grid", TP.FLOAT)], opset=20)
    theta = np.array([[[1, 0, 0, 0.5], [0, 1, 0, 0.25], [0, 0, 1, -0.5]]], np.float32)
    got = _ours(m, {"theta": theta, "size": np.array([1, 1, 1, 2, 1])})[0]
    want = np.array([[0.5, -0.75, -0.5], [0.5, 1.25, -0.5]], np.float32).reshape(1, 1, 2, 1, 3)
    np.testing.assert_array_equal(got, want)


@pytest.mark.full  # float32 1-D and 3-D DeformConv kernels (the default run: every rank in float64)
def test_deform_conv_1d_and_3d(rng):
    """N-D: onnxruntime and onnx's reference take only 2-D DeformConv, so 1-D and 3-D
    models go against the float64 oracle."""
    from reference import deform_conv_ref

    for shape, k in (((2, 2, 9), (3,)), ((1, 2, 4, 5, 4), (2, 2, 3))):
        nd = len(k)
        outs = [d - kk + 1 for d, kk in zip(shape[2:], k)]
        K = int(np.prod(k))
        feeds = {"X": rng.standard_normal(shape).astype(np.float32),
                 "W": rng.standard_normal((3, shape[1]) + k).astype(np.float32),
                 "offset": rng.standard_normal((shape[0], K * nd, *outs)).astype(np.float32)}
        node = helper.make_node("DeformConv", ["X", "W", "offset"], ["Y"], kernel_shape=list(k))
        m = _model([node], [(n, TP.FLOAT) for n in feeds], [("Y", TP.FLOAT)])
        want = deform_conv_ref(feeds["X"], feeds["W"], feeds["offset"]).astype(np.float32)
        _close(_ours(m, feeds), [want], np.float32)


def test_affine_grid_then_grid_sample(rng):
    """A spatial transformer: AffineGrid -> GridSample, every other op on onnx's reference."""
    nodes = [helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=0),
             helper.make_node("GridSample", ["X", "grid"], ["Y"], align_corners=0, mode="linear",
                              padding_mode="zeros")]
    m = _model(nodes, [("X", TP.FLOAT), ("theta", TP.FLOAT), ("size", TP.INT64)], [("Y", TP.FLOAT)])
    theta = np.tile(np.array([[0.9, -0.2, 0.1], [0.25, 1.1, -0.05]], np.float32), (2, 1, 1))
    theta += 0.05 * rng.standard_normal(theta.shape).astype(np.float32)
    feeds = {"X": rng.standard_normal((2, 3, 8, 9)).astype(np.float32), "theta": theta,
             "size": np.array([2, 3, 6, 7], np.int64)}
    got, want = _ours(m, feeds), _ort(m, feeds)
    assert got[0].shape == (2, 3, 6, 7)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)


def test_deform_conv_then_conv(rng):
    feeds, attrs = _deform_inputs(rng, np.float32, stride=(1, 1), pads=(1, 1, 1, 1), dil=(1, 1), k=(3, 3))
    feeds["W2"] = rng.standard_normal((5, 6, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("DeformConv", ["X", "W", "offset", "B", "mask"], ["H"], **attrs),
             helper.make_node("Relu", ["H"], ["R"]),
             helper.make_node("Conv", ["R", "W2"], ["Y"], pads=[1, 1, 1, 1])]
    m = _model(nodes, [(n, TP.FLOAT) for n in feeds], [("Y", TP.FLOAT)])
    got, want = _ours(m, feeds), _ort(m, feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4 * np.abs(want[0]).max())


def test_classes_replace_the_builtins():
    assert AffineGrid.op_domain == "" and DeformConv.op_domain == "" and GridSample.op_domain == ""
    assert AffineWarp.op_domain == "numba_ops" and MMCVMultiScaleDeformableAttention.op_domain == "numba_ops"
    from onnx.reference.op_run import OpRun
    assert all(issubclass(c, OpRun) for c in (AffineGrid, DeformConv, GridSample, AffineWarp))


def test_device_selection(rng):
    cpu = ops("cpu")
    assert [c.__name__ for c in cpu] == ["AffineGrid", "DeformConv", "GridSample", "AffineWarp",
                                         "MMCVMultiScaleDeformableAttention"]
    assert all(c.device == "cpu" for c in cpu) and AffineGrid.device is None
    assert ops() == [AffineGrid, DeformConv, GridSample, AffineWarp, MMCVMultiScaleDeformableAttention]
    with pytest.raises(ValueError, match="device"):
        ops("tpu")
    node = helper.make_node("AffineGrid", ["theta", "size"], ["grid"])
    m = _model([node], [("theta", TP.FLOAT), ("size", TP.INT64)], [("grid", TP.FLOAT)], opset=20)
    feeds = {"theta": rng.standard_normal((1, 2, 3)).astype(np.float32), "size": np.array([1, 1, 3, 4])}
    want = numba_ops.affine_grid(feeds["theta"], [1, 1, 3, 4])
    for dev in numba_ops.devices():
        got = ReferenceEvaluator(m, new_ops=ops(dev)).run(None, feeds)[0]
        assert isinstance(got, np.ndarray)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if "cuda" not in numba_ops.devices():
        with pytest.raises(RuntimeError, match="cuda|CUDA|GPU"):
            ReferenceEvaluator(m, new_ops=ops("cuda")).run(None, feeds)


def test_bad_input_keeps_numba_ops_errors(rng):
    node = helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=2)
    m = _model([node], [("theta", TP.FLOAT), ("size", TP.INT64)], [("grid", TP.FLOAT)], opset=20)
    feeds = {"theta": rng.standard_normal((1, 2, 3)).astype(np.float32), "size": np.array([1, 1, 3, 4])}
    with pytest.raises(ValueError, match="align_corners"):
        ReferenceEvaluator(m, new_ops=ops()).run(None, feeds)
    # TypeErrors too come as numba_ops says them (onnx's OpRun.run would re-wrap them)
    with pytest.raises(TypeError, match="theta has dtype int32"):
        ReferenceEvaluator(m, new_ops=ops()).run(None, dict(feeds, theta=feeds["theta"].astype(np.int32)))
    dfeeds, attrs = _deform_inputs(rng, np.float32)
    names = ["X", "W", "offset", "B", "mask"]
    m = _model([helper.make_node("DeformConv", names, ["Y"], **dict(attrs, group=2.0))],
               [(n, TP.FLOAT) for n in names], [("Y", TP.FLOAT)])
    with pytest.raises(ValueError, match="group must be an integer"):  # a float attribute: both kinds
        ReferenceEvaluator(m, new_ops=ops()).run(None, dfeeds)
    with pytest.raises(TypeError, match="group must be an integer"):
        ReferenceEvaluator(m, new_ops=ops("cpu")).run(None, dfeeds)
    m = _model([helper.make_node("DeformConv", names, ["Y"], **attrs)], [(n, TP.FLOAT) for n in names],
               [("Y", TP.FLOAT)])
    with pytest.raises(TypeError, match="all float inputs must share one dtype"):
        ReferenceEvaluator(m, new_ops=ops()).run(None, dict(dfeeds, W=dfeeds["W"].astype(np.float64)))


def test_import_numba_ops_does_not_import_onnx():
    code = "import sys, numba_ops; assert 'onnx' not in sys.modules, 'onnx imported'"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_models(rng, dtype):
    """float16 and bfloat16 models: the evaluator hands our ops the 16-bit arrays and
    returns exactly what the Python API gives."""
    from numba_ops._dtypes import np_dtype
    dt = np_dtype(dtype)
    et = TP.FLOAT16 if dtype == "float16" else TP.BFLOAT16
    feeds, attrs = _deform_inputs(rng, np.float32)
    feeds = {k: v.astype(dt) for k, v in feeds.items()}
    names = ["X", "W", "offset", "B", "mask"]
    nodes = [helper.make_node("DeformConv", names, ["Y"], **attrs),
             helper.make_node("AffineGrid", ["theta", "size"], ["G"], align_corners=1)]
    feeds["theta"] = rng.standard_normal((2, 2, 3)).astype(dt)
    feeds["size"] = np.array([2, 1, 3, 5], np.int64)
    m = _model(nodes, [(n, et) for n in names] + [("theta", et), ("size", TP.INT64)], [("Y", et), ("G", et)])
    y, g = _ours(m, feeds)
    assert y.dtype == dt and g.dtype == dt
    np.testing.assert_array_equal(y, numba_ops.deform_conv(*(feeds[n] for n in names), **attrs))
    np.testing.assert_array_equal(g, numba_ops.affine_grid(feeds["theta"], [2, 1, 3, 5], 1))


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in numba_ops.devices(), reason="no GPU and no CUDA simulator here")
def test_models_on_cuda_match_cpu(rng):
    """ops("cuda"): NumPy feeds go over to the GPU and back; results equal the CPU's."""
    feeds, attrs = _deform_inputs(rng, np.float32, N=1, H=5, W=4)
    names = ["X", "W", "offset", "B", "mask"]
    nodes = [helper.make_node("DeformConv", names, ["Y"], **attrs),
             helper.make_node("AffineGrid", ["theta", "size"], ["G"])]
    feeds["theta"] = rng.standard_normal((1, 2, 3)).astype(np.float32)
    feeds["size"] = np.array([1, 1, 3, 4], np.int64)
    m = _model(nodes, [(n, TP.FLOAT) for n in names] + [("theta", TP.FLOAT), ("size", TP.INT64)],
               [("Y", TP.FLOAT), ("G", TP.FLOAT)])
    got = _ours(m, feeds, device="cuda")
    want = _ours(m, feeds, device="cpu")
    for g, w in zip(got, want):
        assert isinstance(g, np.ndarray)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_evaluator_runs_local_functions_on_numba_ops(rng, monkeypatch):
    """onnx runs a model-local function's body without new_ops; evaluator() does not."""
    from numba_ops.onnx import evaluator
    calls = []
    run = DeformConv._run
    monkeypatch.setattr(DeformConv, "_run", lambda self, *a, **k: (calls.append(1), run(self, *a, **k))[1])
    inner = helper.make_function("local", "Inner", ["X", "W", "O"], ["Y"],
                                 [helper.make_node("DeformConv", ["X", "W", "O"], ["Y"], pads=[1, 1, 1, 1])],
                                 [helper.make_opsetid("", 22)])
    outer = helper.make_function("local", "Outer", ["X", "W", "O"], ["Y"],  # a function calling a function
                                 [helper.make_node("Inner", ["X", "W", "O"], ["Y"], domain="local")],
                                 [helper.make_opsetid("", 22), helper.make_opsetid("local", 1)])
    vi = [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in "XWO"]
    g = helper.make_graph([helper.make_node("Outer", ["X", "W", "O"], ["Y"], domain="local")], "g", vi,
                          [helper.make_tensor_value_info("Y", TP.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid("local", 1)],
                              functions=[inner, outer])
    x = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
    w = rng.standard_normal((2, 2, 3, 3)).astype(np.float32)
    o = rng.standard_normal((1, 18, 4, 4)).astype(np.float32)
    y, = evaluator(model).run(None, {"X": x, "W": w, "O": o})
    assert calls == [1]
    np.testing.assert_array_equal(y, numba_ops.deform_conv(x, w, o, pads=[1, 1, 1, 1]))
    plain = helper.make_model(helper.make_graph(inner.node, "p", vi, g.output),
                              opset_imports=[helper.make_opsetid("", 22)])  # no functions: as new_ops=ops()
    y2, = evaluator(plain, device="cpu").run(None, {"X": x, "W": w, "O": o})
    assert calls == [1, 1]
    np.testing.assert_array_equal(y2, y)


def test_evaluator_takes_more_ops(rng):
    """evaluator(model, new_ops=[...]): the user's classes join ours and, as in
    ReferenceEvaluator, the first class of a name wins (the user's)."""
    from onnx.reference.op_run import OpRun

    from numba_ops.onnx import evaluator

    class Twice(OpRun):
        op_domain = "local"

        def _run(self, X):
            return (2 * X,)

    class DeformConv(OpRun):  # the user's own DeformConv replaces ours
        op_domain = ""

        def _run(self, X, W, offset, **attrs):
            return (np.zeros(1, X.dtype),)

    vi = [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("theta", "size")]
    g = helper.make_graph([helper.make_node("AffineGrid", ["theta", "size"], ["G"], align_corners=1),
                           helper.make_node("Twice", ["G"], ["Y"], domain="local")], "g", vi,
                          [helper.make_tensor_value_info("Y", TP.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid("local", 1)])
    theta = rng.standard_normal((1, 2, 3)).astype(np.float32)
    size = np.array([1, 1, 2, 1], np.int64)  # a length-1 axis: 0 in numba_ops, -1 in onnx's own
    y, = evaluator(model, new_ops=[Twice]).run(None, {"theta": theta, "size": size})
    np.testing.assert_array_equal(y, 2 * numba_ops.affine_grid(theta, [1, 1, 2, 1], align_corners=True))
    dc = helper.make_model(helper.make_graph([helper.make_node("DeformConv", ["X", "W", "O"], ["Y"])], "d",
                                             [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in "XWO"],
                                             [helper.make_tensor_value_info("Y", TP.FLOAT, None)]),
                           opset_imports=[helper.make_opsetid("", 22)])
    x, w, o = np.ones((1, 1, 2, 2), np.float32), np.ones((1, 1, 1, 1), np.float32), np.zeros((1, 2, 2, 2), np.float32)
    y, = evaluator(dc, new_ops=[DeformConv]).run(None, {"X": x, "W": w, "O": o})
    np.testing.assert_array_equal(y, np.zeros(1, np.float32))


# --- GridSample, AffineWarp and fuse ------------------------------------------------------

def _gs_backend_cases():
    from numba_ops.benchmark.cases import onnx_backend_cases
    return [c for c in onnx_backend_cases() if c.op == "GridSample"]


def test_grid_sample_backend_cases_match_onnx_reference():
    """Every ONNX backend case of GridSample: our operator against onnx's own and the
    case's expected output."""
    cases = _gs_backend_cases()
    assert len(cases) >= 18 and {c.attrs.get("mode", "linear") for c in cases} == {"linear", "nearest", "cubic"}
    for case in cases:
        feeds = {n: v for n, v in zip(case.node.input, case.inputs)}
        sess = ReferenceEvaluator(case.node, new_ops=[GridSample])
        assert any(isinstance(n, GridSample) for n in sess.rt_nodes_)
        got = sess.run(None, feeds)[0]
        want = ReferenceEvaluator(case.node).run(None, feeds)[0]
        assert got.dtype == want.dtype and got.shape == want.shape, case.name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=case.name)
        # the cases quote their expected values to 4 decimals
        np.testing.assert_allclose(got, case.expected, rtol=0, atol=1e-4 * max(1, np.abs(want).max()),
                                   err_msg=case.name)


@pytest.mark.parametrize("pads", [("reflection", "zeros", "zeros"), pytest.param(("reflection",) * 3, marks=FULL)],
                         ids=["default", "reflection"])  # per mode (the default run's: helpers.in_default)
@pytest.mark.parametrize("opset", [16, 20, 22])
def test_grid_sample_attributes_and_defaults(rng, opset, pads):
    """ONNX's defaults (linear, zeros, align_corners 0) where the node gives none;
    opset 16's mode names bilinear/bicubic are opset 20's linear/cubic."""
    x = rng.standard_normal((2, 3, 5, 6)).astype(np.float32)
    grid = (1.2 * rng.standard_normal((2, 4, 3, 2))).astype(np.float32)
    feeds = {"X": x, "grid": grid}
    m = _model([helper.make_node("GridSample", ["X", "grid"], ["Y"])], [("X", TP.FLOAT), ("grid", TP.FLOAT)],
               [("Y", TP.FLOAT)], opset=opset)
    got, = _ours_gs(m, feeds)
    np.testing.assert_array_equal(got, numba_ops.grid_sample(x, grid))
    names = {16: ("bilinear", "nearest", "bicubic"), 20: ("linear", "nearest", "cubic")}
    for name, mode, padding in zip(names.get(opset, names[20]), ("linear", "nearest", "cubic"), pads):
        node = helper.make_node("GridSample", ["X", "grid"], ["Y"], mode=name, padding_mode=padding,
                                align_corners=1)
        m = _model([node], [("X", TP.FLOAT), ("grid", TP.FLOAT)], [("Y", TP.FLOAT)], opset=opset)
        got, = _ours_gs(m, feeds)
        want = numba_ops.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=1)
        np.testing.assert_array_equal(got, want)
        if opset >= 20:  # onnx's own knows the opset-20 names
            np.testing.assert_allclose(got, ReferenceEvaluator(m).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def _ours_gs(model, feeds, device=None):
    sess = ReferenceEvaluator(model, new_ops=ops(device))
    assert any(isinstance(n, (GridSample, AffineWarp)) for n in sess.rt_nodes_)
    return sess.run(None, feeds)


def _warp_model(nodes, extra_outputs=(), r=2, opset=22, x_names=("X",)):
    ins = [(n, TP.FLOAT) for n in x_names] + [("theta", TP.FLOAT), ("size", TP.INT64)]
    outs = [(n, TP.FLOAT) for n in ("Y",) + tuple(extra_outputs)]
    return _model(nodes, ins, outs, opset=opset)


def _warp_feeds(rng, r=2, n=2, c=3, c_size=None):
    x = rng.standard_normal((n, c) + (6, 7, 5)[3 - r:]).astype(np.float32)
    theta = (np.eye(r, r + 1) + 0.3 * rng.standard_normal((n, r, r + 1))).astype(np.float32)
    size = np.array((n, c if c_size is None else c_size) + (4, 5, 6)[3 - r:], np.int64)
    return {"X": x, "theta": theta, "size": size}


def _op_types(model):
    return [(n.domain, n.op_type) for n in model.graph.node]


@pytest.mark.parametrize("r,align,mode,padding", [  # 3-D cubic samples with zeros padding (below)
    param(in_default(r, mode, "zeros" if (r, mode) == (3, "cubic") else padding), r, align, mode, padding)
    for r in (2, 3) for align in (0, 1) for mode, padding in (("linear", "zeros"), ("nearest", "border"),
                                                              ("cubic", "reflection"))])
def test_fuse_affine_grid_then_grid_sample(rng, r, align, mode, padding):
    if r == 3 and mode == "cubic" and padding == "reflection":
        padding = "zeros"
    nodes = [helper.make_node("Relu", ["X"], ["Xr"]),
             helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=align),
             helper.make_node("GridSample", ["Xr", "grid"], ["S"], align_corners=align, mode=mode,
                              padding_mode=padding),
             helper.make_node("Neg", ["S"], ["Y"])]
    m = _warp_model(nodes)
    m.graph.value_info.append(helper.make_tensor_value_info("grid", TP.FLOAT, None))
    before = m.SerializeToString()
    fused = fuse(m)
    assert m.SerializeToString() == before  # the input model is not modified
    assert _op_types(fused) == [("", "Relu"), ("numba_ops", "AffineWarp"), ("", "Neg")]
    warp = fused.graph.node[1]
    assert list(warp.input) == ["Xr", "theta", "size"] and list(warp.output) == ["S"]
    attrs = {a.name: helper.get_attribute_value(a) for a in warp.attribute}
    assert attrs == {"mode": mode.encode(), "padding_mode": padding.encode(), "align_corners": align}
    assert {(o.domain, o.version) for o in fused.opset_import} == {("", 22), ("numba_ops", 1)}
    assert "grid" not in {v.name for v in fused.graph.value_info}
    feeds = _warp_feeds(rng, r)
    want, = _ours_gs(m, feeds)
    got, = _ours_gs(fused, feeds)
    assert got.shape == want.shape == tuple(feeds["size"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # and the unfused model on onnxruntime
    if r == 2 or mode != "cubic":
        np.testing.assert_allclose(got, _ort(m, feeds)[0], rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("padding", ["zeros", pytest.param("border", marks=FULL)])  # helpers.in_default
def test_fuse_one_grid_many_samplers_and_defaults(rng, padding):
    """One AffineGrid feeding two GridSamples (different X, modes; attributes left
    to their defaults, opset 16's mode name): two AffineWarp nodes; size's C is
    AffineGrid's, which ignores it."""
    nodes = [helper.make_node("AffineGrid", ["theta", "size"], ["grid"]),
             helper.make_node("GridSample", ["X", "grid"], ["Y"]),
             helper.make_node("GridSample", ["X2", "grid"], ["Z"], mode="bicubic", padding_mode=padding)]
    m = _warp_model(nodes, extra_outputs=("Z",), opset=16, x_names=("X", "X2"))
    feeds = _warp_feeds(rng, c_size=1)
    feeds["X2"] = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    fused = fuse(m)
    assert _op_types(fused) == [("numba_ops", "AffineWarp")] * 2
    attrs = {a.name: helper.get_attribute_value(a) for a in fused.graph.node[1].attribute}
    assert attrs == {"mode": b"cubic", "padding_mode": padding.encode(), "align_corners": 0}
    want = _ours_gs(m, feeds)
    got = _ours_gs(fused, feeds)
    assert got[1].shape == (2, 5, 5, 6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_fuse_leaves_other_patterns(rng):
    """Left as they were: a grid that also feeds another op, a grid that is a graph
    output, a GridSample whose align_corners differs from the AffineGrid's, a grid
    used as GridSample's X; the model without any fusable pair comes back equal."""
    ag = helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=1)
    gs = helper.make_node("GridSample", ["X", "grid"], ["Y"], align_corners=1)
    cases = {
        "another reader": ([ag, gs, helper.make_node("Neg", ["grid"], ["G2"])], ("G2",)),
        "graph output": ([ag, gs], ("grid",)),
        "align_corners differ": ([ag, helper.make_node("GridSample", ["X", "grid"], ["Y"], align_corners=0)], ()),
        "one of two differs": ([ag, gs, helper.make_node("GridSample", ["X", "grid"], ["Y2"])], ("Y2",)),
    }
    feeds = _warp_feeds(rng)
    for what, (nodes, extra) in cases.items():
        m = _warp_model(nodes, extra_outputs=extra)
        fused = fuse(m)
        assert fused.SerializeToString() == m.SerializeToString(), what
        assert fused is not m
    # one fusable pair beside one that is not: only the first is fused
    nodes = [helper.make_node("AffineGrid", ["theta", "size"], ["g1"]),
             helper.make_node("GridSample", ["X", "g1"], ["Y"]),
             helper.make_node("AffineGrid", ["theta", "size"], ["g2"]),
             helper.make_node("GridSample", ["X", "g2"], ["Y2"], align_corners=1)]
    m = _warp_model(nodes, extra_outputs=("Y2",))
    fused = fuse(m)
    assert _op_types(fused) == [("numba_ops", "AffineWarp"), ("", "AffineGrid"), ("", "GridSample")]
    for g, w in zip(_ours_gs(fused, feeds), _ours_gs(m, feeds)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
    with pytest.raises(TypeError, match="model"):
        fuse(m.graph)


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in numba_ops.devices(), reason="no GPU and no CUDA simulator here")
def test_grid_sample_and_affine_warp_models_on_cuda(rng):
    nodes = [helper.make_node("AffineGrid", ["theta", "size"], ["grid"]),
             helper.make_node("GridSample", ["X", "grid"], ["Y"], mode="cubic", padding_mode="reflection")]
    m = _warp_model(nodes)
    feeds = _warp_feeds(rng, n=1)
    for model in (m, fuse(m)):
        got, = _ours_gs(model, feeds, device="cuda")
        want, = _ours_gs(model, feeds, device="cpu")
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, want)


def test_ms_deform_attn_in_the_evaluator(rng):
    """``MMCVMultiScaleDeformableAttention`` of domain numba_ops (``ops()``; 3-D levels)
    and of MMDeploy's domains (``mmdeploy_ops()``) give the function's result; an
    unknown attribute and inputs that do not fit raise the function's errors."""
    from numba_ops.onnx import mmdeploy_ops
    assert [(c.__name__, c.op_domain) for c in mmdeploy_ops()][-2:] == [
        ("MMCVMultiScaleDeformableAttention", "mmdeploy"), ("MMCVMultiScaleDeformableAttention", "mmcv")]
    names = ["value", "shapes", "starts", "loc", "attn"]
    shapes = np.array([[2, 3, 4], [1, 2, 2]], np.int64)
    feeds = dict(value=rng.standard_normal((1, 28, 2, 3)), shapes=shapes, starts=np.array([0, 24], np.int64),
                 loc=rng.uniform(0, 1, (1, 5, 2, 2, 3, 3)), attn=rng.uniform(0, 1, (1, 5, 2, 2, 3)))
    want = numba_ops.ms_deform_attn(*feeds.values())
    def model(domain, **attrs):
        node = helper.make_node("MMCVMultiScaleDeformableAttention", names, ["Y"], domain=domain, **attrs)
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TP.INT64 if n in ("shapes", "starts")
                                                                          else TP.DOUBLE, None) for n in names],
                              [helper.make_tensor_value_info("Y", TP.DOUBLE, None)])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])

    for domain, new_ops in (("numba_ops", ops()), ("mmdeploy", mmdeploy_ops()), ("mmcv", mmdeploy_ops("cpu"))):
        got = ReferenceEvaluator(model(domain, im2col_step=64), new_ops=new_ops).run(None, feeds)[0]
        np.testing.assert_array_equal(got, want)
    sess = ReferenceEvaluator(model("mmdeploy"), new_ops=mmdeploy_ops())
    with pytest.raises(ValueError, match="level_start_index must be"):
        sess.run(None, dict(feeds, starts=np.array([0, 23], np.int64)))
    with pytest.raises(TypeError, match="attention_weights"):
        sess.run(None, dict(feeds, attn=feeds["attn"].astype(np.float32)))
    with pytest.raises(ValueError, match="no attribute 'im2col'"):
        ReferenceEvaluator(model("mmdeploy", im2col=1), new_ops=mmdeploy_ops()).run(None, feeds)

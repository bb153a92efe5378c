"""numba_ops.onnx.session: whole models in onnxruntime with numba_ops' nodes, against
the functions (the documented contract: ONNX). Shapes are tiny; the default matrix covers every op,
dtype and rank at least once, the exhaustive product is marked ``full``."""
import itertools
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import numba_ops

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime_extensions")
import ml_dtypes  # noqa: E402
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper  # noqa: E402

from numba_ops.onnx import session  # noqa: E402
from helpers import FULL  # noqa: E402

DT = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64), "float16": np.dtype(np.float16),
      "bfloat16": np.dtype(ml_dtypes.bfloat16)}
ELEM = {"float32": TP.FLOAT, "float64": TP.DOUBLE, "float16": TP.FLOAT16, "bfloat16": TP.BFLOAT16}


def _model(nodes, floats, others, dtype, out_elem=None, opset=22, static=True):
    """A model whose float inputs (``floats``: name -> array of ``dtype``) come in as
    float32 and are cast to 16-bit inside (onnxruntime's Python API takes no bfloat16
    arrays), the others (``others``) as they are; output ``Y`` likewise cast back.
    Returns (model, feeds)."""
    half = dtype in ("float16", "bfloat16")
    pre, feeds, ins = [], {}, []
    for name, a in floats.items():
        if half:
            pre.append(helper.make_node("Cast", [name + "_in"], [name], to=ELEM[dtype]))
            feeds[name + "_in"] = a.astype(np.float32)  # exact: a holds 16-bit values
            ins.append(helper.make_tensor_value_info(name + "_in", TP.FLOAT, a.shape if static else None))
        else:
            feeds[name] = a
            ins.append(helper.make_tensor_value_info(name, ELEM[dtype], a.shape if static else None))
    for name, a in others.items():
        feeds[name] = a
        ins.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype),
                                                 a.shape if static else None))
    out_elem = ELEM[dtype] if out_elem is None else out_elem
    post = []
    if half and out_elem in (TP.FLOAT16, TP.BFLOAT16):
        nodes = [helper.make_node(n.op_type, n.input, ["Y16" if o == "Y" else o for o in n.output], domain=n.domain,
                                  name=n.name, **{a.name: helper.get_attribute_value(a) for a in n.attribute})
                 for n in nodes]
        post.append(helper.make_node("Cast", ["Y16"], ["Y"], to=TP.FLOAT))
        out_elem = TP.FLOAT
    g = helper.make_graph(pre + list(nodes) + post, "g", ins, [helper.make_tensor_value_info("Y", out_elem, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), feeds


def _equal(got, want):
    want = np.asarray(want)
    if want.dtype in (DT["float16"], DT["bfloat16"]):
        want = want.astype(np.float32)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def _values(rng, shape, dtype, scale=1.0, uniform=None):
    a = rng.uniform(*uniform, shape) if uniform else scale * rng.standard_normal(shape)
    return a.astype(DT[dtype])


# --- every op x dtype x rank, against the function ---------------------------------------

def _deform_case(rng, dtype, nd, optional="B+mask"):
    spatial = (7, 6, 5)[:nd]
    k = (3, 2, 2)[:nd]
    N, C, oC, group, og = 2, 4, 6, 2, 2
    pads = [1] * nd + [0] * nd
    outs = tuple(s + 1 - kk + 1 for s, kk in zip(spatial, k))
    K = int(np.prod(k))
    f = {"X": _values(rng, (N, C) + spatial, dtype), "W": _values(rng, (oC, C // group) + k, dtype),
         "offset": _values(rng, (N, og * K * nd) + outs, dtype, 1.5),
         "B": _values(rng, (oC,), dtype), "mask": _values(rng, (N, og * K) + outs, dtype, uniform=(0, 1))}
    names = {"B+mask": ["X", "W", "offset", "B", "mask"], "none": ["X", "W", "offset"],
             "mask": ["X", "W", "offset", "", "mask"], "B": ["X", "W", "offset", "B"]}[optional]
    attrs = dict(pads=pads, group=group, offset_group=og)
    node = helper.make_node("DeformConv", names, ["Y"], name="dc", **attrs)
    floats = {n: f[n] for n in names if n}
    want = numba_ops.deform_conv(*(f[n] if n else None for n in names), **attrs)
    return [node], floats, {}, want, None


def _grid_case(rng, dtype, r, mode="linear", padding="zeros", x_u8=False):
    x = (rng.integers(0, 256, (2, 3) + (5, 6, 4)[:r]).astype(np.uint8) if x_u8
         else _values(rng, (2, 3) + (5, 6, 4)[:r], dtype))
    grid = _values(rng, (2,) + (4, 3, 2)[:r] + (r,), dtype, uniform=(-1.2, 1.2))
    node = helper.make_node("GridSample", ["X", "grid"], ["Y"], name="gs", mode=mode, padding_mode=padding,
                            align_corners=1)
    want = numba_ops.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=1)
    if x_u8:
        return [node], {"grid": grid}, {"X": x}, want, TP.UINT8
    return [node], {"X": x, "grid": grid}, {}, want, None


def _affine_case(rng, dtype, r, align=0):
    size = np.array((2, 1) + (3, 4, 5)[:r], np.int64)
    theta = _values(rng, (2, r, r + 1), dtype)
    node = helper.make_node("AffineGrid", ["theta", "size"], ["Y"], name="ag", align_corners=align)
    return [node], {"theta": theta}, {"size": size}, numba_ops.affine_grid(theta, size, align), None


def _run_case(case, dtype, **kw):
    nodes, floats, others, want, out_elem = case
    m, feeds = _model(nodes, floats, others, dtype, out_elem)
    s = session(m, **kw)
    assert len(s.numba_ops_nodes) == 1
    got, = s.run(None, feeds)
    _equal(got, want)
    return s


#: the default run's cases: every op, dtype and rank at least once, on the kernels the
#: default run compiles anyway (helpers.in_default, helpers.deform_default); the
#: session runs 16-bit nodes on the float32 kernel, the function it is checked against
#: on the 16-bit one
COVER = [("DeformConv", "float32", 2), ("DeformConv", "float64", 1), ("DeformConv", "float64", 3),
         ("DeformConv", "float16", 2), ("DeformConv", "bfloat16", 2),
         ("GridSample", "float32", 1), ("GridSample", "float64", 2), ("GridSample", "float32", 3),
         ("GridSample", "float16", 2), ("GridSample", "bfloat16", 2),
         ("AffineGrid", "float32", 2), ("AffineGrid", "float64", 3), ("AffineGrid", "float16", 3),
         ("AffineGrid", "bfloat16", 2)]
PRODUCT = [c for c in itertools.product(("DeformConv", "GridSample"), DT, (1, 2, 3))] + \
       [c for c in itertools.product(("AffineGrid",), DT, (2, 3))]


def _case(rng, op, dtype, rank, full=False):
    if op == "DeformConv":
        return _deform_case(rng, dtype, rank)
    if op == "GridSample":
        if full:  # every mode and padding somewhere in the product
            mode, padding = ("linear", "nearest", "cubic")[rank - 1], ("zeros", "border", "reflection")[rank - 1]
        else:  # the default run's sampler combinations
            mode, padding = ("cubic", "reflection") if rank == 1 else ("linear", "zeros")
        return _grid_case(rng, dtype, rank, mode=mode, padding=padding)
    return _affine_case(rng, dtype, rank, align=rank % 2)


@pytest.mark.parametrize("op,dtype,rank", COVER)
def test_op_dtype_rank(rng, op, dtype, rank):
    _run_case(_case(rng, op, dtype, rank), dtype)


@pytest.mark.full
@pytest.mark.parametrize("op,dtype,rank", [c for c in PRODUCT if c not in COVER])
def test_op_dtype_rank_full(rng, op, dtype, rank):
    _run_case(_case(rng, op, dtype, rank, full=True), dtype)


@pytest.mark.parametrize("optional", ["none", "B", "mask"])
def test_deform_conv_optional_inputs(rng, optional):
    _run_case(_deform_case(rng, "float32", 2, optional), "float32")


@pytest.mark.parametrize("dtype,r,mode", [("float32", 2, "linear"), pytest.param("float32", 2, "cubic", marks=FULL),
                                          pytest.param("float16", 3, "cubic", marks=FULL)])
def test_grid_sample_uint8_x(rng, dtype, r, mode):
    _run_case(_grid_case(rng, dtype, r, mode=mode, x_u8=True), dtype)


@pytest.mark.parametrize("dtype,r,x_u8,mode,padding", [
    ("float32", 2, False, "linear", "zeros"), pytest.param("float32", 2, False, "cubic", "border", marks=FULL),
    pytest.param("float64", 3, False, "cubic", "border", marks=FULL),
    pytest.param("bfloat16", 2, False, "cubic", "border", marks=FULL),
    pytest.param("float32", 2, True, "cubic", "border", marks=FULL)])
def test_fuse_runs_affine_warp(rng, dtype, r, x_u8, mode, padding):
    """fuse=True: AffineGrid -> GridSample as one AffineWarp node, equal to affine_warp."""
    x = rng.integers(0, 256, (2, 3) + (5, 6, 4)[:r]).astype(np.uint8) if x_u8 else _values(rng, (2, 3) + (5, 6, 4)[:r],
                                                                                          dtype)
    theta = (np.eye(r, r + 1) + 0.2 * rng.standard_normal((2, r, r + 1))).astype(DT[dtype])
    size = np.array((2, 3) + (4, 3, 5)[:r], np.int64)
    nodes = [helper.make_node("AffineGrid", ["theta", "size"], ["G"], align_corners=1),
             helper.make_node("GridSample", ["X", "G"], ["Y"], align_corners=1, mode=mode, padding_mode=padding)]
    floats, others = {"theta": theta}, {"size": size}
    (others if x_u8 else floats)["X"] = x
    m, feeds = _model(nodes, floats, others, dtype, TP.UINT8 if x_u8 else None)
    s = session(m, fuse=True)
    assert [op for op, _ in s.numba_ops_nodes] == ["AffineWarp"]
    got, = s.run(None, feeds)
    _equal(got, numba_ops.affine_warp(x, theta, size, mode=mode, padding_mode=padding, align_corners=1))
    plain = session(m)
    assert sorted(op for op, _ in plain.numba_ops_nodes) == ["AffineGrid", "GridSample"]


# --- ops=, providers, options, model forms --------------------------------------------------

def _two_op_model(rng):
    nodes, floats, _, want, _ = _deform_case(rng, "float32", 2, "none")
    nodes = nodes + [helper.make_node("GridSample", ["Y0", "grid"], ["Y"], name="gs")]
    nodes[0].output[0] = "Y0"
    floats["grid"] = _values(rng, (2, 3, 4, 2), "float32", uniform=(-1, 1))
    m, feeds = _model(nodes, floats, {}, "float32")
    return m, feeds, numba_ops.grid_sample(want, floats["grid"])


def test_ops_restricts_the_op_types(rng):
    m, feeds, want = _two_op_model(rng)
    assert session(m).numba_ops_nodes == (("DeformConv", "dc"), ("GridSample", "gs"))
    s = session(m, ops=["DeformConv"])
    assert s.numba_ops_nodes == (("DeformConv", "dc"),)
    got, = s.run(None, feeds)  # GridSample on onnxruntime's kernel
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert session(m, ops=()).numba_ops_nodes == ()
    with pytest.raises(ValueError, match="ops must hold op types"):
        session(m, ops=["Conv"])
    with pytest.raises(ValueError, match="AffineWarp"):
        session(m, ops=["GridSample"], fuse=True)


def test_model_forms_and_the_model_left_unchanged(rng, tmp_path):
    m, feeds, want = _two_op_model(rng)
    before = m.SerializeToString()
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    for form in (m, before, str(path), path):
        got, = session(form).run(None, feeds)
        _equal(got, want)
    assert m.SerializeToString() == before
    with pytest.raises(TypeError, match="model"):
        session(12)


def test_sess_options_used_and_reusable(rng):
    """The caller's options are used (and take numba_ops' library once: a second
    session from the same options works); run_with_iobinding raises too."""
    m, feeds, want = _two_op_model(rng)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    a, b = session(m, so), session(m, so)
    for s in (a, b):
        _equal(s.run(None, feeds)[0], want)
    assert so.intra_op_num_threads == 1
    binding = a.io_binding()
    for k, v in feeds.items():
        binding.bind_cpu_input(k, v)
    binding.bind_output("Y")
    a.run_with_iobinding(binding)
    _equal(binding.copy_outputs_to_cpu()[0], want)


def _spinning(so):
    try:
        return so.get_session_config_entry("session.intra_op.allow_spinning")
    except Exception:  # onnxruntime raises for an absent entry
        return None


@pytest.mark.parametrize("threads,spinning", [(None, None), ("1", None), ("2", "0"), ("0", "0")])
def test_threading_defaults(rng, threads, spinning):
    """On the Python route, numba_ops' nodes on one numba thread leave onnxruntime's pool
    as onnxruntime sets it; more numba threads (or numba's own count, "0") turn its spinning off,
    unless the options set it; the results are the same."""
    m, feeds, want = _two_op_model(rng)
    so = ort.SessionOptions()
    so.add_session_config_entry("numba_ops.capi", "0")  # (the Python route's threads)
    if threads is not None:
        so.add_session_config_entry("numba_ops.num_threads", threads)
    _equal(session(m, so).run(None, feeds)[0], want)
    assert _spinning(so) == spinning
    so = ort.SessionOptions()
    so.add_session_config_entry("numba_ops.capi", "0")
    so.add_session_config_entry("numba_ops.num_threads", "2")
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    session(m, so)
    assert _spinning(so) == "1"


# --- errors ---------------------------------------------------------------------------------

def _dc_model(attrs=None, x_elem=TP.FLOAT, offset_shape=None, name="my_dc"):
    node = helper.make_node("DeformConv", ["X", "W", "offset"], ["Y"], name=name, **(attrs or {}))
    ins = [helper.make_tensor_value_info("X", x_elem, [1, 4, 5, 5]),
           helper.make_tensor_value_info("W", TP.FLOAT, [2, 4, 3, 3]),
           helper.make_tensor_value_info("offset", TP.FLOAT, offset_shape)]
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("Y", x_elem, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)])


@pytest.mark.parametrize("model,error,match", [
    (_dc_model({"pads": [1, 1, 1]}), ValueError, "pads must have 4 entries"),
    (_dc_model({"group": 3}), ValueError, "group=3 must divide"),
    (_dc_model({"strides": [0, 1]}), ValueError, "strides entries must be >= 1"),
    (_dc_model({"foo": 1}), ValueError, "no attribute 'foo'"),
    (_dc_model(x_elem=TP.INT32), TypeError, "X has dtype int32"),
    (_dc_model(offset_shape=[1, 18, 4, 3]), ValueError, r"offset must have shape .* = \(1, 18, 3, 3\)"),
])
def test_bad_nodes_fail_at_creation(model, error, match):
    with pytest.raises(error, match=match) as info:
        session(model)
    assert "DeformConv node 'my_dc'" in str(info.value)


def test_bad_grid_sample_attribute_fails_at_creation():
    node = helper.make_node("GridSample", ["X", "G"], ["Y"], name="g1", mode="bogus")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TP.FLOAT, None),
                                        helper.make_tensor_value_info("G", TP.FLOAT, [1, 2, 2, 2])],
                          [helper.make_tensor_value_info("Y", TP.FLOAT, None)])
    with pytest.raises(ValueError, match="GridSample node 'g1': mode must be one of"):
        session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)]))


# --- DeformConv through onnxruntime's C API, on its pool -------------------------------------

def _profiled_ops(s, feeds):
    """The op types of the nodes a run of ``s`` ran (onnxruntime's profiler)."""
    import json
    s.run(None, feeds)
    path = s.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    return {e["args"].get("op_name") for e in events if e.get("cat") == "Node"}


def _profiling():
    so = ort.SessionOptions()
    so.enable_profiling = True
    return so


@pytest.mark.skipif(sys.platform != "linux", reason="the C API route is built for Linux")
def test_float_deform_conv_takes_the_c_api_route(rng):
    """Float DeformConv nodes run compiled on onnxruntime's pool (op DeformConv_<dtype> of
    domain numba_ops.capi), inputs in their ONNX places; config entry numba_ops.capi "0"
    keeps them on the Python route. Both give the function's result."""
    from numba_ops.onnx import _capi, _ort
    assert _capi.library() is not None, _capi.reason()
    nodes, floats, others, want, _ = _deform_case(rng, "float64", 2, "mask")
    m, feeds = _model(nodes, floats, others, "float64")
    _ort._register()
    rewritten, _ = _ort.prepare(m, pool=2)
    dc, = [n for n in rewritten.graph.node if n.name == "dc"]
    assert (dc.domain, dc.op_type, list(dc.input)) == (_capi.DOMAIN, "DeformConv_float64",
                                                       ["X", "W", "offset", "", "mask"])
    s = session(m, _profiling())
    assert "DeformConv_float64" in _profiled_ops(s, feeds)
    _equal(s.run(None, feeds)[0], want)
    so = _profiling()
    so.add_session_config_entry("numba_ops.capi", "0")
    s = session(m, so)
    assert "DeformConv_float64" not in _profiled_ops(s, feeds)
    _equal(s.run(None, feeds)[0], want)


def test_without_the_c_api_route_deform_conv_takes_the_python_route(rng, monkeypatch):
    """Where the shim cannot be built (no C compiler), the Python route runs the nodes."""
    from numba_ops.onnx import _capi
    monkeypatch.setattr(_capi, "library", lambda: None)
    nodes, floats, others, want, _ = _deform_case(rng, "float32", 2)
    m, feeds = _model(nodes, floats, others, "float32")
    s = session(m, _profiling())
    assert "DeformConv_float32" not in _profiled_ops(s, feeds)
    _equal(session(m).run(None, feeds)[0], want)


@pytest.mark.parametrize("C,size,oC", [(16, 20, 16), (64, 6, 64)])
def test_c_api_route_tiled_rounds_and_shapes_that_change(rng, C, size, oC):
    """Calls large enough for the tiled kernel's pool rounds (the position split; deep
    channels at a small size: the channel split, several rounds a tile), run on
    onnxruntime's pool; then other input shapes in the same session (planned again),
    and back."""
    from numba_ops.deform_conv import parse_params
    from numba_ops.kernels.cpu import deform_conv as dc
    from numba_ops.kernels.cpu._deform_plan import state
    node = helper.make_node("DeformConv", ["X", "W", "offset", "B", "mask"], ["Y"], name="dc", pads=[1, 1, 1, 1])
    ins = [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("X", "W", "offset", "B", "mask")]
    m = helper.make_model(helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("Y", TP.FLOAT, None)]),
                          opset_imports=[helper.make_opsetid("", 22)])
    s = session(m)
    w = rng.standard_normal((oC, C, 3, 3)).astype(np.float32) * 0.1
    b = rng.standard_normal(oC).astype(np.float32)
    for n, sz in ((1, size), (2, size + 3), (1, size)):
        x = rng.standard_normal((n, C, sz, sz)).astype(np.float32)
        off = rng.standard_normal((n, 18, sz, sz)).astype(np.float32)
        mask = rng.uniform(0, 1, (n, 9, sz, sz)).astype(np.float32)
        p = parse_params(x, w, None, None, [1, 1, 1, 1], None, 1, 1)
        st = state(x, w, p)
        assert not st.small
        if n == 1:  # (the channel split: a set-up round and, a tile, its fill, GEMM and sum)
            assert len(dc.schedule(st, st.tiling(2, x, w))) == (2 if C < 64 else 4)
        got, = s.run(None, {"X": x, "W": w, "offset": off, "B": b, "mask": mask})
        want = numba_ops.deform_conv(x, w, off, b, mask, pads=[1, 1, 1, 1])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


RUNTIME_ERROR = textwrap.dedent("""
    import numpy as np
    from onnx import TensorProto as TP, helper
    import numba_ops
    from numba_ops.onnx import session
    def model(after):
        nodes = [helper.make_node("DeformConv", ["X", "W", "offset"], ["D"], name="dc", pads=[1, 1, 1, 1])]
        nodes += after
        ins = [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("X", "W", "offset")]
        ins += [helper.make_tensor_value_info("K", TP.FLOAT, [1, 4])]
        g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info(after[-1].output[0] if after else "D",
                                                                              TP.FLOAT, None)])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)])
    x, w = np.ones((1, 2, 4, 4), np.float32), np.ones((3, 2, 3, 3), np.float32)
    good, bad = np.zeros((1, 18, 4, 4), np.float32), np.zeros((1, 18, 3, 4), np.float32)
    k = np.ones((1, 4), np.float32)
    try:
        numba_ops.deform_conv(x, w, bad, pads=[1, 1, 1, 1])
    except ValueError as exc:
        want = str(exc)
    # alone; then followed by an onnxruntime node that the stand-in output makes fail (Add of
    # shapes that do not broadcast), whose error must give way to numba_ops'
    for after in ([], [helper.make_node("Add", ["D", "K"], ["Y"])]):
        s = session(model(after))
        for i in range(2):
            try:
                s.run(None, {"X": x, "W": w, "offset": bad, "K": k})
                print("NO ERROR")
            except ValueError as exc:
                assert str(exc) == want, (str(exc), want)
                print("VALUEERROR", exc)
        assert s.run(None, {"X": x, "W": w, "offset": good, "K": k})[0].shape == (1, 3, 4, 4)
    print("ALIVE")
""")


def test_run_time_error_raises_and_the_process_lives():
    """A bad input that only shows at run time raises the function's ValueError from
    run, never an abort (in a child process: an abort would kill pytest)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(numba_ops.__file__))]
                                                      + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    p = subprocess.run([sys.executable, "-c", RUNTIME_ERROR], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("VALUEERROR offset must have shape") == 4, p.stdout
    assert "NO ERROR" not in p.stdout and p.stdout.strip().endswith("ALIVE"), p.stdout


def test_without_onnxruntime_extensions_an_import_error_names_the_extra():
    code = ("import sys; sys.modules['onnxruntime_extensions'] = None\n"
            "from numba_ops.onnx import session\n"
            "try:\n    session(b'')\nexcept ImportError as e:\n    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "numba_ops[onnxruntime]" in p.stdout


# --- threads ----------------------------------------------------------------------------------

def test_runs_from_several_threads(rng):
    """Concurrent runs of one session: each its own result, and a bad run's error stays
    with that run."""
    s = session(_dc_model(offset_shape=None, name="dc"))
    x = [rng.standard_normal((1, 4, 5, 5)).astype(np.float32) for _ in range(4)]
    w = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    off = rng.standard_normal((1, 18, 3, 3)).astype(np.float32)
    bad = off[:, :, :2]
    want = [numba_ops.deform_conv(a, w, off) for a in x]
    failures = []

    def work(i):
        try:
            for j in range(20):
                if i == 3 and j % 2:
                    with pytest.raises(ValueError, match="offset must have shape"):
                        s.run(None, {"X": x[i], "W": w, "offset": bad})
                else:
                    np.testing.assert_array_equal(s.run(None, {"X": x[i], "W": w, "offset": off})[0], want[i])
        except BaseException as exc:  # noqa: B036 (reported below)
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def test_a_run_compiles_its_task_outside_the_nodes_lock(rng, monkeypatch):
    """A run whose task is not compiled yet compiles it without holding the node's spin
    lock: a concurrent run of the node waits for that compilation without spinning a
    core (here a compilation that takes 2.5 s: the process uses well under a second of
    CPU time meanwhile; when the lock was held, the waiting run spun all along)."""
    import time

    from numba_ops.onnx import _capi

    node = helper.make_node("GridSample", ["X", "G"], ["Y"], name="gs")
    x, g = _values(rng, (1, 2, 5, 5), "float32"), _values(rng, (1, 3, 3, 2), "float32", uniform=(-1, 1))
    m, feeds = _model([node], {"X": x, "G": g}, {}, "float32")
    want = numba_ops.grid_sample(x, g)
    _equal(session(m).run(None, feeds)[0], want)  # (the task is compiled: the slow one below only waits)
    task_fn = _capi._task_fn

    def slow_task_fn(*args):
        time.sleep(2.5)
        return task_fn(*args)

    monkeypatch.setattr(_capi, "_compiled_task", lambda *a: 0, raising=False)  # every plan's task to compile
    monkeypatch.setattr(_capi, "_task_fn", slow_task_fn)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # (no pool of onnxruntime's spinning meanwhile)
    s = session(m, sess_options=opts)
    out = [None, None]

    def run(i):
        out[i] = s.run(None, feeds)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    cpu = time.process_time()
    threads[0].start()
    time.sleep(0.3)  # (the second run comes while the first compiles)
    threads[1].start()
    for t in threads:
        t.join()
    cpu = time.process_time() - cpu
    for o in out:
        _equal(o, want)
    assert cpu < 0.6, f"{cpu:.2f} s of CPU time while a run waited 2.5 s for a compilation"


def test_errors_from_onnxruntime_threads_parallel_mode_and_run_async():
    """Nodes run on onnxruntime's own threads (ORT_PARALLEL, run_async): the error
    still comes out of run, or reaches run_async's callback as its error string."""
    g = helper.make_graph([helper.make_node("DeformConv", ["X", "W", "offset"], ["Y"], name="dc"),
                           helper.make_node("Relu", ["X"], ["Z"])], "g",
                          [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("X", "W", "offset")],
                          [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("Y", "Z")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)])
    so = ort.SessionOptions()
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    s = session(m, so)
    x, w = np.ones((1, 2, 4, 4), np.float32), np.ones((3, 2, 3, 3), np.float32)
    bad = {"X": x, "W": w, "offset": np.zeros((1, 18, 3, 4), np.float32)}
    with pytest.raises(ValueError, match="offset must have shape"):
        s.run(None, bad)
    y, _ = s.run(None, {"X": x, "W": w, "offset": np.zeros((1, 18, 2, 2), np.float32)})
    np.testing.assert_array_equal(y, numba_ops.deform_conv(x, w, np.zeros((1, 18, 2, 2), np.float32)))
    done, got = threading.Event(), {}

    def callback(outputs, data, err):
        got.update(outputs=outputs, err=err)
        done.set()

    s.run_async(None, bad, callback, None)
    assert done.wait(60)
    assert got["outputs"] is None and got["err"].startswith("ValueError: offset must have shape")


# --- the compiled route: every op, its report, its fallback ----------------------------------

@pytest.mark.skipif(sys.platform != "linux", reason="the compiled route is built for Linux")
def test_grid_sample_nodes_of_each_padding_in_one_session(rng):
    """Three GridSample nodes that differ in their padding alone, in one session: the
    padding is a run-time value of one compiled task, and each node computes with its
    own (a grid reaching outside the input, where the three differ)."""
    x = _values(rng, (2, 3, 5, 6), "float32")
    grid = _values(rng, (2, 4, 3, 2), "float32", uniform=(-1.6, 1.6))
    pads = ("zeros", "border", "reflection")
    nodes = [helper.make_node("GridSample", ["X", "grid"], [f"Y{i}"], name=f"gs{i}", padding_mode=p)
             for i, p in enumerate(pads)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("X", "grid")],
                          [helper.make_tensor_value_info(f"Y{i}", TP.FLOAT, None) for i in range(3)])
    s = session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)]))
    assert {r.route for r in s.numba_ops_nodes} == {"compiled"}
    got = s.run(None, {"X": x, "grid": grid})
    wants = [numba_ops.grid_sample(x, grid, padding_mode=p) for p in pads]
    for y, want in zip(got, wants):
        _equal(y, want)
    assert not np.array_equal(wants[0], wants[1]) and not np.array_equal(wants[1], wants[2])


def test_every_op_takes_the_compiled_route(rng):
    """DeformConv, GridSample, AffineGrid and AffineWarp nodes all run compiled on
    onnxruntime's pool (the profiler sees the compiled operators), the report says so,
    and nothing warns."""
    import warnings
    theta = (np.eye(2, 3) + 0.1 * rng.standard_normal((2, 2, 3))).astype(np.float32)
    nodes = [helper.make_node("AffineGrid", ["theta", "size"], ["G"], name="ag"),
             helper.make_node("GridSample", ["X", "G"], ["S"], name="gs", mode="cubic"),
             helper.make_node("AffineWarp", ["S", "theta", "size"], ["Y"], name="aw", domain="numba_ops")]
    x = _values(rng, (2, 3, 6, 7), "float32")
    size = np.array([2, 3, 5, 4], np.int64)
    m, feeds = _model(nodes, {"X": x, "theta": theta}, {"size": size}, "float32")
    m.opset_import.append(helper.make_opsetid("numba_ops", 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = session(m, _profiling())
    assert [(r.op, r.node, r.route) for r in s.numba_ops_nodes] == [
        ("AffineGrid", "ag", "compiled"), ("GridSample", "gs", "compiled"), ("AffineWarp", "aw", "compiled")]
    assert all(r.reason == "" for r in s.numba_ops_nodes) and "compiled" in repr(s.numba_ops_nodes)
    assert s.numba_ops_nodes[0] == ("AffineGrid", "ag")  # (still the (op type, name) pair)
    assert {"AffineGrid_float32", "GridSample_float32_float32", "AffineWarp_float32_float32"} <= _profiled_ops(s, feeds)
    g = numba_ops.affine_grid(theta, size)
    want = numba_ops.affine_warp(numba_ops.grid_sample(x, g, mode="cubic"), theta, size)
    _equal(s.run(None, feeds)[0], want)
    # the size's values key the plan: other values, other output
    size2 = np.array([2, 3, 3, 8], np.int64)
    want2 = numba_ops.affine_warp(numba_ops.grid_sample(x, numba_ops.affine_grid(theta, size2), mode="cubic"),
                                  theta, size2)
    _equal(s.run(None, dict(feeds, size=size2))[0], want2)
    _equal(s.run(None, feeds)[0], want)


@pytest.mark.full  # (a 4-D kernel of its own to compile)
def test_deform_conv_of_four_spatial_axes_runs_compiled(rng):
    """A DeformConv of 4 spatial axes (onnxruntime has none) runs compiled too."""
    x = _values(rng, (1, 2, 4, 3, 3, 3), "float64")
    w = _values(rng, (2, 2, 2, 2, 2, 2), "float64")
    off = _values(rng, (1, 16 * 4, 3, 2, 2, 2), "float64", 0.5)
    node = helper.make_node("DeformConv", ["X", "W", "offset"], ["Y"], name="dc4")
    m, feeds = _model([node], {"X": x, "W": w, "offset": off}, {}, "float64")
    s = session(m)
    assert [(r.op, r.node, r.route) for r in s.numba_ops_nodes] == [("DeformConv", "dc4", "compiled")]
    _equal(s.run(None, feeds)[0], numba_ops.deform_conv(x, w, off))


def test_without_the_compiled_route_nodes_fall_back_with_a_warning(rng, monkeypatch):
    """Where the compiled route is not available (here: as without a C compiler), every
    node takes the Python route: a RuntimeWarning names each and says why, the report
    too, and the results are the functions'. Asked for by the options
    (``numba_ops.capi`` "0"), it does not warn."""
    import warnings
    from numba_ops.onnx import _capi
    why = "RuntimeError: no C compiler (cc) to build numba_ops' onnxruntime shim"
    monkeypatch.setattr(_capi, "library", lambda: None)
    monkeypatch.setattr(_capi, "reason", lambda: why)
    m, feeds, want = _two_op_model(rng)
    with pytest.warns(RuntimeWarning, match=r"DeformConv node 'dc' runs on the slower Python route: .*no C compiler"):
        s = session(m)
    assert [(r.op, r.route, r.reason) for r in s.numba_ops_nodes] == [("DeformConv", "python", why),
                                                                      ("GridSample", "python", why)]
    _equal(s.run(None, feeds)[0], want)
    so = ort.SessionOptions()
    so.add_session_config_entry("numba_ops.capi", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = session(m, so)
    assert all(r.route == "python" for r in s.numba_ops_nodes)


def test_concurrent_runs_compute_in_parallel_and_right(rng):
    """Runs of one session from several threads at once, each with inputs of its own
    (tiled DeformConv rounds, GridSample, shapes that differ between threads): every
    result is its own function's."""
    from concurrent.futures import ThreadPoolExecutor
    nodes = [helper.make_node("DeformConv", ["X", "W", "offset", "B", "mask"], ["D"], pads=[1, 1, 0, 0], group=2,
                              offset_group=2),
             helper.make_node("GridSample", ["D", "grid"], ["Y"])]
    ins = [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("X", "W", "offset", "B", "mask", "grid")]
    s = session(helper.make_model(helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("Y", TP.FLOAT,
                                                                                                     None)]),
                                  opset_imports=[helper.make_opsetid("", 22)]))
    cases = []
    for n, size in ((1, 12), (2, 9), (1, 16), (2, 12)):
        x = rng.standard_normal((n, 4, size, size)).astype(np.float32)
        w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
        off = rng.standard_normal((n, 2 * 2 * 9, size - 1, size - 1)).astype(np.float32)
        b = rng.standard_normal(6).astype(np.float32)
        mask = rng.uniform(0, 1, (n, 2 * 9, size - 1, size - 1)).astype(np.float32)
        grid = rng.uniform(-1.1, 1.1, (n, 5, 7, 2)).astype(np.float32)
        feeds = dict(X=x, W=w, offset=off, B=b, mask=mask, grid=grid)
        y0 = numba_ops.deform_conv(x, w, off, b, mask, pads=[1, 1, 0, 0], group=2, offset_group=2)
        cases.append((feeds, numba_ops.grid_sample(y0, grid)))

    def one(i):
        feeds, want = cases[i % len(cases)]
        got, = s.run(None, feeds)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(one, range(24)))


MEMORY = textwrap.dedent("""
    import gc
    import numpy as np
    from onnx import TensorProto as TP, helper
    from numba_ops.onnx import session
    try:  # glibc: hand freed heap pages back first, so the size counts what is still held
        import ctypes
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        trim = lambda pad: 0
    def rss():
        gc.collect()
        trim(0)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    nodes = [helper.make_node("GridSample", ["X", "G"], ["S"]), helper.make_node("DeformConv", ["X", "W", "O"], ["Y"])]
    ins = [helper.make_tensor_value_info(n, TP.FLOAT, s) for n, s in
           (("X", [1, 2, 5, 5]), ("G", [1, 3, 3, 2]), ("W", [2, 2, 3, 3]), ("O", [1, 18, 3, 3]))]
    outs = [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("S", "Y")]
    m = helper.make_model(helper.make_graph(nodes, "g", ins, outs), opset_imports=[helper.make_opsetid("", 22)])
    feeds = {"X": np.ones((1, 2, 5, 5), np.float32), "G": np.zeros((1, 3, 3, 2), np.float32),
             "W": np.ones((2, 2, 3, 3), np.float32), "O": np.zeros((1, 18, 3, 3), np.float32)}
    def one():
        session(m).run(None, feeds)
    for _ in range(40):
        one()
    growth = []
    for window in range(3):  # the smallest of three windows: a leak shows in each, a one-off arena in one
        before = rss()
        for _ in range(150):
            one()
        growth.append((rss() - before) / 150)
    print(min(growth))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the process's size from /proc")
def test_creating_sessions_repeatedly_does_not_grow_the_process():
    """Sessions made, run and dropped, 150 at a time, three times: in at least one window
    the process grows by well under 1 kB each (it grew by 34 kB each when every session
    registered the operators again; a leak shows in every window, a one-off heap arena
    of a loaded machine in one: with two windows, a run beside another compiling worker
    once measured 2.4 kB in both)."""
    p = subprocess.run([sys.executable, "-c", MEMORY], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert float(p.stdout.strip().splitlines()[-1]) < 1024, p.stdout


# --- MMDeploy's nodes ------------------------------------------------------------------------

def _mmdeploy_model(domain, dc_attrs, gs_attrs, bias=True):
    ins = ["x", "off", "m", "w"] + (["b"] if bias else [])
    nodes = [helper.make_node("MMCVModulatedDeformConv2d", ins, ["y"], domain=domain, name="dcn", **dc_attrs),
             helper.make_node("grid_sampler", ["y", "g"], ["z"], domain=domain, name="gs", **gs_attrs)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TP.FLOAT, None)
                                       for n in ["x", "off", "m", "w", "b", "g"][:len(ins)] + ["g"]],
                          [helper.make_tensor_value_info("z", TP.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])


@pytest.mark.parametrize("domain,mode,padding,align,bias", [
    ("mmdeploy", 0, 0, 0, True), pytest.param("mmdeploy", 1, 2, 1, False, marks=FULL),
    pytest.param("mmcv", 2, 1, 0, True, marks=FULL),
    pytest.param("mmdeploy", 2, 2, 1, True, marks=FULL), pytest.param("mmcv", 0, 1, 1, False, marks=FULL)])
def test_mmdeploy_nodes(rng, domain, mode, padding, align, bias):
    """MMDeploy's MMCVModulatedDeformConv2d (inputs x, offset, mask, weight[, bias]; stride,
    padding, dilation, groups, deform_groups) and grid_sampler (interpolation_mode,
    padding_mode, align_corners as codes) as MMDeploy's exporter writes them: in the
    session (compiled) and the evaluator, equal to torchvision's deform_conv2d and
    PyTorch's grid_sample."""
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    from numba_ops.onnx import evaluator
    x = rng.standard_normal((2, 4, 9, 8)).astype(np.float32)
    w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
    off = rng.standard_normal((2, 2 * 2 * 9, 5, 4)).astype(np.float32)
    msk = rng.random((2, 2 * 9, 5, 4)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    grid = rng.uniform(-1.2, 1.2, (2, 5, 3, 2)).astype(np.float32)
    m = _mmdeploy_model(domain, dict(stride=[2, 2], padding=[1, 2], dilation=[1, 2], groups=2, deform_groups=2),
                        dict(interpolation_mode=mode, padding_mode=padding, align_corners=align), bias)
    feeds = dict(x=x, off=off, m=msk, w=w, g=grid, **({"b": b} if bias else {}))
    t = torch.from_numpy
    y = torchvision.ops.deform_conv2d(t(x), t(off), t(w), t(b) if bias else None, stride=2, padding=(1, 2),
                                      dilation=(1, 2), mask=t(msk))
    want = torch.nn.functional.grid_sample(y, t(grid), mode=("bilinear", "nearest", "bicubic")[mode],
                                           padding_mode=("zeros", "border", "reflection")[padding],
                                           align_corners=bool(align)).numpy()
    s = session(m)
    assert [(r.op, r.route) for r in s.numba_ops_nodes] == [("MMCVModulatedDeformConv2d", "compiled"),
                                                             ("grid_sampler", "compiled")]
    for got in (s.run(None, feeds)[0], evaluator(m).run(None, feeds)[0]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_mmdeploy_bad_attributes_fail_at_creation():
    with pytest.raises(ValueError, match="grid_sampler node 'gs': attribute interpolation_mode must be one of"):
        session(_mmdeploy_model("mmdeploy", {}, dict(interpolation_mode=5)))
    with pytest.raises(ValueError, match="MMCVModulatedDeformConv2d node 'dcn': .*no attribute 'kernel'"):
        session(_mmdeploy_model("mmdeploy", dict(kernel=[3, 3]), {}))


def test_a_task_that_raises_fails_the_run_and_the_process_lives(rng, monkeypatch):
    """An exception inside a compiled node's task on onnxruntime's thread (never
    expected: the plan checks the inputs) fails that run with a RuntimeError, never a
    silent success with an output left unwritten; the session runs again after."""
    from numba import carray, njit

    from numba_ops.onnx import _capi

    @njit(no_cpython_wrapper=True, no_cfunc_wrapper=True)
    def raising_task(usr, th, z):
        L = carray(usr, (_capi.NS,), np.int64)
        if L[_capi.ITEMS] >= 0:
            raise ValueError("a task's failure")

    variant = _capi._variant
    monkeypatch.setattr(_capi, "_variant", lambda *a: (raising_task, (np.float32(0),)))
    node = helper.make_node("GridSample", ["X", "G"], ["Y"], name="gs")
    x, g = _values(rng, (1, 2, 5, 5), "float32"), _values(rng, (1, 3, 3, 2), "float32", uniform=(-1, 1))
    m, feeds = _model([node], {"X": x, "G": g}, {}, "float32")
    s = session(m)
    with pytest.raises(Exception, match="a numba_ops kernel failed on onnxruntime's thread"):
        s.run(None, feeds)
    monkeypatch.setattr(_capi, "_variant", variant)
    _equal(session(m).run(None, feeds)[0], numba_ops.grid_sample(x, g))


def test_a_plan_that_fails_without_a_status_fails_every_run(rng, monkeypatch):
    """A compiled node whose plan raises fails its run even where onnxruntime made no
    status for the error (the compiled code makes one of its own), and the next run with
    the same shapes plans again and fails again: never a success with the output left
    unwritten. The session runs once the plan succeeds."""
    from numba_ops.onnx import _capi

    node = helper.make_node("GridSample", ["X", "G"], ["Y"], name="gs")
    x, g = _values(rng, (1, 2, 5, 5), "float32"), _values(rng, (1, 3, 3, 2), "float32", uniform=(-1, 1))
    m, feeds = _model([node], {"X": x, "G": g}, {}, "float32")
    s = session(m)

    def plan(self):
        raise ValueError("no plan here")

    monkeypatch.setattr(_capi._Node, "plan", plan)
    monkeypatch.setattr(_capi, "_status", lambda exc: None)
    for _ in range(2):
        with pytest.raises(ValueError, match="no plan here"):  # the recorded error
            s.run(None, feeds)
    monkeypatch.setattr(_capi, "record", lambda *a: None)  # no error recorded: onnxruntime's own
    for _ in range(2):
        with pytest.raises(Exception, match="numba_ops could not plan the node"):
            s.run(None, feeds)
    monkeypatch.undo()
    _equal(s.run(None, feeds)[0], numba_ops.grid_sample(x, g))


def test_mmdeploy_deform_conv_needs_its_four_inputs():
    m = _mmdeploy_model("mmdeploy", {}, {})
    del m.graph.node[0].input[3:]  # weight (and bias) missing
    with pytest.raises(ValueError, match="MMCVModulatedDeformConv2d node 'dcn': takes 4 to 5 inputs"):
        session(m)


# --- multi-scale deformable attention ---------------------------------------------------------

MSDA = "MMCVMultiScaleDeformableAttention"
MSDA_INPUTS = ["value", "shapes", "starts", "loc", "attn"]


def _msda_levels(r):
    shapes = np.array([[5, 6], [3, 2], [1, 1]] if r == 2 else [[3, 4, 2], [2, 1, 3]], np.int64)
    return shapes, np.concatenate(([0], np.cumsum(shapes.prod(1))[:-1])).astype(np.int64)


def _msda_feeds(rng, dtype, shapes, starts, N=2, Lq=4, M=2, Dh=3, P=2):
    L, r = shapes.shape
    return dict(value=_values(rng, (N, int(shapes.prod(1).sum()), M, Dh), dtype),
                shapes=shapes, starts=starts,
                loc=_values(rng, (N, Lq, M, L, P, r), dtype, uniform=(-0.15, 1.15)),
                attn=_values(rng, (N, Lq, M, L, P), dtype, uniform=(0, 1)))


def _msda_model(domain, dtype, **attrs):
    """A one-node model of the attention in ``domain`` (16-bit: between Casts, as
    ``_model``), its inputs of unknown shapes."""
    node = helper.make_node(MSDA, MSDA_INPUTS, ["Y"], domain=domain, name="msda", **attrs)
    empty = {n: np.zeros(0, DT[dtype]) for n in ("value", "loc", "attn")}
    m, _ = _model([node], empty, {n: np.zeros(0, np.int64) for n in ("shapes", "starts")}, dtype, static=False)
    m.opset_import.append(helper.make_opsetid(domain, 1))
    return m


def _msda_feed(feeds, dtype):
    """``feeds`` as ``_model``'s inputs (16-bit values come in as float32)."""
    if dtype not in ("float16", "bfloat16"):
        return feeds
    return {n + "_in" if n in ("value", "loc", "attn") else n: v.astype(np.float32) if v.dtype == DT[dtype] else v
            for n, v in feeds.items()}


@pytest.mark.parametrize("domain,r,dtype", [("mmdeploy", 2, "float32"), ("mmcv", 2, "float64"),
                                            ("numba_ops", 3, "float32"), ("numba_ops", 2, "float64"),
                                            ("mmdeploy", 2, "float16"),
                                            pytest.param("numba_ops", 3, "bfloat16", marks=FULL)])
def test_ms_deform_attn_node(rng, domain, r, dtype):
    """MMDeploy's MMCVMultiScaleDeformableAttention (domains mmdeploy, mmcv; attribute
    im2col_step, of no effect) and the same node in domain numba_ops (2-D or 3-D
    levels) run compiled in the session and in the evaluator, with the function's
    result; other level shapes (their values key the node's plan) and back."""
    from numba_ops.onnx import evaluator
    m = _msda_model(domain, dtype, im2col_step=64)
    shapes, starts = _msda_levels(r)
    feeds = _msda_feeds(rng, dtype, shapes, starts)
    s = session(m)
    assert [(r.op, r.node, r.route) for r in s.numba_ops_nodes] == [(MSDA, "msda", "compiled")]
    want = numba_ops.ms_deform_attn(*feeds.values())
    _equal(s.run(None, _msda_feed(feeds, dtype))[0], want)
    if dtype in ("float32", "float64"):
        _equal(evaluator(m).run(None, feeds)[0], want)
    shapes2 = shapes[::-1].copy()  # the same S and shapes of the inputs: only the values differ
    feeds2 = dict(feeds, shapes=shapes2, starts=np.concatenate(([0], np.cumsum(shapes2.prod(1))[:-1])))
    _equal(s.run(None, _msda_feed(feeds2, dtype))[0], numba_ops.ms_deform_attn(*feeds2.values()))
    _equal(s.run(None, _msda_feed(feeds, dtype))[0], want)


def test_ms_deform_attn_on_onnxruntime_threads(rng):
    """Enough queries for the rows to be dealt onto onnxruntime's pool; an empty batch
    and no queries give empty outputs; the Python route gives the same."""
    m = _msda_model("mmdeploy", "float32")
    shapes = np.array([[16, 12], [8, 6], [4, 3]], np.int64)
    starts = np.concatenate(([0], np.cumsum(shapes.prod(1))[:-1])).astype(np.int64)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    s = session(m, so)
    so = ort.SessionOptions()
    so.add_session_config_entry("numba_ops.capi", "0")
    slow = session(m, so)
    assert s.numba_ops_nodes[0].route == "compiled" and slow.numba_ops_nodes[0].route == "python"
    for N, Lq in ((2, 400), (0, 3), (1, 0)):
        feeds = _msda_feeds(rng, "float32", shapes, starts, N=N, Lq=Lq, M=4, Dh=8, P=4)
        want = numba_ops.ms_deform_attn(*feeds.values())
        _equal(s.run(None, feeds)[0], want)
        _equal(slow.run(None, feeds)[0], want)


def test_ms_deform_attn_bad_node(rng):
    """Level starts that do not fit the shapes fail the run with the function's
    ValueError (the session runs on); as constants of the model, they fail the
    session's creation, naming the node; an unknown attribute too."""
    m = _msda_model("mmdeploy", "float32")
    shapes, starts = _msda_levels(2)
    feeds = _msda_feeds(rng, "float32", shapes, starts)
    bad = dict(feeds, starts=starts + 1)
    with pytest.raises(ValueError) as want:
        numba_ops.ms_deform_attn(*bad.values())
    s = session(m)
    for _ in range(2):
        with pytest.raises(ValueError, match="level_start_index must be") as got:
            s.run(None, bad)
        assert str(got.value) == str(want.value)
    _equal(s.run(None, feeds)[0], numba_ops.ms_deform_attn(*feeds.values()))
    const = _msda_model("mmdeploy", "float32")
    const.graph.initializer.extend([onnx.numpy_helper.from_array(shapes, "shapes"),
                                    onnx.numpy_helper.from_array(starts + 1, "starts")])
    with pytest.raises(ValueError, match=f"{MSDA} node 'msda': level_start_index must be"):
        session(const)
    with pytest.raises(ValueError, match=f"{MSDA} node 'msda': .*no attribute 'im2col'"):
        session(_msda_model("mmdeploy", "float32", im2col=1))


def _encoder(rng, N=2, C=8, M=2, P=2):
    """A Deformable DETR encoder layer's attention (MMDeploy's export of it): value, offset
    and weight projections (MatMul, Add), Softmax over each head's points, sampling
    locations from reference points and offsets over each level's size, the
    MMCVMultiScaleDeformableAttention node, the output projection. Returns (model,
    feeds, the float64 NumPy result)."""
    from onnx import numpy_helper
    from reference import ms_deform_attn_ref
    shapes = np.array([[6, 5], [3, 3], [2, 1]], np.int64)
    starts = np.concatenate(([0], np.cumsum(shapes.prod(1))[:-1])).astype(np.int64)
    L, S = len(shapes), int(shapes.prod(1).sum())
    src = rng.standard_normal((N, S, C)).astype(np.float32)
    ref = rng.uniform(0, 1, (N, S, L, 2)).astype(np.float32)
    w = {n: (rng.standard_normal(sh) / np.sqrt(sh[0])).astype(np.float32) for n, sh in (
        ("Wv", (C, C)), ("Wo", (C, M * L * P * 2)), ("Wa", (C, M * L * P)), ("Wout", (C, C)))}
    w.update({"b" + n[1:]: rng.standard_normal(v.shape[1]).astype(np.float32) * 0.1 for n, v in list(w.items())})
    norm = shapes[:, ::-1].astype(np.float32).reshape(1, 1, 1, L, 1, 2)  # (W, H) per level
    inits = dict(w, shapes=shapes, starts=starts, norm=norm, vshape=np.array([N, S, M, C // M], np.int64),
                 oshape=np.array([N, S, M, L, P, 2], np.int64), ashape=np.array([N, S, M, L * P], np.int64),
                 wshape=np.array([N, S, M, L, P], np.int64), rshape=np.array([N, S, 1, L, 1, 2], np.int64))
    mk = helper.make_node
    nodes = [mk("MatMul", ["src", "Wv"], ["v0"]), mk("Add", ["v0", "bv"], ["v1"]),
             mk("Reshape", ["v1", "vshape"], ["value"]),
             mk("MatMul", ["src", "Wo"], ["o0"]), mk("Add", ["o0", "bo"], ["o1"]),
             mk("Reshape", ["o1", "oshape"], ["off"]),
             mk("MatMul", ["src", "Wa"], ["a0"]), mk("Add", ["a0", "ba"], ["a1"]),
             mk("Reshape", ["a1", "ashape"], ["a2"]), mk("Softmax", ["a2"], ["a3"], axis=-1),
             mk("Reshape", ["a3", "wshape"], ["attn"]),
             mk("Reshape", ["ref", "rshape"], ["r0"]), mk("Div", ["off", "norm"], ["o2"]),
             mk("Add", ["r0", "o2"], ["loc"]),
             mk(MSDA, ["value", "shapes", "starts", "loc", "attn"], ["msda"], domain="mmdeploy", name="attention",
                im2col_step=64),
             mk("MatMul", ["msda", "Wout"], ["y0"]), mk("Add", ["y0", "bout"], ["Y"])]
    g = helper.make_graph(nodes, "encoder", [helper.make_tensor_value_info("src", TP.FLOAT, [N, S, C]),
                                             helper.make_tensor_value_info("ref", TP.FLOAT, [N, S, L, 2])],
                          [helper.make_tensor_value_info("Y", TP.FLOAT, None)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mmdeploy", 1)])
    # the same in NumPy, float64
    d = {k: v.astype(np.float64) for k, v in w.items()}
    x = src.astype(np.float64)
    value = (x @ d["Wv"] + d["bv"]).reshape(N, S, M, C // M)
    off = (x @ d["Wo"] + d["bo"]).reshape(N, S, M, L, P, 2)
    logits = (x @ d["Wa"] + d["ba"]).reshape(N, S, M, L * P)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    attn = (e / e.sum(-1, keepdims=True)).reshape(N, S, M, L, P)
    loc = ref.astype(np.float64)[:, :, None, :, None, :] + off / norm
    want = ms_deform_attn_ref(value, shapes, loc, attn) @ d["Wout"] + d["bout"]
    return m, {"src": src, "ref": ref}, want


def test_deformable_detr_encoder_model(rng):
    """A tiny Deformable-DETR-style encoder (onnxruntime's MatMul/Add/Softmax/Reshape
    around MMDeploy's attention node, level shapes and starts as initializers) runs in
    the session, the attention compiled, and matches NumPy's float64 computation."""
    m, feeds, want = _encoder(rng)
    s = session(m)
    assert [(r.op, r.node, r.route) for r in s.numba_ops_nodes] == [(MSDA, "attention", "compiled")]
    got, = s.run(None, feeds)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_ms_deform_attn_concurrent_runs_of_other_levels(rng):
    """Runs of one session from several threads at once, each with level shapes of its
    own (the same input shapes: only the values, which key the plan, differ): every
    result is its own function's."""
    from concurrent.futures import ThreadPoolExecutor
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    s = session(_msda_model("mmdeploy", "float32"), so)
    cases = []
    for shapes in ([[8, 6], [4, 3]], [[6, 8], [3, 4]], [[12, 4], [2, 6]], [[4, 12], [6, 2]]):
        shapes = np.array(shapes, np.int64)
        feeds = _msda_feeds(rng, "float32", shapes, np.array([0, 48], np.int64), N=1, Lq=200, M=2, Dh=8, P=4)
        cases.append((feeds, numba_ops.ms_deform_attn(*feeds.values())))

    def one(i):
        feeds, want = cases[i % len(cases)]
        _equal(s.run(None, feeds)[0], want)
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(one, range(48)))

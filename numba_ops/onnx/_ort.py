"""numba_ops' operators inside onnxruntime: the machinery behind ``numba_ops.onnx.session``.

Two routes. ``session`` rewrites a copy of the model so that each node it takes
(MMDeploy's nodes translated to their ONNX twins, ``mmdeploy_as_onnx``) becomes a
custom-op node whose one string attribute ``numba_ops`` carries (as JSON) the
original op, its attributes, the node's name, the session it belongs to, its
declared output shape and the thread counts; onnxruntime runs every other node
itself. 16-bit nodes run between Casts. Where the compiled route is available
(``_capi``: a C compiler, onnxruntime's C API 17) every node becomes a node of
domain ``numba_ops.capi``, compiled code on onnxruntime's pool; a node that route
cannot run (a DeformConv of more than 5 spatial axes), or every node where it is
not available, becomes a node of domain ``numba_ops.ort``, an onnxruntime-extensions
Python custom operator, which onnxruntime calls back into Python for, and the
session warns. This module is the rewrite, the routes' choice and report
(``Route``), the session class and the Python route; errors of both routes are
recorded and raised here. onnxruntime-extensions' library and its Python-op hook
are registered only for sessions with nodes on the Python route.

What the extension layer imposes, and how it is met:

- Every custom op is declared once per input/output type signature, and all of
  them must be declared before the first session is created (the extension keeps
  the declarations of a domain in a vector that an InferenceSession's kernels point into:
  a later declaration can move it). ``_register`` declares the whole table at
  once, on first use.
- The extension passes only string attributes, so the node's attributes travel
  as one JSON string (lists included).
- A 16-bit (float16, bfloat16) Python op aborts the process at run time, so such
  nodes run as ``Cast`` to float32, the float32 op, ``Cast`` back: exactly the
  functions' 16-bit semantics (the float32 computation on upcast inputs, rounded
  once to the output dtype).
- A Python exception raised in a custom op aborts the process. The op never
  raises: it records the exception (per ``run`` call, per thread) and returns
  zeros of the declared output shape; the InferenceSession's ``run`` then raises the
  recorded exception (also when the zeros make a later onnxruntime node fail
  first, whose error it replaces).
- The extension's own callback copies every output through a Python list; the
  callback installed here hands the array over as it is (one copy into
  onnxruntime's buffer), and passes any other Python op to the extension's.
"""
import inspect
import json
import os
import threading
import warnings
import weakref

import numba
import numpy as np
import onnx
import onnxruntime as ort
import onnxruntime_extensions
from onnx import TensorProto, helper, shape_inference
from onnxruntime_extensions import PyCustomOpDef, get_library_path

from .. import _dtypes
from ..kernels._compat import set_pool_thread_count
from ..kernels.cpu._blas import ONE_THREAD
from ..kernels.cpu._runtime import num_threads
from . import (CALL_OF, CALLS, MMDEPLOY_DOMAINS, MMDEPLOY_OPS, MSDA, _capi, fuse as fuse_model,
               mmdeploy_as_onnx)
from ._specs import drop, local_run, new_token, record, spec_of, take_pending

#: the custom-op domain of the nodes that run on numba_ops
ORT_DOMAIN = "numba_ops.ort"
#: the config entry that marks SessionOptions into which numba_ops' library is registered
_MARK = "numba_ops.custom_ops_library"

_F, _D, _U8, _I64 = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.UINT8, TensorProto.INT64
_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
_PY = {_F: PyCustomOpDef.dt_float, _D: PyCustomOpDef.dt_double, _U8: PyCustomOpDef.dt_uint8,
       _I64: PyCustomOpDef.dt_int64}

#: op type -> its inputs in ONNX order, and how many are required
INPUTS = {"AffineGrid": (("theta", "size"), 2), "DeformConv": (("X", "W", "offset", "B", "mask"), 3),
          "GridSample": (("X", "grid"), 2), "AffineWarp": (("X", "theta", "size"), 3),
          MSDA: (("value", "value_spatial_shapes", "value_level_start_index", "sampling_locations",
                  "attention_weights"), 5)}
#: the op types ``session`` takes (``ops``' default)
OPS = tuple(INPUTS)


def _signatures():
    """Every (op, input types (None: absent), output type) the kernels take, 16-bit
    types excluded (they run in float32 between casts)."""
    for t in (_F, _D):
        for b in (None, t):
            for m in (None, t):
                yield "DeformConv", (t, t, t, b, m), t
        yield "AffineGrid", (t, _I64), t
        for x in (t, _U8):
            yield "GridSample", (x, t), x
            yield "AffineWarp", (x, t, _I64), x
        yield MSDA, (t, _I64, _I64, t, t), t


def _op_name(op, types):
    return "_".join([op] + ["none" if t is None else TensorProto.DataType.Name(t).lower() for t in types])


#: the Python route's op type names (one per type signature)
_KERNEL_NAMES = {_op_name(op, types) for op, types, _ in _signatures()}


class _Kernel:
    """One declared custom op: the numba_ops call for one type signature."""

    def __init__(self, op, types, out):
        self.op, self.present = op, tuple(t is not None for t in types)
        self.out_dtype = np.dtype(helper.tensor_dtype_to_np_dtype(out))
        self.opdef = onnxruntime_extensions.Opdef.create(
            self.body, op_type=f"{ORT_DOMAIN}::{_op_name(op, types)}", inputs=[_PY[t] for t in types if t],
            outputs=[_PY[out]], attrs={"numba_ops": PyCustomOpDef.dt_string})

    def body(self, *feed, numba_ops):
        """The node's result; never raises (see the module docstring)."""
        spec = None
        try:
            spec = spec_of(numba_ops)
            it = iter(feed)
            args = [next(it) if p else None for p in self.present]
            if spec.threads is None:
                y = spec.call(*args, **spec.attrs)
            else:
                y = _with_threads(spec.threads, spec.call, args, spec.attrs)
            y = np.ascontiguousarray(y)
            if y.dtype != self.out_dtype:  # the kernels keep the dtype: this is a bug, said as one
                raise TypeError(f"numba_ops returned {y.dtype} for a {self.out_dtype} output")
            return y
        except BaseException as exc:  # noqa: B036 (anything escaping aborts the process)
            try:
                record(spec, numba_ops, exc)
                shape = [0 if d is None else d for d in spec.shape] if spec is not None and spec.shape else [0]
                return np.zeros(shape, self.out_dtype)
            except BaseException:  # noqa: B036
                return np.zeros(0, self.out_dtype)


_LOCK = threading.Lock()
_KERNELS = {}  # op type name (in ORT_DOMAIN) -> _Kernel
_BY_ID = {}  # the extension's op id -> _Kernel


def _register():
    """Declare every signature (once per process) and install the callback."""
    with _LOCK:
        if _KERNELS:
            return
        for op, types, out in _signatures():
            k = _Kernel(op, types, out)
            _KERNELS[_op_name(op, types)] = k
            _BY_ID[k.opdef._id] = k
        from onnxruntime_extensions import _ocos
        default = _ocos._on_pyop_invocation

        def invoke(k_id, feed, attributes):
            k = _BY_ID.get(k_id)
            if k is None:
                return default(k_id, feed, attributes)
            y = k.body(*feed, numba_ops=attributes.get("numba_ops", ""))
            return k_id, list(y.shape), y.reshape(-1)

        PyCustomOpDef.install_hooker(invoke)


# --- the node specs the custom ops read, and the errors they record ---------------------

def _set_threads(n):
    """Set numba's thread count for this thread to ``n`` (clamped to numba's pool);
    return the count it had.

    Once numba's pool is up, through its ctypes binding (as ``_runtime.num_threads``
    reads it): ``numba.set_num_threads`` re-checks the pool and the value on every
    call, which costs more than a tiny node's kernel."""
    before = num_threads() or numba.get_num_threads()
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    if n != before:
        set_pool_thread_count(n)
    return before


def _with_threads(n, call, args, attrs):
    """``call`` on ``n`` numba threads: the InferenceSession's ``run`` has set them for its
    thread already, a node on another thread (ORT_PARALLEL) sets them here."""
    if num_threads() == n:
        return call(*args, **attrs)
    before = _set_threads(n)
    try:
        return call(*args, **attrs)
    finally:
        _set_threads(before)


class NumbaOpsSession(ort.InferenceSession):
    """An ``onnxruntime.InferenceSession`` whose numba_ops nodes' errors come out of
    ``run`` (and ``run_with_iobinding``, ``run_with_ort_values``, ``run_async``) as
    the numba_ops function raised them. Made by ``numba_ops.onnx.session``.

    Attributes
    ----------
    numba_ops_nodes : tuple of Route
        Every node of the model that runs on numba_ops: the pair ``(op type, node
        name)`` with attributes ``op``, ``node``, ``route`` (how it runs: "compiled",
        compiled code on onnxruntime's own threads; "python", onnxruntime-extensions'
        Python operator) and ``reason`` (why the Python route; "" otherwise).

    Notes
    -----
    An error is kept with the ``run`` call of the thread that made it. Where a node
    runs on a thread of onnxruntime's (``ExecutionMode.ORT_PARALLEL``, ``run_async``)
    it is kept with the session instead, so concurrent calls of one such session
    may report each other's errors.
    """

    def __init__(self, model_bytes, sess_options, providers, token, nodes, threads, blas=False, **kwargs):
        self._numba_ops_token = token
        self._numba_ops_threads = threads
        # DeformConv nodes on onnxruntime's threads call SciPy's OpenBLAS: held at one thread
        # while a run of such a session is under way (``_blas.ONE_THREAD``)
        self._numba_ops_blas = blas
        self.numba_ops_nodes = tuple(nodes)
        weakref.finalize(self, drop, token)
        super().__init__(model_bytes, sess_options, providers=providers, **kwargs)

    def _guarded(self, fn, *args):
        token = self._numba_ops_token
        errors = []
        outer = getattr(local_run, "run", None)
        local_run.run = (token, errors)
        threads = self._numba_ops_threads if self.numba_ops_nodes else None
        before = None if threads is None else _set_threads(threads)  # once a run, not once a node
        try:
            if self._numba_ops_blas:
                with ONE_THREAD:
                    out = fn(*args)
            else:
                out = fn(*args)
        except Exception:
            exc = errors[0] if errors else take_pending(token)
            if exc is None:
                raise
            raise exc from None  # the numba_ops error, not what it made a later node say
        finally:
            local_run.run = outer
            if before is not None:
                _set_threads(before)
        exc = errors[0] if errors else take_pending(token)
        if exc is not None:
            raise exc
        return out

    def run(self, output_names, input_feed, run_options=None):
        return self._guarded(super().run, output_names, input_feed, run_options)

    def run_with_iobinding(self, iobinding, run_options=None):
        return self._guarded(super().run_with_iobinding, iobinding, run_options)

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None):
        return self._guarded(super().run_with_ort_values, output_names, input_dict_ort_values, run_options)

    def run_async(self, output_names, input_feed, callback, user_data, run_options=None):
        """As ``InferenceSession.run_async``; a numba_ops error reaches ``callback``
        as its error string (onnxruntime's convention), with no outputs."""
        token = self._numba_ops_token

        def done(outputs, data, err):
            exc = take_pending(token)
            if exc is not None:
                outputs, err = None, f"{type(exc).__name__}: {exc}"
            callback(outputs, data, err)

        return super().run_async(output_names, input_feed, done, user_data, run_options)


# --- the rewrite --------------------------------------------------------------------------

def _load(model):
    """A ModelProto of ``model`` (a ModelProto, a path or bytes) that may be changed."""
    if isinstance(model, onnx.ModelProto):
        out = onnx.ModelProto()
        out.CopyFrom(model)
        return out
    if isinstance(model, (bytes, bytearray, memoryview)):
        return onnx.load_from_string(bytes(model))
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be an onnx.ModelProto, a path or bytes; got {type(model).__name__}")
    return onnx.load(model)


def _value_types(graph):
    """name -> TypeProto.Tensor of every typed value of the main graph."""
    types = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type
    for init in graph.initializer:
        t = onnx.TypeProto.Tensor(elem_type=init.data_type)
        for d in init.dims:
            t.shape.dim.add().dim_value = d
        types[init.name] = t
    return types


def _dims(t):
    """The dims of a TypeProto.Tensor: ints, None where not a number; None if the rank is unknown."""
    if t is None or not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]


def _constants(graph):
    """name -> value of the main graph's initializers and Constant outputs."""
    from onnx import numpy_helper
    out = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.output) == 1:
            for a in n.attribute:
                if a.name == "value":
                    out[n.output[0]] = numpy_helper.to_array(a.t)
    return out


def _np_dtype(elem):
    if elem == TensorProto.BFLOAT16:
        return _dtypes.np_dtype("bfloat16")
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem))


def _attr_values(node, op, call):
    names = [p for p in inspect.signature(call).parameters if p != "device"][len(INPUTS[op][0]):]
    attrs = {}
    for a in node.attribute:
        if a.name not in names:
            raise ValueError(f"{op} has no attribute {a.name!r} (it takes {', '.join(names)})")
        v = helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode()
        elif not isinstance(v, (int, float, str, list)) or (isinstance(v, list) and not all(
                isinstance(e, (int, float)) for e in v)):
            raise ValueError(f"attribute {a.name} must be a number, a string or a list of numbers; "
                             f"got a {onnx.AttributeProto.AttributeType.Name(a.type)} attribute")
        attrs[a.name] = v
    return attrs


def _fill(op, shapes, attrs, consts):
    """Shapes for a dry call that checks what is known: unknown sizes made to fit the
    known ones, an unknown batch 0 (no work). None where even the rank is unknown."""
    def ints(v, n, default):
        try:
            v = [int(e) for e in v]
            return v if len(v) == n else [default] * n
        except (TypeError, ValueError):
            return [default] * n

    def one(v, default=1):
        try:
            return max(1, int(v))
        except (TypeError, ValueError):
            return default

    # the batch: the first one known (so that errors quote the model's shapes), else 0 (no work)
    batched = [sh for i, sh in enumerate(shapes) if sh and not (op == "DeformConv" and i in (1, 3))]
    batch = next((sh[0] for sh in batched if sh[0] is not None), None)
    if batch is None and consts is not None and np.size(consts):
        batch = int(np.asarray(consts).reshape(-1)[0])
    batch = batch or 0

    def overlay(known, made):
        """``made`` where ``known`` has no size."""
        if known is None:
            return [batch] + made[1:]
        if len(known) != len(made):
            return [1 if d is None else d for d in known]
        return [batch if known[0] is None else known[0]] + fit(known[1:], made[1:])

    def fit(known, made):
        """``made`` where ``known`` (no batch axis) has no size."""
        if known is None or len(known) != len(made):
            return made if known is None else [1 if d is None else d for d in known]
        return [m if k is None else k for k, m in zip(known, made)]

    if op == "DeformConv":
        x, w, off, b, m = (shapes + [None] * 5)[:5]
        nd = next((len(s) - 2 for s in (x, w, off, m) if s is not None), None)
        if nd is None or nd < 1:
            return None
        g, og = one(attrs.get("group", 1)), one(attrs.get("offset_group", 1))
        k = [kk or 1 for kk in (w[2:] if w is not None and len(w) == nd + 2 else
                                ints(attrs.get("kernel_shape", []), nd, 1))]
        s, d = ints(attrs.get("strides", []), nd, 1), ints(attrs.get("dilations", []), nd, 1)
        p = ints(attrs.get("pads", []), 2 * nd, 0)
        C = x[1] if x is not None and len(x) > 1 and x[1] is not None else (
            w[1] * g if w is not None and len(w) > 1 and w[1] is not None else g * og)
        oC = w[0] if w is not None and w[0] is not None else (b[0] if b is not None and b and b[0] else g)
        sp = [xs if xs is not None else (kk - 1) * dd + 1 - p[i] - p[i + nd]
              for i, (xs, kk, dd) in enumerate(zip(x[2:] if x is not None and len(x) == nd + 2 else [None] * nd,
                                                   k, d))]
        sp = [max(1, v) for v in sp]
        o = [max(1, (sp[i] + p[i] + p[i + nd] - ((k[i] - 1) * d[i] + 1)) // max(1, s[i]) + 1) for i in range(nd)]
        K = int(np.prod(k))
        made = [[0, C] + sp, [oC, max(1, C // g)] + k, [0, og * K * nd] + o, [oC], [0, og * K] + o]
        return [overlay(x, made[0]), fit(w, made[1]), overlay(off, made[2]), fit(b, made[3]), overlay(m, made[4])]
    if op == "GridSample":
        x, grid = shapes
        r = len(x) - 2 if x is not None else (grid[-1] if grid and grid[-1] else None)
        if r is None:
            return None
        return [overlay(x, [0, 1] + [1] * r), overlay(grid, [0] + [1] * r + [r])]
    # AffineGrid (theta, size) and AffineWarp (X, theta, size)
    x = shapes[0] if op == "AffineWarp" else None
    theta = shapes[-2]
    r = (len(x) - 2 if x is not None else theta[1] if theta is not None and len(theta) == 3 and theta[1] else 2)
    made_theta = overlay(theta, [0, r, r + 1])
    size = consts
    if size is not None:
        size = [int(v) for v in np.asarray(size).reshape(-1)]
    else:
        size = [made_theta[0], 1] + [1] * r
    if op == "AffineGrid":
        return [made_theta, size]
    made_x = overlay(x, [0, 1] + [1] * r)
    if size is not None and len(size) >= 2:
        size[1] = made_x[1]
    return [made_x, made_theta, size]


def _check(op, call, node_name, elems, shapes, attrs, consts, kind):
    """The function's own checks of a node, at session creation: a dry call on zeros
    of the node's dtypes and known shapes (``_fill``). Its errors name the node.
    Returns the dry result's shape (None if not run)."""
    if op == MSDA:
        return _check_msda(node_name, elems, shapes, consts, kind)
    try:
        filled = _fill(op, shapes, attrs, consts)
    except Exception:  # incomplete shapes the filler cannot reconcile: checked at run time
        filled = None
    if filled is None:
        return None
    args = []
    names, _ = INPUTS[op]
    for i, (name, elem) in enumerate(zip(names, elems)):
        if elem is None:
            args.append(None)
        elif name == "size":
            args.append(np.asarray(filled[i], np.int64))
        else:
            args.append(np.zeros(filled[i], _np_dtype(elem)))
    try:
        return call(*args, **attrs).shape
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{kind} node {node_name!r}: {exc}") from exc


def _check_msda(node_name, elems, shapes, consts, kind):
    """``_check`` of a multi-scale deformable attention node, whose level shapes and starts
    (``consts``: their values, None where not constants of the model) are values: the
    function's checks on empty stand-ins of the known shapes (unknown sizes made to fit),
    where both are constants; else everything is checked at run time."""
    from ..ms_deform_attn import checked_call
    table, starts = consts
    if table is None or starts is None:
        return None
    table = np.asarray(table)
    value, _, _, loc, attn = shapes
    rows = table.reshape(table.shape[0], -1) if table.ndim == 2 else table.reshape(0, 2)
    L, r = rows.shape
    S = int(np.prod(rows, axis=1).sum()) if L and rows.dtype.kind in "iu" else 0

    def known(i, *where):
        return next((s[i] for s in where if s is not None and len(s) > i and s[i] is not None), None)

    n = known(0, value, loc, attn) or 0  # (an unknown batch: no work)
    M, Lq, P = known(2, value, loc, attn) or 1, known(1, loc, attn) or 1, known(4, loc, attn) or 1

    def fit(dims, made):
        if dims is None:
            return made
        return [m if d is None else d for d, m in zip(dims, made)] if len(dims) == len(made) else \
            [1 if d is None else d for d in dims]

    made = [fit(value, [n, S, M, known(3, value) or 1]), fit(loc, [n, Lq, M, L, P, r]), fit(attn, [n, Lq, M, L, P])]
    value_a, loc_a, attn_a = (_capi.dummy(sh, _np_dtype(e)) for sh, e in zip(made, (elems[0], elems[3], elems[4])))
    try:
        return checked_call(value_a, table, starts, loc_a, attn_a, "cpu")[-1]
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{kind} node {node_name!r}: {exc}") from exc


def msda_out_dims(shapes):
    """A multi-scale deformable attention node's output dims (N, Lq, M * Dh), None
    where not known, from its inputs' dims."""
    value, _, _, loc, attn = shapes
    v = value if value is not None and len(value) == 4 else [None] * 4
    n = v[0] if v[0] is not None else next((s[0] for s in (loc, attn) if s and s[0] is not None), None)
    lq = next((s[1] for s in (loc, attn) if s and len(s) > 1 and s[1] is not None), None)
    return [n, lq, None if None in v[2:] else v[2] * v[3]]


def _op_key(node, wanted):
    """The op a node runs as (ONNX's, or MMDeploy's node's ONNX twin), or None where
    ``session`` does not take it."""
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    op = node.op_type
    if domain in MMDEPLOY_DOMAINS and op in MMDEPLOY_OPS:
        op = MMDEPLOY_OPS[op]
    elif (domain, op) not in CALLS:
        return None
    return op if op in wanted else None


class Route(tuple):
    """How a node of the model runs in a ``session`` (``session.numba_ops_nodes``): the
    pair ``(op, node)`` (its op type, its name: ``<op>_<index>`` where it has none)
    with ``route``, "compiled" (compiled code on onnxruntime's own threads) or
    "python" (onnxruntime-extensions' Python operator, the GIL, one numba thread),
    and ``reason``, why a node takes the Python route ("" otherwise)."""

    def __new__(cls, op, node, route, reason=""):
        self = super().__new__(cls, (op, node))
        self.op, self.node, self.route, self.reason = op, node, route, reason
        return self

    def __repr__(self):
        why = f", reason={self.reason!r}" if self.reason else ""
        return f"Route(op={self.op!r}, node={self.node!r}, route={self.route!r}{why})"


#: the routes' names
COMPILED, PYTHON = "compiled", "python"


def _node_inputs(node, op):
    """A node's inputs (names, "" where absent) in ONNX order, and its attributes, of
    ``op`` (an MMDeploy node's translated: ``mmdeploy_as_onnx``)."""
    if node.op_type in MMDEPLOY_OPS and node.domain in MMDEPLOY_DOMAINS:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        n_in = {"MMCVModulatedDeformConv2d": (4, 5), "grid_sampler": (2, 2), MSDA: (5, 5)}[node.op_type]
        if not n_in[0] <= len(node.input) <= n_in[1] or not all(node.input[:n_in[0]]):
            raise ValueError(f"takes {n_in[0]} to {n_in[1]} inputs, the first {n_in[0]} given; got "
                             f"{list(node.input)}")
        _, ins, attrs = mmdeploy_as_onnx(node.op_type, [v or None for v in node.input], attrs)
        return [v or "" for v in ins], attrs
    return list(node.input), _attr_values(node, op, CALL_OF[op])


def prepare(model, ops=None, fuse=False, token=0, threads=None, pool=None, why=None):
    """The rewritten model for ``session`` (see the module docstring) and the ``Route``
    of every node taken. ``pool``: onnxruntime's intra-op thread count where the
    compiled route is available (``_capi``), else None and ``why`` says why not."""
    if ops is None:
        wanted = set(OPS)
    else:
        if isinstance(ops, str):
            ops = [ops]
        wanted = set()
        for o in ops:
            if o not in INPUTS:
                raise ValueError(f"ops must hold op types among {', '.join(OPS)}; got {o!r}")
            wanted.add(o)
    if fuse and "AffineWarp" not in wanted:
        raise ValueError("fuse=True makes AffineWarp nodes, which only numba_ops runs: ops must include 'AffineWarp'")
    m = _load(model)
    try:
        m = shape_inference.infer_shapes(m)
    except Exception:  # a model onnx cannot infer: the shapes it declares itself
        pass
    if fuse:
        m = fuse_model(m)
    graph = m.graph
    types = _value_types(graph)
    consts = _constants(graph)
    names = {n.name for n in graph.node}
    new_nodes, new_vi, taken = [], [], []
    declared = {vi.name for vi in graph.value_info}
    for idx, node in enumerate(graph.node):
        op = _op_key(node, wanted)
        if op is None:
            new_nodes.append(node)
            continue
        kind = node.op_type
        node_name = node.name or f"{kind}_{idx}"
        call = CALL_OF[op]
        in_names, required = INPUTS[op]
        if len(node.output) != 1:
            raise ValueError(f"{kind} node {node_name!r}: makes one output; got {len(node.output)}")
        try:
            inputs, attrs = _node_inputs(node, op)
        except ValueError as exc:
            raise ValueError(f"{kind} node {node_name!r}: {exc}") from None
        if len(inputs) > len(in_names):
            raise ValueError(f"{kind} node {node_name!r}: takes at most {len(in_names)} inputs; "
                             f"got {len(inputs)}")
        inputs += [""] * (len(in_names) - len(inputs))
        for i in range(required):
            if not inputs[i]:
                raise ValueError(f"{kind} node {node_name!r}: input {in_names[i]} is required")
        elems = []
        for nm, v in zip(in_names, inputs):
            if not v:
                elems.append(None)
            elif v not in types:
                raise ValueError(f"{kind} node {node_name!r}: the type of input {nm} ({v!r}) is not known "
                                 "(declare it in the model's value_info)")
            else:
                elems.append(types[v].elem_type)
        shapes = [_dims(types.get(v)) if v else None for v in inputs]
        if op == MSDA:  # (the level shapes and starts, where constants)
            known = (consts.get(inputs[1]), consts.get(inputs[2]))
        else:
            known = consts.get(inputs[-1]) if op in ("AffineGrid", "AffineWarp") else None
        dry = _check(op, call, node_name, elems, shapes, attrs, known, kind)
        compute = tuple(None if e is None else _F if e in _HALF else e for e in elems)
        kernel = _op_name(op, compute)
        if kernel not in _KERNEL_NAMES:
            raise TypeError(f"{kind} node {node_name!r}: numba_ops has no kernel for inputs of types "
                            + ", ".join(TensorProto.DataType.Name(e) if e else "absent" for e in elems))
        out = node.output[0]
        out_elem = elems[0]  # X's (uint8 included) or theta's
        out_t = types.get(out)
        out_dims = _dims(out_t)
        if out_dims is None and op == MSDA:  # (a custom node: onnx infers nothing)
            out_dims = msda_out_dims(shapes)
        elif out_dims is None and dry is not None:  # onnx could not infer it: the dry call's rank and sizes
            batch = shapes[0][0] if shapes[0] else None
            out_dims = [batch] + list(dry[1:]) if None not in (shapes[0] or [None]) else [None] * len(dry)
        if out not in declared and out_dims is not None:
            new_vi.append(helper.make_tensor_value_info(out, out_elem, out_dims))
        if out not in types:  # (what onnx could not infer: an MMDeploy node's output, for the nodes after it)
            types[out] = helper.make_tensor_type_proto(out_elem, out_dims).tensor_type
        capi_type = _capi.op_type(op, compute)
        reason = why or ""
        if pool and op == "DeformConv":
            rank = next((len(sh) - 2 for sh in (shapes[0], shapes[1]) if sh is not None), None)
            if rank is not None and rank > _capi.MAX_RANK:
                capi_type, reason = None, (f"a DeformConv of {rank} spatial axes (the compiled route takes 1 to "
                                           f"{_capi.MAX_RANK})")
        if pool and capi_type is None and not reason:
            reason = "no compiled operator for its input types"
        route = COMPILED if pool and capi_type else PYTHON
        text = json.dumps({"op": op, "attrs": attrs, "node": node_name, "session": token, "shape": out_dims,
                           "threads": threads, "pool": pool}, separators=(",", ":"))
        ins, casts = [], []
        for nm, v, e in zip(in_names, inputs, elems):
            if e is None:
                continue
            if e in _HALF:
                f32 = _unique(f"{v}/numba_ops_float32", names)
                casts.append(helper.make_node("Cast", [v], [f32], to=_F, name=f32))
                new_vi.append(helper.make_tensor_value_info(f32, _F, shapes[in_names.index(nm)]))
                v = f32
            ins.append(v)
        y = out
        if out_elem in _HALF:
            y = _unique(f"{out}/numba_ops_float32", names)
            new_vi.append(helper.make_tensor_value_info(y, _F, out_dims))
        new_nodes += casts
        if route == COMPILED:  # on onnxruntime's pool; inputs in their places ("": absent)
            it = iter(ins)
            ins = [next(it) if e is not None else "" for e in elems]
            while not ins[-1]:
                ins.pop()
            new_nodes.append(helper.make_node(capi_type, ins, [y], name=node_name, domain=_capi.DOMAIN,
                                              numba_ops=text))
        else:
            new_nodes.append(helper.make_node(kernel, ins, [y], name=node_name, domain=ORT_DOMAIN, numba_ops=text))
        if y != out:
            new_nodes.append(helper.make_node("Cast", [y], [out], to=out_elem, name=f"{y}/cast"))
        taken.append(Route(kind, node_name, route, "" if route == COMPILED else reason))
    if taken:
        del graph.node[:]
        graph.node.extend(new_nodes)
        graph.value_info.extend(new_vi)
        for d in (ORT_DOMAIN, _capi.DOMAIN):
            if not any(o.domain == d for o in m.opset_import):
                m.opset_import.append(helper.make_opsetid(d, 1))
    return m, taken


def _unique(name, names):
    out, i = name, 1
    while out in names:
        i += 1
        out = f"{name}{i}"
    names.add(out)
    return out


def options(sess_options):
    """``sess_options`` (or new SessionOptions) with the compiled route's library
    (``_capi``) registered once per options object where it is available, and the
    threading defaults where the options do not set them. Returns it, numba's thread
    count in the Python route's nodes (``node_threads``), onnxruntime's intra-op
    thread count that the compiled route's nodes deal their work onto (None where
    that route is not available) and why not (None where it is; session config
    entry ``numba_ops.capi`` "0" turns it off)."""
    so = ort.SessionOptions() if sess_options is None else sess_options
    threads = node_threads(so)
    if _entry(so, CAPI) == "0":
        return so, threads, None, f"session option {CAPI} is \"0\""
    if _capi.library() is not None and _entry(so, _MARK_CAPI) is None:
        try:
            so.register_custom_ops_library(_capi.library())
            so.add_session_config_entry(_MARK_CAPI, "1")
        except Exception as exc:  # (reason() says why, where _capi saw it)
            why = _capi.reason() or f"onnxruntime could not register numba_ops' operators ({exc})"
            return so, threads, None, why
    if _entry(so, _MARK_CAPI) is None or _capi.reason() is not None:
        return so, threads, None, _capi.reason() or "numba_ops' operators are not registered"
    return so, threads, so.intra_op_num_threads or numba.config.NUMBA_DEFAULT_NUM_THREADS, None


def _python_route(so, threads):
    """Make ``so`` ready for nodes on the Python route: onnxruntime-extensions' library
    registered (once per options object), numba_ops' Python operators declared."""
    _register()
    if _entry(so, _MARK) is None:
        so.register_custom_ops_library(get_library_path())
        so.add_session_config_entry(_MARK, "1")
    if threads != 1 and _entry(so, SPINNING) is None:
        so.add_session_config_entry(SPINNING, "0")


#: onnxruntime's switch for its intra-op pool's spinning, which numba_ops turns off where
#: its nodes run on more than one numba thread: numba's pool and onnxruntime's, both
#: spinning after their work, then hold the cores that the other's next node needs (on 2
#: cores a DCNv2 backbone ran 2.6x slower). A node on one numba thread runs on the calling
#: thread alone, beside onnxruntime's idle threads, so onnxruntime keeps its own default
#: (spinning: its small nodes start faster; the same backbone ran 1.09x faster than with
#: spinning off)
SPINNING = "session.intra_op.allow_spinning"
#: the config entry that sets numba's thread count in numba_ops' nodes (default 1)
THREADS = "numba_ops.num_threads"
#: the config entry that turns the C API route of float DeformConv nodes off ("0")
CAPI = "numba_ops.capi"
_MARK_CAPI = "numba_ops.capi_library"


def _entry(so, key):
    try:
        return so.get_session_config_entry(key)
    except Exception:  # onnxruntime raises for an absent entry
        return None


def node_threads(so):
    """numba's thread count in the InferenceSession's numba_ops nodes: the options' entry
    ``numba_ops.num_threads`` ("0": numba's own count), default 1."""
    text = _entry(so, THREADS)
    try:
        n = 1 if text is None else int(text)
    except ValueError:
        raise ValueError(f"session option {THREADS} must be an integer >= 0; got {text!r}") from None
    if n < 0:
        raise ValueError(f"session option {THREADS} must be an integer >= 0; got {text!r}")
    return n or None


def session(model, sess_options=None, *, providers=None, ops=None, fuse=False, **kwargs):
    token = new_token()
    try:
        so, threads, pool, why = options(sess_options)
        m, taken = prepare(model, ops=ops, fuse=fuse, token=token, threads=threads, pool=pool, why=why)
        slow = [r for r in taken if r.route == PYTHON]
        if slow:
            _python_route(so, threads)
            if _entry(so, CAPI) != "0":  # (not when the options asked for it)
                warnings.warn("numba_ops.onnx.session: " + "; ".join(
                    f"{r.op} node {r.node!r} runs on the slower Python route: {r.reason}" for r in slow),
                    RuntimeWarning, stacklevel=3)
        blas = any(r.route == COMPILED and MMDEPLOY_OPS.get(r.op, r.op) == "DeformConv" for r in taken)
        return NumbaOpsSession(m.SerializeToString(), so, ["CPUExecutionProvider"] if providers is None else providers,
                               token, taken, threads, blas=blas, **kwargs)
    except BaseException:
        drop(token)
        raise

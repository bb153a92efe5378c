"""numba_ops kernels as operators of ONNX's reference evaluator.

``AffineGrid``, ``DeformConv`` and ``GridSample`` are ``onnx.reference.op_run.OpRun``
subclasses in the default domain, so they replace the built-in implementations::

    from onnx.reference import ReferenceEvaluator
    from numba_ops.onnx import AffineGrid, AffineWarp, DeformConv, GridSample

    sess = ReferenceEvaluator(model, new_ops=[AffineGrid, DeformConv, GridSample, AffineWarp])
    y, = sess.run(None, feeds)

Attributes are read from the node, with ONNX's defaults where the node leaves
one out (``align_corners=0``; ``group=1``, ``offset_group=1``, and strides,
pads, dilations, kernel_shape from the inputs' shapes; ``mode="linear"``,
``padding_mode="zeros"``). Optional inputs (``B``, ``mask``) may be absent or
given the empty name.

``AffineWarp`` (domain ``numba_ops``, opset 1) is ``GridSample(X, AffineGrid(theta,
size))`` in one kernel (``numba_ops.affine_warp``); ``fuse(model)`` rewrites a
model's AffineGrid -> GridSample pairs into it. ``MMCVMultiScaleDeformableAttention``
(domain ``numba_ops``; MMDeploy's node of that name in domain ``mmdeploy`` or ``mmcv``
alike) is ``numba_ops.ms_deform_attn``.

Device: the class attribute ``device`` (``None``: follow the inputs, i.e. the
CPU for NumPy inputs; ``"cpu"``; ``"cuda"``). ``ops(device)`` returns the pair
bound to one device, for example::

    ReferenceEvaluator(model, new_ops=numba_ops.onnx.ops("cuda"))

A model's local functions (``ModelProto.functions``) are a gap in onnx: the
evaluator runs their bodies without ``new_ops``, so an op inside one runs on
onnx's own implementation. ``evaluator(model, device)`` closes it: a
``ReferenceEvaluator`` whose functions run on these ops too.

This module needs onnx (``pip install numba_ops[onnx]``); ``import numba_ops``
does not import it.
"""
import numpy as np
from onnx.reference.op_run import OpRun

from .._dispatch import check_device
from ..affine_grid import affine_grid
from ..affine_warp import affine_warp
from ..deform_conv import deform_conv
from ..grid_sample import grid_sample
from ..ms_deform_attn import ms_deform_attn

__all__ = ["AffineGrid", "AffineWarp", "DeformConv", "GridSample", "MMCVModulatedDeformConv2d",
           "MMCVMultiScaleDeformableAttention", "evaluator", "fuse", "grid_sampler", "mmdeploy_as_onnx",
           "mmdeploy_ops", "ops", "session"]

#: the domain of AffineWarp and MMCVMultiScaleDeformableAttention, and its opset version
DOMAIN = "numba_ops"
DOMAIN_VERSION = 1
#: the op type of multi-scale deformable attention (MMDeploy's name, in its domains and in ``DOMAIN``)
MSDA = "MMCVMultiScaleDeformableAttention"
#: GridSample opset 16's mode names (opset 20 renamed them)
_OPSET16_MODES = {"bilinear": "linear", "bicubic": "cubic"}


def _host(a):
    """The reference evaluator works on NumPy arrays: bring a device result home."""
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


class _Carried(Exception):
    """Carries our TypeError through ``OpRun.run``, which would re-wrap it in a message
    of its own ("Issues with types ...") that says neither the input nor what was expected."""


class _Op(OpRun):
    op_domain = ""
    device = None

    def run(self, *args, **kwargs):
        try:
            return super().run(*args, **kwargs)
        except _Carried as carried:
            raise carried.args[0] from None

    def _call(self, fn, *args, **kwargs):
        """``fn`` on this class's device, its result on the host, a TypeError carried."""
        try:
            return (_host(fn(*args, device=self.device, **kwargs)),)
        except TypeError as exc:
            raise _Carried(exc) from None


def _affine_grid(theta, size, align_corners=None, device=None):
    return affine_grid(theta, np.asarray(size).tolist(), align_corners=0 if align_corners is None else align_corners,
                       device=device)


def _deform_conv(X, W, offset, B=None, mask=None, dilations=None, group=None, kernel_shape=None,
                 offset_group=None, pads=None, strides=None, device=None):
    return deform_conv(X, W, offset, B, mask, kernel_shape=kernel_shape, strides=strides, pads=pads,
                       dilations=dilations, group=1 if group is None else group,
                       offset_group=1 if offset_group is None else offset_group, device=device)


def _mode(mode):
    """GridSample's ``mode`` attribute, ONNX's default "linear" when absent; opset 16's
    "bilinear"/"bicubic" are opset 20's "linear"/"cubic"."""
    return "linear" if mode is None else _OPSET16_MODES.get(mode, mode)


def sample_kwargs(align_corners=None, mode=None, padding_mode=None):
    """grid_sample's and affine_warp's keyword arguments from a GridSample (or
    AffineWarp) node's attributes, ONNX's defaults where absent."""
    return dict(mode=_mode(mode), padding_mode="zeros" if padding_mode is None else padding_mode,
                align_corners=0 if align_corners is None else align_corners)


def _grid_sample(X, grid, align_corners=None, mode=None, padding_mode=None, device=None):
    return grid_sample(X, grid, **sample_kwargs(align_corners, mode, padding_mode), device=device)


def _affine_warp(X, theta, size, align_corners=None, mode=None, padding_mode=None, device=None):
    size = [int(v) for v in np.asarray(size).reshape(-1)]
    if len(size) >= 2 and np.ndim(X) >= 2:
        size[1] = int(np.shape(X)[1])
    return affine_warp(X, theta, size, **sample_kwargs(align_corners, mode, padding_mode), device=device)


def _ms_deform_attn(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                    im2col_step=None, device=None):
    """``im2col_step``: mmcv's CUDA kernel's batch chunking, accepted and of no effect."""
    return ms_deform_attn(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                          attention_weights, device=device)


#: (domain, op type) -> the numba_ops call for a node's inputs (in ONNX order, None where
#: absent) and attributes (ONNX names; absent ones take ONNX's defaults): what both the
#: evaluator's classes and ``session`` run
CALLS = {("", "AffineGrid"): _affine_grid, ("", "DeformConv"): _deform_conv, ("", "GridSample"): _grid_sample,
         (DOMAIN, "AffineWarp"): _affine_warp, (DOMAIN, MSDA): _ms_deform_attn}
#: op type -> its call (the op types are unique across the domains)
CALL_OF = {op: call for (_, op), call in CALLS.items()}


class AffineGrid(_Op):
    """ONNX AffineGrid (opset 20) on numba_ops' kernels."""

    def _run(self, theta, size, align_corners=None):
        return self._call(_affine_grid, theta, size, align_corners=align_corners)


class DeformConv(_Op):
    """ONNX DeformConv (opset 19 and 22) on numba_ops' kernels."""

    def _run(self, X, W, offset, B=None, mask=None, dilations=None, group=None, kernel_shape=None,
             offset_group=None, pads=None, strides=None):
        return self._call(_deform_conv, X, W, offset, B, mask, dilations=dilations, group=group,
                          kernel_shape=kernel_shape, offset_group=offset_group, pads=pads, strides=strides)


class GridSample(_Op):
    """ONNX GridSample (opset 20 and 22; opset 16's mode names too) on numba_ops' kernels."""

    def _run(self, X, grid, align_corners=None, mode=None, padding_mode=None):
        return self._call(_grid_sample, X, grid, align_corners=align_corners, mode=mode, padding_mode=padding_mode)


class AffineWarp(_Op):
    """``GridSample(X, AffineGrid(theta, size))`` in one pass (``numba_ops.affine_warp``),
    domain ``numba_ops``, opset 1: what ``fuse`` puts in place of such a pair.

    Inputs ``X`` (N, C, [D,] H, W), ``theta`` (N, r, r+1), ``size`` (AffineGrid's
    output size (N, C, [D,] H, W); its C is ignored, as AffineGrid ignores it: the
    output has X's C). Attributes ``mode``, ``padding_mode`` (GridSample's) and
    ``align_corners`` (both ops'), with GridSample's defaults.
    """
    op_domain = DOMAIN

    def _run(self, X, theta, size, align_corners=None, mode=None, padding_mode=None):
        return self._call(_affine_warp, X, theta, size, align_corners=align_corners, mode=mode,
                          padding_mode=padding_mode)


class MMCVMultiScaleDeformableAttention(_Op):
    """Multi-scale deformable attention (``numba_ops.ms_deform_attn``), domain
    ``numba_ops``, opset 1, levels of any rank; MMDeploy's and mmcv's node of the same
    name and inputs (domains ``mmdeploy``, ``mmcv``: ``mmdeploy_ops()``) runs alike.

    Inputs ``value`` (N, S, M, Dh), ``value_spatial_shapes`` int64 (L, r),
    ``value_level_start_index`` int64 (L,), ``sampling_locations`` (N, Lq, M, L, P, r),
    ``attention_weights`` (N, Lq, M, L, P); output (N, Lq, M * Dh). Attribute
    ``im2col_step`` (mmcv's CUDA kernel's batch chunking) is accepted and has no effect.
    """
    op_domain = DOMAIN

    def _run(self, value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
             **attrs):
        unknown = sorted(set(attrs) - {"im2col_step"})
        if unknown:
            raise ValueError(f"{MSDA} has no attribute {unknown[0]!r} (it takes im2col_step)")
        return self._call(_ms_deform_attn, value, value_spatial_shapes, value_level_start_index,
                          sampling_locations, attention_weights)


# --- MMDeploy's nodes ---------------------------------------------------------------------

#: the domains of the custom nodes that OpenMMLab's MMDeploy (and mmcv) export for onnxruntime
MMDEPLOY_DOMAINS = ("mmdeploy", "mmcv")
#: MMDeploy's op types, and the op each runs as (ONNX's; numba_ops' for multi-scale
#: deformable attention, the same node in domain ``numba_ops``)
MMDEPLOY_OPS = {"MMCVModulatedDeformConv2d": "DeformConv", "grid_sampler": "GridSample", MSDA: MSDA}
_MM_MODES = {0: "linear", 1: "nearest", 2: "cubic"}
_MM_PADDING = {0: "zeros", 1: "border", 2: "reflection"}
_MM_ATTRS = {"MMCVModulatedDeformConv2d": ("stride", "padding", "dilation", "groups", "deform_groups",
                                           "deformable_groups"),
             "grid_sampler": ("interpolation_mode", "padding_mode", "align_corners"), MSDA: ("im2col_step",)}


def _pair(value, name, default):
    """An MMDeploy (h, w) attribute: two ints (one int stands for both)."""
    if value is None:
        return [default, default]
    v = [value] if isinstance(value, (int, np.integer)) else list(value)
    if len(v) == 1:
        v = v * 2
    if len(v) != 2 or not all(isinstance(e, (int, np.integer)) for e in v):
        raise ValueError(f"attribute {name} must be one or two integers (h, w); got {value!r}")
    return [int(e) for e in v]


def _code(value, name, names):
    try:
        return names[int(value)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"attribute {name} must be one of {sorted(names)} "
                         f"({', '.join(f'{k}: {v}' for k, v in names.items())}); got {value!r}") from None


def mmdeploy_as_onnx(op_type, inputs, attrs):
    """An MMDeploy node as the ONNX node with its semantics: ``(ONNX op type, inputs in
    ONNX order (None where absent), ONNX attributes)``.

    ``MMCVModulatedDeformConv2d`` (inputs input, offset, mask, weight[, bias];
    attributes ``stride``, ``padding`` (symmetric, (h, w)), ``dilation``, ``groups``,
    ``deform_groups`` (``deformable_groups`` in older exports)) is a 2-D DeformConv
    with a mask: mmcv's offsets (dy, dx per kernel point, per offset group) and
    bilinear sampling (zero outside the image) are ONNX's. ``grid_sampler`` (inputs
    input, grid; attributes ``interpolation_mode`` 0/1/2 = bilinear, nearest, bicubic,
    ``padding_mode`` 0/1/2 = zeros, border, reflection, ``align_corners``) is
    PyTorch's ``grid_sample``, which ONNX GridSample follows. Absent attributes take
    PyTorch's defaults. ``MMCVMultiScaleDeformableAttention`` (inputs value,
    value_spatial_shapes, value_level_start_index, sampling_locations,
    attention_weights; attribute ``im2col_step``, of no effect) is the node of that
    name in domain ``numba_ops``, whose inputs are mmcv's.
    """
    a = dict(attrs)
    unknown = sorted(set(a) - set(_MM_ATTRS[op_type]))
    if unknown:
        raise ValueError(f"{op_type} has no attribute {unknown[0]!r} (it takes {', '.join(_MM_ATTRS[op_type])})")
    ins = list(inputs) + [None] * (5 - len(inputs))
    if op_type == MSDA:
        return MSDA, ins[:5], {}
    if op_type == "MMCVModulatedDeformConv2d":
        x, offset, mask, w, b = ins[:5]
        ph, pw = _pair(a.get("padding"), "padding", 0)
        groups = a.get("deform_groups", a.get("deformable_groups"))
        return "DeformConv", [x, w, offset, b, mask], dict(
            strides=_pair(a.get("stride"), "stride", 1), pads=[ph, pw, ph, pw],
            dilations=_pair(a.get("dilation"), "dilation", 1), group=int(a.get("groups", 1)),
            offset_group=1 if groups is None else int(groups))
    return "GridSample", ins[:2], dict(
        mode=_code(a.get("interpolation_mode", 0), "interpolation_mode", _MM_MODES),
        padding_mode=_code(a.get("padding_mode", 0), "padding_mode", _MM_PADDING),
        align_corners=int(a.get("align_corners", 0)))


class MMCVModulatedDeformConv2d(_Op):
    """MMDeploy's (and mmcv's) ``MMCVModulatedDeformConv2d`` node (domain ``mmdeploy``;
    ``ops()`` adds its ``mmcv`` twin) on numba_ops' DeformConv (``mmdeploy_as_onnx``)."""
    op_domain = MMDEPLOY_DOMAINS[0]

    def _run(self, input, offset, mask, weight, bias=None, **attrs):  # noqa: A002 (MMDeploy's names)
        try:
            op, ins, a = mmdeploy_as_onnx("MMCVModulatedDeformConv2d", [input, offset, mask, weight, bias], attrs)
        except ValueError as exc:
            raise ValueError(f"MMCVModulatedDeformConv2d: {exc}") from None
        return self._call(_deform_conv, *ins, **a)


class grid_sampler(_Op):  # noqa: N801 (MMDeploy's op type)
    """MMDeploy's ``grid_sampler`` node (domain ``mmdeploy``; ``ops()`` adds its ``mmcv``
    twin) on numba_ops' GridSample (``mmdeploy_as_onnx``)."""
    op_domain = MMDEPLOY_DOMAINS[0]

    def _run(self, input, grid, **attrs):  # noqa: A002 (MMDeploy's names)
        try:
            op, ins, a = mmdeploy_as_onnx("grid_sampler", [input, grid], attrs)
        except ValueError as exc:
            raise ValueError(f"grid_sampler: {exc}") from None
        return self._call(_grid_sample, *ins, **a)


def _in_domain(cls, domain):
    return type(cls.__name__, (cls,), {"op_domain": domain, "__module__": __name__, "__doc__": cls.__doc__})


_CLASSES = (AffineGrid, DeformConv, GridSample, AffineWarp, MMCVMultiScaleDeformableAttention)
_MMDEPLOY_CLASSES = (MMCVModulatedDeformConv2d, grid_sampler, _in_domain(MMCVModulatedDeformConv2d, "mmcv"),
                     _in_domain(grid_sampler, "mmcv")) + tuple(
    _in_domain(MMCVMultiScaleDeformableAttention, d) for d in MMDEPLOY_DOMAINS)


def _bound(classes, device):
    if check_device(device) is None:
        return list(classes)
    return [type(cls.__name__, (cls,), {"device": device, "__module__": __name__, "op_domain": cls.op_domain})
            for cls in classes]


def ops(device=None):
    """``[AffineGrid, DeformConv, GridSample, AffineWarp, MMCVMultiScaleDeformableAttention]``
    (the last two of domain ``numba_ops``) bound to ``device`` (None, "cpu" or "cuda"),
    for ``new_ops``.

    The classes keep their ONNX names, which is how the evaluator matches them to nodes.
    """
    return _bound(_CLASSES, device)


def mmdeploy_ops(device=None):
    """MMDeploy's nodes ``MMCVModulatedDeformConv2d``, ``grid_sampler`` and
    ``MMCVMultiScaleDeformableAttention``, in domains ``mmdeploy`` and ``mmcv``, bound
    to ``device``, for ``new_ops`` (``evaluator`` adds them)."""
    return _bound(_MMDEPLOY_CLASSES, device)


# --- fuse: AffineGrid -> GridSample as AffineWarp ----------------------------------------

def _attr(node, name, default):
    from onnx import helper
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _is_onnx(node, op_type):
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def _subgraph_names(node, into):
    """Every value name that the subgraphs of ``node`` (If, Loop, Scan bodies) read, recursively."""
    from onnx import AttributeProto
    for a in node.attribute:
        graphs = [a.g] if a.type == AttributeProto.GRAPH else list(a.graphs) if a.type == AttributeProto.GRAPHS else []
        for g in graphs:
            for n in g.node:
                into.update(n.input)
                _subgraph_names(n, into)
            into.update(o.name for o in g.output)
    return into


def _replace(field, items):
    """Set the repeated message ``field`` to (copies of) ``items``."""
    copies = []
    for item in items:
        c = type(item)()
        c.CopyFrom(item)
        copies.append(c)
    del field[:]
    field.extend(copies)


def fuse(model):
    """A copy of the ONNX ``model`` in which every AffineGrid whose grid feeds only
    GridSample nodes (as their ``grid``) with the AffineGrid's ``align_corners``, and
    is no graph output, is replaced, with those nodes, by one ``AffineWarp`` node
    (domain ``numba_ops``, opset 1) per GridSample: inputs the GridSample's ``X``,
    the AffineGrid's ``theta`` and ``size``; attributes ``mode``, ``padding_mode``
    and ``align_corners``. The opset import ``numba_ops`` v1 is added when a node
    is fused. Anything else is left as it was (the main graph is rewritten; subgraphs
    and local functions are not); ``model`` itself is not modified.

    The outputs are unchanged within affine_warp's accuracy when the model runs on
    ``ReferenceEvaluator(fused, new_ops=ops())``: for float32/float64 the fused
    kernel computes the grid as AffineGrid does; for 16-bit data it skips the grid's
    rounding to 16 bits (as ``numba_ops.affine_warp``).
    """
    from onnx import ModelProto, helper

    if not isinstance(model, ModelProto):
        raise TypeError(f"model must be an onnx.ModelProto; got {type(model).__name__}")
    out = ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    nodes = list(graph.node)
    users = {}  # value name -> indices of the nodes that read it
    for i, node in enumerate(nodes):
        for name in node.input:
            users.setdefault(name, []).append(i)
    graph_outputs = {o.name for o in graph.output}
    nested = set()
    for node in nodes:
        _subgraph_names(node, nested)

    fused = {}  # index of a GridSample node -> its AffineWarp node
    dropped = set()  # indices of the fused AffineGrid nodes
    grids = set()
    for i, node in enumerate(nodes):
        if not _is_onnx(node, "AffineGrid") or len(node.input) < 2 or not node.output:
            continue
        grid = node.output[0]
        align = _attr(node, "align_corners", 0)
        readers = users.get(grid, [])
        if (not grid or grid in graph_outputs or grid in nested or not readers
                or not all(_is_onnx(nodes[u], "GridSample") and list(nodes[u].input) == [nodes[u].input[0], grid]
                           and nodes[u].input[0] != grid and _attr(nodes[u], "align_corners", 0) == align
                           for u in readers)):
            continue
        dropped.add(i)
        grids.add(grid)
        for u in readers:
            gs = nodes[u]
            fused[u] = helper.make_node(
                "AffineWarp", [gs.input[0], node.input[0], node.input[1]], list(gs.output),
                name=(gs.name or node.name or "affine_warp") + "/affine_warp", domain=DOMAIN,
                mode=_mode(_attr(gs, "mode", None)), padding_mode=_attr(gs, "padding_mode", "zeros"),
                align_corners=int(align))
    if not fused:
        return out
    _replace(graph.node, [fused.get(i, n) for i, n in enumerate(nodes) if i not in dropped])
    _replace(graph.value_info, [v for v in graph.value_info if v.name not in grids])
    if not any(o.domain == DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return out


def evaluator(model, device=None, new_ops=(), **kwargs):
    """``ReferenceEvaluator(model, new_ops=ops(device) + mmdeploy_ops(device))``, with
    the model's local functions also run on numba_ops' kernels (onnx evaluates function bodies
    without ``new_ops``). ``new_ops``: more operator classes, used before ours (an
    evaluator takes the first class of a name). ``kwargs`` go to every evaluator
    (``verbose``...)."""
    from onnx import ModelProto
    from onnx.reference import ReferenceEvaluator

    new = list(new_ops or ()) + ops(device) + mmdeploy_ops(device)
    if not isinstance(model, ModelProto) or not model.functions:
        return ReferenceEvaluator(model, new_ops=new, **kwargs)
    funcs = []
    for f in model.functions:  # in order: a function may call the ones before it
        funcs.append(ReferenceEvaluator(f, new_ops=new, functions=list(funcs), **kwargs))
    return ReferenceEvaluator(model.graph, opsets={d.domain: d.version for d in model.opset_import},
                              functions=funcs, new_ops=new, **kwargs)


def session(model, sess_options=None, *, providers=None, ops=None, fuse=False, **kwargs):
    """An ``onnxruntime.InferenceSession`` for ``model`` in which every DeformConv,
    AffineGrid and GridSample node (and MMDeploy's ``MMCVModulatedDeformConv2d``,
    ``grid_sampler`` and ``MMCVMultiScaleDeformableAttention``; numba_ops' AffineWarp and
    ``MMCVMultiScaleDeformableAttention``) runs on numba_ops' CPU kernels, compiled, on
    onnxruntime's own intra-op threads, and every other node on onnxruntime's kernels.

    Parameters
    ----------
    model : onnx.ModelProto, str, os.PathLike or bytes
        The model (a path is loaded with its external data). Never modified: the
        session runs a rewritten copy.
    sess_options : onnxruntime.SessionOptions, optional
        Used as given (default: new options), with numba_ops' custom-op library
        registered into it once. Config entries: ``numba_ops.capi`` "0" puts every
        node on the Python route (onnxruntime-extensions' Python operators, whose
        library is then registered too); ``numba_ops.num_threads``: numba's
        thread count in Python-route nodes (default 1, the calling thread; "0":
        numba's own count; more than one turns onnxruntime's intra-op spinning
        off, ``session.intra_op.allow_spinning`` "0", unless the options set it,
        since two spinning pools hold the cores that each other's next node needs).
    providers : sequence, optional
        onnxruntime's execution providers; default ``["CPUExecutionProvider"]``,
        the target. With another provider listed first (CUDA, ...) onnxruntime
        places the numba_ops nodes on the CPU all the same and copies their
        inputs and outputs across; they run on numba_ops' CPU kernels.
    ops : iterable of str, optional
        The op types taken (``"DeformConv"``, ``"AffineGrid"``, ``"GridSample"``,
        ``"AffineWarp"``, ``"MMCVMultiScaleDeformableAttention"``; MMDeploy's
        ``MMCVModulatedDeformConv2d`` and ``grid_sampler`` count as the first and the
        third); default all. The others run on onnxruntime.
    fuse : bool
        Run ``fuse(model)`` first, so that AffineGrid -> GridSample pairs run as
        one AffineWarp node (which only numba_ops runs).
    **kwargs
        Passed to ``onnxruntime.InferenceSession`` (``provider_options``, ...).

    Returns
    -------
    onnxruntime.InferenceSession
        The real one (``run``, ``get_inputs``, ``io_binding``, ...): a subclass whose
        ``run``, ``run_with_iobinding``, ``run_with_ort_values`` raise the error a
        numba_ops node met (the function's ValueError/TypeError), and whose
        ``numba_ops_nodes`` says how each node it took runs: per node the pair
        (op type, node name) with attributes ``op``, ``node``, ``route``
        ("compiled": compiled code on onnxruntime's threads; "python":
        onnxruntime-extensions' Python operator) and ``reason`` (why the Python
        route; "" otherwise).

    Raises
    ------
    ImportError
        Without onnxruntime and onnxruntime-extensions (``pip install 'numba_ops[onnxruntime]'``).
    ValueError, TypeError
        For a node numba_ops cannot run (an attribute, a dtype, a shape known in
        the model), as the function raises it, naming the node.

    Notes
    -----
    Every rank and dtype the functions take works, including those onnxruntime
    refuses (3-D DeformConv, bfloat16 nodes, 1-D GridSample). float16 and
    bfloat16 nodes run as Cast to float32, the float32 kernel, Cast back: the
    functions' 16-bit results exactly. Nodes are taken from the main graph;
    those inside subgraphs (If, Loop, Scan) and model-local functions run on
    onnxruntime. An error that only shows at run time (a dynamic shape that does
    not fit) raises from ``run``; the process and the session live on.
    Concurrent ``run`` calls compute in parallel.

    The compiled route needs a C compiler once (a seven-line library that
    onnxruntime loads, built into numba_ops' cache; ``numba-ops warm`` builds it).
    A node that cannot take it (no compiler, a DeformConv of more than 5 spatial
    axes) takes the Python route, and the session warns (``RuntimeWarning``)
    with the reason. There, a multi-scale deformable attention node's level shapes
    and starts (int64 inputs, read at every run: new values plan the node again)
    may hold 64 values in all (16 levels of 3-D shapes, 21 of 2-D ones).
    """
    try:
        from . import _ort
    except ImportError as exc:
        raise ImportError("numba_ops.onnx.session needs onnxruntime and onnxruntime-extensions: "
                          f"pip install 'numba_ops[onnxruntime]' ({exc})") from exc
    return _ort.session(model, sess_options, providers=providers, ops=ops, fuse=fuse, **kwargs)

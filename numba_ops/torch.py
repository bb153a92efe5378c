"""numba_ops' ops as PyTorch operators (extra ``torch``).

``affine_grid``, ``deform_conv``, ``grid_sample`` and ``affine_warp`` take and
return ``torch.Tensor``s, with the NumPy functions' arguments (less ``device`` and
``stream``: a call runs where its tensors are, on CUDA on torch's current stream).
They are ``torch.library`` custom operators (``torch.ops.numba_ops.<op>``) with
fake (meta) implementations and autograd formulas on numba_ops' backward kernels,
so they train, pass ``torch.autograd.gradcheck`` and trace under
``torch.compile(fullgraph=True)`` without a graph break. Eager calls on plain CPU
and CUDA tensors skip the dispatcher (``_call``): the same functions and autograd
formula, 20-50 µs less per call.

``DeformConv1d``, ``DeformConv2d`` and ``DeformConv3d`` are ``torch.nn.Module``s with
torchvision's ``DeformConv2d`` constructor and ``forward(input, offset, mask=None)``.

``ms_deform_attn`` (multi-scale deformable attention) is such an operator too, differentiable in
``value``, ``sampling_locations`` and ``attention_weights``; ``MSDeformAttn`` is Deformable
DETR's module of that name (constructor, parameters and ``forward``) on it.

``onnx_translations()`` is a ``custom_translation_table`` for
``torch.onnx.export(..., dynamo=True)``: the ops export as standard ONNX DeformConv,
AffineGrid and GridSample nodes (``affine_warp`` as ``numba_ops::AffineWarp``,
``ms_deform_attn`` as ``numba_ops::MMCVMultiScaleDeformableAttention``), which
``numba_ops.onnx.session`` runs.

Data is never copied on the way in or out: CPU tensors are read through
``Tensor.numpy()`` (bfloat16 as its bits, viewed as ``ml_dtypes.bfloat16``) and the
result comes back through ``torch.from_numpy``; CUDA tensors go to numba_ops through
``__cuda_array_interface__`` and the numba device array that comes back is wrapped
by ``torch.as_tensor``.

Not supported, each an error rather than a wrong answer: ``torch.func.vmap`` (and
``jacrev``, ``hessian``, which vmap) and forward-mode AD (``torch.func.jvp``,
``jacfwd``, ``torch.autograd.forward_ad``) raise NotImplementedError;
``torch.func.grad``/``vjp`` raise PyTorch's RuntimeError (custom operators' autograd
formulas are not functorch transforms); a double backward raises from ``backward()``
(the backward operators have no gradients of their own).

Examples
--------
>>> import torch
>>> import numba_ops.torch as nt
>>> x = torch.arange(4.0).reshape(1, 1, 2, 2).requires_grad_()
>>> theta = torch.tensor([[[0.0, -1.0, 0.0], [1.0, 0.0, 0.0]]])  # a quarter turn
>>> y = nt.affine_warp(x, theta)
>>> y.detach()[0, 0]
tensor([[1., 3.],
        [0., 2.]])
>>> y.sum().backward()
>>> x.grad[0, 0]
tensor([[1., 1.],
        [1., 1.]])
"""
import math
import operator

import numpy as np
import torch
import torch.autograd.forward_ad as _fwad

import numba_ops as _no
from ._validate import as_bool as _as_bool

__all__ = ["DeformConv1d", "DeformConv2d", "DeformConv3d", "MSDeformAttn", "affine_grid", "affine_warp",
           "deform_conv", "grid_sample", "ms_deform_attn", "onnx_translations"]

_TBF16 = torch.bfloat16
_I16 = np.int16
_from_numpy = torch.from_numpy
_as_tensor = torch.as_tensor


# --- tensors in, tensors out (no copies) -----------------------------------------------

# Importing this module loads neither numba nor ml_dtypes (whose extension alone took
# 0.7 s, more than the rest of the module): the kernels load on a call's first use, and
# ml_dtypes' bfloat16 with the first bfloat16 tensor (``_bfloat16``). A NumPy array of a
# "V" kind among numba_ops' results is bfloat16 (ml_dtypes' types are NumPy void types).

def _bfloat16():
    from .kernels._dtypes import bfloat16
    return bfloat16()


def _np(t):
    """A CPU tensor as the NumPy array over its memory (bfloat16: its bits, viewed);
    detached only where it requires grad (a detach costs a new tensor, ~0.6 us)."""
    if t is None:
        return None
    if t.requires_grad:
        t = t.detach()
    if t.dtype is _TBF16:
        return t.view(torch.int16).numpy().view(_bfloat16())
    return t.numpy()


def _tensor(a):
    """A NumPy result as a tensor over its memory. The fake implementations promise
    contiguous results (``torch.compile`` checks the strides): one that is not (a
    16-bit gradient cast from a strided view) is copied once."""
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    if a.dtype.kind == "V":  # bfloat16
        return _from_numpy(a.view(_I16)).view(_TBF16)
    return _from_numpy(a)


def _cuda_tensor(a, device):
    """A numba device array (the result of a call on CUDA tensors) as a CUDA tensor
    over its memory (torch reads ``__cuda_array_interface__``; it keeps ``a`` alive)."""
    if a.dtype.kind == "V":  # bfloat16, exported as an untyped "<V2": go through the bits
        t = _as_tensor(a.view(_I16), device=device).view(_TBF16)
    else:
        t = _as_tensor(a, device=device)
    return t.contiguous()  # as the fake implementations promise (a no-op for contiguous results)


def _detached(t):
    # CUDA tensors that require grad refuse __cuda_array_interface__
    return None if t is None else t.detach()


def _on_cuda(fn, device, tensors, kwargs, n_out=1):
    """``fn(*tensors, **kwargs)`` on the GPU of ``device``, on torch's current stream
    there, its device array results as CUDA tensors (None stays None)."""
    for t in tensors:
        if t is not None and t.device != device:
            raise ValueError(f"numba_ops.torch: all tensors must be on one device; got {device} and {t.device}")
    from numba import cuda
    stream = torch.cuda.current_stream(device)
    args = [_detached(t) for t in tensors]
    index = device.index if device.index is not None else torch.cuda.current_device()
    with cuda.gpus[index]:  # numba's context on the tensors' GPU (torch and numba share the primary context)
        out = fn(*args, stream=stream, **kwargs)
    if n_out == 1:
        return _cuda_tensor(out, device)
    return tuple(None if o is None else _cuda_tensor(o, device) for o in out)


def _one_device(**tensors):
    """A ValueError naming both devices unless the tensors (by name; None: absent) are
    on one device. Every op checks in its kernel and in its fake implementation: a
    call that mixes in a meta tensor dispatches to the latter."""
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first = name, t.device
        elif t.device != first[1]:
            raise ValueError(f"numba_ops.torch: all tensors must be on one device; got {first[0]} on {first[1]} "
                             f"and {name} on {t.device}")


def _unsupported(device):
    return NotImplementedError(f"numba_ops.torch runs on CPU and CUDA tensors; got a tensor on {device}")


def _empty(like):
    """What a backward op returns for a gradient not asked for (an op returns Tensors, not None)."""
    return like.new_empty((0,))


def _or_empty(g, like):
    return _empty(like) if g is None else g


# --- the operators ------------------------------------------------------------------------

_LIB = "numba_ops"


def _op(name, schema):
    """The decorated function as the custom operator ``numba_ops::<name>``, with two
    attributes for ``_call``: ``overload`` (``torch.ops.numba_ops.<name>.default``) and
    ``plain``, the function itself."""
    def make(fn):
        op = torch.library.custom_op(f"{_LIB}::{name}", fn, mutates_args=(), schema=schema)
        op.overload, op.plain = getattr(getattr(torch.ops, _LIB), name).default, fn
        return op
    return make


def _differentiable(op, backward, setup_context):
    """Register ``op``'s autograd formula, and the same formula as the operator's
    ``function``: a ``torch.autograd.Function`` over its plain function, which
    ``_call`` applies in eager mode."""
    op.register_autograd(backward, setup_context=setup_context)
    plain = op.plain

    def forward(ctx, *args):  # the classic form: a separate setup_context costs an inspect.signature per call
        out = plain(*args)
        setup_context(ctx, args, out)
        return out

    op.function = type(plain.__name__, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward)})


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _eager(args):
    """Whether a call on ``args`` may bypass torch's dispatcher, and whether autograd
    records it: ``(eager, recording)``. Eager: no compiler, tracer, dispatch or function
    mode, functorch transform or tensor subclass in play, and every tensor a CPU or
    CUDA one (meta and fake tensors go to the fake implementation). (One loop over the
    arguments: two generator expressions cost 2-3 us of a call's ~30.)"""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active() or torch._C._has_torch_function(args)):
        return False, False
    grad = False
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN_TENSORS or not (a.is_cpu or a.is_cuda):
                return False, False
            grad = grad or a.requires_grad
    return True, grad and torch.is_grad_enabled()


def _call(op, *args):
    """``op(*args)`` (every argument positional, as the schema orders them). In eager
    mode on plain tensors (``_eager``), without the dispatcher's 30-50 us per call: the
    operator's function itself when no gradient is recorded, else its autograd
    ``function``, the formula the operator registers. Otherwise (``torch.compile``,
    export, fake or meta tensors, vmap, a backward operator under ``create_graph``)
    the operator, which those see and trace. The autograd formulas call the backward
    operators through here too."""
    eager, recording = _eager(args)
    if eager:
        if not recording:
            return op.plain(*args)
        if hasattr(op, "function"):
            return op.function.apply(*args)
    return op.overload(*args)


@_op("affine_grid", "(Tensor theta, SymInt[] size, bool align_corners=False) -> Tensor")
def _affine_grid(theta, size, align_corners=False):
    if theta.is_cpu:
        return _tensor(_no.affine_grid(_np(theta), size, align_corners))
    if theta.is_cuda:
        return _on_cuda(_no.affine_grid, theta.device, (theta,), {"size": list(size), "align_corners": align_corners})
    raise _unsupported(theta.device)


@_affine_grid.register_fake
def _(theta, size, align_corners=False):
    if len(size) not in (4, 5):
        raise ValueError(f"size must have 4 or 5 entries (N, C, [D,] H, W); got {list(size)}")
    nd = len(size) - 2
    return theta.new_empty((size[0], *size[2:], nd))


@_op("affine_grid_backward", "(Tensor grad_grid, SymInt[] size, bool align_corners) -> Tensor")
def _affine_grid_backward(grad_grid, size, align_corners):
    if grad_grid.is_cpu:
        return _tensor(_no.affine_grid_backward(_np(grad_grid), size, align_corners))
    if grad_grid.is_cuda:
        return _on_cuda(_no.affine_grid_backward, grad_grid.device, (grad_grid,),
                        {"size": list(size), "align_corners": align_corners})
    raise _unsupported(grad_grid.device)


@_affine_grid_backward.register_fake
def _(grad_grid, size, align_corners):
    nd = len(size) - 2
    return grad_grid.new_empty((size[0], nd, nd + 1))


def _affine_grid_setup(ctx, inputs, output):
    ctx.size, ctx.align = inputs[1], inputs[2]


def _affine_grid_bwd(ctx, grad):
    g = None
    if ctx.needs_input_grad[0]:
        g = _call(_affine_grid_backward, grad, ctx.size, ctx.align)
    return g, None, None


_differentiable(_affine_grid, _affine_grid_bwd, _affine_grid_setup)


_GS_ATTRS = "str mode='linear', str padding_mode='zeros', bool align_corners=False"


@_op("grid_sample", f"(Tensor x, Tensor grid, {_GS_ATTRS}) -> Tensor")
def _grid_sample(x, grid, mode="linear", padding_mode="zeros", align_corners=False):
    _one_device(x=x, grid=grid)
    if x.is_cpu:
        return _tensor(_no.grid_sample(_np(x), _np(grid), mode=mode, padding_mode=padding_mode,
                                       align_corners=align_corners))
    if x.is_cuda:
        return _on_cuda(_no.grid_sample, x.device, (x, grid),
                        {"mode": mode, "padding_mode": padding_mode, "align_corners": align_corners})
    raise _unsupported(x.device)


@_grid_sample.register_fake
def _(x, grid, mode="linear", padding_mode="zeros", align_corners=False):
    _one_device(x=x, grid=grid)
    if x.dim() < 3 or grid.dim() != x.dim():
        raise ValueError(f"grid must have shape (N, O1..Or, r) for X of shape (N, C, D1..Dr); "
                         f"got X {tuple(x.shape)} and grid {tuple(grid.shape)}")
    return x.new_empty((x.shape[0], x.shape[1], *grid.shape[1:-1]))


@_op("grid_sample_backward", "(Tensor grad_y, Tensor x, Tensor grid, str mode, str padding_mode, "
                             "bool align_corners, bool want_x, bool want_grid) -> (Tensor, Tensor)")
def _grid_sample_backward(grad_y, x, grid, mode, padding_mode, align_corners, want_x, want_grid):
    _one_device(grad_y=grad_y, x=x, grid=grid)
    wrt = ("x",) * want_x + ("grid",) * want_grid
    attrs = {"mode": mode, "padding_mode": padding_mode, "align_corners": align_corners, "wrt": wrt}
    if x.is_cpu:
        gx, gg = _no.grid_sample_backward(_np(grad_y), _np(x), _np(grid), **attrs)
        gx, gg = (None if g is None else _tensor(g) for g in (gx, gg))
    elif x.is_cuda:
        gx, gg = _on_cuda(_no.grid_sample_backward, x.device, (grad_y, x, grid), attrs, 2)
    else:
        raise _unsupported(x.device)
    return _or_empty(gx, x), _or_empty(gg, grid)


@_grid_sample_backward.register_fake
def _(grad_y, x, grid, mode, padding_mode, align_corners, want_x, want_grid):
    _one_device(grad_y=grad_y, x=x, grid=grid)
    return (x.new_empty(x.shape) if want_x else _empty(x)), (grid.new_empty(grid.shape) if want_grid else _empty(grid))


def _save_two(ctx, inputs, output):
    """setup_context of grid_sample and affine_warp: the two tensors saved, the attributes kept."""
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.attrs = inputs[2:]


def _inputs(ctx):
    """The op's inputs again, from ``_save_two``."""
    return (*ctx.saved_tensors, *ctx.attrs)


def _grid_sample_bwd(ctx, grad):
    x, grid, mode, padding_mode, align = _inputs(ctx)
    want_x, want_grid = ctx.needs_input_grad[:2]
    if not (want_x or want_grid):
        return None, None, None, None, None
    gx, gg = _call(_grid_sample_backward, grad, x, grid, mode, padding_mode, align, want_x, want_grid)
    return (gx if want_x else None), (gg if want_grid else None), None, None, None


_differentiable(_grid_sample, _grid_sample_bwd, _save_two)


@_op("affine_warp", f"(Tensor x, Tensor theta, SymInt[]? size=None, {_GS_ATTRS}) -> Tensor")
def _affine_warp(x, theta, size=None, mode="linear", padding_mode="zeros", align_corners=False):
    _one_device(x=x, theta=theta)
    if x.is_cpu:
        return _tensor(_no.affine_warp(_np(x), _np(theta), size, mode=mode, padding_mode=padding_mode,
                                       align_corners=align_corners))
    if x.is_cuda:
        return _on_cuda(_no.affine_warp, x.device, (x, theta),
                        {"size": None if size is None else list(size), "mode": mode, "padding_mode": padding_mode,
                         "align_corners": align_corners})
    raise _unsupported(x.device)


@_affine_warp.register_fake
def _(x, theta, size=None, mode="linear", padding_mode="zeros", align_corners=False):
    _one_device(x=x, theta=theta)
    if size is None:
        return x.new_empty(x.shape)
    if len(size) != x.dim():
        raise ValueError(f"size must have X's rank {x.dim()}; got {list(size)}")
    return x.new_empty(size)


@_op("affine_warp_backward", "(Tensor grad_y, Tensor x, Tensor theta, SymInt[]? size, str mode, str padding_mode, "
                             "bool align_corners, bool want_x, bool want_theta) -> (Tensor, Tensor)")
def _affine_warp_backward(grad_y, x, theta, size, mode, padding_mode, align_corners, want_x, want_theta):
    _one_device(grad_y=grad_y, x=x, theta=theta)
    wrt = ("x",) * want_x + ("theta",) * want_theta
    attrs = {"mode": mode, "padding_mode": padding_mode, "align_corners": align_corners, "wrt": wrt}
    if x.is_cpu:
        gx, gt = _no.affine_warp_backward(_np(grad_y), _np(x), _np(theta), size, **attrs)
        gx, gt = (None if g is None else _tensor(g) for g in (gx, gt))
    elif x.is_cuda:
        attrs["size"] = None if size is None else list(size)
        gx, gt = _on_cuda(_no.affine_warp_backward, x.device, (grad_y, x, theta), attrs, 2)
    else:
        raise _unsupported(x.device)
    return _or_empty(gx, x), _or_empty(gt, theta)


@_affine_warp_backward.register_fake
def _(grad_y, x, theta, size, mode, padding_mode, align_corners, want_x, want_theta):
    _one_device(grad_y=grad_y, x=x, theta=theta)
    return ((x.new_empty(x.shape) if want_x else _empty(x)),
            (theta.new_empty(theta.shape) if want_theta else _empty(theta)))


def _affine_warp_bwd(ctx, grad):
    x, theta, size, mode, padding_mode, align = _inputs(ctx)
    want_x, want_theta = ctx.needs_input_grad[:2]
    if not (want_x or want_theta):
        return (None,) * 6
    gx, gt = _call(_affine_warp_backward, grad, x, theta, size, mode, padding_mode, align, want_x, want_theta)
    return (gx if want_x else None), (gt if want_theta else None), None, None, None, None


_differentiable(_affine_warp, _affine_warp_bwd, _save_two)


_DC_ATTRS = ("SymInt[]? kernel_shape=None, SymInt[]? strides=None, SymInt[]? pads=None, SymInt[]? dilations=None, "
             "SymInt group=1, SymInt offset_group=1")


def _dc_attrs(kernel_shape, strides, pads, dilations, group, offset_group):
    return {"kernel_shape": kernel_shape, "strides": strides, "pads": pads, "dilations": dilations,
            "group": group, "offset_group": offset_group}


@_op("deform_conv", f"(Tensor x, Tensor w, Tensor offset, Tensor? b=None, Tensor? mask=None, {_DC_ATTRS}) -> Tensor")
def _deform_conv(x, w, offset, b=None, mask=None, kernel_shape=None, strides=None, pads=None, dilations=None,
                 group=1, offset_group=1):
    _one_device(x=x, w=w, offset=offset, b=b, mask=mask)
    if x.is_cpu:
        return _tensor(_no.deform_conv(_np(x), _np(w), _np(offset), _np(b), _np(mask), kernel_shape=kernel_shape,
                                       strides=strides, pads=pads, dilations=dilations, group=group,
                                       offset_group=offset_group))
    if x.is_cuda:
        attrs = _dc_attrs(*(None if v is None else list(v) for v in (kernel_shape, strides, pads, dilations)),
                          group, offset_group)
        return _on_cuda(_no.deform_conv, x.device, (x, w, offset, b, mask), attrs)
    raise _unsupported(x.device)


def _dc_out_shape(x, w, kernel_shape, strides, pads, dilations):
    nd = x.dim() - 2
    if nd < 1 or w.dim() != nd + 2:
        raise ValueError(f"X must have shape (N, C, D1..Dn) and W (oC, C/group, k1..kn); got X {tuple(x.shape)}, "
                         f"W {tuple(w.shape)}")
    k = list(w.shape[2:]) if kernel_shape is None else list(kernel_shape)
    s = [1] * nd if strides is None else list(strides)
    d = [1] * nd if dilations is None else list(dilations)
    p = [0] * (2 * nd) if pads is None else list(pads)
    if len(k) != nd or len(s) != nd or len(d) != nd or len(p) != 2 * nd:
        raise ValueError(f"kernel_shape, strides and dilations must have {nd} entries and pads {2 * nd}; got "
                         f"{k}, {s}, {d}, {p}")
    outs = [(x.shape[2 + i] + p[i] + p[nd + i] - ((k[i] - 1) * d[i] + 1)) // s[i] + 1 for i in range(nd)]
    return (x.shape[0], w.shape[0], *outs)


@_deform_conv.register_fake
def _(x, w, offset, b=None, mask=None, kernel_shape=None, strides=None, pads=None, dilations=None, group=1,
      offset_group=1):
    _one_device(x=x, w=w, offset=offset, b=b, mask=mask)
    return x.new_empty(_dc_out_shape(x, w, kernel_shape, strides, pads, dilations))


@_op("deform_conv_backward", "(Tensor grad_y, Tensor x, Tensor w, Tensor offset, Tensor? b, Tensor? mask, "
                             "SymInt[]? kernel_shape, SymInt[]? strides, SymInt[]? pads, SymInt[]? dilations, "
                             "SymInt group, SymInt offset_group, bool[] wants) -> "
                             "(Tensor, Tensor, Tensor, Tensor, Tensor)")
def _deform_conv_backward(grad_y, x, w, offset, b, mask, kernel_shape, strides, pads, dilations, group,
                          offset_group, wants):
    _one_device(grad_y=grad_y, x=x, w=w, offset=offset, b=b, mask=mask)
    wrt = [n for n, want in zip(("x", "w", "offset", "b", "mask"), wants) if want]
    inputs = (x, w, offset, b, mask)
    if x.is_cpu:
        grads = _no.deform_conv_backward(_np(grad_y), *(_np(t) for t in inputs), kernel_shape=kernel_shape,
                                         strides=strides, pads=pads, dilations=dilations, group=group,
                                         offset_group=offset_group, wrt=wrt)
        grads = [None if g is None else _tensor(g) for g in grads]
    elif x.is_cuda:
        attrs = _dc_attrs(*(None if v is None else list(v) for v in (kernel_shape, strides, pads, dilations)),
                          group, offset_group)
        attrs["wrt"] = wrt
        grads = _on_cuda(_no.deform_conv_backward, x.device, (grad_y,) + inputs, attrs, 5)
    else:
        raise _unsupported(x.device)
    return tuple(_or_empty(g, x) for g in grads)


@_deform_conv_backward.register_fake
def _(grad_y, x, w, offset, b, mask, kernel_shape, strides, pads, dilations, group, offset_group, wants):
    _one_device(grad_y=grad_y, x=x, w=w, offset=offset, b=b, mask=mask)
    return tuple(t.new_empty(t.shape) if want and t is not None else _empty(x)
                 for t, want in zip((x, w, offset, b, mask), wants))


def _deform_conv_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])  # None for an absent b or mask is saved as None
    ctx.attrs = inputs[5:]


def _deform_conv_bwd(ctx, grad):
    args = _inputs(ctx)
    # needs_input_grad covers the inputs passed: b and mask may be absent (defaults not passed)
    wants = [bool(v) for v in (*ctx.needs_input_grad, False, False)[:5]]
    if not any(wants):
        return (None,) * 11
    grads = _call(_deform_conv_backward, grad, *args, wants)
    return tuple(g if want else None for g, want in zip(grads, wants)) + (None,) * 6


_differentiable(_deform_conv, _deform_conv_bwd, _deform_conv_setup)


def _no_vmap(name):
    def rule(info, in_dims, *args, **kwargs):
        raise NotImplementedError(
            f"numba_ops::{name} has no batching rule: torch.func.vmap (and jacrev, jacfwd, hessian, which "
            "vmap) is not supported on numba_ops' operators; call them on the batch (every op takes a batch "
            "axis N) or loop in Python")
    return rule


for _name, _custom in (("affine_grid", _affine_grid), ("affine_grid_backward", _affine_grid_backward),
                       ("grid_sample", _grid_sample), ("grid_sample_backward", _grid_sample_backward),
                       ("affine_warp", _affine_warp), ("affine_warp_backward", _affine_warp_backward),
                       ("deform_conv", _deform_conv), ("deform_conv_backward", _deform_conv_backward)):
    _custom.register_vmap(_no_vmap(_name))
del _name, _custom



# --- the public functions (the NumPy functions' arguments) -------------------------------

def _refuse_forward_ad(*tensors):
    """Forward-mode AD would drop the tangents silently (the ops have no jvp formula):
    an error instead. Called only inside a dual level (``torch.func.jvp``, ``jacfwd``,
    ``torch.autograd.forward_ad.dual_level``)."""
    for t in tensors:
        if t is not None and _fwad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                "numba_ops.torch: forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) is not "
                "implemented for numba_ops' operators; use reverse mode (backward, torch.autograd.grad)")


#: PyTorch's and ONNX opset 16's names of GridSample's modes, as numba_ops names them
_MODE_ALIASES = {"bilinear": "linear", "bicubic": "cubic"}


def _mode(value):
    """``mode`` in numba_ops' names ("bilinear" -> "linear", "bicubic" -> "cubic"); any
    other value as it is (numba_ops says what is wrong with it)."""
    return _MODE_ALIASES.get(value, value) if isinstance(value, str) else value


def _align(value):
    return value if value is True or value is False else _as_bool(value, "align_corners")


def _ints(value, name):
    """An int sequence the op's schema takes: lists, tuples and torch.Size as they are;
    a tensor or NumPy array by its values."""
    if value is None or type(value) in (list, tuple) or isinstance(value, torch.Size):
        return value
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim != 1:
            raise ValueError(f"{name} must be a sequence or 1-D array of integers; got shape {tuple(value.shape)}")
        return [int(v) for v in value.tolist()]
    return list(value)


def affine_grid(theta, size, align_corners=False):
    """Sampling grid of a batch of affine transforms (ONNX AffineGrid), as
    :func:`numba_ops.affine_grid`: ``theta`` (N, 2, 3) or (N, 3, 4), ``size``
    (N, C, [D,] H, W); returns the grid (N, [D,] H, W, r). Differentiable in ``theta``.

    >>> import torch, numba_ops.torch as nt
    >>> nt.affine_grid(torch.eye(2, 3)[None], (1, 1, 1, 3), align_corners=True)[0, 0, :, 0]
    tensor([-1.,  0.,  1.])
    """
    if _fwad._current_level >= 0:
        _refuse_forward_ad(theta)
    return _call(_affine_grid, theta, _ints(size, "size"), _align(align_corners))


def grid_sample(x, grid, *, mode="linear", padding_mode="zeros", align_corners=False):
    """Sample ``x`` (N, C, D1..Dr), r = 1..3, at ``grid`` (N, O1..Or, r) (ONNX GridSample),
    as :func:`numba_ops.grid_sample`: ``mode`` "linear", "nearest" or "cubic" (or
    PyTorch's and ONNX opset 16's names "bilinear" and "bicubic"); ``padding_mode``
    "zeros", "border" or "reflection". Differentiable in ``x`` and ``grid``
    ("nearest": the grid's gradient is 0).

    >>> import torch, numba_ops.torch as nt
    >>> x = torch.tensor([[[[0.0, 1.0], [2.0, 3.0]]]])
    >>> nt.grid_sample(x, torch.zeros(1, 1, 1, 2))
    tensor([[[[1.5000]]]])
    """
    if _fwad._current_level >= 0:
        _refuse_forward_ad(x, grid)
    return _call(_grid_sample, x, grid, _mode(mode), padding_mode, _align(align_corners))


def affine_warp(x, theta, size=None, *, mode="linear", padding_mode="zeros", align_corners=False):
    """``grid_sample(x, affine_grid(theta, size))`` in one pass, as
    :func:`numba_ops.affine_warp`: ``x`` (N, C, [D,] H, W), ``theta`` (N, 2, 3) or
    (N, 3, 4), ``size`` default ``x.shape``; ``mode`` and ``padding_mode`` as
    :func:`grid_sample`'s. Differentiable in ``x`` and ``theta``.

    >>> import torch, numba_ops.torch as nt
    >>> x = torch.arange(4.0).reshape(1, 1, 2, 2)
    >>> nt.affine_warp(x, torch.tensor([[[-1.0, 0, 0], [0, 1, 0]]]))[0, 0]  # mirrored
    tensor([[1., 0.],
            [3., 2.]])
    """
    if _fwad._current_level >= 0:
        _refuse_forward_ad(x, theta)
    return _call(_affine_warp, x, theta, _ints(size, "size"), _mode(mode), padding_mode, _align(align_corners))


def deform_conv(x, w, offset, b=None, mask=None, *, kernel_shape=None, strides=None, pads=None, dilations=None,
                group=1, offset_group=1):
    """Deformable convolution, 1-D to N-D (ONNX DeformConv), as
    :func:`numba_ops.deform_conv`: ``pads`` in ONNX order (every begin, then every
    end). Differentiable in ``x``, ``w``, ``offset``, ``b`` and ``mask``.

    >>> import torch, numba_ops.torch as nt
    >>> x, w = torch.ones(1, 1, 3, 3), torch.ones(1, 1, 2, 2)
    >>> nt.deform_conv(x, w, torch.zeros(1, 8, 2, 2))[0, 0]
    tensor([[4., 4.],
            [4., 4.]])
    """
    if _fwad._current_level >= 0:
        _refuse_forward_ad(x, w, offset, b, mask)
    return _call(_deform_conv, x, w, offset, b, mask, _ints(kernel_shape, "kernel_shape"),
                 _ints(strides, "strides"), _ints(pads, "pads"), _ints(dilations, "dilations"), group, offset_group)


# --- modules ----------------------------------------------------------------------------

def _index(value):
    """``value`` as a Python int if it is an integer (int, NumPy integer, anything with
    ``__index__``) and no bool; else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _int(value, name):
    """An int argument of the modules (NumPy integers too, as torchvision takes them) as a Python int."""
    v = _index(value)
    if v is None:
        raise ValueError(f"{name} must be an int; got {value!r}")
    return v


def _tuple(value, n, name):
    """An int or a sequence of ``n`` ints (NumPy integers too) as a tuple of Python ints."""
    v = _index(value)
    if v is not None:
        return (v,) * n
    try:
        items = tuple(_index(v) for v in value)
    except TypeError:
        items = ()
    if len(items) != n or None in items:
        raise ValueError(f"{name} must be an int or a tuple of {n} ints; got {value!r}")
    return items


class _DeformConvNd(torch.nn.Module):
    _nd = 0

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True):
        super().__init__()
        nd = self._nd
        in_channels = _int(in_channels, "in_channels")
        out_channels = _int(out_channels, "out_channels")
        groups = _int(groups, "groups")
        if in_channels % groups != 0:
            raise ValueError("in_channels must be divisible by groups")
        if out_channels % groups != 0:
            raise ValueError("out_channels must be divisible by groups")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = _tuple(kernel_size, nd, "kernel_size")
        self.stride = _tuple(stride, nd, "stride")
        self.padding = _tuple(padding, nd, "padding")
        self.dilation = _tuple(dilation, nd, "dilation")
        self.groups = groups
        self.weight = torch.nn.Parameter(torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_channels))
        else:
            self.register_parameter("bias", None)
        self._K = math.prod(self.kernel_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torchvision's DeformConv2d initialisation: Kaiming-uniform weights
        (a = sqrt(5)), a bias uniform in +-1/sqrt(fan_in)."""
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = torch.nn.init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in)
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input, offset, mask=None):
        """``input`` (N, C, D1..Dn); ``offset`` (N, offset_groups * K * n, o1..on), channel
        ``(g * K + k) * n + axis``; ``mask`` (N, offset_groups * K, o1..on) or None. The
        offset groups are ``offset.shape[1] // (n * K)``, as torchvision infers them."""
        per_group = self._nd * self._K
        channels = offset.shape[1]
        if channels < per_group or channels % per_group:
            raise ValueError(f"offset must have a multiple of n*K = {self._nd}*{self._K} = {per_group} channels "
                             f"(offset_groups * K * n); got offset shape {tuple(offset.shape)}")
        if _fwad._current_level >= 0:
            _refuse_forward_ad(input, self.weight, offset, self.bias, mask)
        return _call(_deform_conv, input, self.weight, offset, self.bias, mask, self.kernel_size, self.stride,
                     [*self.padding, *self.padding], self.dilation, self.groups, channels // per_group)

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if any(self.padding):
            s += f", padding={self.padding}"
        if any(d != 1 for d in self.dilation):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        return s


class DeformConv1d(_DeformConvNd):
    """1-D deformable convolution (DCNv1/v2) on numba_ops' kernels: torchvision's
    ``DeformConv2d`` interface for (N, C, L) inputs; ``offset`` (N, og*K, oL),
    ``mask`` (N, og*K, oL).

    >>> import torch, numba_ops.torch as nt
    >>> layer = nt.DeformConv1d(2, 3, 3, padding=1)
    >>> layer(torch.randn(1, 2, 5), torch.zeros(1, 3, 5)).shape
    torch.Size([1, 3, 5])
    """
    _nd = 1


class DeformConv2d(_DeformConvNd):
    """2-D deformable convolution on numba_ops' kernels: torchvision's
    ``torchvision.ops.DeformConv2d`` (same constructor, parameters, initialisation,
    ``forward(input, offset, mask=None)`` and results).

    >>> import torch, numba_ops.torch as nt
    >>> layer = nt.DeformConv2d(2, 4, 3, padding=1)
    >>> layer(torch.randn(1, 2, 5, 5), torch.zeros(1, 18, 5, 5)).shape
    torch.Size([1, 4, 5, 5])
    """
    _nd = 2


class DeformConv3d(_DeformConvNd):
    """3-D deformable convolution on numba_ops' kernels: torchvision's ``DeformConv2d``
    interface for (N, C, D, H, W) inputs; ``offset`` (N, og*K*3, oD, oH, oW) with
    channel ``(g*K + k)*3 + axis`` (axis 0 = D), ``mask`` (N, og*K, oD, oH, oW).

    >>> import torch, numba_ops.torch as nt
    >>> layer = nt.DeformConv3d(2, 4, 3, padding=1)
    >>> layer(torch.randn(1, 2, 4, 4, 4), torch.zeros(1, 81, 4, 4, 4)).shape
    torch.Size([1, 4, 4, 4, 4])
    """
    _nd = 3


# --- multi-scale deformable attention (Deformable DETR) -----------------------------------

def _msda_devices(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """value, sampling_locations and attention_weights on one device; the two int tables
    there or on the CPU (they are read on the host: a few integers)."""
    for name, t in (("sampling_locations", sampling_locations), ("attention_weights", attention_weights)):
        if t.device != value.device:
            raise ValueError(f"numba_ops.torch: all tensors must be on one device; got value on {value.device} "
                             f"and {name} on {t.device}")
    for name, t in (("spatial_shapes", spatial_shapes), ("level_start_index", level_start_index)):
        if t.device != value.device and t.device.type != "cpu":
            raise ValueError(f"numba_ops.torch: {name} must be on the CPU or on value's device; got value on "
                             f"{value.device} and {name} on {t.device}")


def _host_table(t):
    """spatial_shapes / level_start_index as a host array (from a CUDA tensor: a copy,
    ordered on torch's current stream)."""
    return t.detach().cpu().numpy()


def _msda_on_cuda(fn, device, tensors, spatial_shapes, level_start_index, kwargs, n_out=1):
    """``fn(tensors[0], shapes, starts, *tensors[1:], ...)`` on CUDA (``_on_cuda``), the
    two tables on the host."""
    shapes, starts = _host_table(spatial_shapes), _host_table(level_start_index)
    lead = len(tensors) - 2  # (grad_out,) value before the tables; locations and weights after

    def call(*args, stream, **kw):
        return fn(*args[:lead], shapes, starts, *args[lead:], stream=stream, **kw)

    return _on_cuda(call, device, tensors, kwargs, n_out)


_MSDA_ARGS = ("Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_locations, "
              "Tensor attention_weights")


@_op("ms_deform_attn", f"({_MSDA_ARGS}) -> Tensor")
def _ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    _msda_devices(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    if value.is_cpu:
        return _tensor(_no.ms_deform_attn(_np(value), _np(spatial_shapes), _np(level_start_index),
                                          _np(sampling_locations), _np(attention_weights)))
    if value.is_cuda:
        return _msda_on_cuda(_no.ms_deform_attn, value.device, (value, sampling_locations, attention_weights),
                             spatial_shapes, level_start_index, {})
    raise _unsupported(value.device)


@_ms_deform_attn.register_fake
def _(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    _msda_devices(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    if value.dim() != 4 or sampling_locations.dim() != 6:
        raise ValueError(f"value must have shape (N, S, M, Dh) and sampling_locations (N, Lq, M, L, P, r); got "
                         f"value {tuple(value.shape)} and sampling_locations {tuple(sampling_locations.shape)}")
    return value.new_empty((value.shape[0], sampling_locations.shape[1], value.shape[2] * value.shape[3]))


#: the differentiable inputs of ms_deform_attn, by their index in its schema
_MSDA_WRT = ((0, "value"), (3, "sampling_locations"), (4, "attention_weights"))


@_op("ms_deform_attn_backward", f"(Tensor grad_out, {_MSDA_ARGS}, bool[] wants) -> (Tensor, Tensor, Tensor)")
def _ms_deform_attn_backward(grad_out, value, spatial_shapes, level_start_index, sampling_locations,
                             attention_weights, wants):
    _msda_devices(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    wrt = [name for (_, name), want in zip(_MSDA_WRT, wants) if want]
    like = (value, sampling_locations, attention_weights)
    if value.is_cpu:
        grads = _no.ms_deform_attn_backward(_np(grad_out), _np(value), _np(spatial_shapes), _np(level_start_index),
                                            _np(sampling_locations), _np(attention_weights), wrt=wrt)
        grads = [None if g is None else _tensor(g) for g in grads]
    elif value.is_cuda:
        grads = _msda_on_cuda(_no.ms_deform_attn_backward, value.device, (grad_out, *like), spatial_shapes,
                              level_start_index, {"wrt": wrt}, 3)
    else:
        raise _unsupported(value.device)
    return tuple(_or_empty(g, t) for g, t in zip(grads, like))


@_ms_deform_attn_backward.register_fake
def _(grad_out, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, wants):
    return tuple(t.new_empty(t.shape) if want else _empty(t)
                 for t, want in zip((value, sampling_locations, attention_weights), wants))


def _ms_deform_attn_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _ms_deform_attn_bwd(ctx, grad):
    wants = [bool(ctx.needs_input_grad[i]) for i, _ in _MSDA_WRT]
    if not any(wants):
        return (None,) * 5
    grads = _call(_ms_deform_attn_backward, grad, *ctx.saved_tensors, wants)
    gv, gl, ga = (g if want else None for g, want in zip(grads, wants))
    return gv, None, None, gl, ga


_differentiable(_ms_deform_attn, _ms_deform_attn_bwd, _ms_deform_attn_setup)
_ms_deform_attn.register_vmap(_no_vmap("ms_deform_attn"))
_ms_deform_attn_backward.register_vmap(_no_vmap("ms_deform_attn_backward"))


def _table(a):
    """spatial_shapes / level_start_index as a tensor: a tensor as it is; a list, tuple
    or NumPy array by its values."""
    return a if isinstance(a, torch.Tensor) else torch.as_tensor(a)


def ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """Multi-scale deformable attention, as :func:`numba_ops.ms_deform_attn` (mmcv's and
    Deformable DETR's ``multi_scale_deformable_attn_pytorch``): ``value`` (N, S, M, Dh),
    ``spatial_shapes`` int (L, 2) or (L, 3), ``level_start_index`` int (L,),
    ``sampling_locations`` (N, Lq, M, L, P, r) in [0, 1], ``attention_weights``
    (N, Lq, M, L, P); returns (N, Lq, M * Dh). Differentiable in ``value``,
    ``sampling_locations`` and ``attention_weights``. The int tables may be tensors
    (on the CPU or on value's device), lists or arrays.

    >>> import torch, numba_ops.torch as nt
    >>> value = torch.arange(4.0).reshape(1, 4, 1, 1)  # one 2x2 level, one head, one channel
    >>> loc = torch.full((1, 1, 1, 1, 1, 2), 0.5)      # its centre
    >>> nt.ms_deform_attn(value, [[2, 2]], [0], loc, torch.ones(1, 1, 1, 1, 1))
    tensor([[[1.5000]]])
    """
    if _fwad._current_level >= 0:
        _refuse_forward_ad(value, sampling_locations, attention_weights)
    return _call(_ms_deform_attn, value, _table(spatial_shapes), _table(level_start_index), sampling_locations,
                 attention_weights)


class MSDeformAttn(torch.nn.Module):
    """Deformable DETR's multi-scale deformable attention module on numba_ops' kernels:
    the constructor, parameters (names, shapes, initialisation) and ``forward`` of
    ``MSDeformAttn`` in Deformable DETR (``models/ops/modules/ms_deform_attn.py``), so
    its checkpoints' ``state_dict``\\ s load unchanged.

    Parameters
    ----------
    d_model : int, default 256
        The channels of queries, inputs and output; divisible by ``n_heads``.
    n_levels : int, default 4
        The feature levels.
    n_heads : int, default 8
        The attention heads (each has ``d_model // n_heads`` channels).
    n_points : int, default 4
        The sampling points per head and level.

    Attributes
    ----------
    sampling_offsets : torch.nn.Linear
        ``d_model -> n_heads * n_levels * n_points * 2``: each point's (x, y) offset.
        Weight 0; bias head h's direction (angle 2*pi*h/n_heads, scaled so its larger
        coordinate is +-1) times point index + 1, the same for every level.
    attention_weights : torch.nn.Linear
        ``d_model -> n_heads * n_levels * n_points``: the points' logits (softmax over
        levels and points per head). Weight and bias 0.
    value_proj, output_proj : torch.nn.Linear
        ``d_model -> d_model``: Xavier-uniform weights, bias 0.

    Examples
    --------
    >>> import torch, numba_ops.torch as nt
    >>> attn = nt.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=2)
    >>> shapes = torch.tensor([[4, 4], [2, 2]])
    >>> starts = torch.tensor([0, 16])
    >>> query, ref = torch.randn(1, 5, 32), torch.rand(1, 5, 2, 2)
    >>> attn(query, ref, torch.randn(1, 20, 32), shapes, starts).shape
    torch.Size([1, 5, 32])
    """

    def __init__(self, d_model=256, n_levels=4, n_heads=8, n_points=4):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model must be divisible by n_heads; got {d_model} and {n_heads}")
        #: Deformable DETR's CUDA batching knob, kept for code that reads it; no effect here
        self.im2col_step = 64
        self.d_model = d_model
        self.n_levels = n_levels
        self.n_heads = n_heads
        self.n_points = n_points
        self.sampling_offsets = torch.nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = torch.nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = torch.nn.Linear(d_model, d_model)
        self.output_proj = torch.nn.Linear(d_model, d_model)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """Deformable DETR's initialisation (see the class docstring)."""
        init = torch.nn.init
        M, L, P = self.n_heads, self.n_levels, self.n_points
        init.constant_(self.sampling_offsets.weight, 0.0)
        angles = torch.arange(M, dtype=torch.float32) * (2.0 * math.pi / M)
        directions = torch.stack([angles.cos(), angles.sin()], -1)
        directions = directions / directions.abs().max(-1, keepdim=True).values
        steps = torch.arange(1, P + 1, dtype=torch.float32).view(1, 1, P, 1)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_((directions.view(M, 1, 1, 2) * steps).expand(M, L, P, 2).reshape(-1))
        init.constant_(self.attention_weights.weight, 0.0)
        init.constant_(self.attention_weights.bias, 0.0)
        for linear in (self.value_proj, self.output_proj):
            init.xavier_uniform_(linear.weight)
            init.constant_(linear.bias, 0.0)

    def forward(self, query, reference_points, input_flatten, input_spatial_shapes, input_level_start_index,
                input_padding_mask=None):
        """``query`` (N, Lq, d_model); ``reference_points`` (N, Lq, n_levels, 2), points
        in [0, 1] ((0, 0) the top-left corner, (1, 1) the bottom-right), or (N, Lq,
        n_levels, 4), boxes (cx, cy, w, h); ``input_flatten`` (N, S, d_model), the
        levels' positions row-major, level after level; ``input_spatial_shapes`` int
        (n_levels, 2), each level's (H, W); ``input_level_start_index`` int (n_levels,);
        ``input_padding_mask`` bool (N, S), True where ``input_flatten`` is padding (its
        values count as 0), or None. Returns (N, Lq, d_model).

        A point is the reference point plus its offset divided by the level's (W, H);
        with boxes, the box centre plus offset / n_points * (w, h) / 2."""
        N, Lq, _ = query.shape
        S = input_flatten.shape[1]
        M, L, P = self.n_heads, self.n_levels, self.n_points
        value = self.value_proj(input_flatten)
        if input_padding_mask is not None:
            value = value.masked_fill(input_padding_mask[..., None], 0.0)
        value = value.view(N, S, M, self.d_model // M)
        offsets = self.sampling_offsets(query).view(N, Lq, M, L, P, 2)
        weights = self.attention_weights(query).view(N, Lq, M, L * P).softmax(-1).view(N, Lq, M, L, P)
        shapes = _table(input_spatial_shapes)
        ref = reference_points[:, :, None, :, None, :]
        if reference_points.shape[-1] == 2:
            normaliser = shapes.flip(-1).to(offsets)  # each level's (W, H)
            locations = ref + offsets / normaliser[None, None, None, :, None, :]
        elif reference_points.shape[-1] == 4:
            locations = ref[..., :2] + offsets / P * ref[..., 2:] * 0.5
        else:
            raise ValueError(f"reference_points must have 2 (x, y) or 4 (cx, cy, w, h) entries on its last axis; "
                             f"got shape {tuple(reference_points.shape)}")
        out = ms_deform_attn(value, shapes, input_level_start_index, locations, weights)
        return self.output_proj(out)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_levels={self.n_levels}, n_heads={self.n_heads}, n_points={self.n_points}"


# --- ONNX export -------------------------------------------------------------------------

def _affine_warp_schema():
    from onnx.defs import OpSchema
    floats = ["tensor(float16)", "tensor(bfloat16)", "tensor(float)", "tensor(double)"]
    return OpSchema(
        "AffineWarp", "numba_ops", 1,
        doc="GridSample(X, AffineGrid(theta, size)) in one pass (numba_ops.affine_warp).",
        inputs=[OpSchema.FormalParameter("X", "T1"), OpSchema.FormalParameter("theta", "T2"),
                OpSchema.FormalParameter("size", "tensor(int64)")],
        outputs=[OpSchema.FormalParameter("Y", "T1")],
        type_constraints=[("T1", floats + ["tensor(uint8)"], "X and Y"), ("T2", floats, "theta")],
        attributes=[OpSchema.Attribute("mode", OpSchema.AttrType.STRING, "linear, nearest or cubic"),
                    OpSchema.Attribute("padding_mode", OpSchema.AttrType.STRING, "zeros, border or reflection"),
                    OpSchema.Attribute("align_corners", OpSchema.AttrType.INT, "0 or 1")])


def _msda_schema():
    """The ``numba_ops::MMCVMultiScaleDeformableAttention`` node: MMDeploy's node of that
    name (inputs and their order; ``im2col_step`` optional, no effect) in numba_ops'
    domain, any level rank."""
    from onnx.defs import OpSchema
    floats = ["tensor(float16)", "tensor(bfloat16)", "tensor(float)", "tensor(double)"]
    return OpSchema(
        "MMCVMultiScaleDeformableAttention", "numba_ops", 1,
        doc="Multi-scale deformable attention (numba_ops.ms_deform_attn).",
        inputs=[OpSchema.FormalParameter("value", "T"),
                OpSchema.FormalParameter("value_spatial_shapes", "tensor(int64)"),
                OpSchema.FormalParameter("value_level_start_index", "tensor(int64)"),
                OpSchema.FormalParameter("sampling_locations", "T"),
                OpSchema.FormalParameter("attention_weights", "T")],
        outputs=[OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", floats, "value, sampling_locations, attention_weights and output")],
        attributes=[OpSchema.Attribute("im2col_step", OpSchema.AttrType.INT, "accepted, no effect", required=False)])

def onnx_translations():
    """The ``custom_translation_table`` that exports the ops with
    ``torch.onnx.export(model, args, dynamo=True, custom_translation_table=...)``.

    ``numba_ops::deform_conv`` becomes ONNX DeformConv (opset 19), ``grid_sample``
    GridSample (opset 20: modes "linear", "nearest", "cubic"), ``affine_grid``
    AffineGrid (opset 20), ``affine_warp`` a ``numba_ops::AffineWarp`` node (domain
    ``numba_ops``, opset 1), ``ms_deform_attn`` a
    ``numba_ops::MMCVMultiScaleDeformableAttention`` node (inputs value,
    value_spatial_shapes, value_level_start_index, sampling_locations,
    attention_weights: MMDeploy's node of that name, in domain ``numba_ops``). Export
    at ``opset_version`` 20 or later (20 is torch's default). ``numba_ops.onnx.session`` runs the model, every rank
    included; onnxruntime alone runs the 2-D DeformConv, GridSample and AffineGrid.

    Needs onnxscript (which ``torch.onnx``'s dynamo exporter needs too).

    Returns
    -------
    dict
        ``{torch.ops.numba_ops.<op>.default: translation function}``.

    Examples
    --------
    >>> import torch, numba_ops.torch as nt
    >>> table = nt.onnx_translations()
    >>> torch.ops.numba_ops.deform_conv.default in table
    True
    """
    import onnxscript
    from onnxscript import opset20 as op
    from onnxscript.values import Op, Opset

    affine_warp_op = Op(Opset("numba_ops", 1), "AffineWarp", _affine_warp_schema())
    msda_op = Op(Opset("numba_ops", 1), "MMCVMultiScaleDeformableAttention", _msda_schema())

    def int64s(values):
        """A 1-D int64 value of ``values`` (Python ints, or symbolic sizes of a dynamic shape)."""
        values = list(values)
        if all(isinstance(v, int) for v in values):
            return op.Constant(value_ints=values)
        parts = [op.Constant(value_ints=[v]) if isinstance(v, int) else op.Reshape(op.Cast(v, to=7), [1])
                 for v in values]
        return op.Concat(*parts, axis=0)

    def deform_conv_onnx(x, w, offset, b=None, mask=None, kernel_shape=None, strides=None, pads=None,
                         dilations=None, group=1, offset_group=1):
        attrs = {"group": int(group), "offset_group": int(offset_group)}
        for name, value in (("kernel_shape", kernel_shape), ("strides", strides), ("pads", pads),
                            ("dilations", dilations)):
            if value is not None:
                attrs[name] = [int(v) for v in value]
        return op.DeformConv(x, w, offset, b, mask, **attrs)

    def grid_sample_onnx(x, grid, mode="linear", padding_mode="zeros", align_corners=False):
        return op.GridSample(x, grid, align_corners=int(align_corners), mode=mode, padding_mode=padding_mode)

    def affine_grid_onnx(theta, size, align_corners=False):
        return op.AffineGrid(theta, int64s(size), align_corners=int(align_corners))

    def affine_warp_onnx(x, theta, size=None, mode="linear", padding_mode="zeros", align_corners=False):
        size = op.Shape(x) if size is None else int64s(size)
        return affine_warp_op(x, theta, size, mode=mode, padding_mode=padding_mode, align_corners=int(align_corners))

    def ms_deform_attn_onnx(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return msda_op(value, op.Cast(spatial_shapes, to=7), op.Cast(level_start_index, to=7), sampling_locations,
                       attention_weights)

    del onnxscript
    return {_deform_conv.overload: deform_conv_onnx, _grid_sample.overload: grid_sample_onnx,
            _affine_grid.overload: affine_grid_onnx, _affine_warp.overload: affine_warp_onnx,
            _ms_deform_attn.overload: ms_deform_attn_onnx}

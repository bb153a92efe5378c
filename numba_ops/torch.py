"""numba_ops' ops as PyTorch operators (extra ``torch``).

``affine_grid``, ``deform_conv``, ``grid_sample`` and ``affine_warp`` take and
return ``torch.Tensor``s, with the NumPy functions' arguments (less ``device`` and
``stream``: a call runs where its tensors are, on CUDA on torch's current stream).
They are ``torch.library`` custom operators (``torch.ops.numba_ops.<op>``) with
fake (meta) implementations and autograd formulas on numba_ops' backward kernels,
so they train, pass ``torch.autograd.gradcheck`` and trace under
``torch.compile(fullgraph=True)`` without a graph break.

``DeformConv1d``, ``DeformConv2d`` and ``DeformConv3d`` are ``torch.nn.Module``s with
torchvision's ``DeformConv2d`` constructor and ``forward(input, offset, mask=None)``.

``onnx_translations()`` is a ``custom_translation_table`` for
``torch.onnx.export(..., dynamo=True)``: the ops export as standard ONNX DeformConv,
AffineGrid and GridSample nodes (``affine_warp`` as ``numba_ops::AffineWarp``), which
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

import ml_dtypes
import numpy as np
import torch
import torch.autograd.forward_ad as _fwad

import numba_ops as _no
from ._validate import as_bool as _as_bool

__all__ = ["DeformConv1d", "DeformConv2d", "DeformConv3d", "affine_grid", "affine_warp", "deform_conv",
           "grid_sample", "onnx_translations"]

_BF16 = ml_dtypes.bfloat16
_TBF16 = torch.bfloat16
_I16 = np.int16
_from_numpy = torch.from_numpy
_as_tensor = torch.as_tensor


# --- tensors in, tensors out (no copies) -----------------------------------------------

def _np(t):
    """A CPU tensor as the NumPy array over its memory (bfloat16: its bits, viewed)."""
    if t is None:
        return None
    if t.dtype is _TBF16:
        return t.detach().view(torch.int16).numpy().view(_BF16)
    return t.detach().numpy()


def _tensor(a):
    """A NumPy result as a tensor over its memory. The fake implementations promise
    contiguous results (``torch.compile`` checks the strides): one that is not (a
    16-bit gradient cast from a strided view) is copied once."""
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    if a.dtype.type is _BF16:
        return _from_numpy(a.view(_I16)).view(_TBF16)
    return _from_numpy(a)


def _cuda_tensor(a, device):
    """A numba device array (the result of a call on CUDA tensors) as a CUDA tensor
    over its memory (torch reads ``__cuda_array_interface__``; it keeps ``a`` alive)."""
    if a.dtype.type is _BF16:  # exported as an untyped "<V2": go through the bits
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
    return torch.library.custom_op(f"{_LIB}::{name}", mutates_args=(), schema=schema)


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
        g = _affine_grid_backward(grad, ctx.size, ctx.align)
    return g, None, None


_affine_grid.register_autograd(_affine_grid_bwd, setup_context=_affine_grid_setup)


_GS_ATTRS = "str mode='linear', str padding_mode='zeros', bool align_corners=False"


@_op("grid_sample", f"(Tensor x, Tensor grid, {_GS_ATTRS}) -> Tensor")
def _grid_sample(x, grid, mode="linear", padding_mode="zeros", align_corners=False):
    if x.is_cpu:
        return _tensor(_no.grid_sample(_np(x), _np(grid), mode=mode, padding_mode=padding_mode,
                                       align_corners=align_corners))
    if x.is_cuda:
        return _on_cuda(_no.grid_sample, x.device, (x, grid),
                        {"mode": mode, "padding_mode": padding_mode, "align_corners": align_corners})
    raise _unsupported(x.device)


@_grid_sample.register_fake
def _(x, grid, mode="linear", padding_mode="zeros", align_corners=False):
    if x.dim() < 3 or grid.dim() != x.dim():
        raise ValueError(f"grid must have shape (N, O1..Or, r) for X of shape (N, C, D1..Dr); "
                         f"got X {tuple(x.shape)} and grid {tuple(grid.shape)}")
    return x.new_empty((x.shape[0], x.shape[1], *grid.shape[1:-1]))


@_op("grid_sample_backward", "(Tensor grad_y, Tensor x, Tensor grid, str mode, str padding_mode, "
                             "bool align_corners, bool want_x, bool want_grid) -> (Tensor, Tensor)")
def _grid_sample_backward(grad_y, x, grid, mode, padding_mode, align_corners, want_x, want_grid):
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
    gx, gg = _grid_sample_backward(grad, x, grid, mode, padding_mode, align, want_x, want_grid)
    return (gx if want_x else None), (gg if want_grid else None), None, None, None


_grid_sample.register_autograd(_grid_sample_bwd, setup_context=_save_two)


@_op("affine_warp", f"(Tensor x, Tensor theta, SymInt[]? size=None, {_GS_ATTRS}) -> Tensor")
def _affine_warp(x, theta, size=None, mode="linear", padding_mode="zeros", align_corners=False):
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
    if size is None:
        return x.new_empty(x.shape)
    if len(size) != x.dim():
        raise ValueError(f"size must have X's rank {x.dim()}; got {list(size)}")
    return x.new_empty(size)


@_op("affine_warp_backward", "(Tensor grad_y, Tensor x, Tensor theta, SymInt[]? size, str mode, str padding_mode, "
                             "bool align_corners, bool want_x, bool want_theta) -> (Tensor, Tensor)")
def _affine_warp_backward(grad_y, x, theta, size, mode, padding_mode, align_corners, want_x, want_theta):
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
    return ((x.new_empty(x.shape) if want_x else _empty(x)),
            (theta.new_empty(theta.shape) if want_theta else _empty(theta)))


def _affine_warp_bwd(ctx, grad):
    x, theta, size, mode, padding_mode, align = _inputs(ctx)
    want_x, want_theta = ctx.needs_input_grad[:2]
    if not (want_x or want_theta):
        return (None,) * 6
    gx, gt = _affine_warp_backward(grad, x, theta, size, mode, padding_mode, align, want_x, want_theta)
    return (gx if want_x else None), (gt if want_theta else None), None, None, None, None


_affine_warp.register_autograd(_affine_warp_bwd, setup_context=_save_two)


_DC_ATTRS = ("SymInt[]? kernel_shape=None, SymInt[]? strides=None, SymInt[]? pads=None, SymInt[]? dilations=None, "
             "SymInt group=1, SymInt offset_group=1")


def _dc_attrs(kernel_shape, strides, pads, dilations, group, offset_group):
    return {"kernel_shape": kernel_shape, "strides": strides, "pads": pads, "dilations": dilations,
            "group": group, "offset_group": offset_group}


@_op("deform_conv", f"(Tensor x, Tensor w, Tensor offset, Tensor? b=None, Tensor? mask=None, {_DC_ATTRS}) -> Tensor")
def _deform_conv(x, w, offset, b=None, mask=None, kernel_shape=None, strides=None, pads=None, dilations=None,
                 group=1, offset_group=1):
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
    return x.new_empty(_dc_out_shape(x, w, kernel_shape, strides, pads, dilations))


@_op("deform_conv_backward", f"(Tensor grad_y, Tensor x, Tensor w, Tensor offset, Tensor? b, Tensor? mask, "
                             f"SymInt[]? kernel_shape, SymInt[]? strides, SymInt[]? pads, SymInt[]? dilations, "
                             f"SymInt group, SymInt offset_group, bool[] wants) -> "
                             f"(Tensor, Tensor, Tensor, Tensor, Tensor)")
def _deform_conv_backward(grad_y, x, w, offset, b, mask, kernel_shape, strides, pads, dilations, group,
                          offset_group, wants):
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
    grads = _deform_conv_backward(grad, *args, wants)
    return tuple(g if want else None for g, want in zip(grads, wants)) + (None,) * 6


_deform_conv.register_autograd(_deform_conv_bwd, setup_context=_deform_conv_setup)


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

_OPS = torch.ops.numba_ops
_AFFINE_GRID = _OPS.affine_grid.default
_GRID_SAMPLE = _OPS.grid_sample.default
_AFFINE_WARP = _OPS.affine_warp.default
_DEFORM_CONV = _OPS.deform_conv.default


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
    return _AFFINE_GRID(theta, _ints(size, "size"), _align(align_corners))


def grid_sample(x, grid, *, mode="linear", padding_mode="zeros", align_corners=False):
    """Sample ``x`` (N, C, D1..Dr), r = 1..3, at ``grid`` (N, O1..Or, r) (ONNX GridSample),
    as :func:`numba_ops.grid_sample`: ``mode`` "linear", "nearest" or "cubic";
    ``padding_mode`` "zeros", "border" or "reflection". Differentiable in ``x`` and
    ``grid`` ("nearest": the grid's gradient is 0).

    >>> import torch, numba_ops.torch as nt
    >>> x = torch.tensor([[[[0.0, 1.0], [2.0, 3.0]]]])
    >>> nt.grid_sample(x, torch.zeros(1, 1, 1, 2))
    tensor([[[[1.5000]]]])
    """
    if _fwad._current_level >= 0:
        _refuse_forward_ad(x, grid)
    return _GRID_SAMPLE(x, grid, mode, padding_mode, _align(align_corners))


def affine_warp(x, theta, size=None, *, mode="linear", padding_mode="zeros", align_corners=False):
    """``grid_sample(x, affine_grid(theta, size))`` in one pass, as
    :func:`numba_ops.affine_warp`: ``x`` (N, C, [D,] H, W), ``theta`` (N, 2, 3) or
    (N, 3, 4), ``size`` default ``x.shape``. Differentiable in ``x`` and ``theta``.

    >>> import torch, numba_ops.torch as nt
    >>> x = torch.arange(4.0).reshape(1, 1, 2, 2)
    >>> nt.affine_warp(x, torch.tensor([[[-1.0, 0, 0], [0, 1, 0]]]))[0, 0]  # mirrored
    tensor([[1., 0.],
            [3., 2.]])
    """
    if _fwad._current_level >= 0:
        _refuse_forward_ad(x, theta)
    return _AFFINE_WARP(x, theta, _ints(size, "size"), mode, padding_mode, _align(align_corners))


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
    return _DEFORM_CONV(x, w, offset, b, mask, _ints(kernel_shape, "kernel_shape"), _ints(strides, "strides"),
                        _ints(pads, "pads"), _ints(dilations, "dilations"), group, offset_group)


# --- modules ----------------------------------------------------------------------------

def _tuple(value, n, name):
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * n
    value = tuple(value)
    if len(value) != n or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name} must be an int or a tuple of {n} ints; got {value!r}")
    return value


class _DeformConvNd(torch.nn.Module):
    _nd = 0

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True):
        super().__init__()
        nd = self._nd
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
        return _DEFORM_CONV(input, self.weight, offset, self.bias, mask, self.kernel_size, self.stride,
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


def onnx_translations():
    """The ``custom_translation_table`` that exports the ops with
    ``torch.onnx.export(model, args, dynamo=True, custom_translation_table=...)``.

    ``numba_ops::deform_conv`` becomes ONNX DeformConv (opset 19), ``grid_sample``
    GridSample (opset 20: modes "linear", "nearest", "cubic"), ``affine_grid``
    AffineGrid (opset 20), ``affine_warp`` a ``numba_ops::AffineWarp`` node (domain
    ``numba_ops``, opset 1). Export at ``opset_version`` 20 or later (20 is
    torch's default). ``numba_ops.onnx.session`` runs the model, every rank
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

    del onnxscript
    return {_DEFORM_CONV: deform_conv_onnx, _GRID_SAMPLE: grid_sample_onnx, _AFFINE_GRID: affine_grid_onnx,
            _AFFINE_WARP: affine_warp_onnx}

"""DeformConv (ONNX opset 19/22): front end. Semantics: the ONNX DeformConv operator page."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from ._dispatch import as_array, launcher, on_device, resolve_device, result_for
from ._dtypes import common_float_dtype, np_dtype
from ._shapes import DeformParams, out_size
from ._validate import as_int, check_grad_y, int_tuple, parse_wrt, remember

if TYPE_CHECKING:
    from numpy.typing import ArrayLike


_PADDED_MAX = 1 << 60


def _axes(letter, nd):
    """How a message names n per-axis sizes: "k1" for one axis, "k1..k3" for three."""
    return f"{letter}1" if nd == 1 else f"{letter}1..{letter}{nd}"


def parse_params(x, w, kernel_shape, strides, pads, dilations, group, offset_group):
    """The checked, normalised attributes (``DeformParams``) of a call with inputs
    ``x`` and ``w`` (anything with ``ndim`` and ``shape``); ValueError naming the
    attribute or input otherwise. The Dask front end checks its calls with it too."""
    if x.ndim < 3:
        raise ValueError(f"X must have shape (N, C, D1, ..., Dn) with n >= 1 spatial dims; got {tuple(x.shape)}")
    nd = x.ndim - 2
    C = x.shape[1]
    if w.ndim != nd + 2:
        raise ValueError(f"W must have rank {nd + 2} (oC, C/group, {_axes('k', nd)}) for a rank-{x.ndim} X; "
                         f"got shape {tuple(w.shape)}")
    group = as_int(group, "group", minimum=1)
    offset_group = as_int(offset_group, "offset_group", minimum=1)
    oC = w.shape[0]
    if C % group:
        raise ValueError(f"group={group} must divide the input channels C={C}")
    if oC % group:
        raise ValueError(f"group={group} must divide the output channels oC={oC} (W.shape[0])")
    if w.shape[1] * group != C:
        raise ValueError(f"W.shape[1] must be C/group = {C}/{group} = {C // group}; got {w.shape[1]}")
    if C % offset_group:
        raise ValueError(f"offset_group={offset_group} must divide the input channels C={C}")
    wk = tuple(int(k) for k in w.shape[2:])
    if min(wk) < 1:
        raise ValueError(f"W must have kernel sizes W.shape[2:] >= 1; got shape {tuple(w.shape)}")
    if kernel_shape is None:
        kernel_shape = wk
    kernel_shape = int_tuple(kernel_shape, "kernel_shape", length=nd, minimum=1)
    if kernel_shape != wk:
        raise ValueError(f"kernel_shape must equal W.shape[2:] = {list(wk)}; got {list(kernel_shape)}")
    strides = int_tuple((1,) * nd if strides is None else strides, "strides", length=nd, minimum=1)
    dilations = int_tuple((1,) * nd if dilations is None else dilations, "dilations", length=nd, minimum=1)
    pads = int_tuple((0,) * (2 * nd) if pads is None else pads, "pads", length=2 * nd, minimum=0)
    begin, end = pads[:nd], pads[nd:]
    spatial = tuple(int(s) for s in x.shape[2:])
    if any(s + b + e >= _PADDED_MAX for s, b, e in zip(spatial, begin, end)):
        # positions are integers plus offsets in 64 bits (kernels/_scalar.py, border_corner)
        raise ValueError(f"pads must keep every padded axis D + begin + end under 2**60; got pads {list(pads)} "
                         f"for spatial size {list(spatial)}")
    outs = tuple(out_size(*a) for a in zip(spatial, begin, end, kernel_shape, dilations, strides))
    if any(o < 1 for o in outs):
        raise ValueError(
            f"output spatial size must be >= 1 on every axis; got {list(outs)} from input {list(spatial)}, "
            f"kernel_shape {list(kernel_shape)}, pads {list(pads)}, dilations {list(dilations)}, "
            f"strides {list(strides)}")
    # a stride along an axis with one output, or a dilation of a 1-long kernel axis, never
    # moves a sample: 1 then, so that any valid value (even past 64 bits) fits the kernels
    strides = tuple(s if o > 1 else 1 for s, o in zip(strides, outs))
    dilations = tuple(d if k > 1 else 1 for d, k in zip(dilations, kernel_shape))
    return DeformParams(kernel_shape, strides, begin, dilations, group, offset_group, outs)


def _check_shape(a, name, want, what):
    if a is not None and tuple(a.shape) != want:
        raise ValueError(f"{name} must have shape {what} = {want}; got {tuple(a.shape)}")


#: validated calls: (shapes, dtype, attributes) -> DeformParams. Only exact ndarrays
#: with one shared dtype and attributes that are None or lists/tuples of plain ints
#: are keyed, so a hit stands for a call that passed every check below.
_SEEN = {}


_NDARRAY = np.ndarray
_INT = int


def _fast_key(x, w, offset, b, mask, kernel_shape, strides, pads, dilations, group, offset_group):
    """The cache key of a plain NumPy call, or None when the call must take the full path.

    Exact ndarrays of one dtype object, ``int`` group/offset_group and attributes
    that are None or lists/tuples of exact ``int`` (bool and float are not): a
    float stride can never hit the entry of an integer one."""
    if type(x) is not _NDARRAY or type(w) is not _NDARRAY or type(offset) is not _NDARRAY:
        return None
    dt = x.dtype
    if w.dtype is not dt or offset.dtype is not dt:
        return None
    if b is not None and (type(b) is not _NDARRAY or b.dtype is not dt):
        return None
    if mask is not None and (type(mask) is not _NDARRAY or mask.dtype is not dt):
        return None
    if type(group) is not _INT or type(offset_group) is not _INT:
        return None
    key = [x.shape, w.shape, offset.shape, None if b is None else b.shape, None if mask is None else mask.shape,
           dt, group, offset_group]
    for v in (kernel_shape, strides, pads, dilations):
        if v is None:
            key.append(None)
            continue
        t = type(v)
        if t is not list and t is not tuple:
            return None
        for e in v:
            if type(e) is not _INT:
                return None
        key.append(tuple(v))
    return tuple(key)


def checked_params(x, w, offset, b, mask, kernel_shape=None, strides=None, pads=None, dilations=None, group=1,
                   offset_group=1):
    """The call's params (``parse_params``) after the checks of its inputs' dtypes and
    shapes (arrays, or anything with ``shape`` and ``dtype``; ``b`` and ``mask`` may be
    None); raises the errors ``deform_conv`` raises."""
    common_float_dtype({"X": x, "W": w, "offset": offset, "B": b, "mask": mask})
    p = parse_params(x, w, kernel_shape, strides, pads, dilations, group, offset_group)
    N, oC = x.shape[0], w.shape[0]
    og, K, nd = p.offset_group, p.K, p.nd
    _check_shape(offset, "offset", (N, og * K * nd) + p.out_spatial,
                 f"(N, offset_group*K*n, {_axes('o', nd)}) with K={K}, n={nd}")
    _check_shape(mask, "mask", (N, og * K) + p.out_spatial, f"(N, offset_group*K, {_axes('o', nd)}) with K={K}")
    _check_shape(b, "B", (oC,), "(oC,)")
    return p


def deform_conv(x: ArrayLike, w: ArrayLike, offset: ArrayLike, b: ArrayLike | None = None,
                mask: ArrayLike | None = None, *, kernel_shape: Sequence[int] | None = None,
                strides: Sequence[int] | None = None, pads: Sequence[int] | None = None,
                dilations: Sequence[int] | None = None, group: int = 1, offset_group: int = 1,
                device: str | None = None, stream: Any = None) -> Any:
    """Deformable convolution, as ONNX DeformConv, for 1-D, 2-D, 3-D (and more) inputs.

    Each kernel point of each output position samples ``x`` at its regular
    place moved by ``offset``: on axis ``i`` at
    ``o_i * strides[i] - pads[i] + k_i * dilations[i] + offset``, by n-linear
    interpolation where every corner outside the input counts 0. The samples,
    scaled by ``mask``, are convolved with ``w``:
    ``y[n, oc, o] = b[oc] + sum over c in oc's group and kernel points of
    w[oc, c, k] * mask * sample``. With zero offsets and no mask this is an
    ordinary (grouped) convolution.

    Parameters
    ----------
    x : array_like, shape (N, C, D1, ..., Dn)
        The input, n >= 1 spatial axes. float16, bfloat16, float32 or float64;
        every float input of the call has the same dtype.
    w : array_like, shape (oC, C / group, k1, ..., kn)
        The weights.
    offset : array_like, shape (N, offset_group * K * n, o1, ..., on)
        Offsets in input elements, ``K = k1 * ... * kn``. Channel
        ``(g * K + kidx) * n + i`` holds the offset along spatial axis ``i`` of
        kernel point ``kidx`` (row-major) for offset group ``g``.
    b : array_like, shape (oC,), optional
        Bias; default zeros.
    mask : array_like, shape (N, offset_group * K, o1, ..., on), optional
        Modulation of each sample (DCNv2), channel ``g * K + kidx``; default ones.
    kernel_shape : sequence of n int, optional
        Defaults to ``w.shape[2:]`` and must equal it.
    strides : sequence of n int >= 1, optional
        Default 1 on every axis.
    pads : sequence of 2n int >= 0, optional
        ONNX order: every axis' begin, then every axis' end
        (``[x1_begin, ..., xn_begin, x1_end, ..., xn_end]``); default 0.
    dilations : sequence of n int >= 1, optional
        Default 1 on every axis.
    group : int >= 1, default 1
        Divides C and oC.
    offset_group : int >= 1, default 1
        Divides C: channel groups that share one set of offsets and masks.
    device : {None, "cpu", "cuda"}, default None
        None runs on the GPU when an input is a CUDA array, else on the CPU.
    stream : optional
        The CUDA stream to run on (ignored on the CPU), as for
        :func:`affine_grid`: with device inputs the call returns without
        waiting; with NumPy inputs, after the copy back.

    Returns
    -------
    y : array, shape (N, oC, o1, ..., on)
        The inputs' dtype, with
        ``o_i = floor((D_i + begin_i + end_i - ((k_i - 1) * dil_i + 1)) / stride_i) + 1``.
        A NumPy array for NumPy inputs, a numba device array for CUDA inputs.
        N = 0 gives an empty result.

    Raises
    ------
    ValueError
        A missing ``x``, ``w`` or ``offset``; a wrong rank or shape (the
        message names the input and the shape expected); an attribute of the
        wrong length or value (``group`` or ``offset_group`` not dividing the
        channels, ``kernel_shape`` not ``w.shape[2:]``); an output size below
        1; an unknown ``device``.
    TypeError
        An input not of a supported float dtype, or inputs of mixed dtypes;
        non-integer attributes; a ``stream`` that is not a stream.
    RuntimeError
        ``device="cuda"`` (or a CUDA input) where no GPU is usable.

    Examples
    --------
    Zero offsets give an ordinary convolution:

    >>> import numpy as np
    >>> import numba_ops
    >>> x = np.ones((1, 1, 3, 3), np.float32)
    >>> w = np.ones((1, 1, 2, 2), np.float32)
    >>> offset = np.zeros((1, 2 * 2 * 2, 2, 2), np.float32)  # K = 4 points, n = 2 axes
    >>> numba_ops.deform_conv(x, w, offset)[0, 0]
    array([[4., 4.],
           [4., 4.]], dtype=float32)

    Moving every sample half an element left reads half of the zero padding
    at the left edge:

    >>> offset[:, 1::2] = -0.5  # odd channels: offsets along the width
    >>> numba_ops.deform_conv(x, w, offset)[0, 0]
    array([[3., 4.],
           [3., 4.]], dtype=float32)
    """
    if device is None or device == "cpu":
        # the fast path: a NumPy call whose shapes, dtype and attributes were validated before
        key = _fast_key(x, w, offset, b, mask, kernel_shape, strides, pads, dilations, group, offset_group)
        if key is not None:
            p = _SEEN.get(key)
            if p is not None:
                return launcher("deform_conv", "cpu", x.dtype)(x, w, offset, b, mask, p)
    else:
        key = None
    inputs = {"X": x, "W": w, "offset": offset, "B": b, "mask": mask}
    device = resolve_device(device, list(inputs.values()))
    back = any(on_device(a) for a in inputs.values())  # device inputs: a device result, wherever it ran
    for name in ("X", "W", "offset"):
        if inputs[name] is None:
            raise ValueError(f"{name} is required")
    arrays = [as_array(a, name, device) for name, a in inputs.items()]
    if any(a is not orig for a, orig in zip(arrays, inputs.values())):
        key = None  # converted (byte order, device copy): such calls never take the fast path
    x, w, offset, b, mask = arrays
    p = checked_params(x, w, offset, b, mask, kernel_shape, strides, pads, dilations, group, offset_group)
    if key is not None and device == "cpu":
        remember(_SEEN, key, p)
    if device == "cuda":
        y = launcher("deform_conv", device, x.dtype)(x, w, offset, b, mask, p, stream=stream)
    else:
        y = launcher("deform_conv", device, x.dtype)(x, w, offset, b, mask, p)
    return result_for(y, back)



def deform_conv_backward(grad_y: ArrayLike, x: ArrayLike, w: ArrayLike, offset: ArrayLike,
                         b: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                         kernel_shape: Sequence[int] | None = None, strides: Sequence[int] | None = None,
                         pads: Sequence[int] | None = None, dilations: Sequence[int] | None = None,
                         group: int = 1, offset_group: int = 1, wrt: Iterable[str] | None = None,
                         device: str | None = None, stream: Any = None) -> tuple:
    """The gradients of :func:`deform_conv` (its vector-Jacobian product), N-D.

    For ``y = deform_conv(x, w, offset, b, mask, ...)`` and the gradient ``grad_y``
    of a loss with respect to ``y``, returns the loss's gradients with respect to
    every input. The sampling's weights are differentiated from ``floor`` of the
    position (PyTorch's and torchvision's convention: the right-hand derivative at
    an integer position); a corner outside the input contributes nothing. A sample
    whose position is not finite gets NaN in its own ``offset`` and ``mask``
    gradients and adds nothing to the others.

    Parameters
    ----------
    grad_y : array_like, shape (N, oC, o1, ..., on)
        The forward result's shape and the inputs' dtype.
    x, w, offset, b, mask, kernel_shape, strides, pads, dilations, group, offset_group, device, stream
        As :func:`deform_conv`.
    wrt : iterable of {"x", "w", "offset", "b", "mask"}, optional
        The gradients to compute (default: every input given); the others are
        None and cost nothing (so do ``b``'s and ``mask``'s when they are None).

    Returns
    -------
    (grad_x, grad_w, grad_offset, grad_b, grad_mask) : tuple of arrays or None
        Each input's shape and dtype. On the CPU the result is the same bits on
        every call, whatever the number of threads (no atomics: every element of
        ``grad_x`` is summed by one thread in a fixed order); on CUDA, atomic adds
        may order the sums differently from call to call.

    Raises
    ------
    ValueError
        The forward's errors; ``grad_y`` missing or not of the result's shape; an
        unknown name in ``wrt``.
    TypeError
        The forward's errors; ``grad_y`` of another dtype.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_ops
    >>> x = np.arange(4, dtype=np.float32).reshape(1, 1, 4)
    >>> w = np.ones((1, 1, 1), np.float32)
    >>> offset = np.full((1, 1, 4), 0.5, np.float32)  # every sample half-way to the next
    >>> gx, gw, goff, gb, gm = numba_ops.deform_conv_backward(np.ones((1, 1, 4), np.float32), x, w, offset)
    >>> gx[0, 0], goff[0, 0]
    (array([0.5, 1. , 1. , 1. ], dtype=float32), array([ 1.,  1.,  1., -3.], dtype=float32))
    """
    if grad_y is None:
        raise ValueError("grad_y is required")
    inputs = {"X": x, "W": w, "offset": offset, "B": b, "mask": mask}
    device = resolve_device(device, list(inputs.values()) + [grad_y])
    back = any(on_device(a) for a in list(inputs.values()) + [grad_y])
    for name in ("X", "W", "offset"):
        if inputs[name] is None:
            raise ValueError(f"{name} is required")
    x, w, offset, b, mask = (as_array(a, name, device) for name, a in inputs.items())
    p = checked_params(x, w, offset, b, mask, kernel_shape, strides, pads, dilations, group, offset_group)
    want = parse_wrt(wrt, ("x", "w", "offset", "b", "mask"), (True, True, True, b is not None, mask is not None))
    grad_y = as_array(grad_y, "grad_y", device)
    check_grad_y(grad_y, (x.shape[0], w.shape[0]) + p.out_spatial, x.dtype)
    wants = tuple(want[n] for n in ("x", "w", "offset", "b", "mask"))
    grads = launcher("deform_conv_backward", device, x.dtype)(grad_y, x, w, offset, b, mask, p, wants,
                                                              stream=stream)  # (the CPU ignores stream)
    return tuple(result_for(g, back) for g in grads)


def warm_calls(dtype):
    """``(args, kwargs)`` of calls that compile every CPU kernel variant of
    deform_conv for float dtype name ``dtype`` (``numba_ops.warm`` makes them on
    each device): n = 1, 2, 3 spatial dims, each on the direct (tiny), serial
    (small) and parallel path, without and with B and mask. Sizes follow the
    CPU launcher's thresholds: 2 channels in and out, a kernel of 2 per axis."""
    from .kernels.cpu._deform_plan import DIRECT_MAX
    from .kernels.cpu._runtime import PARALLEL_MIN_WORK
    dt = np_dtype(dtype)
    C = oC = 2
    calls = []
    for nd in (1, 2, 3):
        K = 2 ** nd

        def side(test):
            o = 1
            while not test(o ** nd):
                o += 1
            return o

        direct = 1
        serial = side(lambda P: P * K * C * oC << nd > DIRECT_MAX)
        parallel = side(lambda P: P * K * (C + oC * C // 4 + 4) >= PARALLEL_MIN_WORK)
        for o in (direct, serial, parallel):
            x = np.zeros((1, C) + (o + 1,) * nd, dt)
            w = np.zeros((oC, C) + (2,) * nd, dt)
            off = np.zeros((1, K * nd) + (o,) * nd, dt)
            calls.append(((x, w, off), {}))
            calls.append(((x, w, off, np.zeros(oC, dt), np.ones((1, K) + (o,) * nd, dt)), {}))
    return calls


def warm_backward_calls(dtype):
    """``(args, kwargs)`` of ``deform_conv_backward`` calls that compile its CPU kernels
    for float dtype ``dtype``: n = 1, 2, 3 spatial dims (a compile-time constant
    there), each a tiny call (serial passes) and one past the pool's threshold
    (parallel), with a mask."""
    from .kernels.cpu._runtime import PARALLEL_MIN_WORK
    dt = np_dtype(dtype)
    calls = []
    for nd in (1, 2, 3):
        K = 2 ** nd
        for big in (False, True):
            o = 1
            while big and 2 * K * o ** nd < PARALLEL_MIN_WORK:  # C * K * positions: the passes' work
                o += 1
            x = np.zeros((1, 2) + (o + 1,) * nd, dt)
            w = np.zeros((2, 2) + (2,) * nd, dt)
            off = np.zeros((1, K * nd) + (o,) * nd, dt)
            mask = np.ones((1, K) + (o,) * nd, dt)
            calls.append(((np.zeros((1, 2) + (o,) * nd, dt), x, w, off, np.zeros(2, dt), mask), {}))
    return calls

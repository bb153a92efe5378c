"""Multi-scale deformable attention (Deformable DETR's MSDeformAttn sampling core):
front end. Semantics: mmcv's ``multi_scale_deformable_attn_pytorch``, i.e.
GridSample (linear, zeros, ``align_corners=False``) of every level at ``2 * loc - 1``,
weighted by the attention weights; the per-point math is kernels/_msda.py."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from ._dispatch import as_array, launcher, on_device, resolve_device, result_for
from ._dtypes import common_float_dtype, np_dtype
from ._validate import check_grad_y, parse_wrt, remember

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

#: the spatial ranks a level may have (2-D and 3-D pyramids; 1-D works alike)
RANKS = (1, 2, 3)
#: the names of the differentiable inputs, in the order the backward returns them
WRT = ("value", "sampling_locations", "attention_weights")


def _int_table(a, name, ndim):
    """``a`` (spatial_shapes or level_start_index) as a host int64 array of ``ndim``
    dimensions; a CUDA array is copied to the host (it is read to check the call)."""
    if a is None:
        raise ValueError(f"{name} is required")
    if on_device(a):
        from .kernels.cuda._device import as_device_array, to_host
        a = to_host(as_device_array(a, name))
    try:
        arr = np.asarray(a)
    except Exception as exc:
        raise ValueError(f"{name} must be an integer array; got a {type(a).__name__} ({exc})") from exc
    if arr.dtype == bool or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"{name} must hold integers; got dtype {arr.dtype}")
    if arr.ndim != ndim:
        want = "(L, r): one row of sizes per level" if ndim == 2 else "(L,): one start per level"
        raise ValueError(f"{name} must have shape {want}; got shape {arr.shape}")
    return arr.astype(np.int64)


#: validated plain NumPy CPU calls: the inputs' shapes and dtypes and the tables' values
#: -> (shapes, starts, dtype, output shape) as checked; a hit stands for a call that passed
#: every check below (a call of the Python API costs ~50 us on tiny inputs, most of it
#: these checks)
_SEEN = {}


def _fast_key(value, shapes, starts, loc, attn, device):
    """The cache key of a plain NumPy CPU call (see ``_SEEN``), or None."""
    if device not in (None, "cpu") or not all(type(a) is np.ndarray for a in (value, shapes, starts, loc, attn)):
        return None
    return (value.shape, value.dtype, loc.shape, loc.dtype, attn.shape, attn.dtype, shapes.shape, shapes.dtype,
            shapes.tobytes(), starts.shape, starts.dtype, starts.tobytes())


def checked_call(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, device,
                 extra=()):
    """The checked call: ``(device, device inputs?, value, shapes, starts, locations,
    weights, dtype, output shape)``; ``shapes`` and ``starts`` host int64 arrays.
    ``extra`` (name, array) pairs (grad_out) count for the device."""
    numpy_extra = all(type(a) is np.ndarray for _, a in extra)
    key = _fast_key(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                    device) if numpy_extra else None
    hit = _SEEN.get(key) if key is not None else None
    if hit is not None:
        shapes, starts, dtype, out_shape = hit
        return "cpu", False, value, shapes, starts, sampling_locations, attention_weights, dtype, out_shape
    checked = _checked_call(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, device,
                            extra)
    if key is not None:
        remember(_SEEN, key, (checked[3], checked[4], checked[7], checked[8]))
    return checked


def _checked_call(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, device, extra):
    arrays = {"value": value, "sampling_locations": sampling_locations, "attention_weights": attention_weights}
    for name, a in arrays.items():
        if a is None:
            raise ValueError(f"{name} is required")
    others = [a for _, a in extra]
    inputs = list(arrays.values()) + [spatial_shapes, level_start_index] + others
    device = resolve_device(device, inputs)
    back = any(on_device(a) for a in list(arrays.values()) + others)
    value, loc, attn = (as_array(a, name, device) for name, a in arrays.items())
    shapes = _int_table(spatial_shapes, "spatial_shapes", 2)
    starts = _int_table(level_start_index, "level_start_index", 1)
    dtype = common_float_dtype({"value": value, "sampling_locations": loc, "attention_weights": attn})

    L, r = shapes.shape
    if r not in RANKS:
        raise ValueError(f"spatial_shapes must have 2 (H, W) or 3 (D, H, W) columns; got shape {shapes.shape}")
    if shapes.size and shapes.min() < 1:
        raise ValueError(f"spatial_shapes must hold sizes >= 1; got {shapes.tolist()}")
    if starts.shape != (L,):
        raise ValueError(f"level_start_index must have one entry per level, shape ({L},); got {starts.shape}")
    sizes = np.prod(shapes, axis=1, dtype=np.int64) if L else np.zeros(0, np.int64)
    expect = np.concatenate(([0], np.cumsum(sizes)[:-1])) if L else sizes
    if not np.array_equal(starts, expect):
        raise ValueError(f"level_start_index must be the levels' starts in value, the cumulative sums of "
                         f"spatial_shapes' products {expect.tolist()}; got {starts.tolist()}")
    if value.ndim != 4:
        raise ValueError(f"value must have shape (N, S, M, Dh); got {tuple(value.shape)}")
    N, S, M, Dh = (int(s) for s in value.shape)
    if S != int(sizes.sum()):
        raise ValueError(f"value must have S = {int(sizes.sum())} positions (the levels' sizes summed) on "
                         f"axis 1; got shape {tuple(value.shape)}")
    lshape = tuple(int(s) for s in loc.shape)
    if loc.ndim != 6 or lshape[0] != N or lshape[2] != M or lshape[3] != L or lshape[5] != r:
        raise ValueError(f"sampling_locations must have shape (N, Lq, M, L, P, r) = ({N}, Lq, {M}, {L}, P, {r}); "
                         f"got {lshape}")
    if tuple(int(s) for s in attn.shape) != lshape[:5]:
        raise ValueError(f"attention_weights must have shape (N, Lq, M, L, P) = {lshape[:5]}; "
                         f"got {tuple(attn.shape)}")
    return device, back, value, shapes, starts, loc, attn, dtype, (N, lshape[1], M * Dh)


def ms_deform_attn(value: ArrayLike, spatial_shapes: ArrayLike, level_start_index: ArrayLike,
                   sampling_locations: ArrayLike, attention_weights: ArrayLike, *, device: str | None = None,
                   stream: Any = None) -> Any:
    """Multi-scale deformable attention: every query reads a few points from every
    level of a feature pyramid, weighted by attention (Deformable DETR's
    ``MSDeformAttn`` sampling core; also DINO's, Mask2Former's, RT-DETR's).

    ``out[n, q, m * Dh + d] = sum over l, p of attention_weights[n, q, m, l, p] *
    sample(level l of value, head m, channel d, at sampling_locations[n, q, m, l, p])``,
    where ``sample`` is :func:`grid_sample` (linear, zeros padding,
    ``align_corners=False``) at the grid value ``2 * loc - 1``: exactly mmcv's and
    Deformable DETR's ``multi_scale_deformable_attn_pytorch``, computed in one pass
    that never materialises the samples.

    Parameters
    ----------
    value : array_like, shape (N, S, M, Dh)
        M heads of Dh channels at the S positions of every level, each level's
        positions row-major, level after level. float16, bfloat16, float32 or float64.
    spatial_shapes : array_like of int, shape (L, r)
        Each level's sizes: (H, W) for 2-D levels (r = 2), (D, H, W) for 3-D ones.
    level_start_index : array_like of int, shape (L,)
        Where each level starts in S: the cumulative sums of the levels' sizes.
    sampling_locations : array_like, shape (N, Lq, M, L, P, r)
        Each query's points, normalised to [0, 1] (0 and 1 the outer edges of the
        level), coordinates innermost axis first (x, y[, z]). value's dtype.
    attention_weights : array_like, shape (N, Lq, M, L, P)
        The points' weights. value's dtype.
    device : {None, "cpu", "cuda"}, default None
        None runs on the GPU when an input is a CUDA array, else on the CPU.
    stream : optional
        The CUDA stream to run on (ignored on the CPU), as for :func:`affine_grid`.

    Returns
    -------
    out : array, shape (N, Lq, M * Dh)
        value's dtype (16-bit inputs computed in float32 and rounded once). A point
        whose location is not finite makes its head's channels NaN; a point far
        outside its level samples 0.

    Raises
    ------
    ValueError
        A missing input; shapes that do not fit together (named); a level size
        below 1; ``level_start_index`` other than the levels' starts; an unknown
        ``device``.
    TypeError
        A dtype not listed, float inputs of different dtypes, or non-integer
        ``spatial_shapes`` / ``level_start_index``.
    RuntimeError
        ``device="cuda"`` (or a CUDA input) where no GPU is usable.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_ops
    >>> value = np.arange(4, dtype=np.float32).reshape(1, 4, 1, 1)  # one 2x2 level
    >>> loc = np.full((1, 1, 1, 1, 1, 2), 0.5, np.float32)  # its centre
    >>> numba_ops.ms_deform_attn(value, [[2, 2]], [0], loc, np.ones((1, 1, 1, 1, 1), np.float32))
    array([[[1.5]]], dtype=float32)
    """
    device, back, value, shapes, starts, loc, attn, dtype, _ = checked_call(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, device)
    out = launcher("ms_deform_attn", device, dtype)(value, shapes, starts, loc, attn, stream=stream)
    return result_for(out, back)


def ms_deform_attn_backward(grad_out: ArrayLike, value: ArrayLike, spatial_shapes: ArrayLike,
                            level_start_index: ArrayLike, sampling_locations: ArrayLike,
                            attention_weights: ArrayLike, *, wrt: Iterable[str] | None = None,
                            device: str | None = None, stream: Any = None) -> tuple[Any, Any, Any]:
    """The gradients of :func:`ms_deform_attn` (its vector-Jacobian product).

    For ``out = ms_deform_attn(value, ...)`` and the gradient ``grad_out`` of a
    loss with respect to ``out``, returns the loss's gradients with respect to
    ``value``, ``sampling_locations`` and ``attention_weights``. The sampling's
    derivative is GridSample's (PyTorch's: from ``floor`` of the position, the
    right-hand one at an integer); a corner outside its level contributes nothing.
    A point whose location is not finite gets NaN for its own location and weight
    gradients and adds nothing to ``value``'s.

    Parameters
    ----------
    grad_out : array_like, shape (N, Lq, M * Dh)
        The forward result's shape and the inputs' dtype.
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights, device, stream
        As :func:`ms_deform_attn`.
    wrt : iterable of {"value", "sampling_locations", "attention_weights"}, optional
        The gradients to compute (default all three); the others are None and cost nothing.

    Returns
    -------
    (grad_value, grad_sampling_locations, grad_attention_weights) : tuple of arrays or None
        The inputs' shapes and dtype. On the CPU each is the same bits on every
        call, whatever the number of threads (every element is summed by one
        thread in a fixed order); on CUDA, atomic adds may order ``grad_value``'s
        sums differently from call to call.

    Raises
    ------
    ValueError
        The forward's errors; ``grad_out`` missing or not of the result's shape; an
        unknown name in ``wrt``.
    TypeError
        The forward's errors; ``grad_out`` of another dtype.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_ops
    >>> value = np.arange(4, dtype=np.float32).reshape(1, 4, 1, 1)
    >>> loc = np.full((1, 1, 1, 1, 1, 2), 0.5, np.float32)
    >>> attn = np.ones((1, 1, 1, 1, 1), np.float32)
    >>> gv, gl, ga = numba_ops.ms_deform_attn_backward(np.ones((1, 1, 1), np.float32), value, [[2, 2]], [0],
    ...                                                loc, attn)
    >>> gv.ravel(), gl.ravel(), ga.ravel()
    (array([0.25, 0.25, 0.25, 0.25], dtype=float32), array([2., 4.], dtype=float32), array([1.5], dtype=float32))
    """
    if grad_out is None:
        raise ValueError("grad_out is required")
    device, back, value, shapes, starts, loc, attn, dtype, out_shape = checked_call(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, device,
        (("grad_out", grad_out),))
    want = parse_wrt(wrt, WRT, (True, True, True))
    grad_out = as_array(grad_out, "grad_out", device)
    check_grad_y(grad_out, out_shape, dtype, "grad_out")
    grads = launcher("ms_deform_attn_backward", device, dtype)(grad_out, value, shapes, starts, loc, attn,
                                                               want["value"], want["sampling_locations"],
                                                               want["attention_weights"], stream=stream)
    return tuple(result_for(g, back) for g in grads)


def warm_calls(dtype):
    """``(args, kwargs)`` of tiny CPU calls of ``ms_deform_attn`` that compile its kernels
    for the dtype named ``dtype``: the serial and the parallel path (the rank is a
    run-time value: one compiled kernel serves 2-D and 3-D levels)."""
    return [(args, {}) for args in _warm_inputs(dtype)]


def warm_backward_calls(dtype):
    """``(args, kwargs)`` of ``ms_deform_attn_backward`` calls that compile its CPU kernels."""
    calls = []
    for value, shapes, starts, loc, attn in _warm_inputs(dtype):
        gy = np.zeros((loc.shape[0], loc.shape[1], value.shape[2] * value.shape[3]), value.dtype)
        calls.append(((gy, value, shapes, starts, loc, attn), {}))
    return calls


def _warm_inputs(dtype):
    from .kernels.cpu._runtime import PARALLEL_MIN_WORK
    dt = np_dtype(dtype)
    shapes = np.array([[2, 2]], np.int64)
    starts = np.zeros(1, np.int64)
    value = np.zeros((1, 4, 1, 8), dt)
    out = []
    for lq in (1, PARALLEL_MIN_WORK // 16 + 1):  # serial; past the pool's threshold (8 channels x 2 corners^2 ...)
        loc = np.full((1, lq, 1, 1, 1, 2), 0.5, dt)
        out.append((value, shapes, starts, loc, np.ones((1, lq, 1, 1, 1), dt)))
    return out

"""GridSample (ONNX opset 20/22): front end. Semantics: the ONNX GridSample
operator page, with onnxruntime's choices where implementations differ (see
``grid_sample``); the per-axis math is kernels/_sample.py."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from ._dispatch import as_array, launcher, on_device, resolve_device, result_for
from ._dtypes import SUPPORTED, common_float_dtype, entry, np_dtype
from ._validate import as_bool, check_grad_y, parse_wrt
from .kernels._modes import MODES, PADDING_MODES

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

#: the most spatial axes the kernels take (1 to 3 are supported)
MAX_SPATIAL = 3


def _choice(value, name, allowed):
    """The kernels' code of the string attribute ``value``, else a ValueError naming it."""
    code = allowed.get(value) if isinstance(value, str) else None
    if code is None:
        raise ValueError(f"{name} must be one of {', '.join(repr(k) for k in allowed)}; got {value!r}")
    return code


def parse_attrs(mode, padding_mode, align_corners):
    """``(mode, padding, align)`` as the kernels take them (``_sample`` codes, a bool)."""
    return (_choice(mode, "mode", MODES), _choice(padding_mode, "padding_mode", PADDING_MODES),
            as_bool(align_corners, "align_corners"))


def sample_dtypes(x, other, other_name):
    """The float dtype of ``other`` (grid or theta), checking that ``x`` shares it or
    is uint8 (grid_sample's dtypes); TypeError naming the input otherwise."""
    if np.dtype(x.dtype) == np.uint8:
        dtype = common_float_dtype({other_name: other})
    elif entry(np.dtype(x.dtype)) is None:
        raise TypeError(f"X has dtype {np.dtype(x.dtype)}; expected uint8 or one of {SUPPORTED}")
    else:
        dtype = common_float_dtype({other_name: other, "X": x})
    return dtype


def check_x(x):
    """``r``, the number of spatial axes of ``X`` (N, C, D1..Dr), 1 <= r <= 3."""
    if x.ndim < 3 or x.ndim > MAX_SPATIAL + 2:
        raise ValueError(f"X must have shape (N, C, D1..Dr) with 1 <= r <= {MAX_SPATIAL} spatial axes; "
                         f"got shape {tuple(x.shape)}")
    return x.ndim - 2


def check_input_sizes(x, out_shape):
    """A non-empty output needs something to sample: every spatial size of ``X`` >= 1."""
    if 0 not in out_shape and 0 in x.shape[2:]:
        raise ValueError(f"X must have spatial sizes >= 1 to sample from (the output {tuple(out_shape)} "
                         f"is not empty); got shape {tuple(x.shape)}")


def grid_sample(x: ArrayLike, grid: ArrayLike, *, mode: str = "linear", padding_mode: str = "zeros",
                align_corners: bool | int = False, device: str | None = None, stream: Any = None) -> Any:
    """Sample ``x`` at the positions of ``grid``, as ONNX GridSample.

    Each output position ``y[n, :, o1, ..., or]`` is ``x[n]`` interpolated at
    ``grid[n, o1, ..., or]``, a position normalised to [-1, 1] on every axis.
    Where published implementations differ this follows onnxruntime:
    ``"nearest"`` rounds the unnormalised position half to even and then pads;
    ``"cubic"`` pads each of its taps (the position itself is not clamped).

    Parameters
    ----------
    x : array_like, shape (N, C, D1, ..., Dr), r = 1, 2 or 3
        float16, bfloat16, float32, float64, or uint8 (computed in the grid's
        compute type, then truncated toward zero and clamped to 0..255 as
        ONNX casts).
    grid : array_like, shape (N, O1, ..., Or, r)
        Positions, coordinates innermost axis first (x, y, z). ``x``'s dtype,
        or any float dtype for a uint8 ``x``.
    mode : {"linear", "nearest", "cubic"}, default "linear"
        n-linear; nearest (ties to the even index); n-cubic (A = -0.75, as
        ONNX and PyTorch), in every rank.
    padding_mode : {"zeros", "border", "reflection"}, default "zeros"
        What a tap outside the input reads: 0; the nearest edge element; the
        input reflected at its edges (repeatedly, until inside).
    align_corners : bool or {0, 1}, default False
        True: -1 and 1 are the centres of the corner elements; False: their
        outer edges.
    device : {None, "cpu", "cuda"}, default None
        None runs on the GPU when an input is a CUDA array, else on the CPU.
    stream : optional
        The CUDA stream to run on (ignored on the CPU), as for
        :func:`affine_grid`.

    Returns
    -------
    y : array, shape (N, C, O1, ..., Or)
        ``x``'s dtype. A position that is not finite samples NaN (0 for uint8
        ``x``). A NumPy array for NumPy inputs, a numba device array for CUDA
        inputs.

    Raises
    ------
    ValueError
        A missing input; ``x`` without 1 to 3 spatial axes; a ``grid`` whose
        shape does not fit ``x``; ``x`` with an empty spatial axis but a
        non-empty output; a ``mode`` or ``padding_mode`` not among the values
        listed; ``align_corners`` not a bool or 0/1; an unknown ``device``.
    TypeError
        A dtype not listed, or ``x`` and ``grid`` of different float dtypes;
        a ``stream`` that is not a stream.
    RuntimeError
        ``device="cuda"`` (or a CUDA input) where no GPU is usable.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_ops
    >>> x = np.array([[[[0, 1], [2, 3]]]], dtype=np.float32)  # (1, 1, 2, 2)
    >>> grid = np.array([[[[0, 0], [-0.5, -0.5]]]], dtype=np.float32)  # the centre, then pixel (0, 0)
    >>> numba_ops.grid_sample(x, grid)
    array([[[[1.5, 0. ]]]], dtype=float32)
    >>> far = np.array([[[[0.9, -0.5], [3.0, 0.5]]]], np.float32)  # the second beyond the right edge
    >>> numba_ops.grid_sample(x, far, padding_mode="border")  # clamped to the edge
    array([[[[1., 3.]]]], dtype=float32)
    """
    device, back, x, grid, dtype, (mode, padding, align), _ = checked_call(x, grid, mode, padding_mode, align_corners,
                                                                          device)
    if device == "cuda":
        y = launcher("grid_sample", "cuda", dtype)(x, grid, mode, padding, align, stream=stream)
    else:
        y = launcher("grid_sample", "cpu", dtype)(x, grid, mode, padding, align)
    return result_for(y, back)


def checked_call(x, grid, mode, padding_mode, align_corners, device, extra=()):
    """The checked call: ``(device, device inputs?, x, grid, dtype, (mode, padding,
    align), output shape)``; ``extra`` (name, array) pairs (grad_y) count for the device."""
    inputs = {"X": x, "grid": grid}
    for name, a in inputs.items():
        if a is None:
            raise ValueError(f"{name} is required")
    others = [a for _, a in extra]
    device = resolve_device(device, [x, grid] + others)
    back = any(on_device(a) for a in [x, grid] + others)  # device inputs: a device result, wherever it ran
    x, grid = (as_array(a, name, device) for name, a in inputs.items())
    dtype = sample_dtypes(x, grid, "grid")
    attrs = parse_attrs(mode, padding_mode, align_corners)
    r = check_x(x)
    if grid.ndim != r + 2 or tuple(grid.shape)[-1] != r:  # (a tuple: the simulator's shapes take no negative index)
        raise ValueError(f"grid must have shape (N, O1..O{r}, {r}) for a rank-{x.ndim} X; got {tuple(grid.shape)}")
    if grid.shape[0] != x.shape[0]:
        raise ValueError(f"grid must have X's batch size N = {x.shape[0]}; got grid shape {tuple(grid.shape)}")
    out_shape = tuple(x.shape[:2]) + tuple(grid.shape[1:-1])
    check_input_sizes(x, out_shape)
    return device, back, x, grid, dtype, attrs, out_shape


def grid_sample_backward(grad_y: ArrayLike, x: ArrayLike, grid: ArrayLike, *, mode: str = "linear",
                         padding_mode: str = "zeros", align_corners: bool | int = False,
                         wrt: Iterable[str] | None = None, device: str | None = None,
                         stream: Any = None) -> tuple[Any, Any]:
    """The gradients of :func:`grid_sample` (its vector-Jacobian product).

    For ``y = grid_sample(x, grid, ...)`` and the gradient ``grad_y`` of a loss
    with respect to ``y``, returns the loss's gradients with respect to ``x`` and
    ``grid``. Where the forward is not differentiable the derivative is PyTorch's:
    weights differentiated from ``floor`` of the position (the right-hand derivative
    at an integer), zero for ``"nearest"``, zero where ``border`` clamps and the
    sign flipped where ``reflection`` mirrors; a tap outside a zeros-padded input
    contributes nothing. In ``"linear"`` mode a coordinate exactly on the first or
    last index counts as clamped under ``border`` and ``reflection`` (zero
    gradient, as PyTorch's ``clip_coordinates_set_grad``: identity grids land
    exactly there). A grid position that is not finite gets NaN for its own
    gradient and adds nothing to ``grad_x``.

    Parameters
    ----------
    grad_y : array_like, shape (N, C, O1, ..., Or)
        The forward result's shape and the inputs' dtype.
    x, grid, mode, padding_mode, align_corners, device, stream
        As :func:`grid_sample`; ``x`` must be float (uint8 has no gradient).
    wrt : iterable of {"x", "grid"}, optional
        The gradients to compute (default both); the other is None and costs nothing.

    Returns
    -------
    (grad_x, grad_grid) : tuple of arrays or None
        ``x``'s and ``grid``'s shapes and dtype. On the CPU the result is the same
        bits on every call, whatever the number of threads; on CUDA, atomic adds
        may order the sums differently from call to call.

    Raises
    ------
    ValueError
        The forward's errors; ``grad_y`` missing or not of the result's shape; an
        unknown name in ``wrt``.
    TypeError
        The forward's errors; ``grad_y`` of another dtype; a uint8 ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_ops
    >>> x = np.array([[[[0, 1], [2, 3]]]], dtype=np.float32)
    >>> grid = np.zeros((1, 1, 1, 2), np.float32)  # the centre: the mean of the four
    >>> gx, gg = numba_ops.grid_sample_backward(np.ones((1, 1, 1, 1), np.float32), x, grid)
    >>> gx[0, 0]
    array([[0.25, 0.25],
           [0.25, 0.25]], dtype=float32)
    >>> gg[0, 0, 0]  # d y / d (gx, gy): 1 per element along x, 2 along y, times 2 / 2
    array([1., 2.], dtype=float32)
    """
    if grad_y is None:
        raise ValueError("grad_y is required")
    device, back, x, grid, dtype, (mode, padding, align), out_shape = checked_call(
        x, grid, mode, padding_mode, align_corners, device, (("grad_y", grad_y),))
    no_uint8(x)
    want = parse_wrt(wrt, ("x", "grid"), (True, True))
    grad_y = as_array(grad_y, "grad_y", device)
    check_grad_y(grad_y, out_shape, dtype)
    args = (grad_y, x, grid, mode, padding, align, want["x"], want["grid"])
    gx, gg = launcher("grid_sample_backward", device, dtype)(*args, stream=stream)  # (the CPU ignores stream)
    return result_for(gx, back), result_for(gg, back)


def no_uint8(x):
    """A backward call's ``x`` must be float: uint8 images have no gradient."""
    if np.dtype(x.dtype) == np.uint8:
        raise TypeError("X has dtype uint8, which has no gradient: the backward ops take float inputs "
                        "(float16, bfloat16, float32, float64)")


def warm_calls(dtype):
    """``(args, kwargs)`` of tiny CPU calls of ``grid_sample`` that together compile
    every kernel variant for the float dtype named ``dtype`` (the grid's; x of that
    dtype and uint8): each r = 1, 2, 3 and mode (each compiles its own kernels)
    with every padding mode (a run-time code: one compilation serves the three), on
    the serial and the parallel path."""
    from .kernels.cpu._runtime import PARALLEL_MIN_WORK
    dt = np_dtype(dtype)
    calls = []
    for r in (1, 2, 3):
        for big in (False, True):
            # parallel: more work (output elements x taps, at least 1 tap) than the pool's threshold
            n_out = PARALLEL_MIN_WORK + 1 if big else 1
            grid = np.zeros((1, n_out) + (1,) * (r - 1) + (r,), dt)
            for xdt in (dt, np.dtype(np.uint8)):
                x = np.zeros((1, 1) + (2,) * r, xdt)
                calls += every_mode((x, grid))
    return calls


def warm_backward_calls(dtype):
    """``(args, kwargs)`` of ``grid_sample_backward`` calls that compile its CPU kernels
    for float dtype ``dtype``: each r = 1, 2, 3 and mode (compile-time constants
    there) with every padding mode (a run-time code), a tiny call (serial) and one
    past the pool's threshold (parallel; one image large enough to be cut into tiles
    on several threads)."""
    from .kernels.cpu._runtime import PARALLEL_MIN_WORK
    from .kernels.cpu.grid_sample_backward import MIN_TILE
    dt = np_dtype(dtype)
    calls = []
    for r in (1, 2, 3):
        for n_out in (1, PARALLEL_MIN_WORK):
            x = np.zeros((1, 1) + ((2,) if n_out == 1 else (2 * MIN_TILE,)) * r, dt)
            grid = np.zeros((1, n_out) + (1,) * (r - 1) + (r,), dt)
            gy = np.zeros((1, 1, n_out) + (1,) * (r - 1), dt)
            calls += every_mode((gy, x, grid))
    return calls


def every_mode(args):
    """``(args, kwargs)`` for each mode x padding mode (each mode compiles its own
    kernels; each padding runs them once, which checks its paths)."""
    return [(args, {"mode": mode, "padding_mode": padding}) for mode in MODES for padding in PADDING_MODES]

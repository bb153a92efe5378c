"""affine_warp: GridSample of AffineGrid's grid in one pass that never builds the
grid. Front end; the kernels are kernels/*/affine_warp.py."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from ._dispatch import as_array, launcher, on_device, resolve_device, result_for
from ._dtypes import np_dtype
from ._validate import check_grad_y, int_tuple, parse_wrt
from .grid_sample import check_input_sizes, every_mode, no_uint8, parse_attrs, sample_dtypes

if TYPE_CHECKING:
    from numpy.typing import ArrayLike


def affine_warp(x: ArrayLike, theta: ArrayLike, size: Sequence[int] | ArrayLike | None = None, *,
                mode: str = "linear", padding_mode: str = "zeros", align_corners: bool | int = False,
                device: str | None = None, stream: Any = None) -> Any:
    """Warp ``x`` by affine transforms: ``grid_sample(x, affine_grid(theta, size,
    align_corners), ...)`` with the same ``align_corners``, in one pass that never
    builds the grid.

    Each output row's positions are computed from ``theta`` as
    :func:`affine_grid` computes them and sampled at once, so no grid is
    written to memory; float32 and float64 results equal the two-step result
    bit for bit on the CPU.

    Parameters
    ----------
    x : array_like, shape (N, C, H, W) or (N, C, D, H, W)
        float16, bfloat16, float32, float64, or uint8.
    theta : array_like, shape (N, 2, 3) for 2-D ``x``, (N, 3, 4) for 3-D
        The affine matrices, mapping output coordinates to input coordinates
        (both normalised to [-1, 1]). ``x``'s dtype, or any float dtype for a
        uint8 ``x``.
    size : sequence or 1-D array of int, optional
        The output size (N, C, [D,] H, W); N and C must be ``x``'s. Default
        ``x.shape``.
    mode : {"linear", "nearest", "cubic"}, default "linear"
        As :func:`grid_sample`.
    padding_mode : {"zeros", "border", "reflection"}, default "zeros"
        As :func:`grid_sample`.
    align_corners : bool or {0, 1}, default False
        Sets both the output's base coordinates (as :func:`affine_grid`) and
        how positions map to ``x`` (as :func:`grid_sample`).
    device : {None, "cpu", "cuda"}, default None
        None runs on the GPU when an input is a CUDA array, else on the CPU.
    stream : optional
        The CUDA stream to run on (ignored on the CPU), as for
        :func:`affine_grid`.

    Returns
    -------
    y : array of shape ``size``
        ``x``'s dtype. For float16 and bfloat16 the grid is never rounded to
        16 bits: the result is the float32 computation on the widened inputs,
        rounded once. A NumPy array for NumPy inputs, a numba device array for
        CUDA inputs.

    Raises
    ------
    ValueError
        A missing input; ``x`` neither 4-D nor 5-D; ``theta`` not (N, 2, 3) /
        (N, 3, 4) for ``x``; a ``size`` of the wrong length or without ``x``'s
        N and C; a ``mode``, ``padding_mode``, ``align_corners`` or
        ``device`` not among the values listed.
    TypeError
        A dtype not listed, or ``x`` and ``theta`` of different float dtypes;
        a non-integer ``size``; a ``stream`` that is not a stream.
    RuntimeError
        ``device="cuda"`` (or a CUDA input) where no GPU is usable.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_ops
    >>> x = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
    >>> identity = np.array([[[1, 0, 0], [0, 1, 0]]], np.float32)
    >>> np.array_equal(numba_ops.affine_warp(x, identity), x)
    True
    >>> flip = np.array([[[-1, 0, 0], [0, 1, 0]]], np.float32)  # mirror the width
    >>> numba_ops.affine_warp(x, flip)[0, 0]
    array([[ 3.,  2.,  1.,  0.],
           [ 7.,  6.,  5.,  4.],
           [11., 10.,  9.,  8.]], dtype=float32)
    """
    device, back, x, theta, dtype, (mode, padding, align), size = checked_call(
        x, theta, size, mode, padding_mode, align_corners, device)
    if device == "cuda":
        y = launcher("affine_warp", "cuda", dtype)(x, theta, size, mode, padding, align, stream=stream)
    else:
        y = launcher("affine_warp", "cpu", dtype)(x, theta, size, mode, padding, align)
    return result_for(y, back)


def checked_call(x, theta, size, mode, padding_mode, align_corners, device, extra=()):
    """The checked call: ``(device, device inputs?, x, theta, dtype, (mode, padding,
    align), size)``; ``extra`` (name, array) pairs (grad_y) count for the device."""
    inputs = {"X": x, "theta": theta}
    for name, a in inputs.items():
        if a is None:
            raise ValueError(f"{name} is required")
    others = [a for _, a in extra]
    device = resolve_device(device, [x, theta, size] + others)
    back = any(on_device(a) for a in [x, theta, size] + others)
    x, theta = (as_array(a, name, device) for name, a in inputs.items())
    dtype = sample_dtypes(x, theta, "theta")
    attrs = parse_attrs(mode, padding_mode, align_corners)
    if x.ndim not in (4, 5):
        raise ValueError(f"X must have shape (N, C, H, W) or (N, C, D, H, W); got {tuple(x.shape)}")
    r = x.ndim - 2
    if size is None:
        size = tuple(x.shape)
    else:
        if on_device(size):
            size = as_array(size, "size", "cpu")
        size = int_tuple(size, "size", length=r + 2, minimum=0)
        if size[:2] != tuple(x.shape[:2]):
            raise ValueError(f"size must have X's N and C {tuple(x.shape[:2])} in front; got {list(size)}")
    size = tuple(int(s) for s in size)
    want = (x.shape[0], r, r + 1)
    if tuple(theta.shape) != want:
        raise ValueError(f"theta must have shape (N, {r}, {r + 1}) = {want} for a {r}-D X of shape "
                         f"{tuple(x.shape)}; got {tuple(theta.shape)}")
    check_input_sizes(x, size)
    return device, back, x, theta, dtype, attrs, size


def affine_warp_backward(grad_y: ArrayLike, x: ArrayLike, theta: ArrayLike,
                         size: Sequence[int] | ArrayLike | None = None, *, mode: str = "linear",
                         padding_mode: str = "zeros", align_corners: bool | int = False,
                         wrt: Iterable[str] | None = None, device: str | None = None,
                         stream: Any = None) -> tuple[Any, Any]:
    """The gradients of :func:`affine_warp` with respect to ``x`` and ``theta``.

    Computed in one pass as the forward, without a grid: each position's gradient
    (as :func:`grid_sample_backward` gives it) goes straight into theta's, summed
    in float64. The derivative conventions are :func:`grid_sample_backward`'s.
    This is what an image registration optimises: ``theta``'s gradient of a
    similarity loss between ``affine_warp(moving, theta)`` and a fixed image.

    Parameters
    ----------
    grad_y : array_like, shape ``size``
        The forward result's shape and the inputs' dtype.
    x, theta, size, mode, padding_mode, align_corners, device, stream
        As :func:`affine_warp`; ``x`` must be float (uint8 has no gradient).
    wrt : iterable of {"x", "theta"}, optional
        The gradients to compute (default both); the other is None and costs nothing.

    Returns
    -------
    (grad_x, grad_theta) : tuple of arrays or None
        ``x``'s and ``theta``'s shapes and dtype; deterministic on the CPU.

    Raises
    ------
    ValueError, TypeError
        As :func:`grid_sample_backward`.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_ops
    >>> x = np.linspace(0, 1, 16, dtype=np.float32).reshape(1, 1, 4, 4)
    >>> theta = np.array([[[1, 0, 0], [0, 1, 0]]], np.float32)
    >>> y = numba_ops.affine_warp(x, theta)
    >>> gx, gt = numba_ops.affine_warp_backward(np.ones_like(y), x, theta, wrt=["theta"])
    >>> gx is None, gt.shape
    (True, (1, 2, 3))
    """
    if grad_y is None:
        raise ValueError("grad_y is required")
    device, back, x, theta, dtype, (mode, padding, align), size = checked_call(
        x, theta, size, mode, padding_mode, align_corners, device, (("grad_y", grad_y),))
    no_uint8(x)
    want = parse_wrt(wrt, ("x", "theta"), (True, True))
    grad_y = as_array(grad_y, "grad_y", device)
    check_grad_y(grad_y, size, dtype)
    args = (grad_y, x, theta, size, mode, padding, align, want["x"], want["theta"])
    gx, gt = launcher("affine_warp_backward", device, dtype)(*args, stream=stream)  # (the CPU ignores stream)
    return result_for(gx, back), result_for(gt, back)


def warm_calls(dtype):
    """``(args, kwargs)`` of tiny CPU calls of ``affine_warp`` that together compile
    every kernel variant for the float dtype named ``dtype`` (theta's; x of that
    dtype and uint8): 2-D and 3-D, each mode (each compiles its own kernels) with
    every padding mode (a run-time code), on the serial and the parallel path."""
    from .kernels.cpu._runtime import PARALLEL_MIN_WORK
    dt = np_dtype(dtype)
    calls = []
    for r in (2, 3):
        theta = np.zeros((1, r, r + 1), dt)
        for big in (False, True):
            width = PARALLEL_MIN_WORK + 1 if big else 1  # parallel: at least 1 tap per position
            size = (1, 1) + (1,) * (r - 1) + (width,)
            for xdt in (dt, np.dtype(np.uint8)):
                x = np.zeros((1, 1) + (2,) * r, xdt)
                calls += every_mode((x, theta, size))
    return calls


def warm_backward_calls(dtype):
    """``(args, kwargs)`` of ``affine_warp_backward`` calls that compile its CPU kernels
    for float dtype ``dtype``: 2-D and 3-D, each mode and padding mode, a tiny call
    (serial) and one past the pool's threshold (parallel; one image large enough to be
    cut into tiles on several threads)."""
    from .kernels.cpu._runtime import PARALLEL_MIN_WORK
    from .kernels.cpu.grid_sample_backward import MIN_TILE
    dt = np_dtype(dtype)
    calls = []
    for r in (2, 3):
        theta = np.zeros((1, r, r + 1), dt)
        for w in (1, PARALLEL_MIN_WORK):
            x = np.zeros((1, 1) + ((2,) if w == 1 else (2 * MIN_TILE,)) * r, dt)
            size = (1, 1) + (1,) * (r - 1) + (w,)
            calls += every_mode((np.zeros(size, dt), x, theta, size))
    return calls

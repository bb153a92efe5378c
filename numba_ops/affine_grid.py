"""AffineGrid (ONNX opset 20): front end. Semantics: the ONNX AffineGrid operator page."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ._dispatch import as_array, launcher, on_device, resolve_device, result_for
from ._dtypes import common_float_dtype, np_dtype
from ._validate import as_bool, int_tuple, remember

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

#: validated plain NumPy CPU calls: (theta shape, dtype, size values with their types
#: (or an integer size array's dtype), align_corners and its type) -> (size, align) as the kernels
#: take them. The types are part of the key, so a hit stands for a call that passed
#: every check below (a float size can never hit the entry of an integer one).
_SEEN = {}


def _fast_key(theta, size, align_corners):
    """The cache key of a plain NumPy call (see ``_SEEN``), or None when the call
    must take the full path."""
    if type(theta) is not np.ndarray:
        return None
    if type(size) in (list, tuple):
        return (theta.shape, theta.dtype, *size, *map(type, size), align_corners, type(align_corners))
    if type(size) is np.ndarray and size.ndim == 1 and size.dtype.kind in "iu":
        return (theta.shape, theta.dtype, size.dtype, *size.tolist(), align_corners, type(align_corners))
    return None


def affine_grid(theta: ArrayLike, size: Sequence[int] | ArrayLike, align_corners: bool | int = False, *,
                device: str | None = None, stream: Any = None) -> Any:
    """Sampling grid of a batch of affine transforms, as ONNX AffineGrid.

    For each matrix ``theta[n]`` the grid holds ``theta[n] @ (x, y, 1)`` (2-D)
    or ``theta[n] @ (x, y, z, 1)`` (3-D) at every output position, where
    ``x, y, z`` are the normalised base coordinates of that position. The grid
    is what :func:`grid_sample` takes; :func:`affine_warp` does both steps in
    one pass.

    Parameters
    ----------
    theta : array_like, shape (N, 2, 3) or (N, 3, 4)
        The affine matrices: float16, bfloat16, float32 or float64. A NumPy
        array or any CUDA array (``__cuda_array_interface__``).
    size : sequence or 1-D array of int
        The output size: (N, C, H, W) for 2-D, (N, C, D, H, W) for 3-D; N must
        be ``theta``'s N (C is ignored, as in ONNX). Any zero gives an empty grid.
    align_corners : bool or {0, 1}, default False
        True: the base coordinate of index ``i`` on an axis of length ``L`` is
        ``-1 + 2 i / (L - 1)`` (-1 and 1 are the centres of the corner
        elements). False: ``(2 i + 1) / L - 1`` (their outer edges). An axis of
        length 1 has the single coordinate 0 either way.
    device : {None, "cpu", "cuda"}, default None
        None runs on the GPU when an input is a CUDA array, else on the CPU.
    stream : optional
        The CUDA stream to run on (ignored on the CPU): None (the default
        stream), a numba stream, an object with ``__cuda_stream__``, a CuPy or
        PyTorch CUDA stream, or an integer handle (0: the legacy default
        stream). With device inputs the call returns without waiting; with
        NumPy inputs, after the copy back.

    Returns
    -------
    grid : array, shape (N, H, W, 2) or (N, D, H, W, 3)
        ``theta``'s dtype; the last axis lists x, y(, z). A NumPy array for
        NumPy inputs, a numba device array (which CuPy and PyTorch take without
        a copy) for CUDA inputs.

    Raises
    ------
    ValueError
        ``theta`` missing or of the wrong shape for ``size``; ``size`` not 4 or
        5 non-negative integers; ``align_corners`` not a bool or 0/1; an
        unknown ``device``.
    TypeError
        ``theta`` not of a supported float dtype; ``size`` not integers; a
        ``stream`` that is not a stream.
    RuntimeError
        ``device="cuda"`` (or a CUDA input) where no GPU is usable.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_ops
    >>> theta = np.array([[[1, 0, 0], [0, 1, 0]]], dtype=np.float32)  # identity
    >>> grid = numba_ops.affine_grid(theta, (1, 1, 2, 3), align_corners=True)
    >>> grid.shape
    (1, 2, 3, 2)
    >>> grid[0, :, :, 0]  # x: -1 .. 1 across the width
    array([[-1.,  0.,  1.],
           [-1.,  0.,  1.]], dtype=float32)
    """
    key = _fast_key(theta, size, align_corners) if device is None or device == "cpu" else None
    if key is not None:
        try:
            hit = _SEEN.get(key)
        except TypeError:  # an unhashable entry: the full path says what is wrong
            hit = key = None
        if hit is not None:
            return launcher("affine_grid", "cpu", theta.dtype)(theta, *hit)
    if theta is None:
        raise ValueError("theta is required")
    device = resolve_device(device, [theta, size])
    size_on_device = on_device(size)
    back = size_on_device or on_device(theta)  # device inputs: a device result, wherever it ran
    arr = as_array(theta, "theta", device)
    if arr is not theta:
        key = None  # converted (byte order, device copy): such calls never take the fast path
    theta = arr
    if size_on_device:
        size = as_array(size, "size", "cpu")  # its values, read on the host
    theta, size, align = checked(theta, size, align_corners)
    if key is not None and device == "cpu":
        remember(_SEEN, key, (size, align))
    if device == "cuda":
        out = launcher("affine_grid", device, theta.dtype)(theta, size, align, stream=stream)
    else:
        out = launcher("affine_grid", device, theta.dtype)(theta, size, align)
    return result_for(out, back)


def checked(theta, size, align_corners):
    """The call's checks (``theta`` an array, ``size`` on the host): ``(theta, size as a
    tuple, align_corners as a bool)`` or the function's ValueError/TypeError."""
    common_float_dtype({"theta": theta})
    align = as_bool(align_corners, "align_corners")
    size = int_tuple(size, "size", length=(4, 5), minimum=0)
    nd = len(size) - 2
    want = (size[0], nd, nd + 1)
    # size N = 0 asks for an empty grid: any count of well-formed matrices gives it
    if tuple(theta.shape) != want and not (size[0] == 0 and tuple(theta.shape[1:]) == want[1:]):
        raise ValueError(
            f"theta must have shape (N, {nd}, {nd + 1}) = {want} for a size of length {len(size)} "
            f"(N = size[0] = {size[0]}); got {tuple(theta.shape)}")
    shape = (size[0],) + size[2:] + (nd,)
    if math.prod(max(1, s) for s in shape) * theta.dtype.itemsize > np.iinfo(np.intp).max:
        raise ValueError(f"size {list(size)} asks for a grid of shape {shape}: too large to allocate")
    return theta, size, align


def affine_grid_backward(grad_grid: ArrayLike, size: Sequence[int] | ArrayLike, align_corners: bool | int = False, *,
                         device: str | None = None, stream: Any = None) -> Any:
    """The gradient of :func:`affine_grid` with respect to ``theta``.

    The grid is linear in ``theta``, so the gradient does not depend on it:
    ``grad_theta[n, i, j] = sum over positions of grad_grid[n, ..., i] * b_j``,
    ``b = (x, y, 1)`` (2-D) or ``(x, y, z, 1)`` (3-D) the position's base
    coordinates. Summed in float64 whatever the dtype; the same bits on every
    CPU call, whatever the number of threads.

    Parameters
    ----------
    grad_grid : array_like, shape (N, H, W, 2) or (N, D, H, W, 3)
        The gradient of a loss with respect to the grid, in theta's float dtype.
    size, align_corners, device, stream
        As :func:`affine_grid`.

    Returns
    -------
    grad_theta : array, shape (N, 2, 3) or (N, 3, 4)
        ``grad_grid``'s dtype.

    Raises
    ------
    ValueError
        ``grad_grid`` missing or not of the grid's shape for ``size``; the forward's
        errors for ``size`` and ``align_corners``.
    TypeError
        ``grad_grid`` not of a float dtype.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_ops
    >>> gg = np.ones((1, 2, 2, 2), np.float32)  # size (1, 1, 2, 2)
    >>> numba_ops.affine_grid_backward(gg, (1, 1, 2, 2))[0]
    array([[0., 0., 4.],
           [0., 0., 4.]], dtype=float32)
    """
    if grad_grid is None:
        raise ValueError("grad_grid is required")
    device = resolve_device(device, [grad_grid, size])
    back = on_device(grad_grid) or on_device(size)
    gg = as_array(grad_grid, "grad_grid", device)
    dtype = common_float_dtype({"grad_grid": gg})
    align = as_bool(align_corners, "align_corners")
    if on_device(size):
        size = as_array(size, "size", "cpu")
    size = tuple(int(v) for v in int_tuple(size, "size", length=(4, 5), minimum=0))
    nd = len(size) - 2
    want = (size[0],) + size[2:] + (nd,)
    if tuple(gg.shape) != want:
        raise ValueError(f"grad_grid must have the grid's shape {want} for size {list(size)}; "
                         f"got {tuple(gg.shape)}")
    out = launcher("affine_grid_backward", device, dtype)(gg, size, align, stream=stream)  # (the CPU ignores stream)
    return result_for(out, back)


def warm_calls(dtype):
    """``(args, kwargs)`` of calls that compile every CPU kernel variant of
    affine_grid for float dtype name ``dtype`` (``numba_ops.warm`` makes them on
    each device): 2-D and 3-D, each small (serial) and large enough for the
    parallel path."""
    from .kernels.cpu._runtime import PARALLEL_MIN_WORK
    dt = np_dtype(dtype)
    calls = []
    for nd in (2, 3):
        W = 64
        rows = -(-PARALLEL_MIN_WORK // (W * nd))  # out.size >= PARALLEL_MIN_WORK: the parallel path
        for size in ((1, 1) + (2,) * nd, (1, 1) + (1,) * (nd - 2) + (rows, W)):
            theta = np.zeros((1, nd, nd + 1), dt)
            calls.append(((theta, size), {"align_corners": 0}))
    return calls


def warm_backward_calls(dtype):
    """``(args, kwargs)`` of ``affine_grid_backward`` calls that compile its CPU kernels
    for float dtype ``dtype``: a tiny call (serial) and one past the pool's threshold."""
    from .kernels.cpu._runtime import PARALLEL_MIN_WORK
    dt = np_dtype(dtype)
    return [((np.zeros((1, 1, w, 2), dt), (1, 1, 1, w)), {}) for w in (1, PARALLEL_MIN_WORK)]

"""affine_warp: GridSample of AffineGrid's grid in one pass that never builds the
grid (API.md, affine_warp). Front end; the kernels are kernels/*/affine_warp.py."""
import numpy as np

from ._dispatch import as_array, launcher, on_device, resolve_device, result_for
from ._dtypes import np_dtype
from ._validate import int_tuple
from .grid_sample import check_input_sizes, every_mode, parse_attrs, sample_dtypes


def affine_warp(x, theta, size=None, *, mode="linear", padding_mode="zeros", align_corners=False,
                device=None, stream=None):
    """``grid_sample(x, affine_grid(theta, size, align_corners), ...)`` with the same
    ``align_corners``, computed without building the grid.

    Parameters
    ----------
    x : array (N, C, H, W) or (N, C, D, H, W)
        float16, bfloat16, float32, float64, or uint8.
    theta : array (N, 2, 3) for 2-D x, (N, 3, 4) for 3-D
        Affine matrices; x's dtype, or any float dtype for uint8 x.
    size : sequence or 1-D array of integers, optional
        The output size (N, C, [D,] H, W); N and C must be x's. Default x.shape.
    mode, padding_mode, align_corners : as ``grid_sample`` (align_corners also
        sets AffineGrid's base coordinates).
    device : None, "cpu" or "cuda"
    stream : CUDA stream (ignored on the CPU)

    Returns
    -------
    y : array of shape ``size``, x's dtype. For 16-bit dtypes the grid is never
        rounded: the result is the float32 composition on upcast inputs, rounded once.
    """
    inputs = {"X": x, "theta": theta}
    for name, a in inputs.items():
        if a is None:
            raise ValueError(f"{name} is required")
    device = resolve_device(device, [x, theta, size])
    back = on_device(x) or on_device(theta) or on_device(size)
    x, theta = (as_array(a, name, device) for name, a in inputs.items())
    dtype = sample_dtypes(x, theta, "theta")
    mode, padding, align = parse_attrs(mode, padding_mode, align_corners)
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
    want = (x.shape[0], r, r + 1)
    if tuple(theta.shape) != want:
        raise ValueError(f"theta must have shape (N, {r}, {r + 1}) = {want} for a {r}-D X of shape "
                         f"{tuple(x.shape)}; got {tuple(theta.shape)}")
    check_input_sizes(x, size)
    if device == "cuda":
        y = launcher("affine_warp", "cuda", dtype)(x, theta, size, mode, padding, align, stream=stream)
    else:
        y = launcher("affine_warp", "cpu", dtype)(x, theta, size, mode, padding, align)
    return result_for(y, back)


def warm_calls(dtype):
    """``(args, kwargs)`` of tiny CPU calls of ``affine_warp`` that together compile
    every kernel variant for the float dtype named ``dtype`` (theta's; x of that
    dtype and uint8): 2-D and 3-D, each mode and padding mode (each compiles its
    own kernels), on the serial and the parallel path."""
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

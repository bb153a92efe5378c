"""AffineGrid (ONNX opset 20): front end. Semantics: seeds/AffineGrid-onnx-spec.txt."""
import math

import numpy as np

from ._dispatch import as_array, launcher, on_device, resolve_device, result_for
from ._dtypes import common_float_dtype, np_dtype
from ._validate import as_bool, int_tuple, remember

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


def affine_grid(theta, size, align_corners=False, *, device=None, stream=None):
    """Sampling grid of an affine transform, as ONNX AffineGrid.

    Parameters
    ----------
    theta : array (N, 2, 3) or (N, 3, 4)
        Affine matrices; float16, bfloat16, float32 or float64.
    size : sequence or 1-D array of 4 or 5 integers
        Target size (N, C, H, W) or (N, C, D, H, W).
    align_corners : bool or 0/1
        Base coordinates -1 + 2i/(L-1) if true, else (2i+1)/L - 1.
    device : None, "cpu" or "cuda"
    stream : None, a numba stream, an object with ``__cuda_stream__``, a CuPy or
        PyTorch CUDA stream, or an integer handle (0: the legacy default stream)
        The CUDA stream to run on (ignored on the CPU). With device inputs the
        call returns without waiting; with NumPy inputs, after the copy back.

    Returns
    -------
    grid : array (N, H, W, 2) or (N, D, H, W, 3), theta's dtype. NumPy for NumPy
        input, a numba device array for device input.
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
    common_float_dtype({"theta": theta})
    align = as_bool(align_corners, "align_corners")
    if size_on_device:
        size = as_array(size, "size", "cpu")  # its values, read on the host
    size = int_tuple(size, "size", length=(4, 5), minimum=0)
    nd = len(size) - 2
    want = (size[0], nd, nd + 1)
    # size N = 0 asks for an empty grid (API.md): any count of well-formed matrices gives it
    if tuple(theta.shape) != want and not (size[0] == 0 and tuple(theta.shape[1:]) == want[1:]):
        raise ValueError(
            f"theta must have shape (N, {nd}, {nd + 1}) = {want} for a size of length {len(size)} "
            f"(N = size[0] = {size[0]}); got {tuple(theta.shape)}")
    shape = (size[0],) + size[2:] + (nd,)
    if math.prod(max(1, s) for s in shape) * theta.dtype.itemsize > np.iinfo(np.intp).max:
        raise ValueError(f"size {list(size)} asks for a grid of shape {shape}: too large to allocate")
    if key is not None and device == "cpu":
        remember(_SEEN, key, (size, align))
    if device == "cuda":
        out = launcher("affine_grid", device, theta.dtype)(theta, size, align, stream=stream)
    else:
        out = launcher("affine_grid", device, theta.dtype)(theta, size, align)
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

"""AffineGrid on the GPU: one thread per output element, grid-stride.

The op writes N·D·H·W·nd elements from an N·nd·(nd+1) theta, so it is bound by
the write bandwidth (an H100/H200 writes ~3-4.5 TB/s). Mapping consecutive
threads to consecutive output elements (component fastest) makes every warp
store one contiguous 32-element run, fully coalesced, whatever nd is; theta is
tiny and stays in L1/L2. The index arithmetic is 64-bit (outputs beyond 2^31
elements); NVVM bypasses 64-bit division with a 32-bit one when the operands
fit, so the unravelling costs a few integer ops per element, well below the
store's cost. The math (base coordinates, loads, the rounding store) is
``kernels/_scalar.py``'s, shared with the CPU kernel, with the same order of
operations: ``theta[k,0]·x + (theta[k,1]·y [+ theta[k,2]·z] + theta[k,nd])``.
"""
import functools

import numpy as np
from numba import cuda

from ..._dtypes import compute, storage
from .._scalar import base_coord, load, store
from . import _device

DTYPES = ("float16", "bfloat16", "float32", "float64")


@functools.lru_cache(maxsize=None)
def kernel(ct):
    """The kernel for compute type ``ct`` (np.float32 or np.float64).

    Arguments: theta (N*nd*(nd+1),) and out (N*D*H*W*nd,) flat storage arrays,
    D, H, W (D = 1 for 2-D), nd, align (0/1).
    """
    ct = np.dtype(ct).type

    @cuda.jit
    def affine_grid_kernel(theta, out, D, H, W, nd, align):
        one = ct(1)
        start = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        step = np.int64(cuda.gridDim.x) * cuda.blockDim.x
        for e in range(start, out.shape[0], step):
            k = e % nd
            r = e // nd
            w = r % W
            r = r // W
            h = r % H
            r = r // H
            d = r % D
            n = r // D
            t = (n * nd + k) * (nd + 1)
            x = ct(base_coord(w, W, align, one))
            y = ct(base_coord(h, H, align, one))
            if nd == 3:
                z = ct(base_coord(d, D, align, one))
                b = load(theta, t + 1) * y + load(theta, t + 2) * z + load(theta, t + 3)
            else:
                b = load(theta, t + 1) * y + load(theta, t + 2)
            store(out, e, load(theta, t) * x + b)

    return affine_grid_kernel


def signatures():
    """(compute type, argument types) for every dtype in DTYPES: what ``compile_ptx`` checks."""
    from numba import types
    from numba.np.numpy_support import from_dtype
    from ..._dtypes import DTYPES as ALL
    for dt in ALL:
        st = from_dtype(storage(dt))
        arr = types.Array(st, 1, "C")
        yield dt, compute(dt).type, (arr, arr, types.int64, types.int64, types.int64, types.int64,
                                     types.boolean)


def launch(theta, size, align):
    """theta: NumPy or device array (N, nd, nd+1), validated; size: (N, C, [D,] H, W)."""
    with _device.launch_guard():
        return _launch(theta, size, align)


def _launch(theta, size, align):
    dtype = np.dtype(theta.dtype)
    nd = len(size) - 2
    shape = (size[0],) + tuple(size[2:]) + (nd,)
    total = int(np.prod(shape, dtype=np.int64))
    to_host = isinstance(theta, np.ndarray)
    out = cuda.device_array(total, dtype=storage(dtype))
    if total:
        D = size[2] if nd == 3 else 1
        th = _device.flat(theta)
        kernel(compute(dtype))[_device.blocks_for(total), _device.THREADS](
            th, out, np.int64(D), np.int64(size[-2]), np.int64(size[-1]), np.int64(nd), bool(align))
    return _device.finish(out, shape, dtype, to_host)

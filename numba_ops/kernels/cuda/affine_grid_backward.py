"""AffineGrid's backward on the GPU: ``grad_theta[n, i, j] = sum over positions of
grad_grid[n, p, i] * base_j(p)``, the base coordinates ``(x, y[, z], 1)`` of the
position (``_scalar.base_coord``, widened to float64 as on the CPU).

The op reads N·P·nd elements and writes N·nd·(nd+1), so it is a reduction: the
positions of each image are cut into units (``grid_sample_backward.units``), one
block per unit at a time (grid-stride over the units); each thread sums its
positions' products in float64 registers, the block adds its threads' sums in a
shared-memory tree (``grid_sample_backward.block_flush``) and adds the result to
theta's gradient with one float64 atomic add per entry. The gradient is rounded
once to the dtype at the end (``narrowed``). Consecutive threads read consecutive
positions, so the loads of ``grad_grid`` coalesce.
"""
import functools

import numpy as np
from numba import cuda

from .._dtypes import NAMES, compute, storage
from .._scalar import base_coord, load
from . import _device
from .grid_sample_backward import block_flush, narrowed, units, zeros

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)


def bounds():
    """Launch bounds: two blocks of ``_device.THREADS`` per SM (the simulator takes none)."""
    return {} if _device.SIMULATOR else {"launch_bounds": (_device.THREADS, 2)}


@functools.lru_cache(maxsize=None)
def kernel(ct, nd):
    """The kernel for compute type ``ct`` and ``nd`` spatial dims. Arguments: gg
    (N*P*nd, flat storage), gth (N*nd*(nd+1), float64, zeroed: sums added), dims
    ``(N, U, P, D, H, W)`` (D = 1 in 2-D), align (bool)."""
    ct = np.dtype(ct).type
    ND = nd
    RR = nd * (nd + 1)
    NT = _device.THREADS
    flush = block_flush(NT, RR)

    @cuda.jit(**bounds())
    def affine_grid_backward_kernel(gg, gth, dims, align):
        N, U, P, D, H, W = dims
        one = ct(1)
        acc = cuda.local.array(RR, np.float64)
        bc = cuda.local.array(3, np.float64)
        sh = cuda.shared.array((NT, RR), np.float64)
        t = np.int64(cuda.threadIdx.x)
        for unit in range(np.int64(cuda.blockIdx.x), N * U, np.int64(cuda.gridDim.x)):  # grid-stride
            n = unit // U
            k = unit - n * U
            for j in range(RR):
                acc[j] = 0.0
            for p in range(k * NT + t, P, U * NT):
                row = p // W
                bc[0] = np.float64(base_coord(p - row * W, W, align, one))
                dd = row // H
                bc[1] = np.float64(base_coord(row - dd * H, H, align, one))
                bc[2] = np.float64(base_coord(dd, D, align, one))
                for ci in range(ND):
                    g = np.float64(load(gg, (n * P + p) * ND + ci))
                    for q in range(ND):
                        acc[ci * (ND + 1) + q] += g * bc[q]
                    acc[ci * (ND + 1) + ND] += g
            flush(sh, acc, gth, n * RR, t)

    return affine_grid_backward_kernel


def compile_jobs():
    """(label, kernel, argument types) for 2-D and 3-D and every dtype: what
    ``compile_ptx`` type-checks and the resource report measures."""
    from numba import from_dtype, types
    i64 = types.int64
    for dt in DTYPES:
        st = types.Array(from_dtype(storage(dt)), 1, "C")
        for nd in (2, 3):
            yield (f"affine_grid_backward/{nd}d/{dt}", kernel(compute(dt).type, nd),
                   (st, types.Array(types.float64, 1, "C"), types.UniTuple(i64, 6), types.boolean))


def launch(gg, size, align, stream=None):
    """grad_grid (N, [D,] H, W, nd): NumPy or device array, validated; size (N, C, [D,]
    H, W). theta's gradient (N, nd, nd+1) in grad_grid's dtype: NumPy for a host
    input, a device array otherwise; all work on ``stream`` (``_device.as_stream``)."""
    with _device.launch_guard():
        return _launch(gg, size, align, _device.as_stream(stream))


def _launch(gg, size, align, stream):
    _device.await_producers((gg,), stream)
    dtype = np.dtype(gg.dtype)
    ct = compute(dtype)
    nd = len(size) - 2
    N = int(size[0])
    spatial = tuple(int(s) for s in size[2:])
    P = int(np.prod(spatial, dtype=np.int64))
    to_host = isinstance(gg, np.ndarray)
    gth = zeros(N * nd * (nd + 1), np.float64, stream)
    if N * P:
        U = units(N, P, _device.THREADS)
        D, H, W = (1,) * (3 - nd) + spatial
        kernel(ct.type, nd)[max(1, min(N * U, _device.MAX_BLOCKS)), _device.THREADS, stream](
            _device.flat(gg, stream), gth, (N, U, P, D, H, W), bool(align))
    return _device.finish(narrowed(gth, storage(dtype), stream), (N, nd, nd + 1), dtype, to_host, stream)

"""AffineGrid on the GPU: a block per output row, threads along the row.

The op writes N·D·H·W·nd elements from a tiny theta, so it is bound by the write
bandwidth, and on an H100/H200 (3.3-4.8 TB/s) that leaves only ~25-40 thread
instructions per float32 element: per-element index unravelling (64-bit
divisions) or per-element base coordinates (a float64 division each) would make
it compute-bound. So the work is organised as the CPU kernel's rows:

- ``coords`` tabulates the base coordinates of the W, H and D axes once
  (``base_coord``, the CPU kernel's function; W + H + D values);
- ``grid`` gives each block whole rows ``(n, d, h)`` (grid-stride over rows, so
  any grid is correct); a row is ``out[w, k] = theta[n,k,0]·xs[w] + b[k]`` with
  ``b[k] = theta[n,k,1]·ys[h] + theta[n,k,2]`` in 2-D, and in 3-D
  ``(theta[n,k,0]·xs[w] + (theta[n,k,2]·zs[d] + theta[n,k,3])) + ys[h]·theta[n,k,1]``:
  the CPU kernels' order of operations in both. The block has a multiple of nd
  threads, so thread ``t`` always writes component ``k = t % nd``: its row
  constants cost a few loads per row, and each element is one table load, a
  multiply-add (and an add in 3-D) and one store, consecutive threads storing
  consecutive elements (fully coalesced). The row decomposition
  (64-bit, for outputs beyond 2^31 elements) is paid once per row, not per element.

16-bit outputs are rounded once by the shared ``store``.
"""
import functools

import numpy as np
from numba import cuda

from .._dtypes import NAMES, compute, storage
from .._scalar import base_coord, load, store
from . import _device

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)


#: threads per block per spatial axis on a GPU
GPU_THREADS_PER_AXIS = 64


def threads(nd):
    """Threads per block: a multiple of nd (the component a thread writes is fixed)
    and of the warp size; 8 elements per thread on a 512-wide row."""
    return 2 * nd if _device.SIMULATOR else GPU_THREADS_PER_AXIS * nd


@functools.lru_cache(maxsize=None)
def kernels(ct, nd):
    """``(coords, grid)`` kernels for compute type ``ct`` and ``nd`` spatial dims."""
    ct = np.dtype(ct).type
    ND = nd
    UND = np.uint64(nd)  # unsigned in the element loop: no Python floor/negative-index fix-ups

    @cuda.jit(cache=True)
    def coords(c, D, H, W, align):
        """c[:W], c[W:W+H], c[W+H:] = base coordinates of the W, H, D axes."""
        one = ct(1)
        for i in range(cuda.grid(1), c.shape[0], cuda.gridsize(1)):  # grid-stride, int64
            if i < W:
                c[i] = base_coord(i, W, align, one)
            elif i < W + H:
                c[i] = base_coord(i - W, H, align, one)
            else:
                c[i] = base_coord(i - W - H, D, align, one)

    @cuda.jit(cache=True)
    def grid(theta, c, out, D, H, W):
        """out viewed as rows (n, d, h) of W * nd elements; theta flat (N*nd*(nd+1),)."""
        t = np.uint64(cuda.threadIdx.x)
        bd = np.uint64(cuda.blockDim.x)
        k = np.int64(cuda.threadIdx.x % ND)
        L = W * ND
        UL = np.uint64(L)
        rows = out.shape[0] // L
        for r in range(np.int64(cuda.blockIdx.x), rows, np.int64(cuda.gridDim.x)):
            h = r % H
            q = r // H
            d = q % D
            n = q // D
            th = (n * ND + k) * (ND + 1)
            a = load(theta, th)
            base = np.uint64(r * L)
            if ND == 3:  # the CPU's 3-D grouping: (a * x + (t2 * z + t3)) + t1 * y
                b = load(theta, th + 2) * c[W + H + d] + load(theta, th + 3)
                yq = c[W + h] * load(theta, th + 1)
            else:
                b = load(theta, th + 1) * c[W + h] + load(theta, th + 2)
            for j in range(t, UL, bd):
                v = a * c[j // UND] + b
                if ND == 3:
                    v += yq
                store(out, base + j, v)

    return coords, grid


def block_size(label):
    """Threads per block the launcher uses for a ``compile_jobs`` label (benchmark/resources.py)."""
    if label.startswith("affine_grid.grid/"):
        return threads(int(label.split("/")[1][0]))
    return _device.THREADS


def compile_jobs():
    """(label, kernel, argument types) for every kernel, dtype and nd: what
    ``compile_ptx`` type-checks (tests/test_cuda.py)."""
    from numba import types
    from numba import from_dtype
    from .._dtypes import DTYPES as ALL
    i64 = types.int64
    for dt in ALL:
        ct = compute(dt).type
        st = types.Array(from_dtype(storage(dt)), 1, "C")
        cf = types.Array(from_dtype(np.dtype(ct)), 1, "C")
        for nd in (2, 3):
            coords, grid = kernels(ct, nd)
            yield f"affine_grid.coords/{nd}d/{dt}", coords, (cf, i64, i64, i64, types.boolean)
            yield f"affine_grid.grid/{nd}d/{dt}", grid, (st, cf, st, i64, i64, i64)


def launch(theta, size, align, stream=None):
    """theta: NumPy or device array (N, nd, nd+1), validated; size: (N, C, [D,] H, W);
    stream: the public ``stream=`` (``_device.as_stream``)."""
    with _device.launch_guard():
        return _launch(theta, size, align, _device.as_stream(stream))


def launch_into(theta, size, align, out, stream=None):
    """``launch`` writing into ``out``, a preallocated flat device array of the
    storage dtype: what bench/gpu_bench.py times as the kernels alone (the
    allocation of a large result is a cudaMalloc that numba does not pool)."""
    with _device.launch_guard():
        return _launch(theta, size, align, _device.as_stream(stream), out)


def _launch(theta, size, align, stream, out=None):
    _device.await_producers((theta,), stream)
    dtype = np.dtype(theta.dtype)
    nd = len(size) - 2
    shape = (size[0],) + tuple(size[2:]) + (nd,)
    total = int(np.prod(shape, dtype=np.int64))
    to_host = isinstance(theta, np.ndarray)
    if out is None:
        out = cuda.device_array(total, dtype=storage(dtype), stream=stream)
    if total:
        ct = compute(dtype).type
        D = size[2] if nd == 3 else 1
        H, W = size[-2], size[-1]
        coords, grid = kernels(ct, nd)
        c = cuda.device_array(W + H + D, dtype=ct, stream=stream)
        coords[_device.blocks_for(W + H + D), _device.THREADS, stream](
            c, np.int64(D), np.int64(H), np.int64(W), bool(align))
        rows = total // (W * nd)
        blocks = max(1, min(rows, _device.MAX_BLOCKS))
        grid[blocks, threads(nd), stream](_device.flat(theta, stream), c, out, np.int64(D), np.int64(H), np.int64(W))
    return _device.finish(out, shape, dtype, to_host, stream)

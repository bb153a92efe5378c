"""GridSample on the GPU: one thread per output position, looping over the channels.

The op reads a few taps of ``x`` per output element and writes the element, so it
is bound by memory traffic (the gathers mostly hit L1/L2: neighbouring positions
share taps). Per output position ``(n, o)`` (grid-stride over the ``N·P``
positions, ``P`` the output's spatial size, so any launch is correct):

1. the position on every spatial axis, ``unnormalize`` of the grid value
   (``affine_warp``'s kernel computes it from theta instead; the steps below are
   shared with it, ``sampler``);
2. per axis, the mode's padded taps (flat offsets: index times the axis'
   stride), weights and inside-flags from the shared per-axis math of
   ``kernels/_sample.py`` (``nearest_tap``, ``linear_taps``, ``cubic_taps``):
   the CPU kernels' functions, so both devices take the same taps and weights;
3. for every channel, the sample: the weights nested as the CPU kernel (and
   onnxruntime) nests them, innermost axis first, ``s = 0; s += w·v`` per axis,
   so results equal the CPU's bit for bit where both round alike (the simulator;
   on a GPU the compiler may fuse a multiply-add); written once.

The taps are computed once per position and serve every channel. The mode and the
number of spatial axes are compile-time constants of each kernel (``kernel(ct, r,
mode)``), so the tap loops unroll and the taps live in registers; the padding and
``align_corners`` are runtime values (one uniform branch). Launch bounds: two blocks
per SM (``threads``: 256 threads and at most 128 registers, or 128 threads for the
cubic kernels that need more; no spills in any specialisation on sm_80 or sm_90,
``numba-ops info --cuda``). Consecutive threads
take consecutive positions: grid reads and output writes coalesce. A
zeros-padded tap outside the input is read at a clamped index and replaced by an
exact 0, as on the CPU. All index arithmetic is 64-bit. 16-bit data is widened on
load and rounded once on store (float32 accumulation); uint8 ``x`` is computed in
the grid's compute type and stored by ``to_uint8``.
"""
import functools

import numpy as np
from numba import cuda

from .._dtypes import NAMES, compute, storage
from .._sample import (CUBIC, LINEAR, NEAREST, TAPS, ZEROS, cubic_taps, linear_taps, load_sample, nearest_tap,
                       store_sample, unnormalize)
from . import _device

#: grid dtypes; ``x`` has the same dtype, or uint8
DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)
MODE_NAMES = {NEAREST: "nearest", LINEAR: "linear", CUBIC: "cubic"}
#: inline the shared sampler into each kernel at the NVVM level (the simulator takes no option)
INLINE = {} if _device.SIMULATOR else {"forceinline": True}

#: the most spatial axes (``geo`` holds 3 sizes and 3 strides)
MAX_R = 3


def threads(ct, r, mode):
    """Threads per block of the kernels for compute type ``ct``, ``r`` axes and
    ``mode``: ``_device.THREADS`` (256 on a GPU), except cubic in 3-D or in float64
    on a GPU: 128. Every kernel's launch bounds ask for two such blocks per SM: at
    most 128 registers per thread at 256, within which those spilled (3-D cubic
    float64: 36-164 B on sm_80; 2-D cubic float64: 8 B with nvJitLink on sm_90); at
    128 they take up to ~185 registers and spill nothing."""
    heavy = mode == CUBIC and (r == 3 or np.dtype(ct) == np.float64)
    return 128 if heavy and not _device.SIMULATOR else _device.THREADS


def blocks(n, nt):
    """Blocks of ``nt`` threads for ``n`` positions (at most ``_device.MAX_BLOCKS``;
    the grid-stride loops cover the rest)."""
    return max(1, min(_device.MAX_BLOCKS, -(-int(n) // nt)))


def bounds(ct, r, mode):
    """``cuda.jit``'s launch-bound options for ``threads(ct, r, mode)`` (the simulator takes none)."""
    return {} if _device.SIMULATOR else {"launch_bounds": (threads(ct, r, mode), 2)}


def block_size(label):
    """Threads per block the launcher uses for a ``compile_jobs`` label (benchmark/resources.py)."""
    parts = label.split("/")  # op/<r>d/<mode>/x_<dtype>/<float dtype>
    return threads(compute(parts[-1]), int(parts[1][0]), {v: k for k, v in MODE_NAMES.items()}[parts[2]])


@functools.lru_cache(maxsize=None)
def sampler(ct, r, mode):
    """The device function ``sample(xf, out, xb, ob, C, S, P, pos, geo, padding, align)``
    for compute type ``ct``, ``r`` spatial axes and ``mode`` (a ``_sample`` code):
    ``out[ob + c·P]`` = the sample of channel image ``xf[xb + c·S:]`` at ``pos[:r]``
    (positions on the spatial axes, outermost first), for ``c < C``; ``geo`` the
    axes' sizes and strides (``geometry``)."""
    ct = np.dtype(ct).type
    R = r
    MODE = mode
    T = TAPS[mode]

    @cuda.jit(device=True, **INLINE)
    def sample(xf, out, xb, ob, C, S, P, pos, geo, padding, align):
        zero = ct(0)
        # per axis k, tap t at [4k + t]: flat offset, weight, inside
        idx = cuda.local.array(12, np.int64)
        wt = cuda.local.array(12, ct)
        ok = cuda.local.array(12, np.bool_)
        for k in range(R):
            size = geo[k]
            stride = geo[MAX_R + k]
            if MODE == NEAREST:
                i0, w0, ok0 = nearest_tap(pos[k], size, padding, align, zero)
                idx[4 * k] = i0 * stride
                wt[4 * k] = w0
                ok[4 * k] = ok0
            elif MODE == LINEAR:
                i0, i1, w0, w1, ok0, ok1 = linear_taps(pos[k], size, padding, align, zero)
                idx[4 * k], idx[4 * k + 1] = i0 * stride, i1 * stride
                wt[4 * k], wt[4 * k + 1] = w0, w1
                ok[4 * k], ok[4 * k + 1] = ok0, ok1
            else:
                i0, i1, i2, i3, w0, w1, w2, w3, ok0, ok1, ok2, ok3 = cubic_taps(pos[k], size, padding, align, zero)
                idx[4 * k], idx[4 * k + 1], idx[4 * k + 2], idx[4 * k + 3] = (i0 * stride, i1 * stride,
                                                                              i2 * stride, i3 * stride)
                wt[4 * k], wt[4 * k + 1], wt[4 * k + 2], wt[4 * k + 3] = w0, w1, w2, w3
                ok[4 * k], ok[4 * k + 1], ok[4 * k + 2], ok[4 * k + 3] = ok0, ok1, ok2, ok3
        zeros = padding == ZEROS
        for c in range(C):
            base = xb + c * S
            acc = zero
            if R == 1:
                for tx in range(T):
                    v = load_sample(xf, base + idx[tx], zero)
                    if zeros:
                        v = v if ok[tx] else zero
                    acc += wt[tx] * v
            elif R == 2:
                for ty in range(T):
                    by = base + idx[ty]
                    s = zero
                    for tx in range(T):
                        v = load_sample(xf, by + idx[4 + tx], zero)
                        if zeros:
                            v = v if (ok[ty] & ok[4 + tx]) else zero
                        s += wt[4 + tx] * v
                    acc += wt[ty] * s
            else:
                for tz in range(T):
                    bz = base + idx[tz]
                    sz = zero
                    for ty in range(T):
                        by = bz + idx[4 + ty]
                        oky = ok[tz] & ok[4 + ty]
                        s = zero
                        for tx in range(T):
                            v = load_sample(xf, by + idx[8 + tx], zero)
                            if zeros:
                                v = v if (oky & ok[8 + tx]) else zero
                            s += wt[8 + tx] * v
                        sz += wt[4 + ty] * s
                    acc += wt[tz] * sz
            store_sample(out, ob + c * P, acc)

    return sample


@functools.lru_cache(maxsize=None)
def kernel(ct, r, mode):
    """The GridSample kernel for compute type ``ct`` (the grid's), ``r`` spatial
    axes and ``mode``.

    Arguments: xf (N*C*S) flat storage of ``x`` (or uint8), gf (N*P*r) the flat
    grid, out (N*C*P) flat, dims ``(N*P, C, P, S)``, geo (``geometry``), padding
    (a ``_sample`` code), align (bool).
    """
    ct = np.dtype(ct).type
    R = r
    sample = sampler(ct, r, mode)

    @cuda.jit(**bounds(ct, r, mode))
    def grid_sample_kernel(xf, gf, out, dims, geo, padding, align):
        total, C, P, S = dims
        one = ct(1)
        pos = cuda.local.array(MAX_R, ct)
        for q in range(cuda.grid(1), total, cuda.gridsize(1)):  # grid-stride, int64
            n = q // P
            for k in range(R):  # the grid lists coordinates innermost axis first
                pos[k] = unnormalize(load_sample(gf, q * R + (R - 1 - k), one), geo[k], align, one)
            sample(xf, out, n * C * S, n * C * P + (q - n * P), C, S, P, pos, geo, padding, align)

    return grid_sample_kernel


def geometry(spatial):
    """``(size_0..size_2, stride_0..stride_2)`` of a C-contiguous image of shape
    ``spatial`` (the input's spatial axes), padded with size-1 axes."""
    sizes = tuple(int(s) for s in spatial) + (1,) * (MAX_R - len(spatial))
    strides, acc = [], 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= s
    return sizes + tuple(reversed(strides))


def x_storage(dtype):
    """The kernel storage dtype of ``x``: uint8 as is, floats as ``_dtypes.storage``."""
    return np.dtype(np.uint8) if np.dtype(dtype) == np.uint8 else storage(dtype)


def signatures(r, gdt):
    """The argument types of ``kernel(compute(gdt), r, mode)`` for x of ``gdt`` and of
    uint8, a grid (or theta) of the float dtype ``gdt``: [(x dtype name, argtypes)]."""
    from numba import types
    from numba import from_dtype
    i64 = types.int64
    arr = lambda dt: types.Array(from_dtype(x_storage(dt)), 1, "C")  # noqa: E731
    out = []
    for xdt in (gdt, "uint8"):
        out.append((xdt, (arr(xdt), arr(gdt), arr(xdt), types.UniTuple(i64, 4), types.UniTuple(i64, 2 * MAX_R),
                          i64, types.boolean)))
    return out


def compile_jobs():
    """(label, kernel, argument types) for every rank, mode, grid dtype and x dtype
    (the grid's or uint8): what ``compile_ptx`` type-checks (tests/test_cuda.py)
    and the resource report measures."""
    for gdt in DTYPES:
        for r in (1, 2, 3):
            for mode, mname in MODE_NAMES.items():
                kern = kernel(compute(gdt).type, r, mode)
                for xdt, sig in signatures(r, gdt):
                    yield f"grid_sample/{r}d/{mname}/x_{xdt}/{gdt}", kern, sig


def launch(x, grid, mode, padding, align, stream=None):
    """x: NumPy or device array (N, C, D1..Dr), float or uint8; grid: (N, O1..Or, r),
    float; validated by the front end (``mode``/``padding`` are ``_sample`` codes,
    ``align`` a bool); stream: the public ``stream=`` (``_device.as_stream``)."""
    with _device.launch_guard():
        return _launch(x, grid, mode, padding, align, _device.as_stream(stream))


def _launch(x, grid, mode, padding, align, stream):
    shape = (int(x.shape[0]), int(x.shape[1])) + tuple(int(s) for s in grid.shape[1:-1])
    return run(kernel, x, grid, shape, (), mode, padding, align, stream)


def run(make, x, pos, shape, extra, mode, padding, align, stream):
    """The launch shared by grid_sample and affine_warp: the result ``shape`` (N, C,
    O1..Or) in x's dtype, one thread per output position, from the kernel
    ``make(ct, r, mode)`` given x, the positions ``pos`` (the grid, or theta) flat, and
    ``dims = (N*P, C, P, S) + extra``."""
    dtype = np.dtype(x.dtype)
    r = x.ndim - 2
    N, C = shape[0], shape[1]
    P = int(np.prod(shape[2:], dtype=np.int64))
    S = int(np.prod(x.shape[2:], dtype=np.int64))
    total = N * C * P
    to_host = not _device.any_on_device(x, pos)
    _device.await_producers((x, pos), stream)
    out = cuda.device_array(total, dtype=x_storage(dtype), stream=stream)
    if total:
        xf = _device.flat(x, stream)
        pf = _device.flat(pos, stream)
        ct = compute(pos.dtype).type
        nt = threads(ct, r, mode)
        make(ct, r, mode)[blocks(N * P, nt), nt, stream](
            xf, pf, out, (N * P, C, P, S) + extra, geometry(x.shape[2:]), np.int64(padding), bool(align))
    return _device.finish(out, shape, dtype, to_host, stream)

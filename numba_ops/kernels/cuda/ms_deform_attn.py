"""Multi-scale deformable attention on the GPU: one thread per output element
``(n, q, m, d)``, looping over the levels and points (as mmcv's CUDA kernel).

Per element the thread walks the query's ``L x P`` points of head ``m``: each
point's taps come from ``kernels/_msda.py`` (``axis_taps``: GridSample's linear
taps with zeros padding, the CPU kernel's function, so both devices take the same
corners and weights), and the corners inside the level add ``attention x corner
weight x value[n, corner, m, d]`` to the element, nested as the CPU kernel nests
them (``(a * wz * wy) * wx``, corners z, y, x in order), so results equal the
CPU's bit for bit where both round alike (the simulator; on a GPU the compiler may
fuse a multiply-add). A point whose location is not finite makes the element NaN;
a far one samples 0 (its corners are all outside).

Consecutive threads take consecutive channels ``d``: the value reads of a corner
coalesce (``Dh`` contiguous channels), and the location and weight reads of a
point are one address for the ``Dh`` threads of a head (a broadcast). The rank is
a run-time value, as on the CPU (the level table holds three sizes per level, 0
for an absent axis: one tap of weight 1), so one kernel per dtype serves 1-, 2-
and 3-D levels and the warm-up's calls compile all of it. Launch bounds: two
blocks of 256 threads per SM (at most 128 registers per thread; no spills,
``numba-ops info --cuda``). Index arithmetic is 64-bit. 16-bit data is widened on
load and the result rounded once on store (float32 accumulation); float64 runs in
float64.
"""
import functools
import math

import numpy as np
from numba import cuda

from .._dtypes import NAMES, compute, storage
from .._msda import axis_taps, corner, level_table
from .._scalar import load, store
from . import _device

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)
#: threads per block (two blocks per SM: ``bounds``)
NT = _device.THREADS


def bounds():
    """``cuda.jit``'s launch bounds: two blocks of ``NT`` threads per SM (at most 128
    registers per thread at 256). The simulator takes none."""
    return {} if _device.SIMULATOR else {"launch_bounds": (NT, 2)}


@functools.lru_cache(maxsize=None)
def kernel(ct):
    """The forward kernel for compute type ``ct``.

    Arguments (flat, C-contiguous storage arrays): vf (N*S*M*Dh) value, lf
    (N*Lq*M*L*P*r) the locations, af (N*Lq*M*L*P) the weights, out (N*Lq*M*Dh,
    written); levels (``level_rows``: per level W, H, D, start); dims ``(N, Lq, M,
    Dh, S, L, P, r)``.
    """
    ct = np.dtype(ct).type

    @cuda.jit(cache=True, **bounds())
    def ms_deform_attn_kernel(vf, lf, af, out, levels, dims):
        N, Lq, M, Dh, S, L, P, r = dims
        zero = ct(0)
        one = ct(1)
        nan = ct(math.nan)
        total = N * Lq * M * Dh
        for e in range(cuda.grid(1), total, cuda.gridsize(1)):  # grid-stride, int64
            d = e % Dh
            t = e // Dh
            m = t % M
            nq = t // M
            n = nq // Lq
            vb = (n * S * M + m) * Dh + d  # value[n, 0, m, d]; a position k adds k * M * Dh
            acc = zero
            finite = True
            for lv in range(L):
                W = levels[lv, 0]
                H = levels[lv, 1]
                D = levels[lv, 2]
                st = levels[lv, 3]
                W1 = max(W, 1)
                H1 = max(H, 1)
                for p in range(P):
                    pt = (nq * M + m) * L * P + lv * P + p
                    a = load(af, pt)
                    tx = axis_taps(load(lf, pt * r), W, one)
                    ty = axis_taps(load(lf, pt * r + 1) if r > 1 else zero, H, one)
                    tz = axis_taps(load(lf, pt * r + 2) if r > 2 else zero, D, one)
                    if not (tx[6] and ty[6] and tz[6]):
                        finite = False
                        continue
                    for c in range(8):
                        k, w, inside = corner(c, tx, ty, tz, W1, H1)
                        if inside:
                            acc += (a * w) * load(vf, vb + (st + k) * (M * Dh))
            store(out, e, acc if finite else nan)

    return ms_deform_attn_kernel


def level_rows(shapes, starts):
    """The kernels' (max(L, 1), 4) int64 table: per level its sizes innermost first
    (W, H, D; 0 for an absent axis, ``level_table``) and its start in S."""
    table = np.zeros((max(len(starts), 1), 4), np.int64)
    if len(starts):
        table[:, :3] = level_table(shapes)
        table[:, 3] = np.asarray(starts, np.int64)
    return table


def signature(dt):
    """The argument types of ``kernel(compute(dt))`` for inputs of ``dt``."""
    from numba import from_dtype, types
    st = types.Array(from_dtype(storage(dt)), 1, "C")
    return (st, st, st, st, types.Array(types.int64, 2, "C"), types.UniTuple(types.int64, 8))


def compile_jobs():
    """(label, kernel, argument types) for every dtype: what ``compile_ptx``
    type-checks (tests/test_ms_deform_attn_cuda.py) and the resource report measures."""
    for dt in DTYPES:
        yield f"ms_deform_attn/{dt}", kernel(compute(dt).type), signature(dt)


def dims_of(value, loc):
    """``(N, Lq, M, Dh, S, L, P, r)`` of a call."""
    N, S, M, Dh = (int(s) for s in value.shape)
    Lq, L, P, r = (int(loc.shape[i]) for i in (1, 3, 4, 5))
    return N, Lq, M, Dh, S, L, P, r


def launch(value, shapes, starts, loc, attn, stream=None):
    """value (N, S, M, Dh), loc (N, Lq, M, L, P, r), attn (N, Lq, M, L, P): NumPy or
    device arrays of one float dtype; shapes int (L, r) and starts int (L,) on the
    host; validated by the front end. Returns (N, Lq, M * Dh) in value's dtype:
    NumPy for host inputs, a device array otherwise; all work on ``stream``
    (``_device.as_stream``)."""
    with _device.launch_guard():
        return _launch(value, shapes, starts, loc, attn, _device.as_stream(stream))


def _launch(value, shapes, starts, loc, attn, stream):
    _device.await_producers((value, loc, attn), stream)
    dtype = np.dtype(value.dtype)
    dims = dims_of(value, loc)
    N, Lq, M, Dh = dims[:4]
    total = N * Lq * M * Dh
    to_host = not _device.any_on_device(value, loc, attn)
    out = cuda.device_array(total, dtype=storage(dtype), stream=stream)
    if total:
        vf, lf, af = (_device.flat(a, stream) for a in (value, loc, attn))
        levels = _device.int64_array(level_rows(shapes, starts), stream)
        kernel(compute(dtype).type)[_device.blocks_for(total), NT, stream](vf, lf, af, out, levels, dims)
    return _device.finish(out, (N, Lq, M * Dh), dtype, to_host, stream)

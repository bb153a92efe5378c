"""Multi-scale deformable attention's backward on the GPU: one thread per point
``(n, q, m, l, p)``, looping over its head's ``Dh`` channels; the value gradient
scattered with atomic adds.

Per point the thread takes, axis by axis, the forward's taps and weights with the
weights' derivatives (``kernels/_msda.py``: ``axis_grad_taps``, the CPU kernel's
function, so both devices take the same corners), then for every corner inside
the level and every channel ``d``, with ``g = grad_out[n, q, m * Dh + d]`` and ``a``
the point's attention weight:

- ``dot += value[n, corner, m, d] * g``, which gives the weight's gradient
  ``sum over corners of (corner weight) * dot`` and the location's ``a * sum over
  corners of (the corner weight differentiated along the axis) * dot``, nested as
  the CPU kernel nests them; both belong to the thread (no atomics) and are
  written once;
- ``grad_value[n, corner, m, d] += a * (corner weight) * g`` (``cuda.atomic.add`` on
  a buffer of the compute type: points of many queries share corners).

A point whose location is not finite gets NaN for its own location and weight
gradients and scatters nothing. Results agree with the CPU kernel's up to the
order of the atomic adds (the CPU's backward is deterministic, this one is not).

Consecutive threads take consecutive points of one (query, head): their location
and weight reads coalesce and their ``grad_out`` reads are one row. The rank is a
run-time value, as in the forward kernel (one kernel per dtype for 1-, 2- and 3-D
levels); which gradients are wanted is a run-time value too (uniform branches).
Launch bounds: two blocks per SM of 256 threads (at most 128 registers per thread),
or of 128 for float64 (``threads``); no spills on sm_80 or sm_90 with ptxas or
nvJitLink (``numba-ops info --cuda``). Index arithmetic is 64-bit. 16-bit data is
widened on load; the value gradient is accumulated in float32 and rounded once at
the end (``grid_sample_backward.narrowed``), the others rounded once on store;
float64 runs in float64.
"""
import functools
import math

import numpy as np
from numba import cuda

from .._dtypes import NAMES, compute, storage
from .._msda import axis_grad_taps, grad_corner
from .._scalar import load, store
from . import _device
from .grid_sample_backward import narrowed, zeros
from .ms_deform_attn import NT, dims_of, level_rows

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)


def threads(ct):
    """Threads per block for compute type ``ct``: ``NT`` (256 on a GPU), or 128 for
    float64 on a GPU, whose taps, derivatives and four sums want more than 128
    registers per thread (at 256 threads and 128 registers it spilled up to 148
    bytes on sm_80); float32 takes 126 of its 128 and spills nothing."""
    return 128 if np.dtype(ct) == np.float64 and not _device.SIMULATOR else NT


def bounds(ct):
    """``cuda.jit``'s launch bounds: two blocks of ``threads(ct)`` per SM (at most 128
    registers per thread at 256, 255 at 128). The simulator takes none."""
    return {} if _device.SIMULATOR else {"launch_bounds": (threads(ct), 2)}


def block_size(label):
    """Threads per block the launcher uses for a ``compile_jobs`` label (benchmark/resources.py)."""
    return threads(compute(label.split("/")[-1]))


@functools.lru_cache(maxsize=None)
def kernel(ct):
    """The backward kernel for compute type ``ct``.

    Arguments (flat, C-contiguous arrays): gyf (N*Lq*M*Dh), vf (N*S*M*Dh), lf
    (N*Lq*M*L*P*r), af (N*Lq*M*L*P) in storage; gv (N*S*M*Dh, compute type, zeroed:
    added to); gl and ga (the locations' and weights' shapes, storage: written);
    levels (``ms_deform_attn.level_rows``); dims ``(N, Lq, M, Dh, S, L, P, r)``;
    want_v, want_l, want_a (bools; an unwanted gradient's array is never touched).
    """
    ct = np.dtype(ct).type

    @cuda.jit(cache=True, **bounds(ct))
    def ms_deform_attn_backward_kernel(gyf, vf, lf, af, gv, gl, ga, levels, dims, want_v, want_l, want_a):
        N, Lq, M, Dh, S, L, P, r = dims
        zero = ct(0)
        one = ct(1)
        nan = ct(math.nan)
        need_dot = want_l or want_a
        total = N * Lq * M * L * P
        for pt in range(cuda.grid(1), total, cuda.gridsize(1)):  # grid-stride, int64
            t = pt // P
            lv = t % L
            nqm = t // L  # (n * Lq + q) * M + m
            m = nqm % M
            n = nqm // (M * Lq)
            W = levels[lv, 0]
            H = levels[lv, 1]
            D = levels[lv, 2]
            st = levels[lv, 3]
            W1 = max(W, 1)
            H1 = max(H, 1)
            a = load(af, pt)
            tx = axis_grad_taps(load(lf, pt * r), W, one)
            ty = axis_grad_taps(load(lf, pt * r + 1) if r > 1 else zero, H, one)
            tz = axis_grad_taps(load(lf, pt * r + 2) if r > 2 else zero, D, one)
            if not (tx[8] and ty[8] and tz[8]):  # NaN for its own gradients, nothing scattered
                if want_a:
                    store(ga, pt, nan)
                if want_l:
                    for i in range(r):
                        store(gl, pt * r + i, nan)
                continue
            gb = nqm * Dh  # grad_out[n, q, m * Dh]
            vb = (n * S * M + m) * Dh  # value[n, 0, m, 0]; a position k adds k * M * Dh
            sa = zero
            sx = zero
            sy = zero
            sz = zero
            for c in range(8):
                k, w, gwx, gwy, gwz, inside = grad_corner(c, tx, ty, tz, W1, H1)
                if not inside:
                    continue
                ob = vb + (st + k) * (M * Dh)
                cv = a * w
                dot = zero
                for d in range(Dh):
                    g = load(gyf, gb + d)
                    if need_dot:
                        dot += load(vf, ob + d) * g
                    if want_v:
                        cuda.atomic.add(gv, ob + d, cv * g)
                if need_dot:
                    sa += w * dot
                    sx += gwx * dot
                    sy += gwy * dot
                    sz += gwz * dot
            if want_a:
                store(ga, pt, sa)
            if want_l:
                store(gl, pt * r, a * sx)
                if r > 1:
                    store(gl, pt * r + 1, a * sy)
                if r > 2:
                    store(gl, pt * r + 2, a * sz)

    return ms_deform_attn_backward_kernel


def signature(dt):
    """The argument types of ``kernel(compute(dt))`` for inputs of ``dt``."""
    from numba import from_dtype, types
    st = types.Array(from_dtype(storage(dt)), 1, "C")
    acc = types.Array(from_dtype(compute(dt)), 1, "C")
    return (st, st, st, st, acc, st, st, types.Array(types.int64, 2, "C"), types.UniTuple(types.int64, 8),
            types.boolean, types.boolean, types.boolean)


def compile_jobs():
    """(label, kernel, argument types) for every dtype: what ``compile_ptx`` type-checks
    (tests/test_ms_deform_attn_cuda.py) and the resource report measures. (The
    buffer helpers it shares are grid_sample_backward's, listed there.)"""
    for dt in DTYPES:
        yield f"ms_deform_attn_backward/{dt}", kernel(compute(dt).type), signature(dt)


def launch(grad_out, value, shapes, starts, loc, attn, want_value, want_loc, want_attn, stream=None):
    """grad_out (N, Lq, M * Dh), value (N, S, M, Dh), loc (N, Lq, M, L, P, r), attn (N,
    Lq, M, L, P): NumPy or device arrays of one float dtype; shapes int (L, r) and
    starts int (L,) on the host; validated by the front end. ``(grad_value,
    grad_locations, grad_weights)`` in that dtype, None where not wanted; NumPy for
    host inputs, device arrays otherwise; all work on ``stream`` (``_device.as_stream``)."""
    with _device.launch_guard():
        return _launch(grad_out, value, shapes, starts, loc, attn, bool(want_value), bool(want_loc),
                       bool(want_attn), _device.as_stream(stream))


def _launch(grad_out, value, shapes, starts, loc, attn, want_v, want_l, want_a, stream):
    _device.await_producers((grad_out, value, loc, attn), stream)
    dtype = np.dtype(value.dtype)
    st = storage(dtype)
    ct = compute(dtype)
    dims = dims_of(value, loc)
    N, Lq, M, Dh, S, L, P, r = dims
    points = N * Lq * M * L * P
    to_host = not _device.any_on_device(grad_out, value, loc, attn)
    run = bool(points and Dh and (want_v or want_l or want_a))
    gv = zeros(N * S * M * Dh if want_v else 0, ct, stream)

    def owned(n):
        # written by the kernel when it runs; zeros when it does not (no channels: as the CPU)
        return cuda.device_array(n, dtype=st, stream=stream) if run else zeros(n, ct, stream)

    gl = owned(points * r if want_l else 0)
    ga = owned(points if want_a else 0)
    if run:
        gyf, vf, lf, af = (_device.flat(a, stream) for a in (grad_out, value, loc, attn))
        levels = _device.int64_array(level_rows(shapes, starts), stream)
        nt = threads(ct)
        kernel(ct.type)[max(1, min(_device.MAX_BLOCKS, -(-points // nt))), nt, stream](
            gyf, vf, lf, af, gv, gl, ga, levels, dims, want_v, want_l, want_a)

    def result(want, buf, shape):
        return _device.finish(narrowed(buf, st, stream), tuple(shape), dtype, to_host, stream) if want else None

    return result(want_v, gv, value.shape), result(want_l, gl, loc.shape), result(want_a, ga, attn.shape)

"""GridSample's and affine_warp's backward on the GPU: one thread per output position,
looping over the channels, the gradients of ``x`` scattered with atomic adds.

Per output position ``(n, o)`` the kernel takes, axis by axis, the forward's taps and
weights with the weights' derivatives (``_sample.grad_taps``, the CPU kernel's
function, so both devices take the same taps), then for every channel, with
``g = grad_y[n, c, o]``:

- ``grad_x[n, c, tap] += g * w`` over the position's taps (``cuda.atomic.add`` on a
  buffer of the compute type: neighbouring positions share taps; a tap outside a
  zeros-padded input contributes nothing);
- ``d sample / d pos_k = sum over taps of (prod of the other axes' weights) * d w_k *
  x[tap]``, summed over the channels with weight ``g`` and times ``d pos / d grid``
  (``unnormalize_scale``) into the position's grid gradient, written once.
  ``nearest`` has none (0); a non-finite position gets NaN for all its coordinates
  and scatters nothing.

Per channel the derivative sums and the scatter are two loops of their own over the
taps (each nests axis by axis, innermost first, the image seen as 3-D with leading
axes of one tap of weight 1): each unrolls, so the taps stay in registers. Results
agree with the CPU kernel's up to the order of the sums and of the atomic adds.
affine_warp (``affine=True``) computes each position from theta in the forward's
(affine_grid's) order of operations, as the CPU backward does (2-D ``theta[n,k,0]·x
+ (theta[n,k,1]·y + theta[n,k,2])``, 3-D ``(theta[n,k,0]·x + (theta[n,k,2]·z +
theta[n,k,3])) + y·theta[n,k,1]``, the base coordinates by the shared
``base_coord`` in the compute type), and sums ``grid gradient * (x, y[, z], 1)``
into theta's gradient in float64: per thread over its positions, then per block (a
tree in shared memory, ``block_flush``), then one atomic add per block and entry,
so the few entries of theta's gradient see few atomics.

Work is cut into units of image ``n`` (``units``: a function of the shape), one
block per unit at a time (grid-stride over the units, so any grid is correct);
thread ``t`` of unit ``k`` takes positions ``k·NT + t + j·U·NT`` (consecutive
threads, consecutive positions: grid and grad_y reads coalesce). The rank and mode
are compile-time constants of each kernel; padding, ``align_corners`` and which
gradients are wanted are runtime values (uniform branches). Launch bounds: two
blocks per SM (``threads``: 256 threads and at most 128 registers, or 128 threads
for the variants that need more); no spills and no stack frame in any
specialisation on sm_80 or sm_90 with ptxas or nvJitLink (``numba-ops info
--cuda``). Index arithmetic is 64-bit. 16-bit data is widened on load; its
gradients are accumulated in float32 buffers and rounded once at the end
(``narrowed``); float64 is computed in float64.
"""
import functools
import math

import numpy as np
from numba import cuda

from .._dtypes import NAMES, compute, storage
from .._sample import CUBIC, LINEAR, NEAREST, TAPS, grad_taps, load_sample, unnormalize, unnormalize_scale
from .._scalar import base_coord, store
from . import _device
from .grid_sample import MODE_NAMES, geometry

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)
#: inline the block reduction into each kernel at the NVVM level (the simulator takes no option)
INLINE = {} if _device.SIMULATOR else {"forceinline": True}
#: units (blocks' worth of positions) per call that ``units`` aims at: enough blocks to
#: fill a GPU, few enough that theta's per-block atomics stay negligible
UNITS = 4096
MODE_CODES = {v: k for k, v in MODE_NAMES.items()}


def threads(ct, r, mode, affine):
    """Threads per block of the kernels for compute type ``ct``, ``r`` axes, ``mode`` and
    positions from theta (``affine``): ``_device.THREADS`` (256 on a GPU), or 128 for
    the variants that need more than 128 registers per thread to spill nothing
    (``bounds``): cubic in 3-D or in float64, float64 linear in 3-D, and from theta in
    3-D, cubic or float64 (the float64 sums of theta's gradient take registers too;
    nvJitLink 13.5 spilled 3-D linear from theta at 256 threads)."""
    f64 = np.dtype(ct) == np.float64
    heavy = ((mode == CUBIC and (r == 3 or f64)) or (f64 and r == 3 and mode == LINEAR)
             or (affine and (f64 or r == 3 or mode == CUBIC)))
    return 128 if heavy and not _device.SIMULATOR else _device.THREADS


def bounds(ct, r, mode, affine):
    """``cuda.jit``'s launch bounds: two blocks of ``threads(ct, r, mode, affine)`` per SM
    (at most 128 registers per thread at 256 threads, 255 at 128). The simulator takes none."""
    return {} if _device.SIMULATOR else {"launch_bounds": (threads(ct, r, mode, affine), 2)}


def block_size(label):
    """Threads per block the launcher uses for a ``compile_jobs`` label (benchmark/resources.py)."""
    parts = label.split("/")  # op/<r>d/<mode>/<dtype>, or backward.<helper>/...
    if parts[0] in ("grid_sample_backward", "affine_warp_backward"):
        return threads(compute(parts[-1]), int(parts[1][0]), MODE_CODES[parts[2]],
                       parts[0] == "affine_warp_backward")
    return _device.THREADS


def units(N, P, nt):
    """Units per image for ``N`` images of ``P`` positions, blocks of ``nt`` threads:
    one per ``nt`` positions, at most ``UNITS`` over the batch (at least one per image)."""
    return max(1, min(-(-P // nt), -(-UNITS // max(N, 1))))


@functools.lru_cache(maxsize=None)
def block_flush(nt, rr):
    """The device function ``flush(sh, acc, out, base, t)``: ``out[base + j] += sum over
    the block's ``nt`` threads of their ``acc[j]``, j < ``rr`` (float64; a tree in the
    shared array ``sh`` (nt, rr), then one atomic add per entry). Every thread of the
    block calls it (it synchronises the block)."""
    NT = nt
    RR = rr
    assert NT & (NT - 1) == 0, NT

    @cuda.jit(device=True, **INLINE)
    def flush(sh, acc, out, base, t):
        for j in range(RR):
            sh[t, j] = acc[j]
        cuda.syncthreads()
        s = NT // 2
        while s > 0:
            if t < s:
                for j in range(RR):
                    sh[t, j] += sh[t + s, j]
            cuda.syncthreads()
            s //= 2
        if t < RR:
            cuda.atomic.add(out, base + t, sh[0, t])
        cuda.syncthreads()  # sh is free again

    return flush


@functools.lru_cache(maxsize=None)
def kernel(ct, r, mode, affine):
    """The backward kernel for compute type ``ct``, ``r`` spatial axes, ``mode`` (a
    ``_sample`` code), positions from a grid or (``affine``) from theta.

    Arguments: xf (N*C*S) and gyf (N*C*P) flat storage; src the flat grid (N*P*r) or
    theta (N*r*(r+1)); gx (N*C*S, compute type, zeroed: gradients added); gpos the
    grid's gradient (N*P*r, storage, written) or theta's (N*r*(r+1), float64, zeroed:
    added); dims ``(N, U, C, P, S, D, H, W)`` (``U`` units per image, D, H, W the
    output's spatial sizes as 3 axes, leading 1s); geo (``grid_sample.geometry`` of
    x); padding (a ``_sample`` code); align, want_x, want_pos (bools).
    """
    ct = np.dtype(ct).type
    R = r
    MODE = mode
    AFFINE = affine
    NT = threads(ct, r, mode, affine)
    RR = r * (r + 1)
    LEAD = 3 - r  # leading axes of the 3-axis view: one tap of weight 1
    T = TAPS[mode]
    NZ = T if r == 3 else 1
    NY = T if r >= 2 else 1
    SH = (NT, RR) if affine else (1, 1)
    flush = block_flush(NT, RR)

    @cuda.jit(**bounds(ct, r, mode, affine))
    def grid_sample_backward_kernel(xf, gyf, src, gx, gpos, dims, geo, padding, align, want_x, want_pos):
        N, U, C, P, S, D, H, W = dims
        zero = ct(0)
        one = ct(1)
        nan = ct(math.nan)
        # per axis a of the 3-axis view, tap t at [4a + t]: flat offset, weight, derivative, inside
        ti = cuda.local.array(12, np.int64)
        tw = cuda.local.array(12, ct)
        td = cuda.local.array(12, ct)
        tok = cuda.local.array(12, np.bool_)
        scl = cuda.local.array(3, ct)
        gcoord = cuda.local.array(3, ct)
        bc = cuda.local.array(3, ct)  # base coordinates (x, y, z)
        acc = cuda.local.array(RR, np.float64)
        sh = cuda.shared.array(SH, np.float64)
        for a in range(LEAD):
            ti[4 * a] = 0
            tw[4 * a] = one
            td[4 * a] = zero
            tok[4 * a] = True
        t = np.int64(cuda.threadIdx.x)
        deriv = want_pos and MODE != NEAREST
        for unit in range(np.int64(cuda.blockIdx.x), N * U, np.int64(cuda.gridDim.x)):  # grid-stride
            n = unit // U
            k = unit - n * U
            for j in range(RR):
                acc[j] = 0.0
            for p in range(k * NT + t, P, U * NT):
                if AFFINE:
                    row = p // W
                    bc[0] = base_coord(p - row * W, W, align, one)
                    dd = row // H
                    bc[1] = base_coord(row - dd * H, H, align, one)
                    bc[2] = base_coord(dd, D, align, one)
                finite = True
                for a in range(LEAD, 3):
                    ci = 2 - a  # the grid's coordinate of this axis (innermost first)
                    if AFFINE:  # in the forward's order of operations: its positions, bit for bit
                        th = (n * R + ci) * (R + 1)
                        t0 = load_sample(src, th, one)
                        t1 = load_sample(src, th + 1, one)
                        t2 = load_sample(src, th + 2, one)
                        if R == 2:
                            g = t0 * bc[0] + (t1 * bc[1] + t2)
                        else:
                            g = (t0 * bc[0] + (t2 * bc[2] + load_sample(src, th + 3, one))) + bc[1] * t1
                    else:
                        g = load_sample(src, (n * P + p) * R + ci, one)
                    size = geo[a - LEAD]
                    (i0, i1, i2, i3, w0, w1, w2, w3, d0, d1, d2, d3, ok0, ok1, ok2, ok3,
                     fin) = grad_taps(MODE, unnormalize(g, size, align, one), size, padding, align, zero)
                    finite = finite and fin
                    s = geo[3 + a - LEAD]
                    ti[4 * a], ti[4 * a + 1], ti[4 * a + 2], ti[4 * a + 3] = i0 * s, i1 * s, i2 * s, i3 * s
                    tw[4 * a], tw[4 * a + 1], tw[4 * a + 2], tw[4 * a + 3] = w0, w1, w2, w3
                    td[4 * a], td[4 * a + 1], td[4 * a + 2], td[4 * a + 3] = d0, d1, d2, d3
                    tok[4 * a], tok[4 * a + 1], tok[4 * a + 2], tok[4 * a + 3] = ok0, ok1, ok2, ok3
                    scl[a] = unnormalize_scale(size, align, one)
                scatter = want_x and finite
                gz = zero
                gyy = zero
                gxx = zero
                for c in range(C):
                    gv = load_sample(gyf, (n * C + c) * P + p, zero)
                    xb = (n * C + c) * S
                    if deriv:  # the sample's derivatives, nested as the CPU kernel's sums
                        az = zero
                        ay = zero
                        ax = zero
                        for tz in range(NZ):
                            if not tok[tz]:
                                continue
                            oz = xb + ti[tz]
                            sy = zero
                            sdy = zero
                            sdx = zero
                            for ty in range(NY):
                                if not tok[4 + ty]:
                                    continue
                                oy = oz + ti[4 + ty]
                                sx = zero
                                dx = zero
                                for tx in range(T):
                                    if tok[8 + tx]:
                                        v = load_sample(xf, oy + ti[8 + tx], zero)
                                        sx += tw[8 + tx] * v
                                        dx += td[8 + tx] * v
                                sy += tw[4 + ty] * sx
                                sdy += td[4 + ty] * sx
                                sdx += tw[4 + ty] * dx
                            az += td[tz] * sy
                            ay += tw[tz] * sdy
                            ax += tw[tz] * sdx
                        gz += gv * az
                        gyy += gv * ay
                        gxx += gv * ax
                    if scatter:  # a loop of its own: each nest unrolls, the taps stay in registers
                        for tz in range(NZ):
                            if not tok[tz]:
                                continue
                            oz = xb + ti[tz]
                            for ty in range(NY):
                                if not tok[4 + ty]:
                                    continue
                                oy = oz + ti[4 + ty]
                                wzy = tw[tz] * tw[4 + ty]
                                for tx in range(T):
                                    if tok[8 + tx]:
                                        cuda.atomic.add(gx, oy + ti[8 + tx], gv * (wzy * tw[8 + tx]))
                if want_pos:
                    gcoord[0] = gxx * scl[2]
                    gcoord[1] = gyy * scl[1]
                    gcoord[2] = gz * scl[0]
                    for ci in range(R):
                        gc = gcoord[ci] if finite else nan
                        if MODE == NEAREST and finite:
                            gc = zero
                        if AFFINE:
                            for q in range(R):
                                acc[ci * (R + 1) + q] += np.float64(gc) * np.float64(bc[q])
                            acc[ci * (R + 1) + R] += np.float64(gc)
                        else:
                            store(gpos, (n * P + p) * R + ci, gc)
            if AFFINE:
                if want_pos:  # uniform over the block
                    flush(sh, acc, gpos, n * RR, t)

    return grid_sample_backward_kernel


# --- buffers: zeroed accumulators, rounded once -------------------------------------

@cuda.jit(cache=True)
def fill_zero(a):
    """a[:] = 0 (an accumulator before its atomic adds)."""
    for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):  # grid-stride, int64
        a[i] = 0


@cuda.jit(cache=True)
def narrow(src, dst):
    """dst[i] = src[i] rounded once to dst's storage type (``store``)."""
    for i in range(cuda.grid(1), src.shape[0], cuda.gridsize(1)):  # grid-stride, int64
        store(dst, i, src[i])


def zeros(n, dtype, stream):
    """A zeroed device array of ``n`` elements of ``dtype`` (float32 or float64), on ``stream``."""
    a = cuda.device_array(n, dtype=dtype, stream=stream)
    if n:
        fill_zero[_device.blocks_for(n), _device.THREADS, stream](a)
    return a


def narrowed(buf, st, stream):
    """The accumulator ``buf`` in the storage dtype ``st``: itself when it has that dtype,
    else a new array of its values rounded once."""
    if np.dtype(buf.dtype) == np.dtype(st):
        return buf
    out = cuda.device_array(buf.shape[0], dtype=st, stream=stream)
    if buf.shape[0]:
        narrow[_device.blocks_for(buf.shape[0]), _device.THREADS, stream](buf, out)
    return out


def helper_jobs():
    """(label, kernel, argument types) of ``fill_zero`` and ``narrow`` for the types the
    launchers of the backward kernels use."""
    from numba import from_dtype, types
    from .._dtypes import DTYPES as ALL
    arr = lambda dt: types.Array(from_dtype(np.dtype(dt)), 1, "C")  # noqa: E731
    for dt in (np.float32, np.float64):
        yield f"backward.fill_zero/{np.dtype(dt)}", fill_zero, (arr(dt),)
    for dt in ALL:
        for acc in (compute(dt), np.dtype(np.float64)):
            if acc != storage(dt):
                yield f"backward.narrow/{acc}/{dt}", narrow, (arr(acc), arr(storage(dt)))


def signature(r, dt, affine):
    """The argument types of ``kernel(compute(dt), r, mode, affine)`` for inputs of ``dt``."""
    from numba import from_dtype, types
    i64 = types.int64
    st = types.Array(from_dtype(storage(dt)), 1, "C")
    acc = types.Array(from_dtype(compute(dt)), 1, "C")
    pos = types.Array(types.float64, 1, "C") if affine else st
    return (st, st, st, acc, pos, types.UniTuple(i64, 8), types.UniTuple(i64, 6), i64, types.boolean,
            types.boolean, types.boolean)


def compile_jobs():
    """(label, kernel, argument types) for every rank, mode and dtype, and the buffer
    helpers: what ``compile_ptx`` type-checks and the resource report measures."""
    for dt in DTYPES:
        for r in (1, 2, 3):
            for mode, mname in MODE_NAMES.items():
                yield (f"grid_sample_backward/{r}d/{mname}/{dt}", kernel(compute(dt).type, r, mode, False),
                       signature(r, dt, False))
    yield from helper_jobs()


# --- launch -------------------------------------------------------------------------

def launch(gy, x, grid, mode, padding, align, want_x, want_grid, stream=None):
    """grad_y (N, C, O1..Or), x (N, C, D1..Dr), grid (N, O1..Or, r): NumPy or device
    arrays of one float dtype, validated by the front end (``mode``/``padding`` are
    ``_sample`` codes). ``(gx, ggrid)`` in that dtype, None where not wanted; NumPy
    for host inputs, device arrays otherwise; all work on ``stream``
    (``_device.as_stream``)."""
    with _device.launch_guard():
        return run(gy, x, grid, tuple(int(s) for s in grid.shape[1:-1]), mode, padding, align, False,
                   bool(want_x), bool(want_grid), _device.as_stream(stream))


def run(gy, x, src, out_spatial, mode, padding, align, affine, want_x, want_pos, stream):
    """The launch shared with affine_warp: ``(gx, gpos)``, ``gpos`` the grid's gradient
    (N, O1..Or, r) or (``affine``) theta's (N, r, r+1); None where not wanted."""
    _device.await_producers((gy, x, src), stream)
    dtype = np.dtype(x.dtype)
    st = storage(dtype)
    ct = compute(dtype)
    r = x.ndim - 2
    N, C = int(x.shape[0]), int(x.shape[1])
    S = int(np.prod(x.shape[2:], dtype=np.int64))
    P = int(np.prod(out_spatial, dtype=np.int64))
    to_host = not _device.any_on_device(gy, x, src)
    gx = zeros(N * C * S if want_x else 0, ct, stream)
    if affine:
        gpos = zeros(N * r * (r + 1) if want_pos else 0, np.float64, stream)
    else:
        gpos = cuda.device_array(N * P * r if want_pos else 0, dtype=st, stream=stream)
    if N * P and (want_x or want_pos):
        nt = threads(ct, r, mode, affine)
        U = units(N, P, nt)
        D, H, W = (1,) * (3 - r) + tuple(out_spatial)
        xf, gyf, sf = (_device.flat(a, stream) for a in (x, gy, src))
        kernel(ct.type, r, mode, affine)[max(1, min(N * U, _device.MAX_BLOCKS)), nt, stream](
            xf, gyf, sf, gx, gpos, (N, U, C, P, S, D, H, W), geometry(x.shape[2:]), np.int64(padding),
            bool(align), want_x, want_pos)
    out_x = _device.finish(narrowed(gx, st, stream), tuple(x.shape), dtype, to_host, stream) if want_x else None
    if not want_pos:
        return out_x, None
    shape = (N, r, r + 1) if affine else (N,) + tuple(out_spatial) + (r,)
    return out_x, _device.finish(narrowed(gpos, st, stream), shape, dtype, to_host, stream)

"""DeformConv's backward on the GPU, N-D: a sampling kernel, one thread per sample
point ``(n, offset group g, kernel point kidx, output position o)``, then reductions
for the weights' and the bias' gradients.

With ``S(c) = S(x[n, c], pos)`` the n-linear sample at the point's position (axis
``i``: ``o_i·stride_i - begin_i + k_i·dil_i + offset[n, (g·K + kidx)·nd + i, o]``,
corners outside the input counting 0) and ``m = mask[n, g, kidx, o]`` (1 without a
mask), the thread

1. splits the position per axis (``_scalar.split_position``, then
   ``_sample.grad_taps_at`` for the two taps and whether each is inside: the CPU
   kernel's functions) into the flat indices and weights of its 2**nd corners
   (a corner outside the input, or every corner of a position that is huge or not
   finite, is dropped: it counts 0 exactly);
2. for every channel ``c`` of the offset group: ``S(c)`` and, where needed,
   ``gcol = sum over oc of c's conv group of w[oc, c, kidx] · grad_y[n, oc, o]``
   (the column gradient, summed in the thread: each (c, kidx, o) is one thread's),
   ``dS/dpos_i`` (the derivative from ``floor``: each corner's value with the other
   axes' weights, signed by its side along ``i``), and
   - ``grad_x[n, c, corner] += gcol · m · weight`` (``cuda.atomic.add`` on a buffer
     of the compute type),
   - ``col[c, kidx, o] = m · S(c)`` (for the weights' gradient);
3. writes ``grad_mask = sum_c gcol · S(c)`` and ``grad_offset_i = m · sum_c gcol ·
   dS/dpos_i`` once (NaN for a position that is not finite, which adds nothing to
   ``grad_x`` or ``grad_w``).

``weights_kernel``: ``grad_w[oc, c, kidx] += sum over o of grad_y[n, oc, o] ·
col[c, kidx, o]``, a block per element (threads along the positions, coalesced; a
shared-memory tree), over a chunk of images whose ``col`` is at most
``COL_BYTES`` (at least one image), chunk after chunk on the stream: each element
is one block's, so no atomics. ``bias_kernel``: ``grad_b[oc]`` = the float64 sum of
``grad_y[:, oc]``, a block per output channel.

The sums follow the CPU kernel's nesting (corners in order, channels in order), so
results agree with it up to the order of the atomic adds into ``grad_x`` and of the
GEMMs' sums on the CPU. The rank is a compile-time constant of the sampling kernel
(its corner loops unroll into registers); group counts and the wanted gradients are
runtime values. Launch bounds: two blocks per SM, of 256 threads (at most 128
registers), or 128 for n >= 3 (``threads``); no spills in any listed variant on
sm_80 or sm_90 with ptxas or nvJitLink (``numba-ops info --cuda``). Index
arithmetic is 64-bit. 16-bit data is widened on load, its
gradients accumulated in float32 and rounded once; float64 runs in float64.
"""
import functools
import math

import numpy as np
from numba import cuda

from .._dtypes import NAMES, compute, storage
from .._sample import LINEAR, ZEROS, grad_taps_at
from .._scalar import load, split_position, store
from . import _device
from .grid_sample_backward import narrowed, zeros

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)
#: most bytes of ``col`` (the sampled columns) per chunk of images
COL_BYTES = 64 << 20
#: largest n the kernel takes (as the forward CUDA kernel)
MAX_ND = 9
#: threads per block of the reductions (and of the sampling kernel for n <= 2)
NT = _device.THREADS


def threads(nd):
    """Threads per block of the sampling kernel for ``nd`` spatial dims: ``NT``, or 128
    for n >= 3 on a GPU, whose 2**n corners (offsets, weights, and each axis' weights
    of the other axes, loop-invariant over the channels) want more than 128 registers
    per thread (at 256 threads and 128 registers float64 spilled 148 bytes)."""
    return 128 if nd >= 3 and not _device.SIMULATOR else NT


def bounds(nt=NT):
    """Launch bounds: two blocks of ``nt`` threads per SM (at most 128 registers per
    thread at 256, 255 at 128); the simulator takes none."""
    return {} if _device.SIMULATOR else {"launch_bounds": (nt, 2)}


def block_size(label):
    """Threads per block the launcher uses for a ``compile_jobs`` label (benchmark/resources.py)."""
    parts = label.split("/")  # deform_conv_backward/<n>d/<dtype>, or deform_conv_backward.<reduction>/<dtype>
    return threads(int(parts[1][:-1])) if parts[0] == "deform_conv_backward" else NT


@functools.lru_cache(maxsize=None)
def kernel(ct, nd):
    """The sampling kernel for compute type ``ct`` and ``nd`` spatial dims.

    Arguments (flat, C-contiguous storage arrays): x (N*C*S), w (oC*cpg*K), offset
    (N*og*K*nd*P), mask (N*og*K*P, or a dummy), gy (N*oC*P); gx (N*C*S, compute
    type, zeroed: added to), col (nb*C*K*P, compute type: written), goff
    (N*og*K*nd*P) and gmask (N*og*K*P) in storage (written); geo (7*nd int64: per
    axis, outermost first, size, stride of x, output size, conv stride, pad begin,
    dilation, kernel size); dims ``(C, oC, og, K, P, S, cpg, ocg, n0, nb, has_mask,
    want_x, want_w, want_off, want_mask)``: this launch covers images n0 .. n0+nb-1.
    """
    ct = np.dtype(ct).type
    ND = nd
    NC = 1 << nd

    @cuda.jit(**bounds(threads(nd)))
    def deform_conv_backward_kernel(x, w, off, mask, gy, gx, col, goff, gmask, geo, dims):
        C, oC, og, K, P, S, cpg, ocg, n0, nb = dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], \
            dims[7], dims[8], dims[9]
        has_mask = dims[10] != 0
        want_x = dims[11] != 0
        want_w = dims[12] != 0
        want_off = dims[13] != 0
        want_mask = dims[14] != 0
        need_gcol = want_x or want_off or want_mask
        zero = ct(0)
        one = ct(1)
        nan = ct(math.nan)
        cidx = cuda.local.array(NC, np.int64)  # a corner's flat offset in the image, -1: dropped
        cw = cuda.local.array(NC, ct)
        fr = cuda.local.array(ND, ct)  # per axis the upper corner's weight
        ds = cuda.local.array(ND, ct)
        Cg = C // og
        total = nb * og * K * P
        for q in range(cuda.grid(1), total, cuda.gridsize(1)):  # grid-stride, int64
            o = q % P
            r = q // P
            k = r % K
            r //= K
            g = r % og
            nl = r // og
            n = n0 + nl
            ogk = (n * og + g) * K + k
            m = load(mask, ogk * P + o) if has_mask else one
            finite = True
            for cn in range(NC):
                cidx[cn] = 0
            rem = o
            kr = k
            # axis by axis from the innermost: output index, kernel index, position, corners
            for ar in range(ND):
                a = ND - 1 - ar
                b = 7 * a
                osz = geo[b + 2]
                ks = geo[b + 6]
                oi = rem % osz
                rem //= osz
                ki = kr % ks
                kr //= ks
                base = oi * geo[b + 3] - geo[b + 4] + ki * geo[b + 5]
                i, frac, near, fa = split_position(base, load(off, (ogk * ND + a) * P + o), zero)
                if not near:  # huge or not finite: outside, every corner 0
                    i = np.int64(-2)
                    frac = zero
                t0, t1, _, _, _, _, _, _, _, _, _, _, ok0, ok1, _, _ = grad_taps_at(
                    LINEAR, i, frac, fa, geo[b], np.int64(0), ZEROS, False, zero)
                finite = finite and fa
                fr[a] = frac
                st = geo[b + 1]
                for cn in range(NC):
                    if cidx[cn] >= 0:
                        if (cn >> (ND - 1 - a)) & 1:
                            cidx[cn] = cidx[cn] + t1 * st if ok1 else np.int64(-1)
                        else:
                            cidx[cn] = cidx[cn] + t0 * st if ok0 else np.int64(-1)
            for cn in range(NC):
                wt = one
                for a in range(ND):
                    wt *= fr[a] if (cn >> (ND - 1 - a)) & 1 else one - fr[a]
                if not finite:
                    cidx[cn] = -1
                cw[cn] = wt if cidx[cn] >= 0 else zero
            for a in range(ND):
                ds[a] = zero
            ssum = zero
            for cg in range(Cg):
                c = g * Cg + cg
                xb = (n * C + c) * S
                s = zero
                for cn in range(NC):
                    ix = cidx[cn]
                    if ix >= 0:
                        s += cw[cn] * load(x, xb + ix)
                if want_w:
                    col[((nl * C + c) * K + k) * P + o] = m * s
                if not need_gcol:
                    continue
                gi = c // cpg
                wb = (c - gi * cpg) * K + k
                gv = zero
                for j in range(ocg):
                    oc = gi * ocg + j
                    gv += load(w, oc * cpg * K + wb) * load(gy, (n * oC + oc) * P + o)
                if want_off or want_mask:
                    ssum += gv * s
                if want_off:
                    for a in range(ND):
                        # d S / d pos_a: each corner's value with the other axes' weights, signed by its side
                        dv = zero
                        for cn in range(NC):
                            ix = cidx[cn]
                            if ix < 0:
                                continue
                            wo = one
                            for a2 in range(ND):
                                if a2 != a:
                                    wo *= fr[a2] if (cn >> (ND - 1 - a2)) & 1 else one - fr[a2]
                            v = wo * load(x, xb + ix)
                            dv += v if (cn >> (ND - 1 - a)) & 1 else -v
                        ds[a] += gv * dv
                if want_x:
                    gm = gv * m if has_mask else gv
                    for cn in range(NC):
                        ix = cidx[cn]
                        if ix >= 0:
                            cuda.atomic.add(gx, xb + ix, gm * cw[cn])
            if want_mask:
                store(gmask, ogk * P + o, ssum if finite else nan)
            if want_off:
                for a in range(ND):
                    store(goff, (ogk * ND + a) * P + o, m * ds[a] if finite else nan)

    return deform_conv_backward_kernel


@functools.lru_cache(maxsize=None)
def weights_kernel(ct):
    """``grad_w`` for compute type ``ct``: gy (N*oC*P, storage), col (nb*C*K*P, compute
    type), gw (oC*cpg*K, compute type: added to); dims ``(C, oC, K, P, cpg, ocg, n0,
    nb)``. A block per element of gw (grid-stride), its threads along the positions."""
    ct = np.dtype(ct).type

    @cuda.jit(**bounds())
    def deform_conv_backward_weights(gy, col, gw, dims):
        C, oC, K, P, cpg, ocg, n0, nb = dims
        sh = cuda.shared.array(NT, ct)
        t = np.int64(cuda.threadIdx.x)
        for e in range(np.int64(cuda.blockIdx.x), oC * cpg * K, np.int64(cuda.gridDim.x)):  # grid-stride
            k = e % K
            r = e // K
            oc = r // cpg
            c = (oc // ocg) * cpg + (r - oc * cpg)
            s = ct(0)
            for nl in range(nb):
                gb = ((n0 + nl) * oC + oc) * P
                cb = ((nl * C + c) * K + k) * P
                for o in range(t, P, NT):
                    s += load(gy, gb + o) * col[cb + o]
            sh[t] = s
            cuda.syncthreads()
            h = NT // 2
            while h > 0:
                if t < h:
                    sh[t] += sh[t + h]
                cuda.syncthreads()
                h //= 2
            if t == 0:
                gw[e] += sh[0]
            cuda.syncthreads()  # sh is free again

    return deform_conv_backward_weights


@cuda.jit(**bounds())
def bias_kernel(gy, gb, N, oC, P):
    """gb[oc] = the float64 sum of gy[:, oc, :] (N*oC*P, storage), rounded once into
    gb's storage; a block per output channel (grid-stride), threads along the positions."""
    sh = cuda.shared.array(NT, np.float64)
    t = np.int64(cuda.threadIdx.x)
    for oc in range(np.int64(cuda.blockIdx.x), oC, np.int64(cuda.gridDim.x)):  # grid-stride
        s = 0.0
        for n in range(N):
            b = (n * oC + oc) * P
            for o in range(t, P, NT):
                s += np.float64(load(gy, b + o))
        sh[t] = s
        cuda.syncthreads()
        h = NT // 2
        while h > 0:
            if t < h:
                sh[t] += sh[t + h]
            cuda.syncthreads()
            h //= 2
        if t == 0:
            store(gb, oc, sh[0])
        cuda.syncthreads()  # sh is free again


def compile_jobs():
    """(label, kernel, argument types) for n = 1, 2, 3 and every dtype, and the
    reductions: what ``compile_ptx`` type-checks and the resource report measures."""
    from numba import from_dtype, types
    i64 = types.int64
    for dt in DTYPES:
        st = types.Array(from_dtype(storage(dt)), 1, "C")
        acc = types.Array(from_dtype(compute(dt)), 1, "C")
        ct = compute(dt).type
        for nd in (1, 2, 3):
            yield (f"deform_conv_backward/{nd}d/{dt}", kernel(ct, nd),
                   (st, st, st, st, st, acc, acc, st, st, types.Array(i64, 1, "C"), types.UniTuple(i64, 15)))
        yield f"deform_conv_backward.weights/{dt}", weights_kernel(ct), (st, acc, acc, types.UniTuple(i64, 8))
        yield f"deform_conv_backward.bias/{dt}", bias_kernel, (st, st, i64, i64, i64)


def launch(gy, x, w, offset, b, mask, p, wants, stream=None):
    """Validated inputs (NumPy or numba device arrays of one dtype; ``p``: DeformParams;
    ``wants``: x, w, offset, b, mask). ``(gx, gw, goffset, gb, gmask)`` in that dtype,
    None where not wanted; NumPy for host inputs, device arrays otherwise; all work
    on ``stream`` (``_device.as_stream``)."""
    with _device.launch_guard():
        return _launch(gy, x, w, offset, b, mask, p, wants, _device.as_stream(stream))


def _launch(gy, x, w, offset, b, mask, p, wants, stream):
    _device.await_producers((gy, x, w, offset, b, mask), stream)
    want_x, want_w, want_off, want_b, want_m = (bool(v) for v in wants)
    want_m = want_m and mask is not None
    dtype = np.dtype(x.dtype)
    st = storage(dtype)
    ct = compute(dtype)
    nd, K, og, G = p.nd, p.K, p.offset_group, p.group
    if nd > MAX_ND:
        raise NotImplementedError(f"the CUDA DeformConv backward takes up to {MAX_ND} spatial dims; got {nd}")
    N, C = int(x.shape[0]), int(x.shape[1])
    oC = int(w.shape[0])
    cpg, ocg = C // G, oC // G
    S = int(np.prod(x.shape[2:], dtype=np.int64))
    P = int(np.prod(p.out_spatial, dtype=np.int64))
    to_host = not _device.any_on_device(gy, x, w, offset, b, mask)
    gx = zeros(N * C * S if want_x else 0, ct, stream)
    gw = zeros(oC * cpg * K if want_w else 0, ct, stream)
    goff = cuda.device_array(N * og * K * nd * P if want_off else 0, dtype=st, stream=stream)
    gmask = cuda.device_array(N * og * K * P if want_m else 0, dtype=st, stream=stream)
    need_gcol = want_x or want_off or want_m
    if N * P and (need_gcol or want_w):
        xf, wf, of, gyf = (_device.flat(a, stream) for a in (x, w, offset, gy))
        mf = _device.dummy(st, stream) if mask is None else _device.flat(mask, stream)
        geo = []
        for a in range(nd):
            geo += [int(x.shape[2 + a]), int(np.prod(x.shape[3 + a:], dtype=np.int64)), p.out_spatial[a],
                    p.strides[a], p.pads_begin[a], p.dilations[a], p.kernel_shape[a]]
        geo = _device.int64_array(geo, stream)
        per_image = C * K * P * ct.itemsize
        nb = max(1, min(N, COL_BYTES // max(1, per_image))) if want_w else N
        col = cuda.device_array(nb * C * K * P if want_w else 0, dtype=ct, stream=stream)
        sample = kernel(ct.type, nd)
        for n0 in range(0, N, nb):
            nbt = min(nb, N - n0)
            dims = (C, oC, og, K, P, S, cpg, ocg, n0, nbt, mask is not None, want_x, want_w, want_off, want_m)
            nt = threads(nd)
            sample[max(1, min(_device.MAX_BLOCKS, -(-(nbt * og * K * P) // nt))), nt, stream](
                xf, wf, of, mf, gyf, gx, col, goff, gmask, geo, tuple(int(v) for v in dims))
            if want_w and gw.shape[0]:
                weights_kernel(ct.type)[max(1, min(gw.shape[0], _device.MAX_BLOCKS)), NT, stream](
                    gyf, col, gw, (C, oC, K, P, cpg, ocg, n0, nbt))
    gb = None
    if want_b:
        gbf = cuda.device_array(oC, dtype=st, stream=stream)
        if oC:
            bias_kernel[max(1, min(oC, _device.MAX_BLOCKS)), NT, stream](
                _device.flat(gy, stream), gbf, np.int64(N), np.int64(oC), np.int64(P))
        gb = _device.finish(gbf, (oC,), dtype, to_host, stream)

    def result(want, buf, shape):
        return _device.finish(narrowed(buf, st, stream), tuple(shape), dtype, to_host, stream) if want else None

    return (result(want_x, gx, x.shape), result(want_w, gw, w.shape), result(want_off, goff, offset.shape), gb,
            result(want_m, gmask, None if mask is None else mask.shape))

"""DeformConv on the GPU: a fused, tiled implicit GEMM.

The op is a GEMM per (image, group), ``Y[oc, p] = Σ_r W[oc, r] · cols[r, p]``,
whose right operand ``cols`` (the deformable im2col: one interpolated sample per
reduction row ``r = (c, kidx)`` and output position ``p``) is gathered, never
stored. torchvision writes the whole im2col matrix (C·K·P floats per image) to
global memory and reads it back for cuBLAS; here each thread block owns a
``TO × TP`` output tile (64 output channels × 64 positions on the GPU) and walks
the reduction in chunks of ``RK`` rows:

1. the *sampling plan* for the tile's positions at one kernel point ``kidx`` and
   offset group: for each position, the flat indices of its in-range corners and
   their n-linear weights with a finite mask folded in (per axis ``border_corner``
   from ``kernels/_scalar.py``, the CPU kernel's function). A plan serves every
   channel of the offset group, so it is rebuilt only when ``kidx`` or the offset
   group changes (the reduction runs kidx-major, channel-minor);
2. the ``RK × TP`` sample tile is filled from the plan into shared memory
   (a few gathers and FMAs per sample, from L2-resident ``x``; the plan is
   stored corner-major so a warp reads it without bank conflicts) and the
   ``RK × TO`` weight tile beside it, with coalesced loads from a copy of W laid
   out (group, kidx, c, oc) by ``weights_by_kernel_point`` once per call;
3. each of the 256 threads accumulates a ``TM × TN`` (4 × 4) register block of
   the output tile by outer products over the ``RK`` rows, reading 8 shared
   values per 16 FMAs, with float32 accumulators (float64 for float64).

Why this suits an H100/H200: the op's arithmetic intensity is that of the GEMM
(2·oC FLOPs per sample) only if the samples are not written to and re-read from
HBM; keeping them in shared memory removes the C·K·P·4-byte round trip that
torchvision pays (write, then read by cuBLAS) for every image, each sample is
gathered once per 64 output channels instead of once per channel, and the plan
amortises the offset/mask reads and the weight arithmetic over the channels.
A block uses ~15 KB of shared memory (float32) and at most 128 registers per
thread (launch bounds), so two blocks share an SM and one block's latency-bound
sampling overlaps the other's GEMM; tiles are distributed by a grid-stride
loop, so any grid size is correct. numba-cuda exposes no tensor-core MMA, so
the GEMM runs on the FP32 FFMA pipes (~60 TFLOP/s on an H100/H200). The
performance is unmeasured so far (written without a GPU);
``bench/gpu_bench.py`` measures it against torchvision.

16-bit data is read and written through ``load``/``store`` (bit patterns, one
rounding on the way out); all index arithmetic is 64-bit. Every output element is
written once, by the thread that accumulated it: ``y = b + Σ``. Corners outside
the input count 0 exactly (they are dropped from the plan, never multiplied by 0),
a non-finite sample position gives a NaN sample, a position outside the input
gives ``0 · mask`` (so a NaN/Inf mask still poisons it, as the definition's
``mask · sample`` does), a NaN/Inf mask multiplies the finished sample (as on the
CPU: folded into corner weights it would make 0 · Inf and Inf - Inf), and
``border_corner`` keeps huge finite offsets from ever reaching an integer conversion.
"""
import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda

from ..._dtypes import compute, storage
from .._scalar import border_corner, load, store
from . import _device

DTYPES = ("float16", "bfloat16", "float32", "float64")


class Tiles(NamedTuple):
    """A block is ``TY × TX`` threads; each thread owns ``TM`` output channels ×
    ``TN`` positions; the reduction advances ``RK`` rows per shared-memory chunk."""
    TY: int
    TX: int
    TM: int
    TN: int
    RK: int


#: 256 threads, 64 × 64 output tile: the GPU configuration for n <= 3 spatial dims.
GPU_TILES = Tiles(16, 16, 4, 4, 16)
#: n >= 4: a plan holds 2**n corners per position, so the tile narrows to 4 positions.
GPU_TILES_ND = Tiles(64, 4, 1, 1, 16)
#: the simulator runs each thread as a Python thread: 4 threads, 4 × 4 tiles (so
#: small test shapes still span several tiles and partial tiles).
SIM_TILES = Tiles(2, 2, 2, 2, 4)
#: largest n the CUDA kernel takes (a 4-position plan of 2**9 corners is 32 KB).
MAX_ND = 9


def config(nd):
    """(tiles, nd_max) used for ``nd`` spatial dims: nd_max sizes the plan (2**nd_max corners)."""
    if _device.SIMULATOR:
        return SIM_TILES, max(3, nd)
    return (GPU_TILES, 3) if nd <= 3 else (GPU_TILES_ND, nd)


@functools.lru_cache(maxsize=None)
def kernel(ct, tiles, nd_max):
    """The tiled kernel for compute type ``ct``, tile shape ``tiles`` and at most
    ``nd_max`` spatial dims.

    Arguments (flat, C-contiguous storage arrays): x (N*C*S), w (group, K, C/group,
    oC/group: ``weights_by_kernel_point``'s layout, so a tile's weights are rows),
    offset (N*og*K*nd*P), mask (N*og*K*P, or a 1-element dummy), bias (oC, or a
    dummy), y (N*oC*P); geo (6, nd) int64 rows: input sizes, kernel, strides,
    pads begin, dilations, output sizes; dims int64: N, C, oC, group,
    offset_group, K, P, S, nd, has_mask, has_bias.
    """
    ct = np.dtype(ct).type
    TY, TX, TM, TN, RK = tiles
    NT = TY * TX
    TO = TY * TM
    TP = TX * TN
    NC = 1 << nd_max
    ND = nd_max

    # Two blocks per SM (128 registers): without the bound ptxas takes 172 (float32),
    # so one 256-thread block per SM, and its sampling phases (latency-bound
    # gathers) would stall the SM instead of overlapping the other block's GEMM
    # phase. Costs ~250 bytes of spills outside the inner product loop. (The
    # simulator takes no launch bounds.)
    opts = {} if _device.SIMULATOR else {"launch_bounds": (NT, 2)}

    @cuda.jit(cache=True, **opts)
    def deform_conv_kernel(x, w, off, mask, bias, y, geo, dims):
        N, C, oC, group, og, K, P, S, nd = (dims[0], dims[1], dims[2], dims[3], dims[4], dims[5],
                                            dims[6], dims[7], dims[8])
        has_mask = dims[9] != 0
        has_bias = dims[10] != 0
        cpg = C // group
        ocg = oC // group
        cpo = C // og
        n_ot = (ocg + TO - 1) // TO
        n_pt = (P + TP - 1) // TP
        ntiles = N * group * n_ot * n_pt
        one = ct(1)
        zero = ct(0)
        nan = ct(math.nan)

        cols = cuda.shared.array((RK, TP), ct)
        ws = cuda.shared.array((RK, TO), ct)
        # corner-major, so the threads of a warp (consecutive positions) hit distinct banks
        pidx = cuda.shared.array((NC, TP), np.int64)
        pw = cuda.shared.array((NC, TP), ct)
        pcnt = cuda.shared.array(TP, np.int64)  # corners in the plan; -1: the sample is pw[0, q]
        pm = cuda.shared.array(TP, ct)  # a NaN/Inf mask, times the finished sample (else 1)
        ax_i0 = cuda.local.array(ND, np.int64)
        ax_w = cuda.local.array((ND, 2), ct)
        acc = cuda.local.array((TM, TN), ct)
        af = cuda.local.array(TM, ct)
        bf = cuda.local.array(TN, ct)

        t = np.int64(cuda.threadIdx.x)
        ty = t // TX
        tx = t % TX
        for tile in range(np.int64(cuda.blockIdx.x), ntiles, np.int64(cuda.gridDim.x)):
            pt = tile % n_pt
            r = tile // n_pt
            ot = r % n_ot
            r = r // n_ot
            gi = r % group
            n = r // group
            p0 = pt * TP
            oc_lo = gi * ocg
            oc0 = oc_lo + ot * TO
            oc_hi = oc_lo + ocg
            for i in range(TM):
                for j in range(TN):
                    acc[i, j] = zero
            plan_g = np.int64(-1)
            plan_k = np.int64(-1)
            for kidx in range(K):
                c_lo = np.int64(0)
                while c_lo < cpg:
                    c = gi * cpg + c_lo  # first channel of this chunk
                    g = c // cpo  # its offset group; a chunk never spans two
                    rows = min(min(np.int64(RK), cpg - c_lo), (g + 1) * cpo - c)
                    cuda.syncthreads()  # the previous chunk's readers are done
                    if g != plan_g or kidx != plan_k:
                        # -- the sampling plan of (g, kidx) for positions p0 .. p0+TP-1
                        for q in range(t, TP, NT):
                            p = p0 + q
                            cnt = np.int64(0)
                            pm[q] = one
                            if p < P:
                                ok = True
                                finite = True
                                rem_k = kidx
                                rem_p = p
                                ob = ((n * og + g) * K + kidx) * nd
                                for ax in range(nd - 1, -1, -1):
                                    kk = rem_k % geo[1, ax]
                                    rem_k = rem_k // geo[1, ax]
                                    oo = rem_p % geo[5, ax]
                                    rem_p = rem_p // geo[5, ax]
                                    f, lam, inside, fin = border_corner(
                                        oo * geo[2, ax] - geo[3, ax] + kk * geo[4, ax],
                                        load(off, (ob + ax) * P + p), geo[0, ax], zero)
                                    ax_i0[ax] = f
                                    ax_w[ax, 0] = one - lam
                                    ax_w[ax, 1] = lam
                                    ok = ok and inside
                                    finite = finite and fin
                                m = load(mask, ((n * og + g) * K + kidx) * P + p) if has_mask else one
                                # a finite mask is folded into the corner weights; a NaN/Inf one
                                # multiplies the finished sample (no 0 * Inf, no Inf - Inf)
                                m_finite = (m - m) == zero
                                wm = m if m_finite else one
                                if not m_finite:
                                    pm[q] = m
                                if not finite:
                                    cnt = -1
                                    pw[0, q] = nan
                                elif not ok:  # sample 0, times the mask (NaN for a NaN/Inf mask)
                                    cnt = -1
                                    pw[0, q] = zero * m
                                else:
                                    for corner in range(1 << nd):
                                        wt = wm
                                        flat = np.int64(0)
                                        valid = True
                                        for ax in range(nd):
                                            bit = (corner >> (nd - 1 - ax)) & 1
                                            jj = ax_i0[ax] + bit
                                            wt = wt * ax_w[ax, bit]
                                            valid = valid and 0 <= jj < geo[0, ax]
                                            flat = flat * geo[0, ax] + jj
                                        if valid:
                                            pidx[cnt, q] = flat
                                            pw[cnt, q] = wt
                                            cnt += 1
                            pcnt[q] = cnt
                        plan_g = g
                        plan_k = kidx
                        cuda.syncthreads()
                    # -- the RK x TP sample tile (rows past `rows` are 0) ...
                    for e in range(t, RK * TP, NT):
                        rr = e // TP
                        pp = e % TP
                        v = zero
                        if rr < rows:
                            cnt = pcnt[pp]
                            if cnt < 0:
                                v = pw[0, pp]
                            else:
                                xb = (n * C + c + rr) * S
                                for jc in range(cnt):
                                    v += pw[jc, pp] * load(x, xb + pidx[jc, pp])
                                v *= pm[pp]
                        cols[rr, pp] = v
                    # -- ... and the RK x TO weight tile (0 past the group's channels)
                    for e in range(t, RK * TO, NT):
                        rr = e // TO
                        mm = e % TO
                        oc = oc0 + mm
                        v = zero
                        if rr < rows and oc < oc_hi:
                            v = load(w, ((gi * K + kidx) * cpg + c_lo + rr) * ocg + oc - oc_lo)
                        ws[rr, mm] = v
                    cuda.syncthreads()
                    # -- register-blocked outer products
                    for rr in range(RK):
                        for i in range(TM):
                            af[i] = ws[rr, ty + TY * i]
                        for j in range(TN):
                            bf[j] = cols[rr, tx + TX * j]
                        for i in range(TM):
                            for j in range(TN):
                                acc[i, j] += af[i] * bf[j]
                    c_lo += rows
            for i in range(TM):
                oc = oc0 + ty + TY * i
                if oc < oc_hi:
                    bv = load(bias, oc) if has_bias else zero
                    for j in range(TN):
                        p = p0 + tx + TX * j
                        if p < P:
                            store(y, (n * oC + oc) * P + p, bv + acc[i, j])

    return deform_conv_kernel


@cuda.jit(cache=True)
def weights_by_kernel_point(w, wt, cpg, K, ocg):
    """wt[((gi*K + kidx)*cpg + c)*ocg + o] = w[((gi*ocg + o)*cpg + c)*K + kidx]: the
    weight tile of a chunk (fixed kidx, consecutive c, consecutive oc) becomes
    contiguous rows, so its loads coalesce. Storage-type copy; W is small."""
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):  # grid-stride, int64
        kidx = i % K
        r = i // K
        c = r % cpg
        oc = r // cpg
        gi = oc // ocg
        wt[((gi * K + kidx) * cpg + c) * ocg + oc - gi * ocg] = w[i]


def variants():
    """Every (tiles, nd_max) the launcher picks on a GPU: n <= 3, and n >= 4 (shown for n = 4)."""
    return [(GPU_TILES, 3), (GPU_TILES_ND, 4)]


def compile_jobs():
    """(label, kernel, argument types) for every GPU variant and dtype: what
    ``compile_ptx`` type-checks (tests/test_cuda.py)."""
    from numba import types
    from numba.np.numpy_support import from_dtype
    from ..._dtypes import DTYPES as ALL
    i64 = types.int64
    for dt in ALL:
        arr = types.Array(from_dtype(storage(dt)), 1, "C")
        args = (arr,) * 6 + (types.Array(i64, 2, "C"), types.Array(i64, 1, "C"))
        for tiles, nd_max in variants():
            yield f"deform_conv/nd<={nd_max}/{dt}", kernel(compute(dt).type, tiles, nd_max), args
        yield f"deform_conv.weights/{dt}", weights_by_kernel_point, (arr, arr, i64, i64, i64)


def launch(x, w, offset, b, mask, p, origin=None):
    """Validated inputs (NumPy or numba device arrays of one dtype) and DeformParams.
    ``origin`` (internal, numba_ops.dask): see the CPU launcher; the region's first
    output indices, folded into the pads-begin row of ``geo``."""
    with _device.launch_guard():
        return _launch(x, w, offset, b, mask, p, origin)


def _launch(x, w, offset, b, mask, p, origin=None):
    dtype = np.dtype(x.dtype)
    st = storage(dtype)
    N, C = int(x.shape[0]), int(x.shape[1])
    oC = int(w.shape[0])
    nd, K, og, group = p.nd, p.K, p.offset_group, p.group
    if nd > MAX_ND:
        raise NotImplementedError(f"the CUDA DeformConv takes up to {MAX_ND} spatial dims; got {nd}")
    P = int(np.prod(p.out_spatial, dtype=np.int64))
    S = int(np.prod(x.shape[2:], dtype=np.int64))
    shape = (N, oC) + tuple(p.out_spatial)
    to_host = not _device.any_on_device(x, w, offset, b, mask)
    total = N * oC * P
    y = cuda.device_array(total, dtype=st)
    if total:
        dummy = _device.dummy(st)
        xf, wf0, of = _device.flat(x), _device.flat(w), _device.flat(offset)
        wf = cuda.device_array(wf0.shape[0], dtype=st)
        if wf.shape[0]:
            weights_by_kernel_point[_device.blocks_for(wf.shape[0]), _device.THREADS](
                wf0, wf, np.int64(C // group), np.int64(K), np.int64(oC // group))
        mf = dummy if mask is None else _device.flat(mask)
        bf = dummy if b is None else _device.flat(b)
        # a region's output o is the whole's origin + o: base (origin + o)*stride - begin
        begin = p.pads_begin if origin is None else [pb - o * s for pb, o, s in zip(p.pads_begin, origin, p.strides)]
        geo = _device.int64_array([tuple(x.shape[2:]), p.kernel_shape, p.strides, begin,
                                   p.dilations, p.out_spatial])
        dims = _device.int64_array([N, C, oC, group, og, K, P, S, nd, mask is not None, b is not None])
        tiles, nd_max = config(nd)
        ntiles = N * group * -(-(oC // group) // (tiles.TY * tiles.TM)) * -(-P // (tiles.TX * tiles.TN))
        blocks = max(1, min(ntiles, _device.MAX_BLOCKS if _device.SIMULATOR else 1 << 20))
        kernel(compute(dtype).type, tiles, nd_max)[blocks, tiles.TY * tiles.TX](
            xf, wf, of, mf, bf, y, geo, dims)
    return _device.finish(y, shape, dtype, to_host)

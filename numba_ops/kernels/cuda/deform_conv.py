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
   stored corner-major so a warp reads it without bank conflicts; a thread
   fills one fixed column at rows ``r0 + k·RS``, so it reads its column's plan
   once per chunk and has ``KP`` independent gathers in flight per corner) and
   the ``RK × TO`` weight tile beside it, with coalesced loads from a copy of W
   laid out (group, kidx, c, oc) by ``weights_by_kernel_point`` once per call;
3. each of the 256 threads accumulates a ``TM × TN`` (4 × 4) register block of
   the output tile by outer products over the ``RK`` rows, reading 8 shared
   values per 16 FMAs, with float32 accumulators (float64 for float64).

Why this suits an H100/H200: the op's arithmetic intensity is that of the GEMM
(2·oC FLOPs per sample) only if the samples are not written to and re-read from
HBM; keeping them in shared memory removes the C·K·P·4-byte round trip that
torchvision pays (write, then read by cuBLAS) for every image, each sample is
gathered once per 64 output channels instead of once per channel, and the plan
amortises the offset/mask reads and the weight arithmetic over the channels.
Tiles are distributed by a grid-stride loop, so any grid size is correct.
numba-cuda exposes no tensor-core MMA, so the GEMM runs on the FP32 FFMA pipes
(~67 TFLOP/s on an H200); with 8 shared loads per 16 FFMAs it is bound by
shared-memory bandwidth at about half of that on paper (README, "GPU"). The
performance is unmeasured so far (written without a GPU); ``bench/gpu_bench.py``
measures it against torchvision.

Register budget (``ptxas -v``, ``numba-ops info --cuda``; launch bounds (256, 2):
at most 128 registers per thread, so two 256-thread blocks, 16 warps, share an
SM and one block's latency-bound sampling overlaps the other's GEMM). The first
version, with 64-bit indices throughout and its sizes read from a device array,
took 128 registers and spilled in every variant (sm_90, float32 / float64 /
n >= 4, spill stores/loads per thread: ptxas 13.0 172/252, 236/316, 100/144 B;
nvJitLink 13.5 324/296, 384/360, 228/212 B); unbounded, ptxas wanted 194-202
registers for float32. Its PTX showed why: LLVM hoisted the per-thread
shared-memory address of every unrolled fill iteration out of the tile loop
(each with numba's negative-index wrap-around arithmetic), every size and tile
coordinate was a 64-bit value live across the loop, and 12 64-bit divisions
each expanded to a subroutine. Now:

- the sizes are kernel parameters (the ``dims`` tuple: the constant bank, which
  instructions read as operands and ptxas reloads rather than spills);
- indices are uint32 when every tensor has fewer than ``WIDE_FROM`` = 2**31
  elements (the launcher decides; the int64 kernel is kept for larger ones):
  half the registers per index, 32-bit divisions, and unsigned shared-memory
  indices with no wrap-around code;
- the fill mapping above: one base address plus constants per thread.

Unbounded, ptxas now wants 118-125 registers (uint32, float32), 135-143 (uint32,
float64), 134-140 (int64, float32), 154-156 (int64, float64); at the bound there
are no spills in any variant on sm_80 or sm_90 with either assembler, except
int64 float64 with 4 × 4 blocks on sm_80 with nvJitLink (92/104 B), which
therefore takes 4 × 2 blocks (``GPU_TILES_WIDE_F64``). Shared memory: 12.5 KB
(float32) and 22.8 KB (float64) per block, far from binding. Other bounds on
paper: three blocks per SM would need at most 80 registers, below what the 16
accumulators, 8 operands and the loop state need without spilling in the GEMM
loop; (256, 1) would allow 255 registers but leave one block per SM, with
nothing to hide its sampling phase behind. So (256, 2) stays.

16-bit data is read and written through ``load``/``store`` (bit patterns, one
rounding on the way out); index arithmetic is 32-bit unsigned below 2**31
elements per tensor, 64-bit above (``WIDE_FROM``). Every output element is
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

from .._dtypes import NAMES, compute, storage
from .._scalar import border_corner, load, store
from . import _device

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)


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
#: float64 with 64-bit indices (tensors past 2**31 elements): 64 × 32 tiles, a 4 × 2
#: register block, as 4 × 4 there wants ~154 registers and spills at 128 (sm_80,
#: nvJitLink 13.5: 92/104 B).
GPU_TILES_WIDE_F64 = Tiles(16, 16, 4, 2, 16)
#: the simulator runs each thread as a Python thread: 4 threads, 4 × 4 tiles (so
#: small test shapes still span several tiles and partial tiles).
SIM_TILES = Tiles(2, 2, 2, 2, 4)
#: tensors of this many elements or more take the kernel with 64-bit indices
WIDE_FROM = 1 << 31
#: largest n the CUDA kernel takes (a 4-position plan of 2**9 corners is 32 KB).
MAX_ND = 9


def gpu_config(nd, wide, ct):
    """(tiles, nd_max) on a GPU for ``nd`` spatial dims, 64-bit indices or not
    (``wide``) and compute type ``ct``: nd_max sizes the plan (2**nd_max corners)."""
    if nd > 3:
        return GPU_TILES_ND, nd
    return (GPU_TILES_WIDE_F64 if wide and np.dtype(ct) == np.float64 else GPU_TILES), 3


def config(nd, wide, ct):
    """(tiles, nd_max) the launcher uses: ``gpu_config``'s, or the simulator's small tiles."""
    if _device.SIMULATOR:
        return SIM_TILES, max(3, nd)
    return gpu_config(nd, wide, ct)


@functools.lru_cache(maxsize=None)
def kernel(ct, tiles, nd_max, wide):
    """The tiled kernel for compute type ``ct``, tile shape ``tiles``, at most
    ``nd_max`` spatial dims and 64-bit (``wide``) or 32-bit indices.

    Arguments (flat, C-contiguous storage arrays): x (N*C*S), w (group, K, C/group,
    oC/group: ``weights_by_kernel_point``'s layout, so a tile's weights are rows),
    offset (N*og*K*nd*P), mask (N*og*K*P, or a 1-element dummy), bias (oC, or a
    dummy), y (N*oC*P); geo (6, nd) int64 rows: input sizes, kernel, strides,
    pads begin, dilations, output sizes; dims, a tuple of 16 integers (``_dims``).

    Indices are ``IT``: int64 when ``wide``, else uint32 (every tensor under
    ``WIDE_FROM`` = 2**31 elements, chosen by the launcher). uint32 arithmetic is written ``IT(a op b)``:
    numba widens it to 64 bits, LLVM narrows it back, and unsigned shared-memory
    indices need no negative-index wrap-around code.
    """
    ct = np.dtype(ct).type
    IT = np.int64 if wide else np.uint32
    TY, TX, TM, TN, RK = tiles
    NT = TY * TX
    TO = TY * TM
    TP = TX * TN
    NC = 1 << nd_max
    ND = nd_max
    # the fill mapping: thread t fills column t % TP (t % TO) of rows t // TP + k * RS (RSW)
    RS = NT // TP
    RSW = NT // TO
    KP = -(-RK // RS)
    KPW = -(-RK // RSW)
    assert NT % TP == 0 and NT % TO == 0, tiles

    # Two blocks per SM: 128 registers per thread (see the module docstring for the
    # budget). The simulator takes no launch bounds.
    opts = {} if _device.SIMULATOR else {"launch_bounds": (NT, 2)}

    @cuda.jit(cache=True, **opts)
    def deform_conv_kernel(x, w, off, mask, bias, y, geo, dims):
        # dims is a tuple: each entry a kernel parameter (constant bank), which an
        # instruction reads as an operand and ptxas reloads instead of spilling
        C, oC, og, K, P, S, nd = IT(dims[0]), IT(dims[1]), IT(dims[2]), IT(dims[3]), IT(dims[4]), \
            IT(dims[5]), IT(dims[6])
        ndi = dims[6]  # signed, for the corner bit arithmetic
        has_mask = dims[7] != 0
        has_bias = dims[8] != 0
        cpg, ocg, cpo, n_ot, n_pt, ntiles, group = IT(dims[9]), IT(dims[10]), IT(dims[11]), IT(dims[12]), \
            IT(dims[13]), IT(dims[14]), IT(dims[15])
        one = ct(1)
        zero = ct(0)
        nan = ct(math.nan)
        i0 = IT(0)

        cols = cuda.shared.array((RK, TP), ct)
        ws = cuda.shared.array((RK, TO), ct)
        # corner-major, so the threads of a warp (consecutive positions) hit distinct banks
        pidx = cuda.shared.array((NC, TP), IT)
        pw = cuda.shared.array((NC, TP), ct)
        pcnt = cuda.shared.array(TP, np.int32)  # corners in the plan; -1: the sample is pw[0, q]
        pm = cuda.shared.array(TP, ct)  # a NaN/Inf mask, times the finished sample (else 1)
        ax_i0 = cuda.local.array(ND, np.int64)
        ax_w = cuda.local.array((ND, 2), ct)
        acc = cuda.local.array((TM, TN), ct)
        af = cuda.local.array(TM, ct)
        bf = cuda.local.array(TN, ct)
        v = cuda.local.array(KP, ct)

        t = IT(np.uint32(cuda.threadIdx.x))  # zero-extended: LLVM knows it is >= 0
        ty = IT(t // IT(TX))
        tx = IT(t % IT(TX))
        pp = IT(t % IT(TP))  # this thread's column of the sample tile ...
        r0 = IT(t // IT(TP))  # ... and first row
        mm = IT(t % IT(TO))  # its column of the weight tile, and first row
        r0w = IT(t // IT(TO))
        for tile in range(IT(np.uint32(cuda.blockIdx.x)), ntiles, IT(np.uint32(cuda.gridDim.x))):
            pt = IT(tile % n_pt)
            r = IT(tile // n_pt)
            ot = IT(r % n_ot)
            r = IT(r // n_ot)
            gi = IT(r % group)
            n = IT(r // group)
            p0 = IT(pt * IT(TP))
            oc_lo = IT(gi * ocg)
            oc0 = IT(oc_lo + IT(ot * IT(TO)))
            for i in range(TM):
                for j in range(TN):
                    acc[i, j] = zero
            plan_g = og  # no offset group: the first chunk builds a plan
            plan_k = i0
            for kidx in range(K):
                c_lo = i0
                while c_lo < cpg:
                    c = IT(IT(gi * cpg) + c_lo)  # first channel of this chunk
                    g = IT(c // cpo)  # its offset group; a chunk never spans two
                    rows = min(min(IT(RK), IT(cpg - c_lo)), IT(IT(IT(g + IT(1)) * cpo) - c))
                    cuda.syncthreads()  # the previous chunk's readers are done
                    if g != plan_g or kidx != plan_k:
                        # -- the sampling plan of (g, kidx) for positions p0 .. p0+TP-1
                        for q in range(t, IT(TP), IT(NT)):
                            p = IT(p0 + q)
                            cnt = np.int32(0)
                            pm[q] = one
                            if p < P:
                                ok = True
                                finite = True
                                rem_k = IT(kidx)
                                rem_p = p
                                ogk = IT(IT(IT(n * og) + g) * K + kidx)
                                for axr in range(nd):
                                    ax = IT(IT(nd - IT(1)) - axr)
                                    kk = IT(rem_k % IT(geo[1, ax]))
                                    rem_k = IT(rem_k // IT(geo[1, ax]))
                                    oo = IT(rem_p % IT(geo[5, ax]))
                                    rem_p = IT(rem_p // IT(geo[5, ax]))
                                    f, lam, inside, fin = border_corner(
                                        np.int64(oo) * geo[2, ax] - geo[3, ax] + np.int64(kk) * geo[4, ax],
                                        load(off, IT(IT(IT(IT(ogk * nd) + ax) * P) + p)), geo[0, ax], zero)
                                    ax_i0[ax] = f
                                    ax_w[ax, 0] = one - lam
                                    ax_w[ax, 1] = lam
                                    ok = ok and inside
                                    finite = finite and fin
                                m = load(mask, IT(IT(ogk * P) + p)) if has_mask else one
                                # a finite mask is folded into the corner weights; a NaN/Inf one
                                # multiplies the finished sample (no 0 * Inf, no Inf - Inf)
                                m_finite = (m - m) == zero
                                wm = m if m_finite else one
                                if not m_finite:
                                    pm[q] = m
                                if not finite:
                                    cnt = np.int32(-1)
                                    pw[0, q] = nan
                                elif not ok:  # sample 0, times the mask (NaN for a NaN/Inf mask)
                                    cnt = np.int32(-1)
                                    pw[0, q] = zero * m
                                else:
                                    for corner in range(1 << ndi):
                                        wt = wm
                                        flat = np.int64(0)
                                        valid = True
                                        for ax in range(ndi):
                                            bit = (corner >> (ndi - 1 - ax)) & 1
                                            jj = ax_i0[ax] + bit
                                            wt = wt * ax_w[ax, bit]
                                            valid = valid and 0 <= jj < geo[0, ax]
                                            flat = flat * geo[0, ax] + jj
                                        if valid:
                                            pidx[cnt, q] = IT(flat)
                                            pw[cnt, q] = wt
                                            cnt += np.int32(1)
                            pcnt[q] = cnt
                        plan_g = g
                        plan_k = kidx
                        cuda.syncthreads()
                    # -- the RK x TP sample tile (rows past `rows` are 0): this thread's
                    # column pp, rows r0 + k * RS; each plan entry is read once and
                    # serves KP independent gathers
                    for k in range(KP):
                        v[k] = zero
                    cnt = pcnt[pp]
                    if cnt < 0:
                        for k in range(KP):
                            v[k] = pw[0, pp]
                    else:
                        xb = IT(IT(IT(IT(n * C) + c) + r0) * S)
                        for jc in range(cnt):
                            wj = pw[jc, pp]
                            ij = IT(xb + pidx[jc, pp])
                            for k in range(KP):
                                if IT(r0 + IT(k * RS)) < rows:
                                    v[k] += wj * load(x, IT(ij + IT(IT(k * RS) * S)))
                        mp = pm[pp]
                        for k in range(KP):
                            v[k] *= mp
                    for k in range(KP):
                        rr = IT(r0 + IT(k * RS))
                        if rr < IT(RK):
                            cols[rr, pp] = v[k] if rr < rows else zero
                    # -- ... and the RK x TO weight tile (0 past the group's channels)
                    oc = IT(oc0 + mm)
                    live = IT(oc - oc_lo) < ocg
                    wb = IT(IT(IT(IT(IT(IT(gi * K) + kidx) * cpg) + c_lo) + r0w) * ocg)
                    for k in range(KPW):
                        rr = IT(r0w + IT(k * RSW))
                        if rr < IT(RK):
                            wv = zero
                            if rr < rows and live:
                                wv = load(w, IT(IT(wb + IT(IT(k * RSW) * ocg)) + IT(oc - oc_lo)))
                            ws[rr, mm] = wv
                    cuda.syncthreads()
                    # -- register-blocked outer products
                    for rr in range(RK):
                        for i in range(TM):
                            af[i] = ws[rr, IT(ty + IT(TY * i))]
                        for j in range(TN):
                            bf[j] = cols[rr, IT(tx + IT(TX * j))]
                        for i in range(TM):
                            for j in range(TN):
                                acc[i, j] += af[i] * bf[j]
                    c_lo = IT(c_lo + rows)
            for i in range(TM):
                oc = IT(oc0 + IT(ty + IT(TY * i)))
                if IT(oc - oc_lo) < ocg:
                    bv = load(bias, oc) if has_bias else zero
                    for j in range(TN):
                        p = IT(p0 + IT(tx + IT(TX * j)))
                        if p < P:
                            store(y, IT(IT(IT(n * oC) + oc) * P) + p, bv + acc[i, j])

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


def variants(ct):
    """Every (tiles, nd_max, wide) the launcher picks on a GPU for compute type ``ct``:
    n <= 3, and n >= 4 (shown for n = 4), with 32- and 64-bit indices."""
    return [gpu_config(nd, wide, ct) + (wide,) for nd in (3, 4) for wide in (False, True)]


def compile_jobs():
    """(label, kernel, argument types) for every GPU variant and dtype: what
    ``compile_ptx`` type-checks (tests/test_cuda.py)."""
    from numba import types
    from numba import from_dtype
    from .._dtypes import DTYPES as ALL
    i64 = types.int64
    for dt in ALL:
        arr = types.Array(from_dtype(storage(dt)), 1, "C")
        args = (arr,) * 6 + (types.Array(i64, 2, "C"), types.UniTuple(i64, 16))
        for tiles, nd_max, wide in variants(compute(dt)):
            yield (f"deform_conv/nd<={nd_max}/{'i64' if wide else 'i32'}/{dt}",
                   kernel(compute(dt).type, tiles, nd_max, wide), args)
        yield f"deform_conv.weights/{dt}", weights_by_kernel_point, (arr, arr, i64, i64, i64)


def launch(x, w, offset, b, mask, p, stream=None, origin=None):
    """Validated inputs (NumPy or numba device arrays of one dtype) and DeformParams;
    stream: the public ``stream=`` (``_device.as_stream``). ``origin`` (internal,
    numba_ops.dask): see the CPU launcher; the region's first output indices, folded
    into the pads-begin row of ``geo``."""
    with _device.launch_guard():
        return _launch(x, w, offset, b, mask, p, _device.as_stream(stream), origin)


def _launch(x, w, offset, b, mask, p, stream, origin=None):
    _device.await_producers((x, w, offset, b, mask), stream)
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
    y = cuda.device_array(total, dtype=st, stream=stream)
    if total:
        dummy = _device.dummy(st, stream)
        xf, wf0, of = (_device.flat(a, stream) for a in (x, w, offset))
        wf = cuda.device_array(wf0.shape[0], dtype=st, stream=stream)
        if wf.shape[0]:
            weights_by_kernel_point[_device.blocks_for(wf.shape[0]), _device.THREADS, stream](
                wf0, wf, np.int64(C // group), np.int64(K), np.int64(oC // group))
        mf = dummy if mask is None else _device.flat(mask, stream)
        bf = dummy if b is None else _device.flat(b, stream)
        # a region's output o is the whole's origin + o: base (origin + o)*stride - begin
        begin = p.pads_begin if origin is None else [pb - o * s for pb, o, s in zip(p.pads_begin, origin, p.strides)]
        geo = _device.int64_array([tuple(x.shape[2:]), p.kernel_shape, p.strides, begin,
                                   p.dilations, p.out_spatial], stream)
        wide = max(x.size, offset.size, w.size, total) >= WIDE_FROM
        ct = compute(dtype).type
        tiles, nd_max = config(nd, wide, ct)
        n_ot = -(-(oC // group) // (tiles.TY * tiles.TM))
        n_pt = -(-P // (tiles.TX * tiles.TN))
        ntiles = N * group * n_ot * n_pt
        dims = tuple(int(v) for v in (C, oC, og, K, P, S, nd, mask is not None, b is not None,
                                      C // group, oC // group, C // og, n_ot, n_pt, ntiles, group))
        blocks = max(1, min(ntiles, _device.MAX_BLOCKS if _device.SIMULATOR else 1 << 20))
        kernel(ct, tiles, nd_max, wide)[blocks, tiles.TY * tiles.TX, stream](
            xf, wf, of, mf, bf, y, geo, dims)
    return _device.finish(y, shape, dtype, to_host, stream)

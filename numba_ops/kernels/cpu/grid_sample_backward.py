"""GridSample's and affine_warp's backward on the CPU: ``@njit(parallel=True)`` over
fixed units of output positions.

Per output position ``(n, o)`` the kernel takes, axis by axis, the forward's taps and
weights with the weights' derivatives (``_sample.grad_taps``, shared with the CUDA
kernels), then for every channel, with ``g = grad_y[n, c, o]``:

- ``grad_x[n, c, tap] += g * w`` over the position's taps (a tap outside a
  zeros-padded input contributes nothing);
- ``d sample / d pos_k = sum over taps of (prod of the other axes' weights) *
  d w_k * x[tap]``, summed over the channels with weight ``g`` and times
  ``d pos / d grid`` (``unnormalize_scale``) into the position's grid gradient.
  ``nearest`` has none (0); a non-finite position gets NaN and scatters nothing.

affine_warp computes each position from theta as affine_grid does (never building
the grid) and sums ``grid gradient * base coordinates`` into theta's gradient in
float64.

**Deterministic whatever the thread count.** The positions of each image are cut
into ``units_per_image(N, P)`` units, a function of the shape alone; each unit
scatters into a grad_x buffer of its own (unit ``k`` of every image into buffer
``k``), so no two threads ever add to one element, and the buffers are summed in
their fixed order afterwards (``_sum_buffers``, into an array of x's size: the
returned gradient owns its memory); theta's partial sums are kept per unit and
added in order too. The units' count is small (``GX_SPLIT`` per call at most): the
extra memory while the call runs is ``units_per_image`` copies of ``x`` in the
compute type, and none for four or more images.

The input is seen as 3-D with leading axes of size 1 (one tap of weight 1 each);
the rank, mode and padding reach the kernel as tokens (tuples whose length numba
folds to a constant), so each combination compiles into loops of constant trip
counts. 16-bit inputs are computed in float32 (their gradients rounded once), so
the kernels compile for float32 and float64 only.
"""
import numpy as np
from numba import njit, prange

from .._dtypes import NAMES, compute
from .._sample import LINEAR, NEAREST, as_compute, grad_taps, unnormalize, unnormalize_scale
from .._scalar import base_coord
from . import _runtime
from ._opaque import INTERNAL, opaque

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)

#: a mode's or padding's token: a tuple as long as its code, so that ``len(tok)`` is a
#: constant where numba compiles, and LLVM drops the other modes' and paddings' code
TOKEN = ((), (0,), (0, 0))
#: the rank's token likewise
RANK = (None, (0,), (0, 0), (0, 0, 0))
#: the most grad_x buffers per call (units of one image): the determinism's memory
GX_SPLIT = 4
#: positions whose taps are taken in one pass (per axis: 4 taps x SEG entries of 4 arrays)
SEG = 128
#: positions a unit holds at least (fewer units for small outputs)
MIN_UNIT = 4096


def units_per_image(N, P):
    """Units (and grad_x buffers) per image: ``GX_SPLIT`` units over the batch, at least
    one per image, none smaller than ``MIN_UNIT`` positions. A function of the shape
    alone, which is what makes the sums' order independent of the thread count."""
    return max(1, min(-(-GX_SPLIT // max(N, 1)), -(-P // MIN_UNIT)))


@njit(**INTERNAL)
def _units(xf, gyf, src, gxb, gpos, gth, dims, isz, osz, rtok, mtok, ptok, align, affine, want_x, want_pos,
           zero, u0, u1):
    """Units ``u0:u1`` (image-major). ``dims = (N, C, P, S, r, U)``; ``isz``/``osz`` the
    input's/output's spatial sizes as 3 axes (leading 1s); ``src`` the flat grid
    (N*P*r), or theta (N*r*(r+1)) when ``affine``. Writes grad_x into ``gxb`` (U
    buffers of N*C*S), the grid gradient into ``gpos`` (N*P*r, grid_sample) or
    theta's partial sums into ``gth`` (N*U*r*(r+1), float64, affine_warp).

    A unit goes by segments of ``SEG`` positions: first, axis by axis, a loop over
    the segment that takes every position's taps (``grad_taps``; a loop of constant
    mode and padding, so LLVM vectorises it), then position by position the
    channels."""
    N, C, P, S, U = dims[0], dims[1], dims[2], dims[3], dims[5]
    r = len(rtok)  # constants where this compiles (``TOKEN``)
    mode = len(mtok)
    padding = len(ptok)
    T = 1 if mode == NEAREST else (2 if mode == LINEAR else 4)
    nt0 = T if r == 3 else 1
    nt1 = T if r >= 2 else 1
    one = as_compute(zero, 1)
    nan = as_compute(zero, np.nan)
    ct = type(zero)
    lead = 3 - r
    stride = np.empty(3, np.int64)
    stride[2] = 1
    stride[1] = isz[2]
    stride[0] = isz[1] * isz[2]
    # per axis, tap and position of the segment: flat offset, weight, d weight / d pos,
    # inside; the leading (absent) axes keep one tap at offset 0 of weight 1
    ti = np.zeros((3, 4, SEG), np.int64)
    tw = np.ones((3, 4, SEG), ct)
    td = np.zeros((3, 4, SEG), ct)
    tk = np.ones((3, 4, SEG), np.bool_)
    fin = np.empty(SEG, np.bool_)
    oi = np.zeros((3, SEG), np.int64)  # output indices (affine)
    gv_ = np.empty(SEG, ct)  # one axis' grid values
    qo = np.zeros(64, np.int64)
    qw = np.zeros(64, ct)
    qd = np.zeros((3, 64), ct)
    scl = np.zeros(3, ct)
    gcoord = np.zeros(3, ct)
    bc = np.ones(4, ct)  # base coordinates (x, y, z), then 1 (affine)
    btab = np.zeros((3, max(osz[0], osz[1], osz[2])), ct)
    if affine:
        for a in range(3):
            for i in range(osz[a]):
                btab[a, i] = base_coord(i, osz[a], align, one)
    for a in range(lead, 3):
        scl[a] = unnormalize_scale(isz[a], align, one)
    acc = np.zeros((3, 4), np.float64)
    deriv = want_pos and mode != NEAREST
    for u in range(u0, u1):
        n = u // U
        k = u - n * U
        acc[:] = 0.0
        j0 = k * P // U
        j1 = (k + 1) * P // U
        if affine:  # the output index of j0 - 1, advanced position by position (no divisions)
            t = j0 // osz[2]
            o2 = j0 - t * osz[2] - 1
            o0 = t // osz[1]
            o1 = t - o0 * osz[1]
        for s0 in range(j0, j1, SEG):
            m = min(SEG, j1 - s0)
            if affine:
                for jj in range(m):
                    o2 += 1
                    if o2 == osz[2]:
                        o2 = 0
                        o1 += 1
                        if o1 == osz[1]:
                            o1 = 0
                            o0 += 1
                    oi[0, jj] = o0
                    oi[1, jj] = o1
                    oi[2, jj] = o2
            for jj in range(m):
                fin[jj] = True
            for a in range(lead, 3):
                ci = 2 - a  # the grid's coordinate of this axis (innermost first)
                if affine:
                    # in the forward's (affine_grid's) order of operations, so the
                    # positions are the forward's bit for bit
                    th = (n * r + ci) * (r + 1)
                    if r == 2:
                        for jj in range(m):
                            gv_[jj] = (src[th] * btab[2, oi[2, jj]]
                                       + (src[th + 1] * btab[1, oi[1, jj]] + src[th + 2]))
                    else:
                        for jj in range(m):
                            gv_[jj] = ((src[th] * btab[2, oi[2, jj]] + (src[th + 2] * btab[0, oi[0, jj]] + src[th + 3]))
                                       + btab[1, oi[1, jj]] * src[th + 1])
                else:
                    for jj in range(m):
                        gv_[jj] = src[(n * P + s0 + jj) * r + ci]
                size = isz[a]
                st = stride[a]
                for jj in range(m):
                    (i0, i1, i2, i3, w0, w1, w2, w3, d0, d1, d2, d3, ok0, ok1, ok2, ok3,
                     f) = grad_taps(mode, unnormalize(gv_[jj], size, align, one), size, padding, align, zero)
                    fin[jj] &= f
                    ti[a, 0, jj], ti[a, 1, jj], ti[a, 2, jj], ti[a, 3, jj] = i0 * st, i1 * st, i2 * st, i3 * st
                    tw[a, 0, jj], tw[a, 1, jj], tw[a, 2, jj], tw[a, 3, jj] = w0, w1, w2, w3
                    td[a, 0, jj], td[a, 1, jj], td[a, 2, jj], td[a, 3, jj] = d0, d1, d2, d3
                    tk[a, 0, jj], tk[a, 1, jj], tk[a, 2, jj], tk[a, 3, jj] = ok0, ok1, ok2, ok3
            for jj in range(m):
                j = s0 + jj
                finite = fin[jj]
                scatter = want_x and finite
                gz = zero
                gy_ = zero
                gx_ = zero
                if mode == LINEAR:
                    # n-linear: the taps' offsets, weights and flags as scalars, the corners
                    # in constant loops that unroll into straight-line code on registers
                    # (d weight / d pos: -1 for the lower tap, +1 for the upper one; 0 for both
                    # where they are padded onto one element)
                    oz0, oz1, wz0, wz1 = ti[0, 0, jj], ti[0, 1, jj], tw[0, 0, jj], tw[0, 1, jj]
                    oy0, oy1, wy0, wy1 = ti[1, 0, jj], ti[1, 1, jj], tw[1, 0, jj], tw[1, 1, jj]
                    ox0, ox1, wx0, wx1 = ti[2, 0, jj], ti[2, 1, jj], tw[2, 0, jj], tw[2, 1, jj]
                    kz0, kz1, ky0, ky1 = tk[0, 0, jj], tk[0, 1, jj], tk[1, 0, jj], tk[1, 1, jj]
                    kx0, kx1 = tk[2, 0, jj], tk[2, 1, jj]
                    dz0, dz1, dy0, dy1 = td[0, 0, jj], td[0, 1, jj], td[1, 0, jj], td[1, 1, jj]
                    dx0, dx1 = td[2, 0, jj], td[2, 1, jj]
                    for c in range(C):
                        gv = gyf[(n * C + c) * P + j]
                        xb = (n * C + c) * S
                        bb = ((k * N + n) * C + c) * S
                        az = zero
                        ay = zero
                        ax = zero
                        for tz in range(nt0):
                            kz, oz, wz = (kz1, oz1, wz1) if tz else (kz0, oz0, wz0)
                            dz = dz1 if tz else dz0
                            if not kz:
                                continue
                            for ty in range(nt1):
                                ky, oy, wy = (ky1, oy1, wy1) if ty else (ky0, oy0, wy0)
                                dy = dy1 if ty else dy0
                                if not ky:
                                    continue
                                for tx in range(2):
                                    kx, ox, wx = (kx1, ox1, wx1) if tx else (kx0, ox0, wx0)
                                    dx = dx1 if tx else dx0
                                    if not kx:
                                        continue
                                    f = oz + oy + ox
                                    if deriv:
                                        v = xf[xb + f]
                                        ax += (wz * wy * dx) * v
                                        ay += (wz * dy * wx) * v
                                        az += (dz * wy * wx) * v
                                    if scatter:
                                        gxb[bb + f] += gv * (wz * wy * wx)
                        gz += gv * az
                        gy_ += gv * ay
                        gx_ += gv * ax
                else:
                    # the position's taps as one list of inside corners: flat offset, weight,
                    # and the weight's derivative along each axis (the other axes' weights times d)
                    nq = 0
                    for tz in range(nt0):
                        for ty in range(nt1):
                            for tx in range(T):
                                if tk[0, tz, jj] and tk[1, ty, jj] and tk[2, tx, jj]:
                                    qo[nq] = ti[0, tz, jj] + ti[1, ty, jj] + ti[2, tx, jj]
                                    qw[nq] = tw[0, tz, jj] * tw[1, ty, jj] * tw[2, tx, jj]
                                    qd[0, nq] = td[0, tz, jj] * tw[1, ty, jj] * tw[2, tx, jj]
                                    qd[1, nq] = tw[0, tz, jj] * td[1, ty, jj] * tw[2, tx, jj]
                                    qd[2, nq] = tw[0, tz, jj] * tw[1, ty, jj] * td[2, tx, jj]
                                    nq += 1
                    for c in range(C):
                        gv = gyf[(n * C + c) * P + j]
                        xb = (n * C + c) * S
                        if deriv:
                            az = zero
                            ay = zero
                            ax = zero
                            for q in range(nq):
                                v = xf[xb + qo[q]]
                                az += qd[0, q] * v
                                ay += qd[1, q] * v
                                ax += qd[2, q] * v
                            gz += gv * az
                            gy_ += gv * ay
                            gx_ += gv * ax
                        if scatter:
                            bb = ((k * N + n) * C + c) * S
                            for q in range(nq):
                                gxb[bb + qo[q]] += gv * qw[q]
                if not want_pos:
                    continue
                gcoord[0] = gx_ * scl[2]
                gcoord[1] = gy_ * scl[1]
                gcoord[2] = gz * scl[0]
                if affine:
                    for q in range(r):
                        bc[q] = btab[2 - q, oi[2 - q, jj]]
                for ci in range(r):
                    gc = gcoord[ci] if finite else nan
                    if not deriv and finite:
                        gc = zero
                    if affine:
                        for q in range(r):
                            acc[ci, q] += np.float64(gc) * np.float64(bc[q])
                        acc[ci, r] += np.float64(gc)
                    else:
                        gpos[(n * P + j) * r + ci] = gc
        if affine and want_pos:
            for ci in range(r):
                for q in range(r + 1):
                    gth[((n * U + k) * r + ci) * (r + 1) + q] = acc[ci, q]


_units_op = opaque(_units)


@njit(cache=True, nogil=True)
def _serial(xf, gyf, src, gxb, gpos, gth, dims, isz, osz, rtok, mtok, ptok, align, affine, want_x, want_pos, zero):
    _units_op(xf, gyf, src, gxb, gpos, gth, dims, isz, osz, rtok, mtok, ptok, align, affine, want_x, want_pos, zero,
              0, dims[0] * dims[5])


@njit(cache=True, parallel=True, nogil=True)
def _parallel(xf, gyf, src, gxb, gpos, gth, dims, isz, osz, rtok, mtok, ptok, align, affine, want_x, want_pos, zero,
              nchunks):
    units = dims[0] * dims[5]
    nchunks = min(units, nchunks)
    for c in prange(nchunks):
        _units_op(xf, gyf, src, gxb, gpos, gth, dims, isz, osz, rtok, mtok, ptok, align, affine, want_x, want_pos,
                  zero, c * units // nchunks, (c + 1) * units // nchunks)


@njit(cache=True, parallel=True, nogil=True)
def _sum_buffers(gxb, U, M, out):
    """``out = sum of the U buffers gxb[k*M:(k+1)*M]`` (``out``: M elements), added in the
    order k = 0, 1, ..."""
    chunk = 1 << 14
    for c in prange((M + chunk - 1) // chunk):
        for i in range(c * chunk, min(M, (c + 1) * chunk)):
            s = gxb[i]
            for k in range(1, U):
                s += gxb[k * M + i]
            out[i] = s


_sum_buffers_serial = _runtime.serial_twin(_sum_buffers)


def _as_compute(a, ct):
    """``a`` flat, C-contiguous, in the compute type ``ct`` (16-bit data upcast: a copy)."""
    return np.ascontiguousarray(a, dtype=ct).reshape(-1)


def _three(sizes):
    """Spatial sizes as three axes, leading 1s first."""
    return np.array((1,) * (3 - len(sizes)) + tuple(int(s) for s in sizes), np.int64)


def run(x, gy, src, out_spatial, mode, padding, align, affine, want_x, want_pos):
    """The shared launch: ``(gx, gpos)`` in the compute type, ``gpos`` the grid's
    gradient (N, O1..Or, r) for grid_sample or theta's (N, r, r+1), float64, for
    affine_warp; either None when not wanted."""
    ct = compute(src.dtype)
    N, C = int(x.shape[0]), int(x.shape[1])
    r = x.ndim - 2
    S = int(np.prod(x.shape[2:], dtype=np.int64))
    P = int(np.prod(out_spatial, dtype=np.int64))
    U = units_per_image(N, P) if want_x or affine else 1
    gxb = np.zeros(U * N * C * S if want_x else 0, ct)
    gpos = np.zeros(N * P * r if want_pos and not affine else 0, ct)
    gth = np.zeros(N * U * r * (r + 1) if want_pos and affine else 0, np.float64)
    if N * P and (want_x or want_pos):
        dims = np.array((N, C, P, S, r, U), np.int64)
        zero = ct.type(0)
        work = N * P * max(C, 1) * 4 ** r
        _runtime.run(_serial, _parallel, work, _as_compute(x, ct), _as_compute(gy, ct), _as_compute(src, ct), gxb,
                     gpos, gth, dims, _three(x.shape[2:]), _three(out_spatial), RANK[r], TOKEN[mode], TOKEN[padding],
                     bool(align), bool(affine), bool(want_x), bool(want_pos), zero)
        if want_x and U > 1:
            # into an array of x's size: the gradient never keeps the U buffers alive
            # (a view of their first would hold U times its own memory)
            out = np.empty(N * C * S, ct)
            _runtime.call(_sum_buffers_serial, _sum_buffers, U * N * C * S, gxb, U, N * C * S, out)
            gxb = out
    gx = gxb.reshape(x.shape) if want_x else None
    if not want_pos:
        return gx, None
    if affine:
        return gx, gth.reshape(N, U, r, r + 1).sum(axis=1)
    return gx, gpos.reshape((N,) + tuple(out_spatial) + (r,))


def launch(gy, x, grid, mode, padding, align, want_x, want_grid, stream=None):
    """grad_y (N, C, O1..Or), x (N, C, D1..Dr), grid (N, O1..Or, r): NumPy, one float
    dtype, validated by the front end. ``(gx, ggrid)`` in that dtype (None where not
    wanted). ``stream`` is ignored on the CPU."""
    gx, gg = run(x, gy, grid, tuple(grid.shape[1:-1]), mode, padding, align, False, want_x, want_grid)
    dt = x.dtype
    return (None if gx is None else gx.astype(dt, copy=False)), (None if gg is None else gg.astype(dt, copy=False))


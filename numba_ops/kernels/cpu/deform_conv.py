"""DeformConv on the CPU: a sampling plan, an im2col fill, one GEMM per group.

For each image, the plan holds, for every (offset group, kernel point, output
position), the 2**n corner indices into the flattened input and their n-linear
weights with the mask folded in; out-of-range corners get weight 0 and a safe
index. The fill reuses the plan for every channel of the offset group, and the
GEMM contracts the column buffer with the weights.
"""
import numba
import numpy as np
from numba import njit, prange

from ..._dtypes import compute
from .._scalar import corner_weights
from . import _runtime

DTYPES = ("float16", "bfloat16", "float32", "float64")


@njit(cache=True)
def _plan(offset, mask, has_mask, geo, og, K):
    """offset (og*K*nd, P), mask (og*K, P) -> idx, wts of shape (og, K, P, 2**nd).

    geo rows: 0 input sizes, 1 kernel, 2 strides, 3 pads begin, 4 dilations, 5 output sizes.
    """
    nd = geo.shape[1]
    P = offset.shape[1]
    ncorner = 1 << nd
    one = offset[0, 0] - offset[0, 0] + 1 if P > 0 else np.float32(1)
    idx = np.zeros((og, K, P, ncorner), dtype=np.int64)
    wts = np.zeros((og, K, P, ncorner), dtype=offset.dtype)
    i0 = np.empty(nd, dtype=np.int64)
    wa = np.empty((nd, 2), dtype=offset.dtype)
    for g in range(og):
        for kidx in range(K):
            for p in range(P):
                ok = True
                rem_k, rem_p = kidx, p
                for ax in range(nd - 1, -1, -1):
                    kk = rem_k % geo[1, ax]
                    rem_k //= geo[1, ax]
                    oo = rem_p % geo[5, ax]
                    rem_p //= geo[5, ax]
                    pos = (oo * geo[2, ax] - geo[3, ax] + kk * geo[4, ax]) + offset[(g * K + kidx) * nd + ax, p]
                    a, w0, w1, inside = corner_weights(pos, geo[0, ax], one)
                    i0[ax] = a
                    wa[ax, 0] = w0
                    wa[ax, 1] = w1
                    ok = ok and inside
                if not ok:
                    continue
                m = mask[g * K + kidx, p] if has_mask else one
                for c in range(ncorner):
                    wt = m
                    flat = 0
                    valid = True
                    for ax in range(nd):
                        bit = (c >> (nd - 1 - ax)) & 1
                        j = i0[ax] + bit
                        wt *= wa[ax, bit]
                        if j < 0 or j >= geo[0, ax]:
                            valid = False
                        flat = flat * geo[0, ax] + j
                    wts[g, kidx, p, c] = wt
                    idx[g, kidx, p, c] = flat if valid else 0
    return idx, wts


@njit(cache=True, parallel=True)
def _fill(xn, idx, wts, cols, og):
    """cols[c*K + kidx, p] = sum over corners of wts * xn[c, idx]."""
    C, S = xn.shape
    K, P, ncorner = idx.shape[1], idx.shape[2], idx.shape[3]
    cpg = C // og
    for c in prange(C):
        g = c // cpg
        for kidx in range(K):
            row = cols[c * K + kidx]
            for p in range(P):
                acc = wts[g, kidx, p, 0] - wts[g, kidx, p, 0]
                for j in range(ncorner):
                    wt = wts[g, kidx, p, j]
                    xv = xn[c, idx[g, kidx, p, j]] if S > 0 else wt - wt
                    acc += wt * xv
                row[p] = acc


def launch(x, w, offset, b, mask, p):
    dtype = x.dtype
    ct = compute(dtype)
    N, C = x.shape[:2]
    oC = w.shape[0]
    nd, K, og, g = p.nd, p.K, p.offset_group, p.group
    P = int(np.prod(p.out_spatial, dtype=np.int64))
    y = np.zeros((N, oC, P), dtype=ct)
    if b is not None:
        y += b.astype(ct)[None, :, None]
    geo = np.array([x.shape[2:], p.kernel_shape, p.strides, p.pads_begin, p.dilations, p.out_spatial],
                   dtype=np.int64)
    xc = np.ascontiguousarray(x.astype(ct, copy=False)).reshape(N, C, -1)
    wc = np.ascontiguousarray(w.astype(ct, copy=False)).reshape(g, oC // g, (C // g) * K)
    off = np.ascontiguousarray(offset.astype(ct, copy=False)).reshape(N, og * K * nd, P)
    has_mask = mask is not None
    mk = (np.ascontiguousarray(mask.astype(ct, copy=False)).reshape(N, og * K, P) if has_mask
          else np.ones((N, 1, 1), dtype=ct))
    cols = np.empty((C * K, P), dtype=ct)
    cg = (C // g) * K
    for n in range(N):
        idx, wts = _plan(off[n], mk[n], has_mask, geo, og, K)
        _fill(xc[n], idx, wts, cols, og)
        for gi in range(g):
            y[n, gi * (oC // g):(gi + 1) * (oC // g)] += wc[gi] @ cols[gi * cg:(gi + 1) * cg]
    return y.reshape((N, oC) + p.out_spatial).astype(dtype)

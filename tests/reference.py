"""Slow float64 oracles, written from the ONNX pages and API.md, kept out of test bodies."""
import itertools
import math

import numpy as np


def affine_grid_ref(theta, size, align_corners):
    """float64 AffineGrid by the definition: grid = theta @ [x, (y, (z,)) 1]."""
    theta = np.asarray(theta, dtype=np.float64)
    nd = len(size) - 2
    axes = []
    for L in size[2:]:
        i = np.arange(L, dtype=np.float64)
        if L <= 1:
            axes.append(np.zeros(L))
        elif align_corners:
            axes.append(-1 + 2 * i / (L - 1))
        else:
            axes.append((2 * i + 1) / L - 1)
    mesh = np.meshgrid(*axes, indexing="ij")  # (D,) H, W
    # base point order is (x, y, z, 1): x is the last spatial axis
    base = np.stack([m for m in reversed(mesh)] + [np.ones_like(mesh[0])], axis=-1)
    out = np.einsum("...k,njk->n...j", base, theta)
    return out.reshape((size[0],) + tuple(size[2:]) + (nd,))


def _sample(xc, pos):
    """n-linear interpolation of xc (D1..Dn) at pos, corners outside count 0."""
    if not all(math.isfinite(p) for p in pos):
        return math.nan
    if any(p <= -1 or p >= d for p, d in zip(pos, xc.shape)):
        return 0.0
    lo = [math.floor(p) for p in pos]
    val = 0.0
    for bits in itertools.product((0, 1), repeat=len(pos)):
        wt, idx = 1.0, []
        for p, l, b in zip(pos, lo, bits):
            wt *= (p - l) if b else (1 - (p - l))
            idx.append(l + b)
        if all(0 <= j < d for j, d in zip(idx, xc.shape)):  # corners outside count 0
            val += wt * xc[tuple(idx)]
    return val


def deform_conv_ref(x, w, offset, b=None, mask=None, kernel_shape=None, strides=None, pads=None,
                    dilations=None, group=1, offset_group=1):
    """float64 DeformConv by the definition in API.md (any number of spatial axes)."""
    x, w, offset = (np.asarray(a, dtype=np.float64) for a in (x, w, offset))
    N, C = x.shape[:2]
    nd = x.ndim - 2
    oC = w.shape[0]
    ks = tuple(w.shape[2:])
    strides = strides or [1] * nd
    dilations = dilations or [1] * nd
    pads = pads or [0] * (2 * nd)
    outs = offset.shape[2:]
    K = int(np.prod(ks))
    cpg, cpo = C // group, C // offset_group
    y = np.zeros((N, oC) + tuple(outs))
    if b is not None:
        y += np.asarray(b, dtype=np.float64).reshape((1, oC) + (1,) * nd)
    mask = None if mask is None else np.asarray(mask, dtype=np.float64)
    for n in range(N):
        for o in itertools.product(*(range(s) for s in outs)):
            for kidx, kk in enumerate(itertools.product(*(range(k) for k in ks))):
                for c in range(C):
                    g = c // cpo
                    pos = [o[i] * strides[i] - pads[i] + kk[i] * dilations[i]
                           + offset[(n, (g * K + kidx) * nd + i) + o] for i in range(nd)]
                    s = _sample(x[n, c], pos)
                    if mask is not None:
                        s *= mask[(n, g * K + kidx) + o]
                    grp = c // cpg
                    for oc in range(grp * (oC // group), (grp + 1) * (oC // group)):
                        y[(n, oc) + o] += w[(oc, c - grp * cpg) + kk] * s
    return y

"""Slow float64 oracles, written from the ONNX pages and API.md, kept out of test bodies."""
import itertools
import math

import ml_dtypes
import numpy as np

from numba_ops._cases import affine_grid_f64 as affine_grid_ref  # noqa: F401  (one definition, shared with `numba-ops check`)


#: API.md's accuracy per result dtype (relative, and times the output's scale absolute);
#: 16-bit: about 2 ulp of the output's scale (two roundings of one float32 computation)
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12,
       np.dtype(np.float16): 2e-3, np.dtype(ml_dtypes.bfloat16): 1.6e-2}


def assert_api_close(got, want, dtype):
    """API.md accuracy: rel tol plus tol x the largest finite |exact output|;
    non-finite entries must match exactly (NaN where NaN, same-signed Inf)."""
    tol = TOL[np.dtype(dtype)]
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fin = np.isfinite(want)
    np.testing.assert_array_equal(got[~fin & ~np.isnan(want)], want[~fin & ~np.isnan(want)])
    scale = np.abs(want[fin]).max() if fin.any() else 0.0
    np.testing.assert_allclose(got[fin], want[fin], rtol=tol, atol=tol * scale)


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


@np.errstate(invalid="ignore", over="ignore")  # NaN/Inf inputs are tested on purpose
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

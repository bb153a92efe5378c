"""Slow float64 oracles, written from the ONNX pages and the documented contract, kept out of test bodies."""
import itertools
import math
import threading

import numpy as np

from numba_ops._accuracy import compare
from numba_ops.benchmark.cases import affine_grid_f64 as affine_grid_ref  # noqa: F401  (one definition, shared with `numba-ops check`)
from numba_ops.benchmark.cases import ms_deform_attn_f64 as ms_deform_attn_ref  # noqa: F401  (likewise)


def assert_api_close(got, want, dtype):
    """The API's accuracy (``numba_ops._accuracy``) of a result of ``dtype`` against
    the exact ``want``: float32/float64 within rel tol plus tol x the largest finite
    |exact output|; float16/bfloat16 the float32 computation rounded once, within 1
    ulp of the output dtype; non-finite entries exactly (NaN where NaN, same-signed Inf)."""
    why = compare(got, want, dtype)
    assert why is None, why


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
    """float64 DeformConv by the documented definition (any number of spatial axes)."""
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


# --- GridSample ---------------------------------------------------------------------

def _gs_unnormalize(g, size, align, dtype):
    """ONNX/onnxruntime GsDenormalize in ``dtype`` (float64 unless a test asks for the
    compute type: the accuracy contract allows what rounding the coordinate to it moves)."""
    g, one, two = dtype(g), dtype(1), dtype(2)
    with np.errstate(invalid="ignore", over="ignore"):
        if align:
            return float((g + one) / two * dtype(size - 1))
        return float(((g + one) * dtype(size) - one) / two)


def _gs_keys(t):
    """Keys' cubic weights, A = -0.75, of taps at distances 1 + t, t, 1 - t, 2 - t."""
    a = -0.75

    def near(d):  # |d| <= 1
        return (a + 2) * d ** 3 - (a + 3) * d ** 2 + 1

    def far(d):  # 1 < |d| < 2
        return a * d ** 3 - 5 * a * d ** 2 + 8 * a * d - 4 * a
    return [far(1 + t), near(t), near(1 - t), far(2 - t)]


def _gs_pad(i, size, padding, align):
    """The element tap ``i`` (a Python int) reads, or None (zeros padding, outside)."""
    if padding == "zeros":
        return i if 0 <= i < size else None
    if padding == "border":
        return min(max(i, 0), size - 1)
    # reflection about -0.5 and size - 0.5 (or 0 and size - 1), repeated until inside
    if align:
        if size == 1:
            return 0
        period = 2 * (size - 1)
        m = i % period
        return m if m < size else period - m
    period = 2 * size
    m = i % period
    return m if m < size else period - 1 - m


def _gs_axis(pos, size, mode, padding, align):
    """[(element or None, weight)] of one axis, exact from the float position."""
    fl = math.floor(pos)  # a Python int: exact for any finite float
    t = pos - fl  # exact
    if mode == "nearest":
        i = fl + (1 if t > 0.5 or (t == 0.5 and fl % 2 == 1) else 0)
        return [(_gs_pad(i, size, padding, align), 1.0)]
    if mode == "linear":
        return [(_gs_pad(fl, size, padding, align), 1.0 - t), (_gs_pad(fl + 1, size, padding, align), t)]
    return [(_gs_pad(fl + k, size, padding, align), w) for k, w in zip(range(-1, 3), _gs_keys(t))]


def grid_sample_ref(x, grid, mode="linear", padding_mode="zeros", align_corners=False, coord_dtype=np.float64):
    """float64 GridSample by the documented definition (any number of spatial axes):
    per axis the unnormalised position (in ``coord_dtype``), its taps (nearest:
    rounded half to even; linear; cubic, A = -0.75), each tap padded on its own
    (zeros: outside counts 0), and the sum over the taps' combinations of the
    product of weights times the element. A non-finite position gives NaN."""
    xf = np.asarray(x, dtype=np.float64)
    g = np.asarray(grid, dtype=np.float64)
    N, C = xf.shape[:2]
    sizes = xf.shape[2:]
    r = len(sizes)
    outs = g.shape[1:-1]
    y = np.zeros((N, C) + outs)
    for n in range(N):
        for o in itertools.product(*(range(s) for s in outs)):
            pos = [_gs_unnormalize(g[(n,) + o + (r - 1 - k,)], sizes[k], align_corners, coord_dtype)
                   for k in range(r)]
            if not all(math.isfinite(p) for p in pos):
                y[(n, slice(None)) + o] = np.nan
                continue
            taps = [_gs_axis(p, s, mode, padding_mode, align_corners) for p, s in zip(pos, sizes)]
            val = np.zeros(C)
            for combo in itertools.product(*taps):
                if any(i is None for i, _ in combo):
                    continue
                w = math.prod(wt for _, wt in combo)
                val += w * xf[(n, slice(None)) + tuple(i for i, _ in combo)]
            y[(n, slice(None)) + o] = val
    return y


def to_uint8_ref(v):
    """ONNX's cast of a computed sample to uint8: NaN -> 0, clamped to 0..255, truncated."""
    v = np.nan_to_num(np.asarray(v, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)
    return np.trunc(np.clip(v, 0, 255)).astype(np.uint8)


def ulp_diff(a, b, dtype):
    """Distance in units of the last place of the 16-bit ``dtype`` between two arrays of it."""
    ia = np.asarray(a).astype(dtype).view(np.int16).astype(np.int64)
    ib = np.asarray(b).astype(dtype).view(np.int16).astype(np.int64)
    # map sign-magnitude bit patterns onto a monotonic integer line
    ia = np.where(ia < 0, -32768 - ia, ia)
    ib = np.where(ib < 0, -32768 - ib, ib)
    return np.abs(ia - ib)


def in_threads(fn, n):
    """``[fn(0), ..., fn(n - 1)]``, each called on a thread of its own, all at once."""
    results = [None] * n

    def work(i):
        results[i] = fn(i)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results

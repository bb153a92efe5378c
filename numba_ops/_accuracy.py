"""The API's accuracy, the one tolerance table: what a result of each dtype may be,
given the exact (float64) result of the same call.

- float32: within 1e-5 relative plus 1e-5 x the output's scale absolute;
- float64: within 1e-12 relative plus 1e-12 x scale;
- float16, bfloat16: the float32 computation on the upcast inputs, rounded once to
  the output dtype, within 1 ulp of the output dtype. Against an exact result that
  is any value of the float32 interval above rounded to nearest, give or take one
  step of the output dtype.

The scale is the largest finite absolute value of the exact output. Non-finite
exact values are met exactly (NaN where NaN, the same infinity).
"""
import numpy as np

#: result dtype name -> (relative, times the scale absolute) of a float computation
TOLERANCE = {"float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12)}
#: 16-bit results: the float32 computation's tolerance, then rounded to the output dtype
ROUNDED_FROM = {"float16": "float32", "bfloat16": "float32"}


def tolerance(dtype):
    """(rtol, atol per unit of scale) of the computation behind a result of ``dtype``
    (for float16/bfloat16: of the float32 computation that is rounded)."""
    name = np.dtype(dtype).name
    return TOLERANCE[ROUNDED_FROM.get(name, name)]


def scale_of(expected):
    """The output's scale: the largest finite |value| of the exact output (0 if none)."""
    finite = np.abs(expected[np.isfinite(expected)])
    return float(finite.max()) if finite.size else 0.0


def bounds(expected, dtype, scale=None):
    """``(lo, hi)``, float64 arrays: the closed interval around each exact value of
    ``expected`` in which the API puts a result of ``dtype``."""
    expected = np.asarray(expected, dtype=np.float64)
    dt = np.dtype(dtype)
    rtol, atol = tolerance(dt)
    if scale is None:
        scale = scale_of(expected)
    with np.errstate(invalid="ignore", over="ignore"):
        slack = rtol * np.abs(expected) + atol * scale
        lo, hi = expected - slack, expected + slack
        if dt.name in ROUNDED_FROM:  # rounded to nearest (monotonic), then one step out
            lo = np.nextafter(lo.astype(dt), np.array(-np.inf, dt)).astype(np.float64)
            hi = np.nextafter(hi.astype(dt), np.array(np.inf, dt)).astype(np.float64)
    return lo, hi


def compare(got, expected, dtype, scale=None):
    """None when ``got`` is within the API's accuracy for ``dtype`` of the exact
    ``expected`` (``scale``: the output's, when ``expected`` is a part of it), else a
    one-line description of the worst mismatch."""
    g = np.asarray(got).astype(np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if g.shape != expected.shape:
        return f"shape {g.shape}, expected {expected.shape}"
    lo, hi = bounds(expected, dtype, scale)
    finite = np.isfinite(expected)
    with np.errstate(invalid="ignore"):
        ok = np.where(finite, (lo <= g) & (g <= hi), (g == expected) | (np.isnan(g) & np.isnan(expected)))
    if ok.all():
        return None
    with np.errstate(invalid="ignore"):
        err = np.where(ok, -1.0, np.nan_to_num(np.abs(g - expected), nan=np.inf))
    i = np.unravel_index(int(np.argmax(err)), err.shape)
    return (f"{int((~ok).sum())} of {ok.size} values off; worst at {tuple(int(v) for v in i)}: "
            f"got {g[i]!r}, expected {expected[i]!r} (allowed {lo[i]!r} to {hi[i]!r} for {np.dtype(dtype).name})")

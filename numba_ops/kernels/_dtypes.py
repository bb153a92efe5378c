"""The four public float dtypes: their names, and how kernels see them.

Numba's CPU target has no float16 arithmetic, so 16-bit data reaches the kernels
as its bit pattern: float16 as ``int16``, bfloat16 as ``uint16``. Two distinct
integer types keep the two formats apart in a kernel's signature (see
``_scalar.py``: ``load``/``store``). Accumulation is float32 for the 16-bit types
and float32, float64 for float64.

ml_dtypes (bfloat16) is imported only when needed (its extension takes ~0.4 s to
load, more than the rest of ``import numba_ops``): an array of dtype bfloat16
exists only once ml_dtypes is loaded, so a dtype named "bfloat16" is checked
against ml_dtypes then, and nothing here imports it before. ``BFLOAT16`` and
``DTYPES`` (every public dtype) are module attributes made on first access.

The one table of dtype names: kernels declare the dtypes they take with
``NAMES``; ``numba_ops._dtypes`` (the front ends' checks), the warm-up, the CLI
and the benchmarks build on it.
"""
import numpy as np

#: every public float dtype's name, narrowest first
NAMES = ("float16", "bfloat16", "float32", "float64")
SUPPORTED = ", ".join(NAMES)
FLOAT16 = np.dtype(np.float16)

#: public dtype -> (storage dtype seen by kernels, compute dtype); bfloat16 joins once seen
_KNOWN = {
    FLOAT16: (np.dtype(np.int16), np.dtype(np.float32)),
    np.dtype(np.float32): (np.dtype(np.float32), np.dtype(np.float32)),
    np.dtype(np.float64): (np.dtype(np.float64), np.dtype(np.float64)),
}
_BF16_ENTRY = (np.dtype(np.uint16), np.dtype(np.float32))


def bfloat16():
    """``np.dtype(ml_dtypes.bfloat16)`` (imports ml_dtypes)."""
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16)
    _KNOWN.setdefault(dt, _BF16_ENTRY)
    return dt


def np_dtype(name):
    """The NumPy dtype for one of ``NAMES`` (bfloat16 from ml_dtypes)."""
    if name not in NAMES:
        raise ValueError(f"unknown dtype name {name!r}; expected one of {SUPPORTED}")
    return bfloat16() if name == "bfloat16" else np.dtype(name)


def entry(dt):
    """(storage, compute) of the public dtype ``dt`` (an np.dtype), or None."""
    e = _KNOWN.get(dt)
    if e is None and dt.name == "bfloat16" and dt.kind == "V":
        if dt == bfloat16():
            return _BF16_ENTRY
    return e


def __getattr__(name):
    if name == "BFLOAT16":
        return bfloat16()
    if name == "DTYPES":
        return {dt: _KNOWN[dt] for dt in map(np_dtype, NAMES)}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def storage(dtype):
    return entry(np.dtype(dtype))[0]


def compute(dtype):
    return entry(np.dtype(dtype))[1]

"""The four public float dtypes and how kernels see them.

Numba's CPU target has no float16 arithmetic, so 16-bit data reaches the kernels
as its bit pattern: float16 as ``int16``, bfloat16 as ``uint16``. Two distinct
integer types keep the two formats apart in a kernel's signature (see
``kernels/_scalar.py``: ``load``/``store``). Accumulation is float32 for the
16-bit types and float32, float64 for float64 (API.md, dtypes).
"""
import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT16 = np.dtype(np.float16)

#: public dtype -> (storage dtype seen by kernels, compute dtype)
DTYPES = {
    FLOAT16: (np.dtype(np.int16), np.dtype(np.float32)),
    BFLOAT16: (np.dtype(np.uint16), np.dtype(np.float32)),
    np.dtype(np.float32): (np.dtype(np.float32), np.dtype(np.float32)),
    np.dtype(np.float64): (np.dtype(np.float64), np.dtype(np.float64)),
}
SUPPORTED = "float16, bfloat16, float32, float64"


def common_float_dtype(named):
    """The one dtype shared by the float inputs ``named`` ({name: array or None}).

    Raises TypeError naming the input when a dtype is not one of the four or the
    inputs disagree.
    """
    dtype, first = None, None
    for name, a in named.items():
        if a is None:
            continue
        dt = np.dtype(a.dtype)
        if dt not in DTYPES:
            raise TypeError(f"{name} has dtype {dt}; expected one of {SUPPORTED}")
        if dtype is None:
            dtype, first = dt, name
        elif dt != dtype:
            raise TypeError(f"all float inputs must share one dtype: {first} is {dtype} but {name} is {dt}")
    return dtype


def storage(dtype):
    return DTYPES[np.dtype(dtype)][0]


def compute(dtype):
    return DTYPES[np.dtype(dtype)][1]

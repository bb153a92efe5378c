"""The front ends' dtype checks, on the dtype table of the kernels
(``kernels/_dtypes.py``: names, storage and compute types, lazy bfloat16)."""
import numpy as np

from .kernels._dtypes import NAMES, SUPPORTED, compute, entry, np_dtype, storage  # noqa: F401


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
        if entry(dt) is None:
            raise TypeError(f"{name} has dtype {dt}; expected one of {SUPPORTED}")
        if dtype is None:
            dtype, first = dt, name
        elif dt != dtype:
            raise TypeError(f"all float inputs must share one dtype: {first} is {dtype} but {name} is {dt}")
    return dtype

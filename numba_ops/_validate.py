"""Attribute normalisation shared by the front ends (API.md, Bad input)."""
import numbers

import numpy as np


def as_bool(value, name):
    """A bool, or the integer 0/1; anything else is a ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be a bool or 0/1; got {value!r}")


def as_int(value, name, minimum=None):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return value


def int_tuple(value, name, length=None, minimum=None):
    """A sequence or 1-D array of integers as a tuple of Python ints."""
    if isinstance(value, (str, bytes)) or np.ndim(value) != 1:
        raise ValueError(f"{name} must be a sequence or 1-D array of integers; got {value!r}")
    arr = np.asarray(value)
    if arr.size and arr.dtype.kind not in "iu" and not all(
            isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) for v in value):
        raise ValueError(f"{name} must hold integers; got {value!r}")
    out = tuple(int(v) for v in arr.tolist())
    if length is not None and len(out) not in np.atleast_1d(length):
        want = " or ".join(str(n) for n in np.atleast_1d(length))
        raise ValueError(f"{name} must have {want} entries; got {len(out)}: {list(out)}")
    if minimum is not None and any(v < minimum for v in out):
        raise ValueError(f"{name} entries must be >= {minimum}; got {list(out)}")
    return out

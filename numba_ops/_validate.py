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
    """A sequence or 1-D array of integers as a tuple of Python ints.

    ``length`` is an int or a tuple of allowed lengths.
    """
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or (value.size and value.dtype.kind not in "iu"):
            raise ValueError(f"{name} must be a 1-D array of integers; got {value.dtype} shape {value.shape}")
        out = tuple(value.tolist())
    else:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise ValueError(f"{name} must be a sequence or 1-D array of integers; got {value!r}")
        for v in value:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
                raise ValueError(f"{name} must hold integers; got {value!r}")
        out = tuple(int(v) for v in value)
    allowed = (length,) if isinstance(length, int) else length
    if allowed is not None and len(out) not in allowed:
        want = " or ".join(str(n) for n in allowed)
        raise ValueError(f"{name} must have {want} entries; got {len(out)}: {list(out)}")
    if minimum is not None and any(v < minimum for v in out):
        raise ValueError(f"{name} entries must be >= {minimum}; got {list(out)}")
    return out

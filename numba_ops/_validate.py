"""Attribute normalisation shared by the front ends (ValueError/TypeError naming the input)."""
import numbers
import operator

import numpy as np


#: entries a front end's validated-call cache holds before it starts over
SEEN_MAX = 512


def remember(seen, key, value):
    """``seen[key] = value`` in a front end's validated-call cache, emptied first once
    it holds ``SEEN_MAX`` entries (calls with ever-new shapes never grow it further)."""
    if len(seen) >= SEEN_MAX:
        seen.clear()
    seen[key] = value


class IntegerError(TypeError, ValueError):
    """A value that must be an integer is not (both kinds of error: a wrong type and a wrong value)."""


def as_bool(value, name):
    """A bool, or the integer 0/1; anything else is a ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be a bool or 0/1; got {value!r}")


def as_int(value, name, minimum=None):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise IntegerError(f"{name} must be an integer; got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return value


def int_tuple(value, name, length=None, minimum=None):
    """A sequence or 1-D array of integers as a tuple of Python ints.

    ``length`` is an int or a tuple of allowed lengths. Non-integer entries raise
    ``IntegerError`` (a TypeError and a ValueError: the value's type is wrong).
    """
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be a sequence or 1-D array of integers; got {value!r}")
    try:
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a sequence or 1-D array of integers; got {value!r}") from exc
    if arr.ndim == 0:
        raise ValueError(f"{name} must be a sequence or 1-D array of integers; "
                         f"got {type(value).__name__} {value!r:.80}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (a sequence of integers); got shape {arr.shape}")
    objects = arr.dtype.kind == "O"
    if (arr is not value or objects) and any(isinstance(v, (bool, np.bool_)) for v in value):
        raise IntegerError(f"{name} must hold integers, not bools; got {list(value)!r}")
    if arr.size and arr.dtype.kind not in "iu":
        if not (objects or (arr is not value and arr.dtype.kind == "f")):
            raise IntegerError(f"{name} must hold integers; got {arr.dtype} values {arr.tolist()}")
        # NumPy holds integers beyond 64 bits as objects, and turns a mix of uint64 and
        # signed integers into float64: ask each entry
        try:
            out = tuple(operator.index(v) for v in value)
        except TypeError:
            raise IntegerError(f"{name} must hold integers; got {list(value)!r}") from None
    else:
        out = tuple(arr.tolist())
    allowed = (length,) if isinstance(length, int) else length
    if allowed is not None and len(out) not in allowed:
        want = " or ".join(str(n) for n in allowed)
        raise ValueError(f"{name} must have {want} entries; got {len(out)}: {list(out)}")
    if minimum is not None and any(v < minimum for v in out):
        raise ValueError(f"{name} entries must be >= {minimum}; got {list(out)}")
    return out


def parse_wrt(wrt, names, given):
    """The inputs whose gradients a backward call computes: ``wrt`` None (every input
    in ``names`` that ``given`` marks present) or an iterable of names from ``names``
    (ValueError naming ``wrt`` for any other, TypeError for a non-iterable); a name
    asked for whose input is absent (``b``/``mask`` None) is simply not computed.
    A dict {name: bool}."""
    if wrt is None:
        return {n: bool(g) for n, g in zip(names, given)}
    if isinstance(wrt, str):
        wrt = (wrt,)
    try:
        asked = list(wrt)
    except TypeError:
        raise TypeError(f"wrt must be None or an iterable of input names from {names}; got {wrt!r}") from None
    for a in asked:
        if not isinstance(a, str) or a not in names:
            raise ValueError(f"wrt names inputs from {', '.join(map(repr, names))}; got {a!r}")
    return {n: (n in asked) and bool(g) for n, g in zip(names, given)}


def check_grad_y(grad_y, shape, dtype, name="grad_y"):
    """``grad_y`` (an array, called ``name``) must have the forward result's ``shape`` and
    the inputs' ``dtype``."""
    if tuple(grad_y.shape) != tuple(shape):
        raise ValueError(f"{name} must have the forward result's shape {tuple(shape)}; got {tuple(grad_y.shape)}")
    if np.dtype(grad_y.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must have the inputs' dtype {np.dtype(dtype)}; got {np.dtype(grad_y.dtype)}")

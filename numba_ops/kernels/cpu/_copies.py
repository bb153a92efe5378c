"""Whole-array copies for the CPU launchers, compiled and parallel where NumPy's are
slow: 16-bit arrays to float32 and back, and the middle axes of an array swapped.

The launchers that run 16-bit calls on the float32 kernels (GridSample, affine_warp,
DeformConv, multi-scale deformable attention and the gradients) convert with these.

``widened(a)`` is ``a`` C-contiguous in its compute type (float32 for float16 and
bfloat16: a copy, exact; float32 and float64 as they are); ``narrowed(a, dtype)``
rounds a float32 result once to a 16-bit ``dtype`` (to nearest even, as the CUDA
kernels' stores). Both are one flat pass through ``_scalar``'s ``load``/``store``
(F16C's ``vcvtph2ps``/``vcvtps2ph`` for float16, the bit shift for bfloat16), in
parallel for large arrays: NumPy's own float16 conversions run at a tenth of that
speed (12 and 20 ms for 6.3 M elements here, against a 1.7 ms copy), which would
have made a 16-bit call several times its float32 call. Compiled once per
direction and 16-bit dtype, small.

``swapped(a, out)`` copies ``a`` (A, B, C, K) to ``out`` (A, C, B, K): multi-scale
deformable attention's backward takes its points and value in the order of its units
and gives their gradients back (NumPy's strided copies of 16-32-byte runs there
took a quarter of the encoder's backward, on one thread).
"""
import numpy as np
from numba import njit, prange

from .._dtypes import compute, storage
from .._scalar import load, store
from . import _runtime
from ._opaque import INTERNAL, opaque


@njit(**INTERNAL)
def _span(src, dst, lo, hi):
    for i in range(np.uint64(lo), np.uint64(hi)):
        store(dst, i, load(src, i))


_span_op = opaque(_span)


@njit(cache=True, nogil=True)
def _serial(src, dst):
    _span_op(src, dst, 0, src.size)


@njit(cache=True, parallel=True, nogil=True)
def _parallel(src, dst, nchunks):
    n = src.size
    for c in prange(nchunks):
        _span_op(src, dst, c * n // nchunks, (c + 1) * n // nchunks)


#: rows of ``B`` a swap's unit copies (its reads of them contiguous, its writes C
#: runs of BLOCK * K elements)
BLOCK = 64


@njit(**INTERNAL)
def _swap_span(a, out, lo, hi):
    """Units ``lo:hi`` (``(i, block of B)``) of ``out[i, c, b, :] = a[i, b, c, :]``."""
    B, C, K = a.shape[1], a.shape[2], a.shape[3]
    nb = (B + BLOCK - 1) // BLOCK
    for u in range(lo, hi):
        i = u // nb
        b0 = (u - i * nb) * BLOCK
        b1 = min(B, b0 + BLOCK)
        for c in range(C):
            for b in range(b0, b1):
                for k in range(K):
                    out[i, c, b, k] = a[i, b, c, k]


_swap_span_op = opaque(_swap_span)


@njit(cache=True, nogil=True)
def _swap_serial(a, out):
    _swap_span_op(a, out, 0, a.shape[0] * ((a.shape[1] + BLOCK - 1) // BLOCK))


@njit(cache=True, parallel=True, nogil=True)
def _swap_parallel(a, out, nchunks):
    units = a.shape[0] * ((a.shape[1] + BLOCK - 1) // BLOCK)
    nchunks = min(units, nchunks)
    for c in prange(nchunks):
        _swap_span_op(a, out, c * units // nchunks, (c + 1) * units // nchunks)


def swapped(a, out):
    """``out`` (A, C, B, K), C-contiguous, filled with ``a`` (A, B, C, K), C-contiguous,
    of the same dtype: ``out[i, c, b, k] = a[i, b, c, k]``."""
    _runtime.run(_swap_serial, _swap_parallel, a.size, a, out)
    return out


def _convert(src, dst):
    """``dst`` (flat) = ``src`` (flat) converted element by element."""
    _runtime.run(_serial, _parallel, src.size, src, dst)
    return dst


def widened(a):
    """``a`` C-contiguous in its compute type: float32 and float64 as they are (a copy
    only when ``a`` is not C-contiguous), 16-bit floats widened to a new float32 array."""
    ct = compute(a.dtype)
    a = np.ascontiguousarray(a)
    if a.dtype == ct:
        return a
    out = np.empty(a.shape, ct)
    _convert(a.reshape(-1).view(storage(a.dtype)), out.reshape(-1))
    return out


def narrowed(a, dtype):
    """The float array ``a`` in ``dtype``: as it is when that is its dtype, else float32
    rounded once to the 16-bit ``dtype`` (a new array), or cast (float64)."""
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    if a.dtype != np.float32 or storage(dtype) == dtype:
        return a.astype(dtype)
    a = np.ascontiguousarray(a)
    out = np.empty(a.shape, storage(dtype))
    _convert(a.reshape(-1), out.reshape(-1))
    return out.view(dtype)

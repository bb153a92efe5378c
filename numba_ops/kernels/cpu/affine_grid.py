"""AffineGrid on the CPU: ``@njit(parallel=True)`` over rows of the output grid.

The output, viewed flat, is rows ``(n, [d,] h)`` of ``W * nd`` elements, each
written once, rounded straight into its storage type.

- 2-D: ``row[2w + k] = theta[n,k,0] * x_w + b_k`` with two per-row constants
  ``b_k``; LLVM vectorises the stride-2 store pair (interleaving shuffles).
- 3-D: LLVM leaves the stride-3 version scalar, so every row of one ``(n, d)``
  slab is written as the same linear function of its ``y``::

      row[3w + k] = P[3w + k] + y * Q[3w + k],   P = A + (C * z_d + T)
      A = theta[n,k,0] * x_w,  C = theta[n,k,2],  T = theta[n,k,3],  Q = theta[n,k,1]

  ``A``, ``C``, ``T`` and ``Q`` are built once per image and ``P`` once per slab
  (a contiguous loop), all in cache (rows longer than ``_BLOCK`` go in column
  blocks, the tables rebuilt per block); the row loop is contiguous loads, a
  multiply-add and a contiguous store: 1.5-2x faster than the stride-3 loop.
  (The grouping is the CUDA kernel's, so both devices round alike.)

bfloat16 is rounded by ``f32_to_bf16_bits_rne`` (no NaN branch: theta is
bfloat16, so every NaN here has zero low bits), which keeps the loop unrolled.
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ..._dtypes import compute, storage
from .._scalar import base_coord, f32_to_bf16_bits_rne, store
from . import _runtime

DTYPES = ("float16", "bfloat16", "float32", "float64")

#: 3-D column block: five tables of this many elements (60 KB in float32) stay in
#: L2 and bound the kernel's scratch memory however long a row is
_BLOCK = 3 * 1024


@njit(cache=True)
def _coords(length, align, one):
    c = np.empty(length, dtype=type(one))
    for i in range(length):
        c[i] = base_coord(i, length, align, one)
    return c


def _put(out, i, v):
    """``store``, with bfloat16 rounded by ``f32_to_bf16_bits_rne`` (see above)."""


@overload(_put, jit_options={"inline": "always"})
def _put_impl(out, i, v):
    if out.dtype == types.uint16:
        def impl(out, i, v):
            out[i] = f32_to_bf16_bits_rne(v)
    else:
        def impl(out, i, v):
            store(out, i, v)
    return impl


@njit(cache=True)
def _rows(theta, out, D, H, W, align, one, r0, r1):
    """Rows ``r0:r1`` of the flat ``out`` (N * D * H rows of W * nd elements, D being
    1 in 2-D); ``one`` is 1 in the compute type. (Sizes come as ints, not a tuple:
    numba's dispatcher types a tuple argument in Python, a microsecond on small calls.)

    The rows go by runs within one ``(n, d)`` slab, so the integer divisions that
    find ``(n, d, h)`` are paid once a run, not once a (3-D: 192-element) row.
    """
    nd = theta.shape[1]
    L = W * nd
    xs = _coords(W, align, one)
    ys = _coords(H, align, one)
    zs = _coords(D, align, one)
    B = min(L, _BLOCK) if nd == 3 else 0  # 3-D: rows go in column blocks of B elements
    A = np.empty(B, dtype=type(one))  # the 3-D tables (above), for one column block
    C, T, Q, P = np.empty_like(A), np.empty_like(A), np.empty_like(A), np.empty_like(A)
    n_tables = -1
    r = r0
    o = r0 * L
    while r < r1:
        s = r // H
        n = s // D
        h0 = r - s * H
        h1 = min(H, h0 + (r1 - r))
        if nd == 2:
            a0, a1 = theta[n, 0, 0], theta[n, 1, 0]
            ob = o
            for h in range(h0, h1):
                b0 = theta[n, 0, 1] * ys[h] + theta[n, 0, 2]
                b1 = theta[n, 1, 1] * ys[h] + theta[n, 1, 2]
                for w in range(W):
                    _put(out, np.uint64(ob + 2 * w), a0 * xs[w] + b0)  # unsigned: no negative-index fix-up
                    _put(out, np.uint64(ob + 2 * w + 1), a1 * xs[w] + b1)
                ob += L
        else:
            for j0 in range(0, L, B):
                j1 = min(L, j0 + B)
                if n != n_tables or B < L:  # one block: the tables last the image
                    for k in range(3):
                        for w in range(j0 // 3, j1 // 3):
                            A[3 * w + k - j0] = theta[n, k, 0] * xs[w]
                            C[3 * w + k - j0] = theta[n, k, 2]
                            T[3 * w + k - j0] = theta[n, k, 3]
                            Q[3 * w + k - j0] = theta[n, k, 1]
                    n_tables = n
                z = zs[s - n * D]
                for j in range(j1 - j0):
                    P[j] = A[j] + (C[j] * z + T[j])
                ob = o + j0
                for h in range(h0, h1):
                    y = ys[h]
                    for j in range(j1 - j0):
                        _put(out, np.uint64(ob + j), P[j] + y * Q[j])
                    ob += L
        o += (h1 - h0) * L
        r += h1 - h0


@njit(cache=True)
def _serial(theta, out, D, H, W, align, one):
    _rows(theta, out, D, H, W, align, one, 0, out.size // (W * theta.shape[1]))


@njit(cache=True, parallel=True)
def _parallel(theta, out, D, H, W, align, one, nchunks):
    rows = out.size // (W * theta.shape[1])
    nchunks = min(rows, nchunks)
    for c in prange(nchunks):
        _rows(theta, out, D, H, W, align, one, c * rows // nchunks, (c + 1) * rows // nchunks)


#: 1 in each compute type, made once: a fresh NumPy scalar per call costs a large call ~5 us
_ONE = {np.dtype(t): t(1) for t in (np.float32, np.float64)}


def launch(theta, size, align):
    """theta: NumPy (N, nd, nd+1), validated; size: (N, C, [D,] H, W)."""
    dtype = theta.dtype
    nd = len(size) - 2
    shape = (size[0],) + tuple(size[2:])
    st = storage(dtype)
    out = np.empty(shape + (nd,), dtype=st)
    if out.size:
        th = np.ascontiguousarray(theta, dtype=compute(dtype))
        D = shape[1] if nd == 3 else 1
        _runtime.run(_serial, _parallel, out.size, th, out.reshape(-1), D, shape[-2], shape[-1], align,
                     _ONE[th.dtype])
    return out if st == dtype else out.view(dtype)  # 16-bit: the bit patterns as their dtype

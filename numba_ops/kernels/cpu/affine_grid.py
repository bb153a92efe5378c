"""AffineGrid on the CPU: ``@njit(parallel=True)`` over rows of the output grid.

The output, viewed flat, is rows ``(n, [d,] h)`` of ``W * nd`` elements, each
written once, rounded straight into its storage type.

- 2-D: ``row[2w + k] = theta[n,k,0] * x_w + b_k`` with two per-row constants
  ``b_k``; LLVM vectorises the stride-2 store pair (interleaving shuffles).
- 3-D: LLVM leaves the stride-3 version scalar, so every row of one ``(n, d)``
  slab is written as the same linear function of its ``y``::

      row[3w + k] = P[3w + k] + y * Q[3w + k]
      P = theta[n,k,0] * x_w + (theta[n,k,2] * z_d + theta[n,k,3]),  Q = theta[n,k,1]

  ``P`` is built once per slab and ``Q`` once per image (in L1), and the row
  loop is contiguous loads, a multiply-add and a contiguous store: 1.5-2x faster.
  (The grouping is the CUDA kernel's, so both devices round alike.)

bfloat16 is rounded by ``f32_to_bf16_bits_rne`` (no NaN branch: theta is
bfloat16, so every NaN here has zero low bits), which keeps the loop unrolled.

A 2-D grid reaches the kernels in its own shape (N, H, W, 2), a 3-D one flat:
the rank is then part of the compiled signature, and numba prunes the
``grid.ndim`` branches before typing, so a 2-D call compiles the 2-D code only
and a 3-D call the 3-D code only, which keeps first calls short. (nd stays a runtime value and the
3-D grid the flat argument itself: with nd fixed at compile time, or the rows
written through a reshaped 5-D grid, ag3d_4x64 ran 6-18 % slower here.)
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .._dtypes import NAMES, compute, storage
from .._scalar import base_coord, f32_to_bf16_bits_rne, store
from . import _runtime
from ._opaque import INTERNAL, opaque
from ._views import flat

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)


@njit(**INTERNAL)
def base_coords(length, align, one):
    """The ``length`` base coordinates of one axis in the type of ``one`` (affine_warp's kernels share them)."""
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


@njit(**INTERNAL)
def _rows(theta, grid, D, H, W, align, one, r0, r1):
    """Rows ``r0:r1`` of the grid, viewed flat as N * D * H rows of W * nd elements
    (D being 1 in 2-D); ``one`` is 1 in the compute type. (Sizes come as ints, not a tuple:
    numba's dispatcher types a tuple argument in Python, a microsecond on small calls.)

    The rows go by runs within one ``(n, d)`` slab, so the integer divisions that
    find ``(n, d, h)`` are paid once a run, not once a (3-D: 192-element) row.
    """
    out = flat(grid)  # 3-D comes flat; 2-D is (N, H, W, 2)
    nd = theta.shape[1]
    L = W * nd
    xs = base_coords(W, align, one)
    ys = base_coords(H, align, one)
    if grid.ndim == 1:
        zs = base_coords(D, align, one)
        P = np.empty(L, dtype=type(one))  # the 3-D tables (above)
        Q = np.empty_like(P)
    n_q = -1
    r = r0
    o = r0 * L
    while r < r1:
        s = r // H
        n = s // D
        h0 = r - s * H
        h1 = min(H, h0 + (r1 - r))
        if grid.ndim == 4:
            a0, a1 = theta[n, 0, 0], theta[n, 1, 0]
            for h in range(h0, h1):
                b0 = theta[n, 0, 1] * ys[h] + theta[n, 0, 2]
                b1 = theta[n, 1, 1] * ys[h] + theta[n, 1, 2]
                for w in range(W):
                    _put(out, np.uint64(o + 2 * w), a0 * xs[w] + b0)  # unsigned: no negative-index fix-up
                    _put(out, np.uint64(o + 2 * w + 1), a1 * xs[w] + b1)
                o += L
        else:
            if n != n_q:
                for k in range(3):
                    for w in range(W):
                        Q[3 * w + k] = theta[n, k, 1]
                n_q = n
            for k in range(3):
                a = theta[n, k, 0]
                b = theta[n, k, 2] * zs[s - n * D] + theta[n, k, 3]
                for w in range(W):
                    P[3 * w + k] = a * xs[w] + b
            for h in range(h0, h1):
                y = ys[h]
                for j in range(L):
                    _put(out, np.uint64(o + j), P[j] + y * Q[j])
                o += L
        r += h1 - h0


#: called through its own compiled code (``_opaque``): the serial and parallel entries do
#: not compile it again
_rows_op = opaque(_rows)


@njit(cache=True, nogil=True)
def _serial(theta, grid, D, H, W, align, one):
    _rows_op(theta, grid, D, H, W, align, one, 0, grid.size // (W * theta.shape[1]))


@njit(cache=True, parallel=True, nogil=True)
def _parallel(theta, grid, D, H, W, align, one, nchunks):
    rows = grid.size // (W * theta.shape[1])
    nchunks = min(rows, nchunks)
    for c in prange(nchunks):
        _rows_op(theta, grid, D, H, W, align, one, c * rows // nchunks, (c + 1) * rows // nchunks)


#: 1 in each compute type, made once: a fresh NumPy scalar per call costs a large call ~5 us
_ONE = {np.dtype(t): t(1) for t in (np.float32, np.float64)}


def launch_plan(size):
    """``(grid shape, work, rows)`` of a call for output ``size``: the work that decides
    serial or parallel (``_runtime``) and the rows (``_rows``' units) that a pool
    shares out; ``launch`` and numba_ops.onnx's session run by it."""
    nd = len(size) - 2
    shape = (size[0],) + tuple(size[2:]) + (nd,)
    n = 1
    for s in shape:
        n *= s
    return shape, n, n // (shape[-2] * nd) if n else 0


@njit(cache=True, inline="always")
def rows_task(theta, grid, D, H, W, align, one, th, items, rows):
    """Pool item ``th`` of ``items``: its share of the grid's ``rows`` (a pool other
    than numba's, as ``_parallel`` deals them)."""
    _rows_op(theta, grid, D, H, W, align, one, th * rows // items, (th + 1) * rows // items)


def launch(theta, size, align):
    """theta: NumPy (N, nd, nd+1), validated; size: (N, C, [D,] H, W)."""
    dtype = theta.dtype
    nd = len(size) - 2
    gshape, _, _ = launch_plan(size)
    shape = gshape[:-1]
    st = storage(dtype)
    out = np.empty(gshape, dtype=st)
    if out.size:
        th = np.ascontiguousarray(theta, dtype=compute(dtype))
        D = shape[1] if nd == 3 else 1
        grid = out if nd == 2 else out.reshape(-1)  # the rank in the kernels' signature (above)
        _runtime.run(_serial, _parallel, out.size, th, grid, D, shape[-2], shape[-1], align,
                     _ONE[th.dtype])
    return out if st == dtype else out.view(dtype)  # 16-bit: the bit patterns as their dtype

"""affine_warp on the CPU: GridSample at AffineGrid's positions, computed on the fly.

Each image's output positions, in order, are cut into segments of at most ``SEG``
as GridSample's (``kernels/cpu/grid_sample.py``; rows shorter than ``SEG`` share a
segment, so that its fixed cost is spread as widely), which ``prange`` shares out. A
segment's grid values, row piece by row piece, are computed from theta exactly as the CPU AffineGrid
kernel computes them (same base coordinates, same grouping: 2-D
``theta[n,k,0] * x_w + (theta[n,k,1] * y_h + theta[n,k,2])``, 3-D
``(theta[n,k,0] * x_w + (theta[n,k,2] * z_d + theta[n,k,3])) + y_h * theta[n,k,1]``)
in the compute type, unnormalised, and sampled by GridSample's plan and
accumulation: float32/float64 results equal ``grid_sample(affine_grid(...))``
bit for bit, and the grid is never stored (nor, for 16-bit theta, rounded to 16
bits).
"""
import numpy as np
from numba import njit, prange

from .._compat import NO_NRT
from .._dtypes import NAMES, compute
from .._sample import TAPS, as_compute, unnormalize
from . import _runtime
from ._copies import narrowed
from ._opaque import INTERNAL, inline, opaque
from .affine_grid import base_coords
from .grid_sample import SEG, TOKEN, ZERO, accumulate_op, kernel_view, output_for, plan_op, prefetch_ahead, scratch

#: theta dtypes; ``x`` has the same dtype, or uint8
DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)


@inline(**NO_NRT)
def positions(x, th, n, j0, m, H, W, align, one, xs, ys, zs, pos):
    """Output positions ``j0 .. j0 + m`` of image ``n`` (row-major over (D, H, W)),
    unnormalised into ``pos[k, :m]`` (axis ``k`` of x's spatial axes, outermost first),
    computed from the flat theta ``th`` (N*r*(r+1)) row piece by row piece as the
    CPU AffineGrid kernel computes the grid (``xs``/``ys``/``zs``: the base
    coordinates). Shared with the backward, whose positions are thus these bits."""
    r = x.ndim - 2
    j = 0
    while j < m:  # the segment's pieces of rows (d, h)
        row = (j0 + j) // W
        w0 = j0 + j - row * W
        L = min(W - w0, m - j)
        h = row % H
        d = row // H
        for k in range(r):
            t = (n * r + r - 1 - k) * (r + 1)  # theta's row of spatial axis k (grid component r - 1 - k)
            size = x.shape[2 + k]
            t0, t1, t2 = th[t], th[t + 1], th[t + 2]
            if r == 2:
                b = t1 * ys[h] + t2
                for q in range(L):  # unsigned indices: the loop vectorises
                    pos[k, np.uint64(j + q)] = unnormalize(t0 * xs[np.uint64(w0 + q)] + b, size, align, one)
            else:
                b = t2 * zs[d] + th[t + 3]
                yq = ys[h] * t1
                for q in range(L):
                    pos[k, np.uint64(j + q)] = unnormalize((t0 * xs[np.uint64(w0 + q)] + b) + yq, size, align, one)
        j += L


@njit(**INTERNAL)
def _units(x, xf, theta, out, D, H, W, mtok, padding, align, zero, u0, u1):
    """Segments ``u0:u1`` (image-major, ``SEG`` consecutive output positions each, as
    GridSample's: rows shorter than ``SEG`` share one) of ``out`` (flat, N*C*D*H*W;
    D = 1 in 2-D); ``x`` (N, C, [Di,] Hi, Wi) C-contiguous, ``xf`` its flat view,
    ``theta`` (N, r, r+1) in the compute type."""
    N, C = x.shape[0], x.shape[1]
    P = D * H * W
    S = xf.size // (N * C)
    nseg = (P + SEG - 1) // SEG
    one = as_compute(zero, 1)
    xs = base_coords(W, align, one)
    ys = base_coords(H, align, one)
    zs = base_coords(D, align, one)
    pos, base, pidx, pw, pok, kind, res, bkind = scratch(zero)
    thf = theta.reshape(-1)
    for u in range(u0, u1):
        n = u // nseg
        j0 = (u - n * nseg) * SEG
        m = min(SEG, P - j0)
        positions(x, thf, n, j0, m, H, W, align, one, xs, ys, zs, pos)
        count, full = plan_op(x, pos, m, mtok, padding, align, zero, base, pidx, pw, pok, kind)
        prefetch_ahead(xf, N, C, P, n, u - n * nseg, nseg, u == u0)
        accumulate_op(x, xf, out, n * C * S, S, n * C * P + j0, P, C, m, mtok, padding, count, full, base, pidx, pw,
                      pok, kind, res, bkind, zero)


#: called through its own compiled code (``_opaque``): the serial and parallel entries do
#: not compile it again
_units_op = opaque(_units)


@njit(cache=True, nogil=True)
def _serial(x, xf, theta, out, D, H, W, mtok, padding, align, zero):
    units = x.shape[0] * ((D * H * W + SEG - 1) // SEG)
    _units_op(x, xf, theta, out, D, H, W, mtok, padding, align, zero, 0, units)


@njit(cache=True, parallel=True, nogil=True)
def _parallel(x, xf, theta, out, D, H, W, mtok, padding, align, zero, nchunks):
    units = x.shape[0] * ((D * H * W + SEG - 1) // SEG)
    nchunks = min(units, nchunks)
    for c in prange(nchunks):
        _units_op(x, xf, theta, out, D, H, W, mtok, padding, align, zero,
                  c * units // nchunks, (c + 1) * units // nchunks)


def launch_plan(xshape, size, mode):
    """``(work, units)`` of a call on X of shape ``xshape`` with output ``size``: the
    work that decides serial or parallel (``_runtime``) and the segments (``_units``'
    units) that a pool shares out; ``launch`` and numba_ops.onnx's session run by it."""
    P = 1
    for o in size[2:]:
        P *= o
    return P * size[0] * size[1] * TAPS[mode] ** (len(xshape) - 2), size[0] * ((P + SEG - 1) // SEG)


@njit(cache=True, inline="always")
def units_task(x, xf, theta, out, D, H, W, mtok, padding, align, zero, th, items, units):
    """Pool item ``th`` of ``items``: its share of the ``units`` segments (a pool
    other than numba's, as ``_parallel`` deals them)."""
    _units_op(x, xf, theta, out, D, H, W, mtok, padding, align, zero, th * units // items, (th + 1) * units // items)


def launch(x, theta, size, mode, padding, align, stream=None):
    """x: NumPy (N, C, [D,] H, W), float or uint8; theta: NumPy (N, r, r+1), float;
    size: the output size (N, C, [D,] H, W); validated by the front end
    (``mode``/``padding`` are ``_sample`` codes, ``align`` a bool). ``stream`` is
    ignored on the CPU."""
    work, _ = launch_plan(x.shape, size, mode)
    out = output_for(x, tuple(size))
    if out.size:
        ct = compute(theta.dtype)
        th = np.ascontiguousarray(theta, dtype=ct)
        xs = kernel_view(x)
        D = size[2] if len(size) == 5 else 1
        _runtime.run(_serial, _parallel, work, xs, xs.reshape(-1), th, out.reshape(-1), D, size[-2], size[-1],
                     TOKEN[mode], np.int64(padding), bool(align), ZERO[ct])
    return narrowed(out, x.dtype)

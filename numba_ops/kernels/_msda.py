"""Multi-scale deformable attention's per-point math, shared by its CPU and CUDA
kernels, forward and backward.

A sampling location ``loc`` in [0, 1] on an axis of ``size`` elements is sampled
as ``grid_sample`` samples the grid value ``2 * loc - 1`` (linear, zeros padding,
``align_corners=False``), which is how mmcv's and Deformable DETR's
``multi_scale_deformable_attn_pytorch`` define the op: the position is
``unnormalize(2 * loc - 1)`` (``= loc * size - 0.5``) and its two taps and
weights are GridSample's ``linear_taps`` / ``grad_taps_linear`` of ``kernels/_sample.py``,
so the n-linear sampling is the same code as GridSample's and DeformConv's.

A finite location whose position overflows the compute type (``2 * loc`` beyond
float32's range) is held at ``±2**62``: it samples 0 like every far position,
and only a location that is itself NaN or ±Inf samples NaN.

``interior`` is the CPU kernels' fast path: a position whose two taps are both
inside the axis (``0 <= pos < size - 1``, most of every level's points) needs
neither padding nor the huge-position care, only its floor and fraction, which are
the generic path's exactly.

Axes beyond the level's rank (``size`` 0 here: a 2-D level's depth) have one tap,
index 0, weight 1 and derivative 0, so every kernel loops over three axes.
"""
import numpy as np
from numba import njit

from ._compat import SHARED
from ._modes import ZEROS
from ._sample import as_compute, grad_taps_linear, linear_taps, split_coord, unnormalize

_HUGE = float(1 << 62)


@njit(**SHARED)
def position(loc, size, one):
    """The position on an axis of ``size`` elements that location ``loc`` (in [0, 1])
    samples: ``unnormalize(2 * loc - 1)`` with ``align_corners=False``, held within
    ``±2**62`` where a finite ``loc`` would overflow."""
    pos = unnormalize(loc + loc - one, size, False, one)
    if (loc - loc) == (one - one):  # finite loc
        big = as_compute(one, _HUGE)
        pos = min(max(pos, -big), big)
    return pos


@njit(**SHARED)
def interior(loc, size, last, one):
    """``(i, frac, inside)``: whether the taps ``floor(pos), floor(pos) + 1`` of the
    position ``pos`` that ``loc`` samples on an axis of ``size`` elements both lie
    inside the axis (``0 <= pos < last``, ``last = size - 1``; both in the compute
    type), and where they do, the floor (int32: the kernels plan only axes shorter
    than 2**31) and fraction, as ``axis_taps`` gives them; elsewhere 0 and 0. Without
    branches, so that the CPU kernels' loops over many points vectorise."""
    zero = one - one
    pos = unnormalize(loc + loc - one, size, False, one)
    ok = (pos >= zero) & (pos < last)
    pc = pos if ok else zero
    i = np.int32(pc)  # truncation is the floor of a position >= 0
    return i, pc - as_compute(one, i), ok


@njit(**SHARED)
def axis_taps(loc, size, one):
    """``(i0, i1, w0, w1, in0, in1, finite)``: the two taps of ``loc`` on an axis of
    ``size`` elements (indices always in ``[0, size - 1]``), their weights and
    whether each is inside; ``size`` 0 stands for an absent axis (one tap, 0, weight 1)."""
    zero = one - one
    if size == 0:
        return np.int64(0), np.int64(0), one, zero, True, False, True
    pos = position(loc, size, one)
    i0, i1, w0, w1, in0, in1 = linear_taps(pos, size, ZEROS, False, zero)
    return i0, i1, w0, w1, in0, in1, (pos - pos) == zero


@njit(**SHARED)
def axis_grad_taps(loc, size, one):
    """``(i0, i1, w0, w1, d0, d1, in0, in1, finite)``: ``axis_taps`` with each weight's
    derivative with respect to ``loc`` (GridSample's, times ``d position / d loc =
    size``); an absent axis (``size`` 0) has derivatives 0."""
    zero = one - one
    if size == 0:
        return np.int64(0), np.int64(0), one, zero, zero, zero, True, False, True
    pos = position(loc, size, one)
    per = np.int64(0)  # (zeros padding: no period)
    i, frac, finite = split_coord(pos, per, zero)
    i0, i1, _, _, w0, w1, _, _, d0, d1, _, _, in0, in1, _, _ = grad_taps_linear(i, frac, finite, size, per, ZEROS,
                                                                               False, zero)
    s = as_compute(one, size)
    return i0, i1, w0, w1, d0 * s, d1 * s, in0, in1, finite


@njit(**SHARED)
def corner(c, x, y, z, W1, H1):
    """Corner ``c`` (0..7; bit 0 picks x's tap, bit 1 y's, bit 2 z's) of a point whose
    axes' taps are ``x, y, z`` (``axis_taps``' tuples): ``(k, w, inside)``, the corner's
    position in its level (row-major over ``H1 x W1`` planes), its weight (the axes'
    weights' product) and whether every axis' tap is inside."""
    bx, by, bz = c & 1, (c >> 1) & 1, c >> 2
    kx, wx, ix = (x[1], x[3], x[5]) if bx else (x[0], x[2], x[4])
    ky, wy, iy = (y[1], y[3], y[5]) if by else (y[0], y[2], y[4])
    kz, wz, iz = (z[1], z[3], z[5]) if bz else (z[0], z[2], z[4])
    return (kz * H1 + ky) * W1 + kx, wz * wy * wx, ix & iy & iz


@njit(**SHARED)
def grad_corner(c, x, y, z, W1, H1):
    """``corner`` of ``axis_grad_taps``' tuples, with the weight's derivatives along x, y
    and z: ``(k, w, dw_x, dw_y, dw_z, inside)``."""
    bx, by, bz = c & 1, (c >> 1) & 1, c >> 2
    kx, wx, dx, ix = (x[1], x[3], x[5], x[7]) if bx else (x[0], x[2], x[4], x[6])
    ky, wy, dy, iy = (y[1], y[3], y[5], y[7]) if by else (y[0], y[2], y[4], y[6])
    kz, wz, dz, iz = (z[1], z[3], z[5], z[7]) if bz else (z[0], z[2], z[4], z[6])
    return ((kz * H1 + ky) * W1 + kx, wz * wy * wx, wz * wy * dx, wz * dy * wx, dz * wy * wx,
            ix & iy & iz)


def level_table(shapes):
    """The kernels' (L, 3) int64 table of the levels' sizes, innermost axis first
    ((W, H, D) for a (D, H, W) level), 0 for the axes a level lacks (host code)."""
    shapes = np.asarray(shapes, np.int64)
    table = np.zeros((shapes.shape[0], 3), np.int64)
    table[:, :shapes.shape[1]] = shapes[:, ::-1]
    return table

"""GridSample on the CPU: ``@njit(parallel=True)`` over segments of output positions.

Each image's output positions, in order, are cut into segments of at most
``SEG``; a segment is the unit of work (``prange`` goes over chunks of them, so
the parallel split is over (image, positions) whatever the shape). Per segment:

1. positions: the segment's grid values unnormalised, axis by axis, into a
   float buffer (``affine_warp``'s kernel fills the same buffer from theta
   instead: the steps below are shared with it);
2. ``plan``: per axis and position, the mode's padded taps (flat offsets: index
   times the axis' stride), weights and inside-flags, from the shared per-axis
   math of ``kernels/_sample.py``; and per position a ``kind``: every tap inside
   (always, but under zeros padding), every tap of some axis outside (the sample
   is 0, or NaN at a non-finite position), or mixed. The padding is a constant
   in each inlined copy of the per-axis loop and the axes are unrolled, so these
   loops are branch-free and vectorise;
3. ``accumulate``: for every channel, each position's sample from the plan, the
   weights nested as onnxruntime nests them (innermost axis first), written
   once into the output. The plan is computed once per position and serves
   every channel; only mixed positions pay for masks, and outside ones read
   nothing. The rank and the taps per axis are constants in each loop, so the
   tap loops unroll.

A zeros-padded tap outside the input is read at a clamped index and replaced by
an exact 0 (never ``0 * x``, which an Inf in ``x`` would turn into NaN). 16-bit
data is widened on load and rounded once on store (float32 accumulation); uint8
``x`` is computed in the grid's compute type and stored by ``to_uint8``.
"""
import numpy as np
from numba import njit, prange

from ..._dtypes import compute, storage
from .._sample import (BORDER, LINEAR, NEAREST, REFLECTION, TAPS, ZEROS, as_compute, cubic_taps, linear_taps,
                       load_sample, nearest_tap, store_sample, unnormalize)
from .._scalar import load
from . import _runtime

#: grid dtypes; ``x`` has the same dtype, or uint8
DTYPES = ("float16", "bfloat16", "float32", "float64")

#: output positions per segment (the plan's length: 3 axes x 4 taps x SEG entries stay in L1)
SEG = 256


# --- plan: per-axis taps of a segment ---------------------------------------------------

#: ``kind`` bits of a zeros-padded position: some tap outside; all taps of some axis
#: outside (then the sample is 0, or NaN at a non-finite position). 0: all inside.
SOME_OUT, AXIS_OUT = 1, 2


@njit(cache=True, inline="always")
def _kind(kind, j, first, all_in, any_in):
    b = (0 if all_in else SOME_OUT) | (0 if any_in else AXIS_OUT)
    kind[j] = b if first else kind[j] | b


@njit(cache=True, inline="always")
def _plan_axis(pos, m, k, size, stride, mode, padding, align, zero, pidx, pw, pok, kind, first):
    """Taps of spatial axis ``k`` for the positions ``pos[k, :m]``: ``pidx[k, t, j]``
    the flat offset (padded index times ``stride``), ``pw`` the weight, ``pok``
    whether the tap is inside (False only for zeros padding, which also folds the
    axis into ``kind``; ``first``: the first axis planned)."""
    if mode == NEAREST:
        for j in range(m):
            i, w, ok = nearest_tap(pos[k, j], size, padding, align, zero)
            pidx[k, 0, j] = i * stride
            pw[k, 0, j] = w
            pok[k, 0, j] = ok
            _kind(kind, j, first, ok, ok)
    elif mode == LINEAR:
        for j in range(m):
            i0, i1, w0, w1, ok0, ok1 = linear_taps(pos[k, j], size, padding, align, zero)
            pidx[k, 0, j] = i0 * stride
            pidx[k, 1, j] = i1 * stride
            pw[k, 0, j] = w0
            pw[k, 1, j] = w1
            pok[k, 0, j] = ok0
            pok[k, 1, j] = ok1
            _kind(kind, j, first, ok0 & ok1, ok0 | ok1)
    else:
        for j in range(m):
            i0, i1, i2, i3, w0, w1, w2, w3, ok0, ok1, ok2, ok3 = cubic_taps(pos[k, j], size, padding, align, zero)
            pidx[k, 0, j] = i0 * stride
            pidx[k, 1, j] = i1 * stride
            pidx[k, 2, j] = i2 * stride
            pidx[k, 3, j] = i3 * stride
            pw[k, 0, j] = w0
            pw[k, 1, j] = w1
            pw[k, 2, j] = w2
            pw[k, 3, j] = w3
            pok[k, 0, j] = ok0
            pok[k, 1, j] = ok1
            pok[k, 2, j] = ok2
            pok[k, 3, j] = ok3
            _kind(kind, j, first, ok0 & ok1 & ok2 & ok3, ok0 | ok1 | ok2 | ok3)


@njit(cache=True, inline="always")
def _plan_pad(pos, m, k, size, stride, mode, padding, align, zero, pidx, pw, pok, kind, first):
    # the padding a constant in each inlined copy: its loops are branch-free and vectorise
    if padding == ZEROS:
        _plan_axis(pos, m, k, size, stride, mode, ZEROS, align, zero, pidx, pw, pok, kind, first)
    elif padding == BORDER:
        _plan_axis(pos, m, k, size, stride, mode, BORDER, align, zero, pidx, pw, pok, kind, first)
    else:
        _plan_axis(pos, m, k, size, stride, mode, REFLECTION, align, zero, pidx, pw, pok, kind, first)


@njit(cache=True)
def plan(x, pos, m, mode, padding, align, zero, pidx, pw, pok, kind):
    """The plan of a segment of ``m`` positions (``pos[k, :m]`` on spatial axis ``k``
    of ``x``, shape (N, C, D1..Dr)); under zeros padding also each position's
    ``kind``, so that only positions with some taps outside pay for masks. The
    axes are unrolled (``x.ndim`` is a constant), innermost first."""
    r = x.ndim - 2
    sh = x.shape
    _plan_pad(pos, m, r - 1, sh[x.ndim - 1], 1, mode, padding, align, zero, pidx, pw, pok, kind, True)
    if r >= 2:
        _plan_pad(pos, m, r - 2, sh[x.ndim - 2], sh[x.ndim - 1], mode, padding, align, zero, pidx, pw, pok,
                  kind, False)
    if r >= 3:
        _plan_pad(pos, m, r - 3, sh[x.ndim - 3], sh[x.ndim - 2] * sh[x.ndim - 1], mode, padding, align, zero,
                  pidx, pw, pok, kind, False)


# --- accumulate: one channel's samples of a segment --------------------------------------

@njit(cache=True, inline="always")
def _s1(xf, xb, j, T, masked, pidx, pw, pok, zero):
    acc = zero
    for tx in range(T):
        v = load_sample(xf, np.uint64(xb + pidx[0, tx, j]), zero)
        if masked:
            v = v if pok[0, tx, j] else zero
        acc += pw[0, tx, j] * v
    return acc


@njit(cache=True, inline="always")
def _s2(xf, xb, j, T, masked, pidx, pw, pok, zero):
    acc = zero
    for ty in range(T):
        by = xb + pidx[0, ty, j]
        s = zero
        for tx in range(T):
            v = load_sample(xf, np.uint64(by + pidx[1, tx, j]), zero)
            if masked:
                v = v if (pok[0, ty, j] & pok[1, tx, j]) else zero
            s += pw[1, tx, j] * v
        acc += pw[0, ty, j] * s
    return acc


@njit(cache=True, inline="always")
def _s3(xf, xb, j, T, masked, pidx, pw, pok, zero):
    acc = zero
    for tz in range(T):
        bz = xb + pidx[0, tz, j]
        sz = zero
        for ty in range(T):
            by = bz + pidx[1, ty, j]
            oky = pok[0, tz, j] & pok[1, ty, j]
            s = zero
            for tx in range(T):
                v = load_sample(xf, np.uint64(by + pidx[2, tx, j]), zero)
                if masked:
                    v = v if (oky & pok[2, tx, j]) else zero
                s += pw[2, tx, j] * v
            sz += pw[1, ty, j] * s
        acc += pw[0, tz, j] * sz
    return acc


@njit(cache=True, inline="always")
def _sample(r, xf, xb, j, T, masked, pidx, pw, pok, zero):
    """Sample ``j`` of the plan (``r`` spatial axes, ``T`` taps per axis), the
    weights nested innermost axis first as onnxruntime nests them; ``masked``:
    taps outside (zeros padding) read as exact zeros."""
    if r == 1:
        return _s1(xf, xb, j, T, masked, pidx, pw, pok, zero)
    if r == 2:
        return _s2(xf, xb, j, T, masked, pidx, pw, pok, zero)
    return _s3(xf, xb, j, T, masked, pidx, pw, pok, zero)


@njit(cache=True, inline="always")
def _acc(r, xf, out, xb, ob, m, T, pidx, pw, pok, kind, zero):
    for j in range(m):
        kd = kind[j]
        if kd == 0:
            acc = _sample(r, xf, xb, j, T, False, pidx, pw, pok, zero)
        elif kd >= AXIS_OUT:  # 0, or NaN at a non-finite position
            acc = pw[0, 0, j] * zero
            for k in range(1, r):
                acc *= pw[k, 0, j]
            acc = zero if acc == acc else acc
        else:
            acc = _sample(r, xf, xb, j, T, True, pidx, pw, pok, zero)
        store_sample(out, np.uint64(ob + j), acc)


@njit(cache=True)
def accumulate(x, xf, out, xb, ob, m, mode, pidx, pw, pok, kind, zero):
    """``out[ob + j] = sample j`` of the segment's plan for ``j < m``, reading the
    channel image that starts at ``xf[xb]``. Positions with every tap inside
    (all of them but under zeros padding) take the unmasked loop, those with all
    taps of an axis outside store 0 without reading. ``x`` (N, C, D1..Dr) is
    passed for its rank alone, which numba folds to a constant, so only that
    rank's loops are compiled; the mode's tap count is a constant in each
    (inlined) loop, so they unroll."""
    r = x.ndim - 2
    if mode == LINEAR:
        _acc(r, xf, out, xb, ob, m, 2, pidx, pw, pok, kind, zero)
    elif mode == NEAREST:
        _acc(r, xf, out, xb, ob, m, 1, pidx, pw, pok, kind, zero)
    else:
        _acc(r, xf, out, xb, ob, m, 4, pidx, pw, pok, kind, zero)


@njit(cache=True)
def scratch(zero):
    """``(pos, pidx, pw, pok, kind)``: one thread's segment buffers."""
    return (np.empty((3, SEG), type(zero)), np.empty((3, 4, SEG), np.int64),
            np.empty((3, 4, SEG), type(zero)), np.empty((3, 4, SEG), np.bool_), np.empty(SEG, np.uint8))


# --- GridSample ------------------------------------------------------------------------

@njit(cache=True)
def _units(x, xf, gf, out, mode, padding, align, zero, u0, u1):
    """Segments ``u0:u1`` (image-major) of the output ``out`` (flat, N*C*P); ``x``
    (N, C, D1..Dr) C-contiguous and ``xf`` its flat view; ``gf`` the flat grid."""
    r = x.ndim - 2
    N, C = x.shape[0], x.shape[1]
    P = out.size // (N * C)
    S = xf.size // (N * C)
    nseg = (P + SEG - 1) // SEG
    one = as_compute(zero, 1)
    pos, pidx, pw, pok, kind = scratch(zero)
    for u in range(u0, u1):
        n = u // nseg
        j0 = (u - n * nseg) * SEG
        m = min(SEG, P - j0)
        g0 = (n * P + j0) * r
        for k in range(r):
            size = x.shape[2 + k]
            a = r - 1 - k  # the grid lists coordinates innermost axis first
            for j in range(m):
                pos[k, j] = unnormalize(load(gf, g0 + j * r + a), size, align, one)
        plan(x, pos, m, mode, padding, align, zero, pidx, pw, pok, kind)
        for c in range(C):
            nc = n * C + c
            accumulate(x, xf, out, nc * S, nc * P + j0, m, mode, pidx, pw, pok, kind, zero)


@njit(cache=True)
def _serial(x, xf, gf, out, mode, padding, align, zero):
    N, C = x.shape[0], x.shape[1]
    P = out.size // (N * C)
    _units(x, xf, gf, out, mode, padding, align, zero, 0, N * ((P + SEG - 1) // SEG))


@njit(cache=True, parallel=True)
def _parallel(x, xf, gf, out, mode, padding, align, zero, nchunks):
    N, C = x.shape[0], x.shape[1]
    P = out.size // (N * C)
    units = N * ((P + SEG - 1) // SEG)
    nchunks = min(units, nchunks)
    for c in prange(nchunks):
        _units(x, xf, gf, out, mode, padding, align, zero, c * units // nchunks, (c + 1) * units // nchunks)


#: 0 in each compute type, made once
ZERO = {np.dtype(t): t(0) for t in (np.float32, np.float64)}


def kernel_view(a):
    """``a`` C-contiguous in its kernel storage dtype (16-bit floats as their bit
    patterns, uint8 as is); a copy only when ``a`` is not C-contiguous."""
    a = np.ascontiguousarray(a)
    return a if a.dtype == np.uint8 else a.view(storage(a.dtype))


def output_for(x, shape):
    """An uninitialised result of ``x``'s dtype (uint8 or float) in storage form."""
    return np.empty(shape, dtype=np.uint8 if x.dtype == np.uint8 else storage(x.dtype))


def public(out, x):
    """The kernel's output viewed as ``x``'s dtype (16-bit: the bit patterns as their dtype)."""
    return out if out.dtype == x.dtype else out.view(x.dtype)


def launch(x, grid, mode, padding, align, stream=None):
    """x: NumPy (N, C, D1..Dr), float or uint8; grid: NumPy (N, O1..Or, r), float;
    validated by the front end (``mode``/``padding`` are ``_sample`` codes, ``align``
    a bool). ``stream`` is ignored on the CPU."""
    r = x.ndim - 2
    shape = tuple(x.shape[:2]) + tuple(grid.shape[1:-1])
    out = output_for(x, shape)
    if out.size:
        xs = kernel_view(x)
        gs = kernel_view(grid)
        work = out.size * TAPS[mode] ** r
        _runtime.run(_serial, _parallel, work, xs, xs.reshape(-1), gs.reshape(-1), out.reshape(-1),
                     mode, padding, bool(align), ZERO[compute(grid.dtype)])
    return public(out, x)

"""Multi-scale deformable attention's backward on the CPU: ``@njit(parallel=True)``
over units ``(n, m, level)``, each the owner of everything it writes.

The gradients of one point ``(n, q, m, l, p)`` with respect to its location and
attention weight read ``value`` at the point's corners in level ``l`` of head
``m``; the value gradient it scatters lands in the same corners. So a unit
``(n, m, l)`` walks its queries and points in order and owns the value
gradient's rows of level ``l`` for head ``m`` (``Dh`` contiguous channels each)
and the location and weight gradients of its points: no two units write one
element, nothing is summed in partial copies, and every element is summed in
the same order whatever the thread count (deterministic). Per point and corner:
``dot = value_row . grad_out_row`` (a channel loop that vectorises) gives the
weight's and the location's gradients, and ``grad_value_row += a * w *
grad_out_row`` the scatter.

The four dot products of an interior point (``_dots``) are compiled with ``fastmath``
reassociation, so that their channel sums vectorise (as partial sums over SIMD lanes):
the order of every sum is still fixed by the compiled code, not by the threads or by
which gradients are asked for (10-20 % of the encoder's backward here). Working
memory, kept by each calling thread between calls (``launch``): unit-major copies of
the locations and weights and their gradients, and for the encoder's many points per
value row head-major copies of value and its gradient. 16-bit inputs are widened to
float32 by the launcher, and the gradients rounded once.
"""
import threading

import numpy as np
from numba import njit, prange

from .._dtypes import NAMES, compute
from .._msda import axis_grad_taps, grad_corner
from .._sample import as_compute
from . import _runtime
from ._copies import narrowed, swapped, widened
from ._opaque import INTERNAL, inline, opaque
from ._views import flat
from .ms_deform_attn import AHEAD, ONE, level_table, plan, plan_buffers, point_table, prefetch_corners

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)


@inline(fastmath={"reassoc"})
def _dots(vf, gf, o0, o1, o2, o3, og, Dh, zero):
    """The dot products of four value rows (at ``o0..o3``) with the output gradient's row
    (at ``og``): the one place that is compiled with reassociation, so that the channel
    sums vectorise as partial sums over SIMD lanes (their order is fixed by the compiled
    code, the same on every call and thread count)."""
    d0 = zero
    d1 = zero
    d2 = zero
    d3 = zero
    for d in range(Dh):
        g = gf[np.uint64(og + d)]
        d0 += vf[np.uint64(o0 + d)] * g
        d1 += vf[np.uint64(o1 + d)] * g
        d2 += vf[np.uint64(o2 + d)] * g
        d3 += vf[np.uint64(o3 + d)] * g
    return d0, d1, d2, d3


@njit(**INTERNAL)
def _units(gy, v, shapes, starts, loc, attn, gv, gl, ga, want_v, want_l, want_a, one, hm, u0, u1):
    """Units ``u0:u1`` (``(n * M + m) * L + l``). ``gy`` (N, Lq, M, Dh) the output's
    gradient; ``loc`` (N, M, L, Lq, P, r) and ``attn`` (N, M, L, Lq, P) unit-major (a
    unit's points contiguous), ``gl`` and ``ga`` their gradients in the same layout,
    ``gv`` value's (each unit zeroes its rows first); each gradient may be a dummy when
    its ``want_*`` is False.
    ``v`` and ``gv`` are (N, S, M, Dh), or head-major (N, M, S, Dh) where ``hm``.

    A unit's points are planned a block of queries at a time (``ms_deform_attn.plan``);
    a 2-D or 3-D point whose taps are all inside then reads and scatters the four
    corners of a plane in one pass over the channels (their rows, value's and its
    gradient's, prefetched a few points ahead); others take every axis' padded taps
    (``axis_grad_taps``) corner by corner."""
    Lq, M, Dh = gy.shape[1], gy.shape[2], gy.shape[3]
    L, P, r = loc.shape[2], loc.shape[4], loc.shape[5]
    S = v.shape[2] if hm else v.shape[1]
    vf = flat(v)
    gf = flat(gy)
    gvf = flat(gv)
    lf = flat(loc)
    af = flat(attn)
    one = as_compute(one, 1)  # a constant where this compiles: LLVM folds the halvings into products
    zero = one - one
    nan = one * np.nan
    row = Dh if hm else M * Dh  # a position's stride in value
    QB = max(1, BLOCK // P)  # queries planned at a time
    planes = 2 if r > 2 else 1
    size, last, ix, iy, iz, fx, fy, fz, ok = plan_buffers(QB * P, one)
    for u in range(u0, u1):
        lv = u % L
        nm = u // L
        m = nm % M
        n = nm // M
        W, H, D = shapes[lv, 0], shapes[lv, 1], shapes[lv, 2]
        W1 = max(W, 1)
        H1 = max(H, 1)
        fW, fH, fD = as_compute(one, W), as_compute(one, H), as_compute(one, D)
        for j in range(QB * P):
            point_table(shapes, lv, size, last, j)
        # head m's first position of the level
        at = ((n * M + m) * S + starts[lv]) * Dh if hm else ((n * S + starts[lv]) * M + m) * Dh
        ys, zs = W1 * row, W1 * H1 * row  # the y and z strides of value and its gradient
        if want_v:  # the unit's rows of value's gradient, zeroed before it adds to them
            for k in range(W1 * H1 * max(D, 1)):
                o = np.uint64(at + k * row)
                for d in range(np.uint64(Dh)):
                    gvf[o + d] = zero
        for q0 in range(0, Lq, QB):
            count = min(QB, Lq - q0) * P
            plan(lf, (u * Lq + q0) * P * r, count, r, size, last, ix, iy, iz, fx, fy, fz, ok, one)
            for q in range(q0, q0 + count // P):
                og = ((n * Lq + q) * M + m) * Dh
                for p in range(P):
                    j = (q - q0) * P + p
                    ja = j + AHEAD  # prefetch the corners of a point a few ahead
                    if ja < count and ok[ja]:
                        ka = ((iz[ja] * H1 if r > 2 else 0) + iy[ja]) * W1 + ix[ja]
                        prefetch_corners(vf, at + ka * row, ys, zs, row, planes, Dh)
                        if want_v:
                            prefetch_corners(gvf, at + ka * row, ys, zs, row, planes, Dh)
                    a = af[np.uint64((u * Lq + q) * P + p)]
                    sa = zero
                    sx = zero
                    sy = zero
                    sz = zero
                    if ok[j]:
                        ax, ay, az = fx[j], fy[j], fz[j]  # the fractions
                        for cz in range(2 if r > 2 else 1):
                            wz = one if r == 2 else (one - az if cz == 0 else az)
                            kz = np.int64(iz[j]) + cz if r > 2 else np.int64(0)
                            k0 = (kz * H1 + iy[j]) * W1 + ix[j]
                            o0 = at + k0 * row  # (value's and its gradient's rows)
                            o2 = o0 + W1 * row
                            d0 = d1 = d2 = d3 = zero
                            if want_l or want_a:
                                d0, d1, d2, d3 = _dots(vf, gf, o0, o0 + row, o2, o2 + row, og, Dh, zero)
                            if want_v:
                                w0 = a * wz * (one - ay)
                                w1 = a * wz * ay
                                c0, c1, c2, c3 = w0 * (one - ax), w0 * ax, w1 * (one - ax), w1 * ax
                                for d in range(Dh):
                                    g = gf[np.uint64(og + d)]
                                    gvf[np.uint64(o0 + d)] += c0 * g
                                    gvf[np.uint64(o0 + row + d)] += c1 * g
                                    gvf[np.uint64(o2 + d)] += c2 * g
                                    gvf[np.uint64(o2 + row + d)] += c3 * g
                            bx0 = (one - ax) * d0 + ax * d1  # the plane's rows, interpolated along x
                            bx1 = (one - ax) * d2 + ax * d3
                            plane = (one - ay) * bx0 + ay * bx1
                            sa += wz * plane
                            sx += wz * ((one - ay) * (d1 - d0) + ay * (d3 - d2))
                            sy += wz * (bx1 - bx0)
                            sz += plane if cz == 1 else -plane
                        sx *= fW
                        sy *= fH
                        sz *= fD
                    else:
                        o = np.uint64(((u * Lq + q) * P + p) * r)
                        lx = lf[o]
                        ly = lf[o + 1] if r > 1 else zero
                        lz = lf[o + 2] if r > 2 else zero
                        tx, ty, tz = axis_grad_taps(lx, W, one), axis_grad_taps(ly, H, one), axis_grad_taps(lz, D, one)
                        if not (tx[8] and ty[8] and tz[8]):  # NaN for its own gradients, nothing scattered
                            if want_a:
                                ga[n, m, lv, q, p] = nan
                            if want_l:
                                for i in range(r):
                                    gl[n, m, lv, q, p, i] = nan
                            continue
                        for c in range(8):
                            k, w, gwx, gwy, gwz, inside = grad_corner(c, tx, ty, tz, W1, H1)
                            if not inside:
                                continue
                            o = at + k * row
                            if want_l or want_a:
                                dot = zero
                                for d in range(Dh):
                                    dot += vf[np.uint64(o + d)] * gf[np.uint64(og + d)]
                                sa += w * dot
                                sx += gwx * dot
                                sy += gwy * dot
                                sz += gwz * dot
                            if want_v:
                                w = a * w
                                for d in range(Dh):
                                    gvf[np.uint64(o + d)] += w * gf[np.uint64(og + d)]
                    if want_a:
                        ga[n, m, lv, q, p] = sa
                    if want_l:
                        gl[n, m, lv, q, p, 0] = a * sx
                        if r > 1:
                            gl[n, m, lv, q, p, 1] = a * sy
                        if r > 2:
                            gl[n, m, lv, q, p, 2] = a * sz


_units_op = opaque(_units)


@njit(cache=True, nogil=True)
def _serial(gy, v, shapes, starts, loc, attn, gv, gl, ga, want_v, want_l, want_a, one, hm):
    units = gy.shape[0] * gy.shape[2] * loc.shape[2]
    _units_op(gy, v, shapes, starts, loc, attn, gv, gl, ga, want_v, want_l, want_a, one, hm, 0, units)


@njit(cache=True, parallel=True, nogil=True)
def _parallel(gy, v, shapes, starts, loc, attn, gv, gl, ga, want_v, want_l, want_a, one, hm, nchunks):
    units = gy.shape[0] * gy.shape[2] * loc.shape[2]
    nchunks = min(units, nchunks)
    for c in prange(nchunks):
        _units_op(gy, v, shapes, starts, loc, attn, gv, gl, ga, want_v, want_l, want_a, one, hm,
                  c * units // nchunks, (c + 1) * units // nchunks)


#: points planned at a time (``ms_deform_attn.plan``), in whole queries
BLOCK = 256

#: points per value row from which a unit reads value head-major (``launch``)
HEAD_MAJOR_POINTS = 4

#: each calling thread's buffers, kept between calls (``kept``)
_KEPT = threading.local()


def kept(name, shape, dtype):
    """An uninitialised C-contiguous array of ``shape`` over a buffer that this thread
    keeps between calls under ``name`` (grown when too small): the encoder's copies
    and gradients are tens of MB, and fresh pages cost the kernel's time to clear as
    they are first touched (a fifth of the encoder's backward here)."""
    n = 1
    for e in shape:
        n *= e
    bufs = _KEPT.__dict__
    a = bufs.get(name)
    if a is None or a.size < n or a.dtype != dtype:
        bufs[name] = None  # free the old one first
        a = bufs[name] = np.empty(max(n, 1), dtype)
    return a[:n].reshape(shape)


def unit_major(a, name):
    """``a`` (N, Lq, M, L, ...) copied C-contiguous to (N, M, L, Lq, ...) in its compute
    type, a unit's points contiguous, into the kept buffer ``name``."""
    N, Lq, M, L = a.shape[:4]
    K = int(np.prod(a.shape[4:]))
    out = kept(name, (N, M, L, Lq) + a.shape[4:], compute(a.dtype))
    swapped(widened(a).reshape(N, Lq, M * L, K), out.reshape(N, M * L, Lq, K))
    return out


def launch(grad_out, value, shapes, starts, loc, attn, want_value, want_loc, want_attn, stream=None):
    """NumPy inputs validated by the front end (grad_out (N, Lq, M * Dh)); returns
    ``(grad_value, grad_locations, grad_weights)`` in value's dtype, None for those not
    wanted. ``stream`` is ignored on the CPU.

    The locations and weights go to the kernel unit-major (``unit_major``): a unit
    walks its points in memory order instead of 32 bytes of every kilobyte (a quarter
    of the encoder's backward here), and their gradients come back the same way.
    Where the points are many per value row (``HEAD_MAJOR_POINTS``: the encoder's),
    value is read head-major, (N, M, S, Dh): a unit's rows are then one contiguous
    block, not every M-th row of the whole value; the decoder's few points would not
    repay the copy. Value's gradient is written in the same layout, and copied to
    value's at the end (the encoder's backward 0.91x the time of scattering into
    value's layout). The copies and the unit-major gradients live in
    buffers the calling thread keeps (``kept``): only the returned gradients are new
    memory."""
    dt = value.dtype
    ct = compute(dt)
    N, S, M, Dh = value.shape
    Lq, L, P = loc.shape[1], loc.shape[3], loc.shape[4]
    lt, at = unit_major(loc, "loc"), unit_major(attn, "attn")
    hm = Lq * L * P >= HEAD_MAJOR_POINTS * S  # (the encoder's 16 per row; the decoder's 0.24)
    if hm:
        vh = kept("value", (N, M, S, Dh), ct)
        swapped(widened(value), vh)
    else:
        vh = widened(value)
    units = N * M * L
    launched = units and Lq and P and Dh and (want_value or want_loc or want_attn)
    # value's gradient as the kernel writes it: each unit zeroes its rows first (the
    # units' rows are all of it), unless the kernel does not run
    if hm and want_value:
        gvk = kept("grad_value", (N, M, S, Dh), ct)
        if not launched:
            gvk.fill(0)
    else:
        gvk = gv = (np.empty if launched else np.zeros)(value.shape if want_value else (0, 0, 0, 0), ct)
    gl = kept("grad_loc", lt.shape if want_loc else (0,) * 6, ct)
    ga = kept("grad_attn", at.shape if want_attn else (0,) * 5, ct)
    if launched:
        work = N * Lq * M * L * P * Dh * (1 << loc.shape[5]) * 2
        gy = widened(grad_out).reshape(N, Lq, M, Dh)
        _runtime.run(_serial, _parallel, work, gy, vh, level_table(shapes),
                     np.ascontiguousarray(starts, np.int64), lt, at, gvk, gl, ga,
                     bool(want_value), bool(want_loc), bool(want_attn), ONE[ct], hm)
    else:  # (the kernel writes every point's gradients; without it they are 0)
        gl.fill(0)
        ga.fill(0)

    def back(g, want):  # a unit-major gradient in the inputs' layout, new memory
        if not want:
            return None
        K = int(np.prod(g.shape[4:]))
        out = np.empty((N, Lq, M, L) + g.shape[4:], ct)
        swapped(g.reshape(N, M * L, Lq, K), out.reshape(N, Lq, M * L, K))
        return narrowed(out, dt)

    if hm and want_value:
        gv = swapped(gvk, np.empty(value.shape, ct))
    return narrowed(gv, dt) if want_value else None, back(gl, want_loc), back(ga, want_attn)

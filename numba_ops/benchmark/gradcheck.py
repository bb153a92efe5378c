"""The gradient check of ``numba-ops check``: each backward op against central finite
differences of its float64 forward, on small cases of every op and rank.

A case picks a few elements of each differentiable input, moves each by ``±EPS``
and compares ``(f(v + EPS) - f(v - EPS)) / (2 EPS)`` of ``sum(grad_y * y)`` with
the analytic gradient there. Positions are drawn away from the integer knots where
the n-linear and cubic weights have kinks (a finite difference across one measures
neither side's derivative).
"""
from __future__ import annotations

import numpy as np

#: the finite-difference step and the tolerance (relative to the gradient's scale)
EPS = 1e-6
TOL = 1e-6
#: elements checked per input
SAMPLES = 6


class GradCase:
    """One check: ``name``, the forward ``fn(*inputs, **attrs)``, the backward
    ``grad(grad_y, *inputs, **attrs)`` returning one gradient per name in ``wrt``."""

    def __init__(self, name, op, fn, grad, inputs, wrt, attrs):
        self.name, self.op, self.fn, self.grad = name, op, fn, grad
        self.inputs, self.wrt, self.attrs = inputs, wrt, attrs


def _off_knots(v):
    """``v`` moved to at least 0.05 from every integer (kinks of the weights) and from
    every half-integer (nearest's ties)."""
    frac = v - np.floor(v)
    return np.floor(v) + np.where(frac < 0.5, 0.05 + 0.8 * frac, 0.55 + 0.8 * (frac - 0.5))


def _unnormalized_safe_grid(rng, shape, sizes, align):
    """A grid whose unnormalised positions lie off the integer knots."""
    r = shape[-1]
    pos = np.stack([rng.uniform(-1.5, sizes[r - 1 - k] + 0.5, shape[:-1]) for k in range(r)], -1)
    pos = _off_knots(pos)
    size = np.array([sizes[r - 1 - k] for k in range(r)], np.float64)
    return (2 * pos / np.maximum(size - 1, 1) - 1) if align else ((2 * pos + 1) / size - 1)


def cases(seed=0):
    """The gradient cases: affine_grid 2-D/3-D, grid_sample 1-D..3-D (every mode, every
    padding, every rank; border's clamp under a linear derivative), affine_warp 2-D/3-D,
    deform_conv 1-D..3-D with mask and groups. Each case compiles kernels of its own,
    which is most of ``numba-ops check``'s time on a cold cache: the grid_sample cases
    cover each mode, padding and rank once rather than their product."""
    import numba_ops
    rng = np.random.default_rng(seed)
    out = []
    for nd in (2, 3):
        size = (2, 1) + (3,) * nd
        theta = rng.standard_normal((2, nd, nd + 1))
        out.append(GradCase(f"affine_grid {nd}-D", "AffineGrid", lambda t, s=size: numba_ops.affine_grid(t, s),
                            lambda g, t, s=size, device=None: (numba_ops.affine_grid_backward(g, s, device=device),), [theta], ["theta"], {}))
    for r, mode, padding, align in ((1, "nearest", "border", False), (2, "linear", "zeros", False),
                                    (2, "cubic", "reflection", True), (2, "linear", "border", True),
                                    (3, "linear", "zeros", False)):
        sizes = (4, 5, 3)[:r]
        x = rng.standard_normal((1, 2) + sizes)
        grid = _unnormalized_safe_grid(rng, (1,) + (2,) * r + (r,), sizes, align)
        attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
        out.append(GradCase(f"grid_sample {r}-D {mode}/{padding}/align={int(align)}", "GridSample",
                            numba_ops.grid_sample, numba_ops.grid_sample_backward, [x, grid], ["x", "grid"], attrs))
    for nd in (2, 3):
        x = rng.standard_normal((1, 2) + (4,) * nd)
        theta = np.concatenate([np.eye(nd) * 0.8, rng.uniform(-0.1, 0.1, (nd, 1))], 1)[None]
        theta[0, :, :nd] += rng.uniform(-0.1, 0.1, (nd, nd))
        out.append(GradCase(f"affine_warp {nd}-D linear", "AffineWarp", numba_ops.affine_warp,
                            numba_ops.affine_warp_backward, [x, theta], ["x", "theta"], {}))
    for nd, group, og in ((1, 1, 1), (2, 2, 2), (3, 1, 1)):
        C = oC = 4
        k = (2,) * nd
        K = 2 ** nd
        x = rng.standard_normal((1, C) + (4,) * nd)
        w = rng.standard_normal((oC, C // group) + k)
        o = (5,) * nd  # 4 + 2 pads - 2 + 1
        off = _off_knots(rng.uniform(-1.5, 1.5, (1, og * K * nd) + o))
        mask = rng.uniform(0.2, 1, (1, og * K) + o)
        b = rng.standard_normal(oC)
        attrs = dict(pads=[1] * (2 * nd), group=group, offset_group=og)
        out.append(GradCase(f"deform_conv {nd}-D group={group} offset_group={og}", "DeformConv",
                            numba_ops.deform_conv, numba_ops.deform_conv_backward, [x, w, off, b, mask],
                            ["x", "w", "offset", "b", "mask"], attrs))
    return out


def check(case, device="cpu", seed=1):
    """None if ``case``'s gradients match central differences on ``device``, else why not."""
    rng = np.random.default_rng(seed)
    y = np.asarray(_host(case.fn(*case.inputs, **case.attrs)))
    gy = rng.standard_normal(y.shape)
    grads = [_host(g) for g in case.grad(gy, *case.inputs, **case.attrs, device=device)]
    for i, (name, g) in enumerate(zip(case.wrt, grads)):
        inp = case.inputs[i]
        if tuple(g.shape) != inp.shape:
            return f"{name}: gradient of shape {tuple(g.shape)}, expected {inp.shape}"
        scale = max(1.0, float(np.abs(g).max()))
        for flat in rng.choice(inp.size, min(SAMPLES, inp.size), replace=False):
            idx = np.unravel_index(flat, inp.shape)
            f = []
            for step in (EPS, -EPS):
                moved = list(case.inputs)
                moved[i] = inp.copy()
                moved[i][idx] += step
                f.append(float((np.asarray(_host(case.fn(*moved, **case.attrs))) * gy).sum()))
            fd = (f[0] - f[1]) / (2 * EPS)
            if abs(fd - g[idx]) > TOL * scale + 1e-8 * abs(fd):
                return f"{name}{list(idx)}: gradient {g[idx]!r}, central difference {fd!r}"
    return None


def _host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else a

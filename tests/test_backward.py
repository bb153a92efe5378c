"""The gradients on the CPU: affine_grid_backward, deform_conv_backward,
grid_sample_backward and affine_warp_backward against their public contract.

- central differences of the float64 forward (every op, every rank; linear inputs
  with a unit step, where the difference is exact, positions with a small one);
- PyTorch autograd (grid_sample 2-D/3-D, affine_grid, affine_grid + grid_sample)
  and torchvision's deform_conv2d as float64 oracles;
- errors, ``wrt``, non-finite and huge positions, determinism across thread
  counts, float32 accuracy, float16/bfloat16 = float32 rounded once, layouts,
  untouched inputs, empty inputs.

Positions (grid, offset, theta) are drawn away from the forward's kinks: integer
unnormalised positions (where the n-linear and cubic weights switch taps) and
half-integers (where nearest switches), so central differences are the
derivative there. Integer positions, where the contract takes the right-hand
derivative (from ``floor``), have tests of their own.

GridSample's and affine_warp's kernels (forward and backward) compile per rank x
mode x padding x compute type, DeformConv's per rank x compute type: the default
run takes a covering subset of each matrix (``F64_DEFAULT``, ``F32_DEFAULT``,
``helpers.deform_default``), the rest is marked ``full``.
"""
import itertools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import numba_ops
from helpers import BF16, MODES, PADS, deform_default, param
from reference import affine_grid_ref, ulp_diff

TORCH_MODE = {"linear": "bilinear", "nearest": "nearest", "cubic": "bicubic"}
#: tolerance of a gradient against central differences of a linear input (exact up to rounding)
LIN = 1e-10
#: step and tolerance of central differences in a position (grid, offset, theta)
H_POS, POS = 1e-6, 1e-6
#: float64 against a float64 peer (PyTorch, torchvision): the same formulas, other orders of summation
PEER = 1e-12
DC_NAMES = ("x", "w", "offset", "b", "mask")

#: (rank, mode, padding) of GridSample/affine_warp that the default run takes in float64:
#: each mode and each padding once, every rank once (the rest of the matrix: --full;
#: each combination compiles kernels of its own, which is most of this file's time)
F64_DEFAULT = {(2, "linear", "zeros"), (2, "cubic", "reflection"), (1, "nearest", "border"), (3, "linear", "zeros")}
#: ... and in float32 (the 16-bit types too: computed in float32), combinations the
#: forward's default tests compile anyway (tests/helpers.py, DEFAULT_F32)
F32_DEFAULT = {(2, "linear", "zeros"), (3, "linear", "zeros")}


def sampler_matrix(ranks, modes=MODES, default=F64_DEFAULT, aligns=(0, 1), **extra):
    """``(names, params)`` for parametrize: rank x mode x padding x align_corners (x the
    ``extra`` axes), marked full unless ``(rank, mode, padding)`` is in ``default``."""
    names = ["r", "mode", "padding"] + (["align"] if aligns else []) + list(extra)
    axes = [ranks, modes, PADS] + ([list(aligns)] if aligns else []) + list(extra.values())
    params = []
    show = {"r": "{}d".format, "align": "a{}".format}
    for row in itertools.product(*axes):
        ident = "-".join(np.dtype(v).name if isinstance(v, (type, np.dtype)) else show.get(n, str)(v)
                         for n, v in zip(names, row))
        params.append(param(tuple(row[:3]) in default, *row, id=ident))
    return ",".join(names), params


# --- helpers ------------------------------------------------------------------------------

def assert_close(got, want, rtol, floor=0.0):
    """``got`` within ``rtol * |want| + rtol * scale + floor`` of ``want`` (``scale``: the
    largest finite |want|), same shape; NaN where NaN."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    finite = np.isfinite(want)
    scale = float(np.abs(want[finite]).max()) if finite.any() else 0.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale + floor)


def assert_rounded_once(got, want32, dtype):
    """A 16-bit gradient within 1 ulp of the float32 computation's ``want32`` rounded to ``dtype``."""
    assert got.dtype == np.dtype(dtype) and got.shape == want32.shape
    assert np.isfinite(want32).all()
    d = ulp_diff(got, want32.astype(dtype), dtype)
    assert d.max(initial=0) <= 1, f"{int((d > 1).sum())} values more than 1 ulp off (worst {d.max()})"


def fd(loss, arrays, name, h):
    """Central differences of ``loss()`` in each element of ``arrays[name]`` (changed in
    place and restored)."""
    a = arrays[name]
    out = np.empty(a.shape)
    for idx in np.ndindex(a.shape):
        v = a[idx]
        a[idx] = v + h
        lp = loss()
        a[idx] = v - h
        lm = loss()
        a[idx] = v
        out[idx] = (lp - lm) / (2 * h)
    return out


def fractions(rng, shape):
    """Fractions in [0.1, 0.4] or [0.6, 0.9]: at least 0.1 from every integer and half-integer."""
    f = rng.uniform(0.1, 0.4, shape)
    return np.where(rng.random(shape) < 0.5, 1.0 - f, f)


def grid_coord(pos, size, align):
    """The grid value whose unnormalised position on an axis of ``size`` is ``pos`` (any
    value for a single element with ``align_corners``: every value maps to 0 there)."""
    if align:
        return 2.0 * pos / (size - 1) - 1.0 if size > 1 else 0.37 + 0.0 * pos
    return (2.0 * pos + 1.0) / size - 1.0


def unnormalize(g, size, align):
    return (g + 1) / 2 * (size - 1) if align else ((g + 1) * size - 1) / 2


def smooth_grid(rng, n, outs, sizes, align, far=0.2):
    """A grid (n, O1..Or, r) for an input of spatial ``sizes`` whose unnormalised positions
    are at least 0.1 from every knot: most of them in [-2, size + 1], a fraction ``far``
    up to three sizes away (zeros' outside, reflection's repeated mirrors)."""
    r = len(sizes)
    shape = (n,) + tuple(outs)
    g = np.empty(shape + (r,))
    for k in range(r):
        size = sizes[r - 1 - k]  # coordinate k (x first) is the innermost axis first
        cell = rng.integers(-2, size + 1, shape)
        cell = np.where(rng.random(shape) < far, rng.integers(-3 * size - 2, 3 * size + 2, shape), cell)
        g[..., k] = grid_coord(cell + fractions(rng, shape), size, align)
    return g


def knot_distance(pos):
    """The distance of each position to the nearest integer or half-integer."""
    f = pos - np.floor(pos)
    return np.minimum(np.minimum(f, 1 - f), np.abs(f - 0.5))


def smooth_theta(rng, n, xs, size, align, margin=0.01, tries=2000):
    """Near-identity affine transforms (n, r, r+1), scaled so some of the output samples
    outside ``x``, whose positions all keep ``margin`` from every knot."""
    r = len(xs) - 2
    for _ in range(tries):
        t = np.zeros((n, r, r + 1))
        t[:, :, :r] = np.eye(r) * 1.2 + rng.standard_normal((n, r, r)) * 0.3
        t[:, :, r] = rng.standard_normal((n, r)) * 0.3
        grid = affine_grid_ref(t, size, align)
        ok = True
        for k in range(r):
            L = xs[2 + r - 1 - k]
            if align and L == 1:
                continue  # every position is 0 there, and its derivative 0
            ok &= knot_distance(unnormalize(grid[..., k], L, align)).min() > margin
        if ok:
            return t
    raise AssertionError("no knot-free theta found")


def layouts(a):
    """Arrays with ``a``'s values in other layouts: Fortran order, a strided view,
    negative strides, read-only."""
    big = np.zeros(a.shape + (2,), a.dtype)
    big[..., 1] = a
    ro = a.copy()
    ro.flags.writeable = False
    return {"fortran": np.asfortranarray(a), "strided": big[..., 1], "negative": np.flip(np.flip(a).copy()),
            "readonly": ro}


def torch_or_skip():
    return pytest.importorskip("torch")


def no_3d_cubic(matrix):
    """A ``sampler_matrix`` without 3-D cubic (PyTorch has no 3-D bicubic grid_sample)."""
    names, params = matrix
    return names, [p for p in params if tuple(p.values[:2]) != (3, "cubic")]


# --- grid_sample: central differences -----------------------------------------------------

#: (x shape, output spatial shape) per rank: a general one and one with axes of size 1
GS_SHAPES = {1: [((2, 2, 5), (6,)), ((1, 1, 1), (3,))],
             2: [((1, 2, 4, 5), (3, 4)), ((1, 2, 1, 4), (2, 3))],
             3: [((1, 2, 3, 4, 3), (2, 2, 3)), ((1, 1, 1, 3, 2), (2, 1, 2))]}


def gs_grads(gy, x, grid, **attrs):
    return numba_ops.grid_sample_backward(gy, x, grid, **attrs)


@pytest.mark.parametrize(*sampler_matrix([1, 2, 3]))
def test_grid_sample_finite_differences(r, mode, padding, align):
    for i, (xs, outs) in enumerate(GS_SHAPES[r]):
        rng = np.random.default_rng(100 * r + 10 * i + align)
        ins = {"x": rng.standard_normal(xs), "grid": smooth_grid(rng, xs[0], outs, xs[2:], align)}
        attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
        gy = rng.standard_normal(xs[:2] + outs)

        def loss():
            return np.vdot(gy, numba_ops.grid_sample(ins["x"], ins["grid"], **attrs))

        gx, gg = gs_grads(gy, ins["x"], ins["grid"], **attrs)
        assert gx.dtype == gg.dtype == np.float64
        assert_close(gx, fd(loss, ins, "x", 1.0), LIN)
        assert_close(gg, fd(loss, ins, "grid", H_POS), POS, floor=1e-9)
        if mode == "nearest":
            assert not gg.any()  # no gradient wrt positions
        elif i == 0:
            assert np.abs(gg).max() > 0.1  # something was checked


def test_right_hand_derivative_at_integers():
    """At an integer position the weights come from floor: the right-hand derivative."""
    x = np.array([[[[0.0, 1.0, 3.0, 6.0]]]])  # (1, 1, 1, 4): slopes 1, 2, 3 along the width
    grid = np.array([[[[-0.25, 0.0]]]])  # width 4, align_corners=False: position exactly 1
    _, gg = gs_grads(np.ones((1, 1, 1, 1)), x, grid)
    assert gg[0, 0, 0, 0] == 2.0 * 2.0  # slope 2 on [1, 2], times d pos / d grid = size / 2 = 2
    # deform_conv, 1-D: every sample moved by exactly 1, to positions 1, 2, 3, 4
    _, _, goff, _, _ = numba_ops.deform_conv_backward(np.ones((1, 1, 4)), x[0], np.ones((1, 1, 1)),
                                                      np.ones((1, 1, 4)))
    np.testing.assert_array_equal(goff[0, 0], [2.0, 3.0, -6.0, 0.0])  # right of 3 is outside: -x[3]; 4: 0


@pytest.mark.parametrize("padding,pos,want", [
    ("border", 4.3, 0.0),  # clamped beyond the last element
    ("border", -0.7, 0.0),  # clamped before the first
    ("zeros", 4.3, 0.0),  # every tap outside
    ("zeros", -0.6, 2.0 * 2),  # only the tap at 0 inside, weight pos + 1: the slope x[0]
    ("reflection", 4.3, -3.0 * 2),  # mirrored about 3.5: the slope of [2, 3] with its sign flipped
    ("reflection", 1.4, 2.0 * 2),  # inside: the slope
    ("border", 0.0, 0.0),  # exactly on the first index: clamped (PyTorch's clip_coordinates_set_grad)
    ("border", 3.0, 0.0),  # ... on the last
    ("zeros", 0.0, -1.0 * 2),  # zeros clamps nothing: the right-hand slope
    ("reflection", 0.0, 0.0),  # on the first index: clamped
    ("reflection", 4.0, 0.0),  # mirrored onto the last index (3): clamped
    ("reflection", -1.0, 0.0),  # mirrored onto the first
    ("reflection", 5.0, -3.0 * 2),  # mirrored onto 2: the right-hand slope there ([2, 3]), flipped
])
def test_padding_derivative_conventions(padding, pos, want):
    """Linear along a row x = (2, 1, 3, 6), align_corners=False (d pos / d grid = size / 2
    = 2): border-clamped positions have no gradient, reflected ones the mirrored slope;
    a position exactly on the first or last index (or mirrored onto one) counts as
    clamped under border and reflection, as PyTorch's."""
    x = np.array([[[[2.0, 1.0, 3.0, 6.0]]]])
    grid = np.array([[[[grid_coord(pos, 4, False), 0.0]]]])
    _, gg = gs_grads(np.ones((1, 1, 1, 1)), x, grid, padding_mode=padding)
    np.testing.assert_allclose(gg[0, 0, 0, 0], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_border_clamped_position_gradient_is_exactly_zero(dtype):
    """Linear, border padding: where a coordinate is clamped (both taps on the same edge
    element) the sample does not depend on it, and its gradient is 0 exactly, as
    PyTorch's bilinear one (clip_coordinates_set_grad). 2-D, the y coordinate clamped,
    x inside. (Cubic is left out: PyTorch's bicubic sums the taps' weight derivatives
    there too, with rounding residue.)"""
    rng = np.random.default_rng(22)
    x = rng.standard_normal((1, 3, 4, 5)).astype(dtype)
    grid = rng.uniform(-0.9, 0.9, (1, 4, 4, 2)).astype(dtype)
    grid[..., 1] = rng.choice([-1e30, -5.0, -3.0, 3.0, 5.0, 1e30], (1, 4, 4))  # y: clamped (height 4)
    gy = rng.standard_normal((1, 3, 4, 4)).astype(dtype)
    _, gg = gs_grads(gy, x, grid, padding_mode="border")
    assert np.abs(gg[..., 0]).max() > 0.1
    bad = np.count_nonzero(gg[..., 1])
    assert bad == 0, f"{bad} of 16 clamped y-gradients not 0 (largest {np.abs(gg[..., 1]).max():.3g})"


# --- grid_sample: PyTorch -----------------------------------------------------------------

def torch_grid_sample(x, grid, gy_fn, mode, padding, align, ours):
    """PyTorch's (x grad, grid grad) of ``grid_sample`` for the grad_y that ``gy_fn(agree)``
    makes from the mask of output positions (N, 1, O..) where PyTorch's forward equals
    ``ours``; returns (grad_y, torch's grads, the fraction that agrees)."""
    torch = torch_or_skip()
    xt = torch.tensor(x, requires_grad=True)
    gt = torch.tensor(grid, requires_grad=True)
    yt = torch.nn.functional.grid_sample(xt, gt, mode=TORCH_MODE[mode], padding_mode=padding,
                                         align_corners=bool(align))
    agree = np.isclose(ours, yt.detach().numpy(), rtol=1e-12, atol=1e-12).all(axis=1, keepdims=True)
    gy = gy_fn(agree)
    yt.backward(torch.from_numpy(gy))
    return gy, (xt.grad.numpy(), gt.grad.numpy()), agree.mean()


@pytest.mark.parametrize(*no_3d_cubic(sampler_matrix([2, 3])))
def test_grid_sample_vs_torch(r, mode, padding, align):
    """torch.nn.functional.grid_sample's autograd, float64, at knot-free positions. Where
    the forwards differ (nearest's ties, cubic's padding) grad_y is 0."""
    rng = np.random.default_rng(7 * r + align)
    xs, outs = ((2, 3, 5, 6), (4, 5)) if r == 2 else ((2, 2, 3, 4, 5), (2, 3, 4))
    x = rng.standard_normal(xs)
    grid = smooth_grid(rng, xs[0], outs, xs[2:], align)
    attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
    y = numba_ops.grid_sample(x, grid, **attrs)
    gy0 = rng.standard_normal(y.shape)
    gy, (tgx, tgg), agree = torch_grid_sample(x, grid, lambda m: gy0 * m, mode, padding, align, y)
    assert agree > 0.9
    gx, gg = gs_grads(gy, x, grid, **attrs)
    assert_close(gx, tgx, PEER)
    assert_close(gg, tgg, PEER)


@pytest.mark.parametrize(*sampler_matrix([2]))
def test_grid_sample_integer_positions_vs_torch(r, mode, padding, align):
    """Exact integer positions (right-hand derivatives, from floor, as PyTorch's), the
    edges included (clamped under border and reflection: zero gradient) and outside
    them (reflection's mirrors)."""
    torch_or_skip()
    xs = (1, 2, 4, 8) if not align else (1, 2, 5, 3)  # sizes where the grid values are exact
    rng = np.random.default_rng(5 + align)
    x = rng.standard_normal(xs)
    outs = (3, 5)
    grid = np.empty((1,) + outs + (2,))
    for k in range(2):
        size = xs[3 - k]
        pos = rng.integers(-2, size + 2, (1,) + outs).astype(np.float64)
        grid[..., k] = grid_coord(pos, size, align)
        np.testing.assert_array_equal(unnormalize(grid[..., k], size, align), pos)
    attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
    y = numba_ops.grid_sample(x, grid, **attrs)
    gy0 = rng.standard_normal(y.shape)
    gy, (tgx, tgg), agree = torch_grid_sample(x, grid, lambda m: gy0 * m, mode, padding, align, y)
    assert agree > 0.6
    gx, gg = gs_grads(gy, x, grid, **attrs)
    assert_close(gx, tgx, PEER)
    assert_close(gg, tgg, PEER)


# --- affine_grid ------------------------------------------------------------------------

AG_SIZES = [(1, 1, 3, 4), (2, 3, 1, 5), (2, 1, 4, 1), (1, 1, 2, 3, 4), (2, 2, 3, 1, 2)]


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("size", AG_SIZES, ids=str)
def test_affine_grid_finite_differences_and_torch(size, align):
    """The grid is linear in theta: unit-step central differences are exact; PyTorch's
    affine_grid autograd agrees."""
    rng = np.random.default_rng(len(size) + size[0] + align)
    r = len(size) - 2
    ins = {"theta": rng.standard_normal((size[0], r, r + 1))}
    gg = rng.standard_normal((size[0],) + size[2:] + (r,))

    def loss():
        return np.vdot(gg, numba_ops.affine_grid(ins["theta"], size, align))

    got = numba_ops.affine_grid_backward(gg, size, align)
    assert got.dtype == np.float64 and got.shape == ins["theta"].shape
    assert_close(got, fd(loss, ins, "theta", 1.0), LIN)
    torch = torch_or_skip()
    tt = torch.tensor(ins["theta"], requires_grad=True)
    torch.nn.functional.affine_grid(tt, list(size), align_corners=bool(align)).backward(torch.from_numpy(gg))
    assert_close(got, tt.grad.numpy(), PEER)


# --- affine_warp --------------------------------------------------------------------------

AW_SHAPES = {2: [((1, 2, 4, 5), (1, 2, 3, 4)), ((2, 1, 3, 3), None)],
             3: [((1, 2, 3, 4, 3), (1, 2, 2, 3, 2))]}
#: affine_warp's forward compiles per rank x mode x padding too: a smaller default
AW_DEFAULT = {(2, "linear", "zeros"), (2, "cubic", "reflection"), (3, "linear", "zeros")}


@pytest.mark.parametrize(*sampler_matrix([2, 3], default=AW_DEFAULT))
def test_affine_warp_finite_differences(r, mode, padding, align):
    for i, (xs, size) in enumerate(AW_SHAPES[r]):
        rng = np.random.default_rng(31 * r + 3 * i + align)
        out = tuple(xs) if size is None else size
        ins = {"x": rng.standard_normal(xs), "theta": smooth_theta(rng, xs[0], xs, out, align)}
        attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
        gy = rng.standard_normal(out)

        def loss():
            return np.vdot(gy, numba_ops.affine_warp(ins["x"], ins["theta"], size, **attrs))

        gx, gt = numba_ops.affine_warp_backward(gy, ins["x"], ins["theta"], size, **attrs)
        assert gx.dtype == gt.dtype == np.float64 and gt.shape == ins["theta"].shape
        assert_close(gx, fd(loss, ins, "x", 1.0), LIN)
        assert_close(gt, fd(loss, ins, "theta", H_POS), POS, floor=1e-9)
        if mode == "nearest":
            assert not gt.any()


@pytest.mark.parametrize(*sampler_matrix([2, 3], aligns=()))
def test_affine_warp_is_the_chain_of_grid_sample_and_affine_grid(r, mode, padding):
    """The fused gradient equals grid_sample_backward on affine_grid's grid, chained
    through affine_grid_backward."""
    rng = np.random.default_rng(8)
    for align in (0, 1):
        xs = (2, 2, 4, 5) if r == 2 else (1, 2, 3, 4, 3)
        size = (xs[0], xs[1]) + ((3, 6) if r == 2 else (2, 3, 4))
        x = rng.standard_normal(xs)
        theta = smooth_theta(rng, xs[0], xs, size, align)
        gy = rng.standard_normal(size)
        attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
        gx, gt = numba_ops.affine_warp_backward(gy, x, theta, size, **attrs)
        grid = numba_ops.affine_grid(theta, size, align)
        gx2, gg = gs_grads(gy, x, grid, **attrs)
        assert_close(gx, gx2, 1e-13)
        assert_close(gt, numba_ops.affine_grid_backward(gg, size, align), 1e-12)


@pytest.mark.parametrize(*no_3d_cubic(sampler_matrix([2, 3], default={
    (2, "linear", "zeros"), (2, "cubic", "reflection"), (3, "linear", "zeros")})))
def test_affine_warp_vs_torch(r, mode, padding, align):
    """PyTorch's affine_grid + grid_sample autograd, float64; grad_y 0 where the forwards differ."""
    torch = torch_or_skip()
    F = torch.nn.functional
    rng = np.random.default_rng(50 + r + align)
    xs = (2, 2, 4, 5) if r == 2 else (1, 2, 3, 4, 3)
    size = (xs[0], xs[1]) + ((3, 6) if r == 2 else (2, 3, 4))
    x = rng.standard_normal(xs)
    theta = smooth_theta(rng, xs[0], xs, size, align)
    attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
    y = numba_ops.affine_warp(x, theta, size, **attrs)
    xt = torch.tensor(x, requires_grad=True)
    tt = torch.tensor(theta, requires_grad=True)
    yt = F.grid_sample(xt, F.affine_grid(tt, list(size), align_corners=bool(align)), mode=TORCH_MODE[mode],
                       padding_mode=padding, align_corners=bool(align))
    agree = np.isclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-12).all(axis=1, keepdims=True)
    assert agree.mean() > 0.9
    gy = rng.standard_normal(y.shape) * agree
    yt.backward(torch.from_numpy(gy))
    gx, gt = numba_ops.affine_warp_backward(gy, x, theta, size, **attrs)
    assert_close(gx, xt.grad.numpy(), PEER)
    assert_close(gt, tt.grad.numpy(), PEER)


# --- identity grids: positions exactly on every index, the edges included ------------------

#: x shapes per rank: small, and of unequal sizes per axis
ID_SHAPES = {2: (2, 3, 5, 6), 3: (1, 2, 4, 5, 3)}
#: ... for affine_warp, which computes its positions as affine_grid does: sizes whose
#: positions PyTorch's affine_grid gives bit for bit too (without align_corners its
#: linspace rounds sizes 3, 6 or 7 an ulp off the integer, to the other side of the kink)
AW_ID_SHAPES = {2: (2, 3, 5, 4), 3: (1, 2, 4, 5, 2)}
#: the default run's combinations: those the tests above compile anyway in float64
#: (test_padding_derivative_conventions: 2-D linear with every padding)
ID_DEFAULT = {(2, "linear", "zeros"), (2, "linear", "border"), (2, "linear", "reflection"),
              (2, "cubic", "reflection"), (3, "linear", "zeros")}


def identity_case(torch, xs, align, seed):
    """``(x, theta, grid, grad_y)`` in float64 for an x of shape ``xs``: an identity theta
    (N, r, r+1), PyTorch's affine_grid of it (exact integer positions with
    align_corners, and within an ulp of them without), random x and grad_y."""
    rng = np.random.default_rng(seed)
    r = len(xs) - 2
    theta = np.zeros((xs[0], r, r + 1))
    theta[:, :, :r] = np.eye(r)
    grid = torch.nn.functional.affine_grid(torch.from_numpy(theta), list(xs), align_corners=bool(align)).numpy()
    if align:  # the first and last indices are sampled exactly
        for k in range(r):
            pos = unnormalize(grid[..., k], xs[1 + r - k], align)
            assert pos.min() == 0.0 and pos.max() == xs[1 + r - k] - 1
    return rng.standard_normal(xs), theta, grid, rng.standard_normal(xs)


@pytest.mark.parametrize(*no_3d_cubic(sampler_matrix([2, 3], default=ID_DEFAULT)))
def test_grid_sample_identity_grid_vs_torch(r, mode, padding, align):
    """grid_sample_backward at an identity grid equals PyTorch's autograd (float64), every
    position compared: under border and reflection a linear position exactly on the
    first or last index has zero gradient (PyTorch's clip_coordinates_set_grad)."""
    torch = torch_or_skip()
    x, _, grid, gy = identity_case(torch, ID_SHAPES[r], align, 60 + r + align)
    xt = torch.tensor(x, requires_grad=True)
    gt = torch.tensor(grid, requires_grad=True)
    yt = torch.nn.functional.grid_sample(xt, gt, mode=TORCH_MODE[mode], padding_mode=padding,
                                         align_corners=bool(align))
    yt.backward(torch.from_numpy(gy))
    gx, gg = gs_grads(gy, x, grid, mode=mode, padding_mode=padding, align_corners=align)
    assert_close(gx, xt.grad.numpy(), PEER)
    assert_close(gg, gt.grad.numpy(), PEER)


@pytest.mark.parametrize(*no_3d_cubic(sampler_matrix([2, 3], default=ID_DEFAULT)))
def test_affine_warp_identity_vs_torch(r, mode, padding, align):
    """affine_warp_backward at an identity theta equals PyTorch's autograd through
    affine_grid + grid_sample (float64), every position compared."""
    torch = torch_or_skip()
    F = torch.nn.functional
    x, theta, grid, gy = identity_case(torch, AW_ID_SHAPES[r], align, 70 + r + align)
    ours = numba_ops.affine_grid(theta, x.shape, align)
    for k in range(r):  # the same positions (the kinks' side included), so the same derivatives
        size = x.shape[1 + r - k]
        np.testing.assert_array_equal(unnormalize(ours[..., k], size, align), unnormalize(grid[..., k], size, align))
    xt = torch.tensor(x, requires_grad=True)
    tt = torch.tensor(theta, requires_grad=True)
    yt = F.grid_sample(xt, F.affine_grid(tt, list(x.shape), align_corners=bool(align)), mode=TORCH_MODE[mode],
                       padding_mode=padding, align_corners=bool(align))
    yt.backward(torch.from_numpy(gy))
    gx, gt = numba_ops.affine_warp_backward(gy, x, theta, mode=mode, padding_mode=padding, align_corners=align)
    assert_close(gx, xt.grad.numpy(), PEER)
    assert_close(gt, tt.grad.numpy(), PEER)


# --- deform_conv ------------------------------------------------------------------------

def out_sizes(D, k, pads, strides, dil):
    nd = len(D)
    return tuple((D[i] + pads[i] + pads[nd + i] - ((k[i] - 1) * dil[i] + 1)) // strides[i] + 1 for i in range(nd))


def dc_case(rng, N=1, C=2, D=(4, 5), oC=2, k=(2, 2), pads=None, strides=None, dil=None, group=1, og=1,
            bias=True, mask=True, integer=False):
    """Inputs and attributes of a deform_conv call; offsets at least 0.1 from integers
    (``integer``: whole numbers 0..2)."""
    nd = len(D)
    pads = list(pads or [0] * (2 * nd))
    strides = list(strides or [1] * nd)
    dil = list(dil or [1] * nd)
    outs = out_sizes(D, k, pads, strides, dil)
    K = int(np.prod(k))
    oshape = (N, og * K * nd) + outs
    offset = (rng.integers(0, 3, oshape) * 1.0 if integer
              else rng.integers(-2, 2, oshape) + fractions(rng, oshape))
    ins = dict(x=rng.standard_normal((N, C) + tuple(D)), w=rng.standard_normal((oC, C // group) + tuple(k)),
               offset=offset, b=rng.standard_normal(oC) if bias else None,
               mask=rng.uniform(-0.5, 1.5, (N, og * K) + outs) if mask else None)
    att = dict(kernel_shape=list(k), pads=pads, strides=strides, dilations=dil, group=group, offset_group=og)
    return ins, att


def dc_forward(ins, att):
    return numba_ops.deform_conv(ins["x"], ins["w"], ins["offset"], ins["b"], ins["mask"], **att)


def dc_grads(gy, ins, att, **kw):
    return numba_ops.deform_conv_backward(gy, ins["x"], ins["w"], ins["offset"], ins["b"], ins["mask"], **att, **kw)


def cast(ins, dtype):
    return {k: (None if v is None else v.astype(dtype)) for k, v in ins.items()}


DC_CASES = [
    dict(N=1, C=2, D=(7,), oC=2, k=(3,), pads=[1, 2], strides=[2]),
    dict(N=2, C=4, D=(6,), oC=2, k=(2,), dil=[2], group=2, og=2, mask=False, bias=False),
    dict(N=1, C=2, D=(4, 5), oC=2, k=(2, 2)),
    dict(N=2, C=4, D=(5, 6), oC=4, k=(3, 2), pads=[1, 0, 2, 1], strides=[2, 1], dil=[1, 2], group=2, og=2),
    dict(N=1, C=4, D=(4, 4), oC=2, k=(2, 2), og=4, mask=False),
    dict(N=1, C=2, D=(3, 4, 3), oC=2, k=(2, 2, 2), pads=[1, 0, 0, 0, 1, 1]),
    dict(N=1, C=4, D=(4, 3, 4), oC=2, k=(2, 1, 2), strides=[2, 1, 1], dil=[1, 1, 2], group=2, og=2, mask=False),
]


@pytest.mark.parametrize("i", range(len(DC_CASES)))
def test_deform_conv_finite_differences(i):
    """1-D, 2-D and 3-D with mask, bias, groups, offset groups, strides, dilations and pads."""
    rng = np.random.default_rng(200 + i)
    ins, att = dc_case(rng, **DC_CASES[i])
    gy = rng.standard_normal(dc_forward(ins, att).shape)

    def loss():
        return np.vdot(gy, dc_forward(ins, att))

    grads = dc_grads(gy, ins, att)
    assert len(grads) == 5
    for name, g in zip(DC_NAMES, grads):
        if ins[name] is None:
            assert g is None
            continue
        assert g.dtype == np.float64 and g.shape == ins[name].shape, name
        if name == "offset":
            assert_close(g, fd(loss, ins, name, H_POS), POS, floor=1e-9)
            assert np.abs(g).max() > 0.1
        else:
            assert_close(g, fd(loss, ins, name, 1.0), LIN)


TV_CASES = [
    dict(N=1, C=2, D=(5, 5), oC=2, k=(2, 2)),
    dict(N=2, C=4, D=(6, 7), oC=4, k=(3, 3), pads=[1, 1, 1, 1], strides=[2, 1], dil=[1, 2], group=2, og=2),
    dict(N=1, C=3, D=(5, 4), oC=6, k=(2, 3), pads=[2, 1, 2, 1], group=3, og=3, mask=False),
    dict(N=1, C=4, D=(7, 6), oC=2, k=(3, 2), strides=[2, 2], dil=[2, 1], og=4, bias=False),
    dict(N=1, C=4, D=(5, 6), oC=4, k=(2, 2), pads=[1, 1, 1, 1], group=2, og=1),  # an offset group over 2 conv groups
]


@pytest.mark.parametrize("integer", [False, True], ids=["fractional", "integer"])
@pytest.mark.parametrize("i", range(len(TV_CASES)))
def test_deform_conv_vs_torchvision(i, integer):
    """torchvision.ops.deform_conv2d's autograd, float64 (symmetric pads; groups from W's
    shape; its offsets are (dy, dx) pairs per kernel point, our channel order). Integer
    offsets: every position on the lattice, right-hand derivatives as torchvision's
    (pads put some at exactly -1)."""
    torch = torch_or_skip()
    tvo = pytest.importorskip("torchvision.ops")
    rng = np.random.default_rng(300 + i)
    ins, att = dc_case(rng, integer=integer, **TV_CASES[i])
    t = {k: None if v is None else torch.tensor(v, requires_grad=True) for k, v in ins.items()}
    yt = tvo.deform_conv2d(t["x"], t["offset"], t["w"], t["b"], stride=tuple(att["strides"]),
                           padding=tuple(att["pads"][:2]), dilation=tuple(att["dilations"]), mask=t["mask"])
    y = dc_forward(ins, att)
    assert_close(y, yt.detach().numpy(), 1e-12)
    gy = rng.standard_normal(y.shape)
    yt.backward(torch.from_numpy(gy))
    for name, g in zip(DC_NAMES, dc_grads(gy, ins, att)):
        if t[name] is None:
            assert g is None
        else:
            assert_close(g, t[name].grad.numpy(), PEER)


# --- errors -------------------------------------------------------------------------------

def _gs_inputs(dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((1, 2, 3, 4)).astype(dtype), rng.uniform(-1, 1, (1, 2, 3, 2)).astype(dtype),
            np.ones((1, 2, 2, 3), dtype))


def test_grid_sample_backward_errors():
    x, grid, gy = _gs_inputs()
    f = numba_ops.grid_sample_backward
    with pytest.raises(ValueError, match="grad_y"):
        f(gy[:, :, :1], x, grid)
    with pytest.raises(ValueError, match="grad_y"):
        f(gy.reshape(1, 2, 3, 2), x, grid)
    with pytest.raises(TypeError, match="grad_y"):
        f(gy.astype(np.float64), x, grid)
    with pytest.raises(ValueError, match="grad_y"):
        f(None, x, grid)
    with pytest.raises(TypeError, match="uint8"):
        f(gy, x.astype(np.uint8), grid)
    with pytest.raises(ValueError, match="wrt"):
        f(gy, x, grid, wrt=["x", "theta"])
    with pytest.raises(ValueError, match="wrt"):
        f(gy, x, grid, wrt=["X"])
    with pytest.raises(TypeError, match="wrt"):
        f(gy, x, grid, wrt=3)
    with pytest.raises(ValueError, match="mode"):
        f(gy, x, grid, mode="bilinear")
    with pytest.raises(ValueError, match="padding_mode"):
        f(gy, x, grid, padding_mode="wrap")
    with pytest.raises(ValueError, match="align_corners"):
        f(gy, x, grid, align_corners=2)
    with pytest.raises(ValueError, match="grid"):
        f(gy, x, grid[..., :1])
    with pytest.raises(TypeError):
        f(gy, x, grid.astype(np.float64))  # x and grid of different float dtypes
    with pytest.raises(ValueError, match="X"):
        f(gy, None, grid)


def test_affine_warp_backward_errors():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    theta = np.array([[[1, 0, 0], [0, 1, 0]]], np.float32)
    gy = np.ones((1, 2, 3, 4), np.float32)
    f = numba_ops.affine_warp_backward
    with pytest.raises(ValueError, match="grad_y"):
        f(gy, x, theta, (1, 2, 5, 4))
    with pytest.raises(ValueError, match="grad_y"):
        f(gy[..., :2], x, theta)
    with pytest.raises(TypeError, match="grad_y"):
        f(gy.astype(np.float16), x, theta)
    with pytest.raises(ValueError, match="grad_y"):
        f(None, x, theta)
    with pytest.raises(TypeError, match="uint8"):
        f(gy, x.astype(np.uint8), theta)
    with pytest.raises(ValueError, match="wrt"):
        f(gy, x, theta, wrt=("grid",))
    with pytest.raises(ValueError, match="theta"):
        f(gy, x, theta[:, :, :2])
    with pytest.raises(ValueError, match="size"):
        f(gy, x, theta, (2, 2, 3, 4))
    with pytest.raises(ValueError, match="mode"):
        f(gy, x, theta, mode="area")


def test_affine_grid_backward_errors():
    gg = np.ones((1, 3, 4, 2), np.float32)
    f = numba_ops.affine_grid_backward
    with pytest.raises(ValueError, match="grad_grid"):
        f(gg, (1, 1, 4, 3))
    with pytest.raises(ValueError, match="grad_grid"):
        f(gg[..., :1], (1, 1, 3, 4))
    with pytest.raises(ValueError, match="grad_grid"):
        f(None, (1, 1, 3, 4))
    with pytest.raises(TypeError, match="grad_grid"):
        f(gg.astype(np.int32), (1, 1, 3, 4))
    with pytest.raises(ValueError, match="size"):
        f(gg, (1, 1, 3))
    with pytest.raises(ValueError, match="align_corners"):
        f(gg, (1, 1, 3, 4), align_corners="yes")


def test_deform_conv_backward_errors():
    ins, att = dc_case(np.random.default_rng(0))
    ins = cast(ins, np.float32)
    gy = np.ones(dc_forward(ins, att).shape, np.float32)
    with pytest.raises(ValueError, match="grad_y"):
        dc_grads(gy[:, :1], ins, att)
    with pytest.raises(TypeError, match="grad_y"):
        dc_grads(gy.astype(np.float64), ins, att)
    with pytest.raises(ValueError, match="grad_y"):
        dc_grads(None, ins, att)
    with pytest.raises(TypeError):
        dc_grads(gy, dict(ins, x=ins["x"].astype(np.uint8)), att)
    with pytest.raises(ValueError, match="wrt"):
        dc_grads(gy, ins, att, wrt=["x", "grid"])
    with pytest.raises(ValueError, match="group"):
        dc_grads(gy, ins, dict(att, group=3))
    with pytest.raises(ValueError, match="offset"):
        dc_grads(gy, dict(ins, offset=ins["offset"][:, :4]), att)
    with pytest.raises(ValueError, match="W"):
        dc_grads(gy, dict(ins, w=None), att)


# --- wrt ----------------------------------------------------------------------------------

def test_grid_sample_wrt():
    x, grid, gy = _gs_inputs(np.float64)
    gx, gg = numba_ops.grid_sample_backward(gy, x, grid)
    for wrt, want in [(["x"], (True, False)), (("grid",), (False, True)), ([], (False, False)),
                      ({"x", "grid"}, (True, True)), ((n for n in ["grid"]), (False, True))]:
        got = numba_ops.grid_sample_backward(gy, x, grid, wrt=wrt)
        for g, full, w in zip(got, (gx, gg), want):
            if w:
                np.testing.assert_allclose(g, full, rtol=1e-15, atol=0)
            else:
                assert g is None


def test_affine_warp_wrt():
    x, _, _ = _gs_inputs(np.float64)
    theta = np.array([[[0.9, 0.2, 0.1], [-0.1, 1.1, 0.05]]])
    gy = np.random.default_rng(1).standard_normal(x.shape)
    gx, gt = numba_ops.affine_warp_backward(gy, x, theta)
    a, b = numba_ops.affine_warp_backward(gy, x, theta, wrt=["theta"])
    assert a is None
    np.testing.assert_allclose(b, gt, rtol=1e-15, atol=0)
    a, b = numba_ops.affine_warp_backward(gy, x, theta, wrt=("x",))
    assert b is None
    np.testing.assert_allclose(a, gx, rtol=1e-15, atol=0)
    assert numba_ops.affine_warp_backward(gy, x, theta, wrt=[]) == (None, None)


def test_deform_conv_wrt():
    ins, att = dc_case(np.random.default_rng(2), N=2, C=4, oC=2, group=2, og=2)
    gy = np.random.default_rng(3).standard_normal(dc_forward(ins, att).shape)
    full = dc_grads(gy, ins, att)
    assert all(g is not None for g in full)
    for names in [["x"], ["w"], ["offset"], ["b"], ["mask"], ["x", "mask"], ["w", "offset", "b"], []]:
        got = dc_grads(gy, ins, att, wrt=names)
        for name, g, f in zip(DC_NAMES, got, full):
            if name in names:
                np.testing.assert_allclose(g, f, rtol=1e-14, atol=1e-14 * np.abs(f).max(), err_msg=name)
            else:
                assert g is None, name
    # b and mask absent: None, asked for or not
    no_bm = dict(ins, b=None, mask=None)
    got = dc_grads(gy, no_bm, att)
    assert got[3] is None and got[4] is None and all(g is not None for g in got[:3])
    got = dc_grads(gy, no_bm, att, wrt=["b", "mask"])
    assert got == (None,) * 5


# --- non-finite and huge positions ----------------------------------------------------------

@pytest.mark.parametrize(*sampler_matrix([2, 3], aligns=()))
def test_grid_sample_nonfinite_position(r, mode, padding):
    """A non-finite coordinate (NaN, ±Inf): NaN in every coordinate of its own grid
    gradient; grad_x finite, equal to the gradient without that position's
    contribution; every other grid gradient unchanged."""
    rng = np.random.default_rng(9)
    for bad, align in itertools.product([np.nan, np.inf, -np.inf], [0, 1]):
        xs, outs = ((2, 2, 4, 5), (3, 4)) if r == 2 else ((2, 2, 3, 4, 3), (2, 2, 3))
        x = rng.standard_normal(xs)
        grid = smooth_grid(rng, xs[0], outs, xs[2:], align)
        gy = rng.standard_normal(xs[:2] + outs)
        where = (1,) + (1,) * (r - 1) + (2,)  # image 1, one position
        bad_grid = grid.copy()
        bad_grid[where + (r - 1,)] = bad  # its outermost coordinate only
        attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
        gx, gg = gs_grads(gy, x, bad_grid, **attrs)
        assert np.isnan(gg[where]).all()
        others = np.ones(gg.shape[:-1], bool)
        others[where] = False
        assert np.isfinite(gg[others]).all() and np.isfinite(gx).all()
        gy0 = gy.copy()
        gy0[(where[0], slice(None)) + where[1:]] = 0
        gx0, gg0 = gs_grads(gy0, x, grid, **attrs)
        np.testing.assert_allclose(gx, gx0, rtol=1e-14, atol=0)
        np.testing.assert_array_equal(gg[others], gs_grads(gy, x, grid, **attrs)[1][others])


@pytest.mark.parametrize("dtype,mode,padding", [
    param((2, m, p) in (F64_DEFAULT if d == np.float64 else F32_DEFAULT), d, m, p, id=f"{np.dtype(d).name}-{m}-{p}")
    for d in (np.float32, np.float64) for m in MODES for p in PADS])
def test_grid_sample_huge_positions(dtype, mode, padding):
    """2-D positions of ±1e30: no crash; zeros and border have no position gradient there
    (outside / clamped), reflection a finite one; zeros adds nothing to grad_x."""
    rng = np.random.default_rng(10)
    x = rng.standard_normal((1, 2, 4, 5)).astype(dtype)
    grid = rng.uniform(-1, 1, (1, 3, 4, 2)).astype(dtype)
    grid[0, 0, 0] = [1e30, 0.2]
    grid[0, 1, 2] = [0.3, -1e30]
    grid[0, 2, 3] = [-1e30, 1e30]
    gy = rng.standard_normal((1, 2, 3, 4)).astype(dtype)
    huge = [(0, 0, 0), (0, 1, 2), (0, 2, 3)]
    gx, gg = gs_grads(gy, x, grid, mode=mode, padding_mode=padding)
    assert np.isfinite(gx).all() and np.isfinite(gg).all()
    if padding != "reflection":  # 0 (border: up to rounding, see test_border_clamped_...)
        noise = 1e-5 if dtype == np.float32 else 1e-13
        for h in huge:
            assert np.abs(gg[h][np.abs(grid[h]) > 1]).max() <= noise, h
    if padding == "zeros":
        gy0 = gy.copy()
        for h in huge:
            gy0[(h[0], slice(None)) + h[1:]] = 0
        np.testing.assert_allclose(gx, gs_grads(gy0, x, grid, mode=mode)[0], rtol=1e-6, atol=0)
        for h in huge:  # every tap outside: no gradient at all
            assert not gg[h].any()


@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no-mask"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_deform_conv_nonfinite_offset(nd, with_mask):
    """A NaN offset: NaN in every axis' offset gradient of its sample and in its mask
    gradient; grad_x, grad_w, grad_b finite and equal to the gradients without that
    sample (mask 0 there); every other offset and mask gradient unchanged."""
    D, k = {1: ((6,), (3,)), 2: ((4, 5), (2, 2)), 3: ((3, 4, 3), (2, 2, 2))}[nd]
    rng = np.random.default_rng(40 + nd)
    ins, att = dc_case(rng, N=2, C=4, D=D, oC=2, k=k, og=2, mask=with_mask)
    K = int(np.prod(k))
    gy = rng.standard_normal(dc_forward(ins, att).shape)
    n, g, kk = 1, 1, K - 1
    o = (0,) * nd
    for bad in (np.nan, np.inf):
        bad_ins = dict(ins, offset=ins["offset"].copy())
        bad_ins["offset"][(n, (g * K + kk) * nd + nd - 1) + o] = bad
        gx, gw, goff, gb, gm = dc_grads(gy, bad_ins, att)
        chans = [(g * K + kk) * nd + a for a in range(nd)]
        assert np.isnan(goff[(n, chans) + o]).all()
        off_ok = np.ones(goff.shape, bool)
        off_ok[(n, chans) + o] = False
        assert np.isfinite(goff[off_ok]).all()
        for a in (gx, gw, gb):
            assert np.isfinite(a).all()
        # the same call with that sample's mask 0 (and a finite offset)
        ref_ins = dict(ins, mask=(ins["mask"] if with_mask else np.ones((2, 2 * K) + goff.shape[2:])).copy())
        ref_ins["mask"][(n, g * K + kk) + o] = 0
        rx, rw, roff, rb, rm = dc_grads(gy, ref_ins, att)
        for got, want in ((gx, rx), (gw, rw), (gb, rb)):
            assert_close(got, want, 1e-14)
        full = dc_grads(gy, ins, att)
        np.testing.assert_array_equal(goff[off_ok], full[2][off_ok])
        if with_mask:
            assert np.isnan(gm[(n, g * K + kk) + o])
            m_ok = np.ones(gm.shape, bool)
            m_ok[(n, g * K + kk) + o] = False
            np.testing.assert_array_equal(gm[m_ok], full[4][m_ok])
        else:
            assert gm is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_deform_conv_huge_offsets(dtype):
    """Offsets of ±1e30 sample outside: zero offset and mask gradients there, no crash."""
    rng = np.random.default_rng(12)
    ins, att = dc_case(rng, N=1, C=2, D=(4, 5), oC=2, k=(2, 2))
    ins = cast(ins, dtype)
    ins["offset"][0, 0, 0, 0] = 1e30
    ins["offset"][0, 3, 1, 2] = -1e30  # kernel point 1's x
    gy = rng.standard_normal(dc_forward(ins, att).shape).astype(dtype)
    gx, gw, goff, gb, gm = dc_grads(gy, ins, att)
    for a in (gx, gw, goff, gb, gm):
        assert np.isfinite(a).all()
    assert not goff[0, 0:2, 0, 0].any() and gm[0, 0, 0, 0] == 0
    assert not goff[0, 2:4, 1, 2].any() and gm[0, 1, 1, 2] == 0


def test_affine_warp_nonfinite_and_huge_theta():
    """A NaN in theta makes every position of its image non-finite: that theta's gradient
    NaN, nothing added to its grad_x; the other image untouched. A huge shift moves the
    image outside: zero gradients."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 2, 4, 5))
    theta = smooth_theta(rng, 2, x.shape, x.shape, False)
    gy = rng.standard_normal(x.shape)
    gx_ref, gt_ref = numba_ops.affine_warp_backward(gy, x, theta)
    for bad in (np.nan, np.inf):
        t = theta.copy()
        t[0, 0, 0] = bad
        gx, gt = numba_ops.affine_warp_backward(gy, x, t)
        assert np.isnan(gt[0]).all()
        assert np.isfinite(gx).all() and not gx[0].any()
        np.testing.assert_array_equal(gx[1], gx_ref[1])
        np.testing.assert_array_equal(gt[1], gt_ref[1])
    t = theta.copy()
    t[0, 0, 2] = 1e30
    for mode in MODES:
        gx, gt = numba_ops.affine_warp_backward(gy, x, t, mode=mode)
        assert not gt[0].any() and not gx[0].any()
        np.testing.assert_array_equal(gt[1], numba_ops.affine_warp_backward(gy, x, theta, mode=mode)[1][1])


# --- determinism across thread counts ----------------------------------------------------------

def _rand(seed, shape, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _parallel_cases():
    """Calls big enough for the parallel path (several units of positions per image)."""
    f32 = np.float32
    x = _rand(1, (1, 2, 64, 64), f32)
    grid = np.random.default_rng(2).uniform(-1.1, 1.1, (1, 96, 96, 2)).astype(f32)  # 9216 positions
    gy = _rand(3, (1, 2, 96, 96), f32)
    theta = np.array([[[0.9, 0.3, 0.05], [-0.25, 1.1, -0.1]]], f32)
    ins, att = dc_case(np.random.default_rng(4), N=1, C=8, D=(32, 32), oC=8, k=(3, 3), pads=[1, 1, 1, 1],
                       group=2, og=2)
    ins = cast(ins, f32)
    gyd = _rand(5, (1, 8, 32, 32), f32)
    x3 = _rand(6, (1, 2, 12, 12, 12))
    grid3 = np.random.default_rng(7).uniform(-1.1, 1.1, (1, 20, 20, 20, 3))
    gy3 = _rand(8, (1, 2, 20, 20, 20))
    gg2, gg3 = _rand(9, (1, 192, 192, 2)), _rand(10, (2, 32, 32, 32, 3))
    xc = _rand(11, (1, 32, 32, 32), f32)  # 32 channels: blocks of them are units of their own
    gyc = _rand(12, (1, 32, 48, 48), f32)
    return {
        "grid_sample-linear-zeros": lambda: gs_grads(gy, x, grid),
        "grid_sample-channel-blocks": lambda: gs_grads(gyc, xc, grid[:, :48, :48]),
        "affine_warp-channel-blocks": lambda: numba_ops.affine_warp_backward(gyc, xc, theta, (1, 32, 48, 48)),
        "grid_sample-cubic-reflection": lambda: gs_grads(gy, x, grid, mode="cubic", padding_mode="reflection"),
        "grid_sample-3d-float64": lambda: gs_grads(gy3, x3, grid3, padding_mode="reflection", align_corners=1),
        "affine_warp": lambda: numba_ops.affine_warp_backward(gy, x, theta, (1, 2, 96, 96)),
        "affine_grid-2d": lambda: (numba_ops.affine_grid_backward(gg2, (1, 1, 192, 192)),),
        "affine_grid-3d": lambda: (numba_ops.affine_grid_backward(gg3, (2, 1, 32, 32, 32), True),),
        "deform_conv": lambda: dc_grads(gyd, ins, att),
    }


#: the cases of other modes and ranks that the full pass adds (each compiles kernels of its own)
_PARALLEL_FULL = {"grid_sample-cubic-reflection", "grid_sample-3d-float64"}


class _CountingLock:
    """The CPU pool's lock, counting the parallel launches that take it."""

    def __init__(self, lock):
        self.lock, self.entered = lock, 0

    def __enter__(self):
        self.entered += 1
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.full) if n in _PARALLEL_FULL else n
                                  for n in _parallel_cases()])
def test_deterministic_across_thread_counts(name, monkeypatch):
    """Bit-identical gradients at 1 thread (serial) and at 2 (the parallel path), and on
    repeated calls."""
    import numba
    from numba_ops.kernels.cpu import _runtime
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has a single thread here")
    fn = _parallel_cases()[name]
    lock = _CountingLock(_runtime.POOL_LOCK)
    monkeypatch.setattr(_runtime, "POOL_LOCK", lock)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = fn()
        assert lock.entered == 0
        numba.set_num_threads(2)
        two = fn()
        assert lock.entered > 0, "no parallel launch at 2 threads"
        again = fn()
    finally:
        numba.set_num_threads(before)
    for a, b, c in zip(one, two, again):
        assert a is not None
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(b, c)


#: the thread counts the subprocesses run at (more threads than this VM's cores too)
_THREAD_COUNTS = (1, 2, 3, 5, 8)
_HERE = os.path.dirname(os.path.abspath(__file__))

_THREADS_CHILD = textwrap.dedent("""
    import hashlib, json, sys
    import numba
    import numpy as np
    from numba_ops.kernels.cpu import _runtime
    import test_backward as tb
    n = int(sys.argv[1])
    assert numba.config.NUMBA_NUM_THREADS == n == _runtime.num_threads(), (n, _runtime.num_threads())
    lock = tb._CountingLock(_runtime.POOL_LOCK)
    _runtime.POOL_LOCK = lock
    cases = tb._parallel_cases()
    out = {}
    for name in sys.argv[2:]:
        h = hashlib.sha256()
        for g in cases[name]():
            h.update(f"{g.dtype.str}{g.shape}".encode())
            h.update(np.ascontiguousarray(g).tobytes())
        out[name] = h.hexdigest()
    print(json.dumps({"hashes": out, "parallel_launches": lock.entered}))
""")


@pytest.mark.full  # five fresh processes: ~20 s (the default run: 1 and 2 threads in-process, above)
def test_bit_identical_across_numba_num_threads():
    """Every backward of ``_parallel_cases`` (grid_sample_backward in three modes and
    ranks, affine_warp_backward, affine_grid_backward, deform_conv_backward) in fresh
    processes at NUMBA_NUM_THREADS = 1, 2, 3, 5 and 8 (each pool of its size, the work
    dealt into 4 pieces per thread): the same bits at every count, on the parallel
    path at every count above 1."""
    names = list(_parallel_cases())
    results = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_HERE, os.environ.get("PYTHONPATH", "")]))
    for n in _THREAD_COUNTS:
        env["NUMBA_NUM_THREADS"] = str(n)
        proc = subprocess.run([sys.executable, "-c", _THREADS_CHILD, str(n), *names], capture_output=True,
                              text=True, env=env, cwd=_HERE, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert (got["parallel_launches"] > 0) == (n > 1), (n, got)
        results[n] = got["hashes"]
    for n in _THREAD_COUNTS[1:]:
        assert results[n] == results[1], f"NUMBA_NUM_THREADS={n} differs from 1"


def test_grid_sample_backward_units():
    """The CPU backward's units (what a pool shares out): channel blocks make them grow
    with the channels whatever the batch, and where images and blocks leave threads
    idle, tiles of grad_x (each unit owns its tile: no copies) make at least 8 units a
    thread on 64 threads, a one-channel volume included; each block's share of the
    grid gradient is summed in block order (equal to one block's within float64
    rounding)."""
    from numba_ops.kernels.cpu import grid_sample_backward as k
    for N, C, spatial, nth, want in [(1, 64, (256, 256), 64, 512), (1, 1, (128,) * 3, 64, 512),
                                     (4, 64, (128, 128), 2, 16), (32, 3, (256, 256), 2, 32),
                                     (1, 1, (128,) * 3, 2, 2), (1, 1, (128,) * 3, 16, 32), (2, 2, (160, 160), 2, 2), (1, 1, (300,), 64, 1)]:
        B, K1, K2 = k.plan_units(N, C, int(np.prod(spatial)), spatial, nth)
        assert N * B * K1 * K2 == want, (N, C, spatial, nth, B, K1, K2)
        assert C // B >= min(C, k.MIN_BLOCK)
        B, K, _ = k.plan_units(N, C, int(np.prod(spatial)), spatial, nth, want_x=False)  # parts of positions
        assert N * B * K >= min(want, nth), (N, C, spatial, nth, B, K)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 12, 7, 9))
    grid = rng.uniform(-1.1, 1.1, (2, 5, 6, 2))
    gy = rng.standard_normal((2, 12, 5, 6))
    theta = np.array([[[0.9, 0.3, 0.05], [-0.25, 1.1, -0.1]]] * 2)
    for mode, padding in (("linear", "zeros"), ("cubic", "border"), ("nearest", "reflection")):
        attrs = dict(mode=mode, padding_mode=padding)
        old = k.MIN_BLOCK
        try:
            k.MIN_BLOCK = 4  # three blocks
            assert k.plan_units(2, 12, 30, (7, 9), 1)[0] == 3
            blocks = gs_grads(gy, x, grid, **attrs), numba_ops.affine_warp_backward(gy, x, theta, (2, 12, 5, 6),
                                                                                    **attrs)
            k.MIN_BLOCK = 1000  # one block
            one = gs_grads(gy, x, grid, **attrs), numba_ops.affine_warp_backward(gy, x, theta, (2, 12, 5, 6),
                                                                                 **attrs)
        finally:
            k.MIN_BLOCK = old
        for a, b in zip(blocks, one):
            np.testing.assert_array_equal(a[0], b[0])  # grad_x: each channel's own
            np.testing.assert_allclose(a[1], b[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("mode,padding", [("linear", "zeros"), ("linear", "border"), ("nearest", "reflection"),
                                          param(False, "nearest", "border"), param(False, "cubic", "reflection"),
                                          param(False, "cubic", "zeros")])
def test_grid_sample_backward_tiles(rank, mode, padding, monkeypatch):
    """grad_x cut into tiles, each unit scattering only into its own (the positions
    whose taps reach several tiles in each of them), gives the bits of one tile: the
    gradients do not depend on the thread count that chooses the tiles. Positions
    inside, outside, on tile edges and non-finite; grid_sample and affine_warp."""
    from numba_ops.kernels.cpu import grid_sample_backward as k
    rng = np.random.default_rng(rank)
    spatial = (9, 8, 7)[3 - rank:]
    x = rng.standard_normal((1, 2) + spatial).astype(np.float32)
    out = (5, 6, 4)[3 - rank:]
    grid = rng.uniform(-1.3, 1.3, (1,) + out + (rank,)).astype(np.float32)
    grid.reshape(-1, rank)[:3] = [np.nan, np.inf, -np.inf][:rank] if rank == 3 else [[np.nan, 0.1], [np.inf, 0],
                                                                                     [0.2, -np.inf]]
    gy = rng.standard_normal((1, 2) + out).astype(np.float32)
    theta = np.eye(rank, rank + 1, dtype=np.float32)[None] * 1.1 + rng.normal(0, 0.2, (1, rank, rank + 1)).astype(
        np.float32)
    calls = {"grid": lambda: numba_ops.grid_sample_backward(gy, x, grid, mode=mode, padding_mode=padding),
             "affine": lambda: numba_ops.affine_warp_backward(gy, x, theta, gy.shape, mode=mode,
                                                              padding_mode=padding)}
    for name, call in calls.items():
        one = call()
        for K in [(2, 1), (3, 2), (spatial[0] // 2, 3)]:
            K = K if rank == 3 else (K[0], 1)
            monkeypatch.setattr(k, "tiles", lambda *a, K=K: K)
            for a, b in zip(one, call()):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} tiles {K}")
            monkeypatch.undo()


# --- dtypes -------------------------------------------------------------------------------

F32 = 1e-4  # float32 against the float64 gradient of the same (float32) inputs


def _up(*arrays, dtype=np.float64):
    return [None if a is None else a.astype(dtype) for a in arrays]


@pytest.mark.parametrize(*sampler_matrix([1, 2, 3], default=F32_DEFAULT, aligns=()))
def test_grid_sample_float32_accuracy(r, mode, padding):
    """Within 1e-4 relative plus 1e-4 x scale of the float64 gradient of the same inputs."""
    rng = np.random.default_rng(17)
    for align in (0, 1):
        xs, outs = GS_SHAPES[r][0]
        x = rng.standard_normal(xs).astype(np.float32)
        grid = smooth_grid(rng, xs[0], outs, xs[2:], align).astype(np.float32)
        gy = rng.standard_normal(xs[:2] + outs).astype(np.float32)
        attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
        got = gs_grads(gy, x, grid, **attrs)
        want = gs_grads(*_up(gy, x, grid), **attrs)
        for g, w in zip(got, want):
            assert g.dtype == np.float32
            assert_close(g, w, F32)


@pytest.mark.parametrize(*sampler_matrix([2, 3], default=F32_DEFAULT, aligns=()))
def test_affine_warp_and_grid_float32_accuracy(r, mode, padding):
    rng = np.random.default_rng(18)
    for align in (0, 1):
        xs = (2, 2, 4, 5) if r == 2 else (1, 2, 3, 4, 3)
        size = (xs[0], xs[1]) + ((3, 6) if r == 2 else (2, 3, 4))
        x = rng.standard_normal(xs).astype(np.float32)
        theta = smooth_theta(rng, xs[0], xs, size, align).astype(np.float32)
        gy = rng.standard_normal(size).astype(np.float32)
        attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
        got = numba_ops.affine_warp_backward(gy, x, theta, size, **attrs)
        want = numba_ops.affine_warp_backward(*_up(gy, x, theta), size, **attrs)
        for g, w in zip(got, want):
            assert g.dtype == np.float32
            assert_close(g, w, F32)
        gg = rng.standard_normal((size[0],) + size[2:] + (r,)).astype(np.float32)
        got = numba_ops.affine_grid_backward(gg, size, align)
        assert got.dtype == np.float32
        assert_close(got, numba_ops.affine_grid_backward(gg.astype(np.float64), size, align), F32)


def _dc_params(dtypes):
    return [param(deform_default(len(c["D"]), d), i, d, id=f"{i}-{len(c['D'])}d-{np.dtype(d).name}")
            for i, c in enumerate(DC_CASES) for d in dtypes]


@pytest.mark.parametrize("i,dtype", _dc_params([np.float32]))
def test_deform_conv_float32_accuracy(i, dtype):
    rng = np.random.default_rng(500 + i)
    ins, att = dc_case(rng, **DC_CASES[i])
    ins = cast(ins, dtype)
    gy = rng.standard_normal(dc_forward(ins, att).shape).astype(dtype)
    got = dc_grads(gy, ins, att)
    want = dc_grads(gy.astype(np.float64), cast(ins, np.float64), att)
    for name, g, w in zip(DC_NAMES, got, want):
        if w is None:
            assert g is None
        else:
            assert g.dtype == np.float32, name
            assert_close(g, w, F32)


SIXTEEN = [np.float16, BF16]


@pytest.mark.parametrize(*sampler_matrix([1, 2, 3], default=F32_DEFAULT, aligns=(), dtype=SIXTEEN))
def test_grid_sample_16bit_is_float32_rounded_once(r, mode, padding, dtype):
    """The 16-bit gradients are the float32 computation on the upcast inputs, rounded
    once (within 1 ulp)."""
    rng = np.random.default_rng(19)
    xs, outs = GS_SHAPES[r][0]
    x, grid, gy = (a.astype(dtype) for a in (rng.standard_normal(xs), rng.uniform(-1.2, 1.2, (xs[0],) + outs + (r,)),
                                             rng.standard_normal(xs[:2] + outs)))
    for align in (0, 1):
        attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
        for g, w in zip(gs_grads(gy, x, grid, **attrs), gs_grads(*_up(gy, x, grid, dtype=np.float32), **attrs)):
            assert_rounded_once(g, w, dtype)


@pytest.mark.parametrize(*sampler_matrix([2, 3], default=F32_DEFAULT, aligns=(), dtype=SIXTEEN))
def test_affine_warp_and_grid_16bit_is_float32_rounded_once(r, mode, padding, dtype):
    rng = np.random.default_rng(20)
    f32 = np.float32
    xs = (2, 2, 4, 5) if r == 2 else (1, 2, 3, 4, 3)
    size = (xs[0], xs[1]) + ((3, 6) if r == 2 else (2, 3, 4))
    x, gy = rng.standard_normal(xs).astype(dtype), rng.standard_normal(size).astype(dtype)
    for align in (0, 1):
        theta = smooth_theta(rng, xs[0], xs, size, align).astype(dtype)
        attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
        for g, w in zip(numba_ops.affine_warp_backward(gy, x, theta, size, **attrs),
                        numba_ops.affine_warp_backward(*_up(gy, x, theta, dtype=f32), size, **attrs)):
            assert_rounded_once(g, w, dtype)
        gg = rng.standard_normal((size[0],) + size[2:] + (r,)).astype(dtype)
        assert_rounded_once(numba_ops.affine_grid_backward(gg, size, align),
                            numba_ops.affine_grid_backward(gg.astype(f32), size, align), dtype)


@pytest.mark.parametrize("i,dtype", _dc_params(SIXTEEN))
def test_deform_conv_16bit_is_float32_rounded_once(i, dtype):
    rng = np.random.default_rng(600 + i)
    ins, att = dc_case(rng, **DC_CASES[i])
    ins = cast(ins, dtype)
    gy = rng.standard_normal(dc_forward(ins, att).shape).astype(dtype)
    got = dc_grads(gy, ins, att)
    want = dc_grads(gy.astype(np.float32), cast(ins, np.float32), att)
    for name, g, w in zip(DC_NAMES, got, want):
        if w is None:
            assert g is None
        else:
            assert_rounded_once(g, w, dtype)


# --- layouts, untouched inputs, empty inputs --------------------------------------------------

def _layout_calls():
    """(name, inputs, call) of each op, float64 and float16."""
    rng = np.random.default_rng(20)
    calls = []
    for dt in (np.float64, np.float16):
        x = rng.standard_normal((2, 2, 4, 5)).astype(dt)
        grid = rng.uniform(-1.2, 1.2, (2, 3, 4, 2)).astype(dt)
        gy = rng.standard_normal((2, 2, 3, 4)).astype(dt)
        calls.append((f"grid_sample-{np.dtype(dt).name}", [gy, x, grid],
                      lambda gy, x, grid: gs_grads(gy, x, grid, mode="cubic", padding_mode="reflection")))
        theta = np.array([[[0.9, 0.3, 0.05], [-0.25, 1.1, -0.1]], [[1.1, -0.2, 0.1], [0.3, 0.8, 0.2]]], dt)
        calls.append((f"affine_warp-{np.dtype(dt).name}", [gy, x, theta],
                      lambda gy, x, theta: numba_ops.affine_warp_backward(gy, x, theta, (2, 2, 3, 4))))
        calls.append((f"affine_grid-{np.dtype(dt).name}", [rng.standard_normal((2, 3, 4, 2)).astype(dt)],
                      lambda gg: (numba_ops.affine_grid_backward(gg, (2, 1, 3, 4)),)))
        ins, att = dc_case(rng, N=2, C=4, D=(4, 5), oC=2, k=(2, 2), pads=[1, 0, 0, 1], og=2, group=2)
        ins = cast(ins, dt)
        gyd = rng.standard_normal(dc_forward(ins, att).shape).astype(dt)
        calls.append((f"deform_conv-{np.dtype(dt).name}", [gyd] + [ins[k] for k in DC_NAMES],
                      lambda gy, *a, att=att: numba_ops.deform_conv_backward(gy, *a, **att)))
    return calls


@pytest.mark.parametrize("name,inputs,call", _layout_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_layouts_and_inputs_untouched(name, inputs, call):
    """Fortran order, strided views, negative strides and read-only inputs (grad_y too)
    give the bits of the contiguous call; no input is modified."""
    want = call(*inputs)
    kept = [a.copy() for a in inputs]
    for layout in ("fortran", "strided", "negative", "readonly"):
        args = [layouts(a)[layout] for a in inputs]
        for i, (g, w) in enumerate(zip(call(*args), want)):
            if name.startswith("deform_conv") and i == 3:
                # grad_b is NumPy's sum of grad_y, whose order follows grad_y's layout: to the ulp
                np.testing.assert_allclose(g, w, rtol=4 * np.finfo(w.dtype).eps, atol=0, err_msg=f"{name} {layout}")
            else:
                np.testing.assert_array_equal(g, w, err_msg=f"{name} {layout}")
        for a, k in zip(args, kept):
            np.testing.assert_array_equal(a, k)
    for a, k in zip(inputs, kept):
        np.testing.assert_array_equal(a, k)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
def test_gradients_hold_no_larger_buffer(dtype):
    """Each returned gradient owns its memory or is a view of a buffer of its own size:
    never of a larger working buffer, which it would keep alive (grid_sample's and
    affine_warp's grad_x with one image, cut into tiles on several threads)."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((1, 2, 64, 64)).astype(dtype)
    grid = rng.uniform(-1.1, 1.1, (1, 128, 128, 2)).astype(dtype)  # 16384 positions: 4 units
    gy = rng.standard_normal((1, 2, 128, 128)).astype(dtype)
    theta = np.array([[[0.9, 0.3, 0.05], [-0.25, 1.1, -0.1]]], dtype)
    ins, att = dc_case(rng, N=1, C=4, D=(16, 16), oC=4, k=(3, 3), pads=[1] * 4)
    ins = cast(ins, dtype)
    grads = {"grid_sample": numba_ops.grid_sample_backward(gy, x, grid),
             "affine_warp": numba_ops.affine_warp_backward(gy, x, theta, gy.shape),
             "affine_grid": (numba_ops.affine_grid_backward(grid, (1, 1, 128, 128)),),
             "deform_conv": dc_grads(rng.standard_normal((1, 4, 16, 16)).astype(dtype), ins, att)}
    for name, gs in grads.items():
        for i, g in enumerate(gs):
            assert isinstance(g, np.ndarray), (name, i)
            assert g.base is None or g.base.nbytes <= g.nbytes, (name, i, g.nbytes, g.base.nbytes)


def test_empty_inputs():
    """N = 0, empty outputs and no channels: gradients of the right shapes, zero."""
    def check(grads, shapes):
        assert len(grads) == len(shapes)
        for g, s in zip(grads, shapes):
            assert g.shape == s and g.dtype == np.float32 and not g.any()

    f32 = np.float32
    z = lambda *s: np.zeros(s, f32)  # noqa: E731
    # grid_sample: no images; no output positions; no channels
    check(gs_grads(z(0, 2, 3, 4), z(0, 2, 3, 4), z(0, 3, 4, 2)), [(0, 2, 3, 4), (0, 3, 4, 2)])
    check(gs_grads(z(1, 2, 0, 4), np.ones((1, 2, 3, 4), f32), z(1, 0, 4, 2)), [(1, 2, 3, 4), (1, 0, 4, 2)])
    check(gs_grads(z(1, 0, 2, 2), z(1, 0, 3, 4), np.full((1, 2, 2, 2), 0.3, f32)),
          [(1, 0, 3, 4), (1, 2, 2, 2)])
    # affine_warp
    check(numba_ops.affine_warp_backward(z(0, 2, 3, 4), z(0, 2, 3, 4), z(0, 2, 3)), [(0, 2, 3, 4), (0, 2, 3)])
    check(numba_ops.affine_warp_backward(z(1, 2, 0, 5), np.ones((1, 2, 3, 4), f32), np.ones((1, 2, 3), f32),
                                         (1, 2, 0, 5)), [(1, 2, 3, 4), (1, 2, 3)])
    check(numba_ops.affine_warp_backward(z(1, 2, 2, 3, 0), np.ones((1, 2, 3, 4, 2), f32),
                                         np.ones((1, 3, 4), f32), (1, 2, 2, 3, 0)), [(1, 2, 3, 4, 2), (1, 3, 4)])
    # affine_grid
    check([numba_ops.affine_grid_backward(z(0, 3, 4, 2), (0, 1, 3, 4))], [(0, 2, 3)])
    check([numba_ops.affine_grid_backward(z(2, 0, 4, 2), (2, 1, 0, 4))], [(2, 2, 3)])
    check([numba_ops.affine_grid_backward(z(1, 2, 0, 4, 3), (1, 3, 2, 0, 4), True)], [(1, 3, 4)])
    # deform_conv: no images
    got = numba_ops.deform_conv_backward(z(0, 2, 3, 3), z(0, 2, 4, 4), np.ones((2, 2, 2, 2), f32),
                                         z(0, 8, 3, 3), z(2), z(0, 4, 3, 3))
    check(got, [(0, 2, 4, 4), (2, 2, 2, 2), (0, 8, 3, 3), (2,), (0, 4, 3, 3)])


def test_deform_conv_no_input_channels():
    """C = 0: y is the bias alone; only grad_b is not zero."""
    gy = np.random.default_rng(21).standard_normal((1, 2, 3, 3)).astype(np.float32)
    gx, gw, goff, gb, gm = numba_ops.deform_conv_backward(
        gy, np.zeros((1, 0, 4, 4), np.float32), np.zeros((2, 0, 2, 2), np.float32),
        np.full((1, 8, 3, 3), 0.25, np.float32), np.ones(2, np.float32), np.ones((1, 4, 3, 3), np.float32))
    assert gx.shape == (1, 0, 4, 4) and gw.shape == (2, 0, 2, 2)
    assert goff.shape == (1, 8, 3, 3) and not goff.any() and gm.shape == (1, 4, 3, 3) and not gm.any()
    np.testing.assert_allclose(gb, gy.astype(np.float64).sum(axis=(0, 2, 3)), rtol=1e-6)

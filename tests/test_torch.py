"""numba_ops.torch: the ops as PyTorch operators (custom ops, autograd, fake
implementations, torch.compile, ONNX export) and the DeformConv modules.

- ``torch.autograd.gradcheck`` in float64 for every op and rank (GridSample: each
  mode and padding; positions at least 0.1 from integers and half-integers, where
  the forward has kinks); the default run takes a covering subset, ``--full`` all;
- ``DeformConv2d`` against ``torchvision.ops.DeformConv2d`` (same parameters and
  inputs: outputs and every gradient within float32 accuracy), the modules'
  initialisation, a 3-D layer that trains;
- ``torch.library.opcheck`` (schema, fake tensors, autograd registration, AOT
  dispatch with dynamic shapes), meta tensors, ``torch.compile(fullgraph=True)``;
- ``torch.onnx.export(dynamo=True)`` with ``onnx_translations()``, run in
  ``numba_ops.onnx.session``;
- 16-bit dtypes, layouts, errors, vmap's refusal; CUDA tensors where torch has a GPU.
"""
import contextlib
import doctest
import io
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_ops  # noqa: E402
import numba_ops.torch as nt  # noqa: E402
from helpers import BF16, FULL, MODES, PADS, param  # noqa: E402

F64 = torch.float64
TORCH_MODE = {"linear": "bilinear", "nearest": "nearest", "cubic": "bicubic"}


# --- inputs away from the forward's kinks ----------------------------------------------

def fractions(rng, shape):
    """Fractions in [0.1, 0.4] or [0.6, 0.9]: at least 0.1 from every integer and half-integer."""
    f = rng.uniform(0.1, 0.4, shape)
    return np.where(rng.random(shape) < 0.5, 1.0 - f, f)


def normalise(pos, size, align):
    """The grid coordinate of the unnormalised position ``pos`` on an axis of ``size``."""
    return 2.0 * pos / (size - 1) - 1.0 if align else (2.0 * pos + 1.0) / size - 1.0


def knot_free_grid(rng, n, outs, sizes, align, spill=1):
    """A float64 grid (n, *outs, r) whose unnormalised positions are fractional (see
    ``fractions``), from ``spill`` elements before the input to ``spill`` after it."""
    r = len(sizes)
    grid = np.empty((n,) + tuple(outs) + (r,))
    for k in range(r):
        size = sizes[r - 1 - k]  # the grid lists x (innermost) first
        pos = rng.integers(-spill, size + spill - 1, (n,) + tuple(outs)) + fractions(rng, (n,) + tuple(outs))
        grid[..., k] = normalise(pos, size, align) if size > 1 else 0.0
    return grid


def t64(a, grad=True):
    return torch.tensor(a, dtype=F64, requires_grad=grad)


# --- gradcheck: grid_sample -------------------------------------------------------------

#: (rank, mode, padding) the default run checks: every 2-D mode and padding once, each
#: mode in 1-D and 3-D once
GS_DEFAULT = {(2, "linear", "zeros"), (2, "cubic", "reflection"), (1, "nearest", "border"), (3, "linear", "zeros")}


def _gs_params():
    params = []
    for r in (1, 2, 3):
        for mode in MODES:
            for padding in PADS:
                for align in (False, True):
                    keep = (r, mode, padding) in GS_DEFAULT and align == ((r + len(mode)) % 2 == 1)
                    params.append(param(keep, r, mode, padding, align, id=f"{r}d-{mode}-{padding}-a{int(align)}"))
    return params


GS_SHAPES = {1: ((2, 2, 5), (3,)), 2: ((2, 2, 4, 5), (3, 2)), 3: ((1, 2, 3, 4, 3), (2, 2, 2))}


@pytest.mark.parametrize("r,mode,padding,align", _gs_params())
def test_grid_sample_gradcheck(r, mode, padding, align):
    """float64 gradcheck wrt x and grid; "nearest": wrt x, and the grid's gradient is 0."""
    rng = np.random.default_rng(11 * r + len(mode) + len(padding) + align)
    xs, outs = GS_SHAPES[r]
    x = t64(rng.standard_normal(xs))
    grid = t64(knot_free_grid(rng, xs[0], outs, xs[2:], align))
    attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
    if mode == "nearest":
        assert torch.autograd.gradcheck(lambda a: nt.grid_sample(a, grid.detach(), **attrs), (x,))
        y = nt.grid_sample(x, grid, **attrs)
        (gg,) = torch.autograd.grad(y, grid, torch.randn_like(y))
        assert torch.equal(gg, torch.zeros_like(gg))
    else:
        assert torch.autograd.gradcheck(lambda a, g: nt.grid_sample(a, g, **attrs), (x, grid))


@pytest.mark.parametrize("r,mode,padding", [param((r, m, p) in {(2, "linear", "zeros"), (3, "linear", "zeros")},
                                                  r, m, p, id=f"{r}d-{m}-{p}")
                                            for r in (2, 3) for m in MODES for p in PADS if (r, m) != (3, "cubic")])
def test_grid_sample_vs_torch(r, mode, padding):
    """2-D and 3-D forward and gradients against torch.nn.functional.grid_sample (float64,
    knot-free positions inside the input, where both implementations agree; torch has no
    3-D bicubic)."""
    rng = np.random.default_rng(3 * r + len(mode))
    xs, outs = GS_SHAPES[r]
    x, grid = t64(rng.standard_normal(xs)), t64(knot_free_grid(rng, xs[0], outs, xs[2:], False, spill=0))
    xr, gr = x.detach().clone().requires_grad_(), grid.detach().clone().requires_grad_()
    y = nt.grid_sample(x, grid, mode=mode, padding_mode=padding)
    yr = torch.nn.functional.grid_sample(xr, gr, mode=TORCH_MODE[mode], padding_mode=padding, align_corners=False)
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    gy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, (x, grid), gy), torch.autograd.grad(yr, (xr, gr), gy),
                               rtol=1e-10, atol=1e-10)


# --- gradcheck: affine_grid, affine_warp ------------------------------------------------

def random_theta(rng, n, r, scale=0.15):
    return np.eye(r, r + 1)[None] * 0.9 + scale * rng.standard_normal((n, r, r + 1))


@pytest.mark.parametrize("size", [(2, 1, 3, 4), (1, 3, 2, 3, 4)], ids=["2d", "3d"])
@pytest.mark.parametrize("align", [False, True])
def test_affine_grid_gradcheck(size, align):
    rng = np.random.default_rng(len(size) + align)
    r = len(size) - 2
    theta = t64(random_theta(rng, size[0], r))
    assert torch.autograd.gradcheck(lambda t: nt.affine_grid(t, size, align_corners=align), (theta,))
    ref = torch.nn.functional.affine_grid(theta.detach(), size, align_corners=align)
    torch.testing.assert_close(nt.affine_grid(theta.detach(), size, align_corners=align), ref)


AW_DEFAULT = {(2, "linear", "zeros"), (2, "cubic", "reflection"), (3, "linear", "zeros")}


@pytest.mark.parametrize("r,mode,padding", [param((r, m, p) in AW_DEFAULT, r, m, p, id=f"{r}d-{m}-{p}")
                                            for r in (2, 3) for m in MODES for p in PADS])
@pytest.mark.parametrize("align", [False, True])
def test_affine_warp_gradcheck(r, mode, padding, align):
    """gradcheck wrt x and theta (nearest: x), a size other than x's."""
    rng = np.random.default_rng(5 * r + len(mode) + align)
    xs = (2, 2, 4, 5) if r == 2 else (1, 2, 3, 4, 3)
    size = xs[:2] + ((3, 4) if r == 2 else (2, 3, 2))
    x, theta = t64(rng.standard_normal(xs)), t64(random_theta(rng, xs[0], r))
    attrs = dict(mode=mode, padding_mode=padding, align_corners=align)
    if mode == "nearest":
        assert torch.autograd.gradcheck(lambda a: nt.affine_warp(a, theta.detach(), size, **attrs), (x,))
    else:
        assert torch.autograd.gradcheck(lambda a, t: nt.affine_warp(a, t, size, **attrs), (x, theta))
    # the two-step result
    y2 = nt.grid_sample(x.detach(), nt.affine_grid(theta.detach(), size, align_corners=align), **attrs)
    torch.testing.assert_close(nt.affine_warp(x.detach(), theta.detach(), size, **attrs), y2)


# --- gradcheck: deform_conv -------------------------------------------------------------

DC_CASES = [
    pytest.param(dict(C=2, D=(6,), oC=2, k=(3,), pads=[1, 2], strides=[2]), id="1d"),
    pytest.param(dict(C=2, D=(4, 5), oC=2, k=(2, 2)), id="2d"),
    pytest.param(dict(C=4, D=(5, 5), oC=4, k=(3, 2), pads=[1, 0, 1, 1], strides=[2, 1], dil=[1, 2], group=2, og=2),
                 id="2d-groups"),
    pytest.param(dict(C=2, D=(3, 4, 3), oC=2, k=(2, 2, 2), pads=[1, 0, 0, 0, 1, 1]), id="3d"),
    pytest.param(dict(C=4, D=(4, 3, 4), oC=2, k=(2, 1, 2), strides=[2, 1, 1], dil=[1, 1, 2], group=2, og=2,
                      mask=False, bias=False), id="3d-groups", marks=FULL),
]


def out_sizes(D, k, pads, strides, dil):
    nd = len(D)
    return tuple((D[i] + pads[i] + pads[nd + i] - ((k[i] - 1) * dil[i] + 1)) // strides[i] + 1 for i in range(nd))


def dc_inputs(rng, N=1, C=2, D=(4, 5), oC=2, k=(2, 2), pads=None, strides=None, dil=None, group=1, og=1,
              bias=True, mask=True):
    nd = len(D)
    att = dict(kernel_shape=list(k), pads=list(pads or [0] * 2 * nd), strides=list(strides or [1] * nd),
               dilations=list(dil or [1] * nd), group=group, offset_group=og)
    outs = out_sizes(D, k, att["pads"], att["strides"], att["dilations"])
    K = int(np.prod(k))
    oshape = (N, og * K * nd) + outs
    ins = dict(x=rng.standard_normal((N, C) + tuple(D)), w=rng.standard_normal((oC, C // group) + tuple(k)),
               offset=rng.integers(-2, 2, oshape) + fractions(rng, oshape),
               b=rng.standard_normal(oC) if bias else None,
               mask=rng.uniform(-0.5, 1.5, (N, og * K) + outs) if mask else None)
    return ins, att


@pytest.mark.parametrize("case", DC_CASES)
def test_deform_conv_gradcheck(case):
    rng = np.random.default_rng(len(str(case)))
    ins, att = dc_inputs(rng, **case)
    names = [n for n in ("x", "w", "offset", "b", "mask") if ins[n] is not None]
    tensors = tuple(t64(ins[n]) for n in names)

    def f(*ts):
        kw = dict(zip(names, ts))
        return nt.deform_conv(kw["x"], kw["w"], kw["offset"], kw.get("b"), kw.get("mask"), **att)

    assert torch.autograd.gradcheck(f, tensors)
    y = f(*(t.detach() for t in tensors))
    want = numba_ops.deform_conv(ins["x"], ins["w"], ins["offset"], ins["b"], ins["mask"], **att)
    np.testing.assert_array_equal(y.numpy(), want)


def test_deform_conv_needs_input_grad():
    """Only the inputs that require grad get one (the others are not computed: wrt)."""
    rng = np.random.default_rng(0)
    ins, att = dc_inputs(rng)
    x, w, off = t64(ins["x"], False), t64(ins["w"]), t64(ins["offset"], False)
    y = nt.deform_conv(x, w, off, **att)
    y.sum().backward()
    assert x.grad is None and off.grad is None
    want = numba_ops.deform_conv_backward(np.ones(y.shape), ins["x"], ins["w"], ins["offset"], **att)[1]
    np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-12)
    assert w.grad.is_contiguous()


# --- DeformConv modules ----------------------------------------------------------------

TV_CASES = [
    pytest.param(dict(cin=4, cout=6, k=3, stride=1, padding=1, dilation=1, groups=2, og=2, mask=True), id="groups"),
    pytest.param(dict(cin=3, cout=4, k=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=1, og=3,
                      mask=False, bias=False), id="strided-nomask-nobias"),
    pytest.param(dict(cin=2, cout=2, k=1, stride=1, padding=0, dilation=1, groups=1, og=1, mask=True), id="1x1"),
]


@pytest.mark.parametrize("case", TV_CASES)
def test_deform_conv2d_vs_torchvision(case):
    """The same parameters, inputs and gradient of the output: float32 outputs and every
    gradient within float32 accuracy of torchvision's."""
    tvo = pytest.importorskip("torchvision.ops")
    c = dict(case)
    bias = c.pop("bias", True)
    torch.manual_seed(0)
    ref = tvo.DeformConv2d(c["cin"], c["cout"], c["k"], stride=c["stride"], padding=c["padding"],
                           dilation=c["dilation"], groups=c["groups"], bias=bias)
    ours = nt.DeformConv2d(c["cin"], c["cout"], c["k"], stride=c["stride"], padding=c["padding"],
                           dilation=c["dilation"], groups=c["groups"], bias=bias)
    ours.load_state_dict(ref.state_dict())
    N, H, W = 2, 7, 6
    x = torch.randn(N, c["cin"], H, W, requires_grad=True)
    kh, kw = ours.kernel_size
    oh, ow = out_sizes((H, W), ours.kernel_size, list(ours.padding) * 2, ours.stride, ours.dilation)
    off = (torch.randn(N, c["og"] * 2 * kh * kw, oh, ow) * 1.5).requires_grad_()
    mask = torch.rand(N, c["og"] * kh * kw, oh, ow, requires_grad=True) if c["mask"] else None
    y_ref, y = ref(x, off, mask), ours(x, off, mask)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    gy = torch.randn_like(y)
    leaves = [x, off] + ([mask] if mask is not None else [])
    g_ref = torch.autograd.grad(y_ref, leaves + list(ref.parameters()), gy)
    g = torch.autograd.grad(y, leaves + list(ours.parameters()), gy)
    for a, b in zip(g, g_ref):
        scale = float(b.abs().max())
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, scale))


def test_modules_init_and_repr():
    """torchvision's initialisation (the same draws: equal parameters from one seed),
    per-axis attributes, a bias-free layer, the constructor's checks."""
    tvo = pytest.importorskip("torchvision.ops")
    torch.manual_seed(3)
    ref = tvo.DeformConv2d(4, 6, 3, padding=1, groups=2)
    torch.manual_seed(3)
    ours = nt.DeformConv2d(4, 6, 3, padding=1, groups=2)
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)
    assert ours.weight.shape == (6, 2, 3, 3)
    layer = nt.DeformConv3d(2, 3, (1, 2, 3), stride=2, padding=(0, 1, 1), dilation=1, bias=False)
    assert layer.weight.shape == (3, 2, 1, 2, 3) and layer.bias is None
    assert layer.stride == (2, 2, 2) and layer.padding == (0, 1, 1)
    assert "bias=False" in repr(layer) and "DeformConv3d" in repr(layer)
    assert nt.DeformConv1d(2, 2, 3).weight.shape == (2, 2, 3)
    with pytest.raises(ValueError, match="groups"):
        nt.DeformConv2d(3, 4, 3, groups=2)
    with pytest.raises(ValueError, match="kernel_size"):
        nt.DeformConv2d(2, 2, (3, 3, 3))


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_modules_forward(nd):
    """Each rank against the function (offset groups inferred from the offset's channels)."""
    torch.manual_seed(nd)
    cls = [nt.DeformConv1d, nt.DeformConv2d, nt.DeformConv3d][nd - 1]
    layer = cls(4, 2, 2, stride=1, padding=1, dilation=1, groups=2)
    D = (4,) * nd
    outs = (5,) * nd
    K = 2 ** nd
    x = torch.randn(1, 4, *D)
    off, mask = torch.randn(1, 2 * K * nd, *outs), torch.rand(1, 2 * K, *outs)  # 2 offset groups
    y = layer(x, off, mask)
    want = numba_ops.deform_conv(x.numpy(), layer.weight.detach().numpy(), off.numpy(), layer.bias.detach().numpy(),
                                 mask.numpy(), pads=[1] * 2 * nd, group=2, offset_group=2)
    np.testing.assert_array_equal(y.detach().numpy(), want)
    with pytest.raises(ValueError, match="offset"):
        layer(x, off[:, :-1])


def test_deform_conv3d_trains():
    """A 3-D DCNv2 layer (offsets and mask predicted by a Conv3d) fitting a shifted
    volume: the loss falls over a few SGD steps."""
    torch.manual_seed(0)
    K = 8

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.om = torch.nn.Conv3d(1, 4 * K, 3, padding=1)
            torch.nn.init.zeros_(self.om.weight)
            torch.nn.init.zeros_(self.om.bias)
            self.dc = nt.DeformConv3d(1, 1, 2, padding=0)

        def forward(self, x):
            om = self.om(x)[:, :, :-1, :-1, :-1]
            return self.dc(x, om[:, :3 * K], torch.sigmoid(om[:, 3 * K:]))

    net = Net()
    x = torch.randn(2, 1, 6, 6, 6)
    target = 0.5 * torch.roll(x, 1, dims=2)[:, :, :5, :5, :5]
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


# --- operators: registration, fake tensors, compile ------------------------------------

def _small_inputs(dtype=F64):
    rng = np.random.default_rng(1)
    x = torch.tensor(rng.standard_normal((1, 2, 4, 5)), dtype=dtype, requires_grad=True)
    g = torch.tensor(knot_free_grid(rng, 1, (3, 2), (4, 5), False), dtype=dtype, requires_grad=True)
    th = torch.tensor(random_theta(rng, 1, 2), dtype=dtype, requires_grad=True)
    ins, att = dc_inputs(rng)
    dc = {k: None if v is None else torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in ins.items()}
    return x, g, th, dc, att


def _opcheck_cases():
    ops = torch.ops.numba_ops
    x, g, th, dc, att = _small_inputs()
    a = [att[k] for k in ("kernel_shape", "strides", "pads", "dilations", "group", "offset_group")]
    return [
        pytest.param(ops.grid_sample.default, (x, g, "cubic", "reflection", True), id="grid_sample"),
        pytest.param(ops.affine_grid.default, (th, [1, 2, 3, 4], False), id="affine_grid"),
        pytest.param(ops.affine_warp.default, (x, th, [1, 2, 3, 3], "linear", "border", False), id="affine_warp"),
        pytest.param(ops.affine_warp.default, (x, th, None, "nearest", "zeros", True), id="affine_warp-nosize",
                     marks=FULL),
        pytest.param(ops.deform_conv.default, (dc["x"], dc["w"], dc["offset"], dc["b"], dc["mask"], *a),
                     id="deform_conv"),
        pytest.param(ops.deform_conv.default, (dc["x"], dc["w"], dc["offset"], None, None, None, None, None, None,
                                               1, 1), id="deform_conv-defaults", marks=FULL),
    ]


@pytest.mark.parametrize("op,args", _opcheck_cases())
def test_opcheck(op, args):
    """torch.library.opcheck: schema, fake implementation, autograd registration and
    AOT dispatch (dynamic shapes) agree with the real kernels."""
    torch.library.opcheck(op, args)


def test_meta_tensors():
    """The fake implementations give the shapes without touching data."""
    m = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    assert nt.grid_sample(m(2, 3, 5, 6, 7), m(2, 1, 2, 4, 3)).shape == (2, 3, 1, 2, 4)
    assert nt.affine_grid(m(2, 3, 4), (2, 1, 3, 4, 5)).shape == (2, 3, 4, 5, 3)
    assert nt.affine_warp(m(2, 3, 5, 6), m(2, 2, 3), (2, 3, 7, 8)).shape == (2, 3, 7, 8)
    assert nt.affine_warp(m(2, 3, 5, 6), m(2, 2, 3)).shape == (2, 3, 5, 6)
    # H: (9 + 1 + 1 - 3) // 2 + 1 = 5; W: (8 + 0 + 1 - 3) // 1 + 1 = 7
    y = nt.deform_conv(m(2, 4, 9, 8), m(6, 2, 3, 2), m(2, 2 * 6 * 2, 5, 7), pads=[1, 0, 1, 1], strides=[2, 1],
                       dilations=[1, 2], group=2, offset_group=2)
    assert y.shape == (2, 6, 5, 7) and y.device.type == "meta"


class _AllOps(torch.nn.Module):
    """A small model that uses each op (and is differentiable through all of them)."""

    def __init__(self, nd=2):
        super().__init__()
        conv = torch.nn.Conv2d if nd == 2 else torch.nn.Conv3d
        self.nd, self.K = nd, 3 ** nd
        self.om = conv(2, self.K * (nd + 1), 3, padding=1)
        torch.nn.init.normal_(self.om.weight, std=0.05)
        self.dc = (nt.DeformConv2d if nd == 2 else nt.DeformConv3d)(2, 3, 3, padding=1)

    def forward(self, x, theta):
        n, nd, K = x.shape[0], self.nd, self.K
        om = self.om(x)
        y = self.dc(x, om[:, :K * nd], torch.sigmoid(om[:, K * nd:]))
        size = (n, 3) + (4,) * nd
        grid = nt.affine_grid(theta, size, align_corners=True)
        z = nt.grid_sample(y, grid, mode="cubic", padding_mode="border", align_corners=True)
        w = nt.affine_warp(y, theta, size, mode="linear", padding_mode="reflection", align_corners=True)
        return z * torch.tanh(w) + 0.5 * nt.affine_warp(y, theta, mode="nearest")[(Ellipsis,) + (slice(0, 4),) * nd]


def _model_inputs(nd=2, dtype=torch.float32):
    torch.manual_seed(nd)
    x = torch.randn(2, 2, *(5,) * nd, dtype=dtype)
    theta = (torch.eye(nd, nd + 1, dtype=dtype) * 0.9 + 0.1 * torch.randn(2, nd, nd + 1, dtype=dtype))
    return x, theta


def _compiled_matches(nd, backend, dynamic=None):
    torch._dynamo.reset()
    model = _AllOps(nd)
    x, theta = _model_inputs(nd)
    theta.requires_grad_()
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=dynamic)
    got = compiled(x, theta)
    want = model(x, theta)
    torch.testing.assert_close(got, want)
    gy = torch.randn_like(want)
    g_got = torch.autograd.grad(got, [theta] + list(model.parameters()), gy)
    g_want = torch.autograd.grad(want, [theta] + list(model.parameters()), gy)
    torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-5)


@pytest.mark.full  # torch.compile's inductor: seconds of compiling
def test_compile_fullgraph():
    """torch.compile(fullgraph=True) traces a model using every op, forward and backward
    (AOT autograd through the fake implementations), without a graph break."""
    _compiled_matches(2, "aot_eager")


@FULL
@pytest.mark.parametrize("nd,dynamic", [(2, None), (3, None), (2, True)])
def test_compile_inductor(nd, dynamic):
    _compiled_matches(nd, "inductor", dynamic)


def test_unsupported_transforms_raise():
    """vmap, forward-mode AD, torch.func.grad and double backward: errors, never a wrong
    (or silently zero) derivative."""
    x, g = torch.randn(3, 1, 1, 2, 2), torch.zeros(3, 1, 1, 1, 2)
    with pytest.raises(NotImplementedError, match="vmap"):
        torch.func.vmap(nt.grid_sample)(x, g)
    with pytest.raises(NotImplementedError, match="vmap"):
        torch.func.vmap(nt.affine_warp)(torch.randn(3, 1, 1, 2, 2), torch.zeros(3, 1, 2, 3))
    x1, g1 = x[0].double(), g[0].double() + 0.3
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda a: nt.grid_sample(a, g1), (x1,), (torch.ones_like(x1),))
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jacfwd(lambda t: nt.affine_grid(t, (1, 1, 2, 2)))(torch.eye(2, 3)[None])
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode"):
        layer = nt.DeformConv1d(1, 1, 2)
        layer(fwAD.make_dual(torch.randn(1, 1, 4), torch.ones(1, 1, 4)), torch.zeros(1, 2, 3))
    with pytest.raises(RuntimeError):
        torch.func.grad(lambda a: nt.grid_sample(a, g1).sum())(x1)
    xr = x1.clone().requires_grad_()
    (gx,) = torch.autograd.grad(nt.grid_sample(xr, g1.requires_grad_()).sum(), g1, create_graph=True)
    with pytest.raises(RuntimeError, match="grid_sample_backward"):
        gx.sum().backward()


class _Through(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that changes nothing: under it every call goes through torch's
    dispatcher (the path torch.compile and export see), never the eager shortcut."""
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _calls(rng):
    """Each op once, on float64 tensors that require grad: (name, call, inputs)."""
    x, grid = t64(rng.standard_normal((1, 2, 3, 4))), t64(rng.uniform(-1.1, 1.1, (1, 2, 3, 2)))
    theta = t64(np.array([[[0.9, 0.2, 0.1], [-0.1, 1.1, 0.0]]]))
    w, off = t64(rng.standard_normal((3, 2, 2, 2))), t64(rng.standard_normal((1, 8, 2, 3)))
    value, loc = t64(rng.standard_normal((1, 6, 1, 2))), t64(rng.uniform(0, 1, (1, 3, 1, 2, 2, 2)))
    attn = t64(rng.uniform(0, 1, (1, 3, 1, 2, 2)))
    return [("affine_grid", lambda: nt.affine_grid(theta, (1, 1, 3, 4)), [theta]),
            ("grid_sample", lambda: nt.grid_sample(x, grid, padding_mode="border"), [x, grid]),
            ("affine_warp", lambda: nt.affine_warp(x, theta, mode="cubic"), [x, theta]),
            ("deform_conv", lambda: nt.deform_conv(x, w, off, mask=None), [x, w, off]),
            ("ms_deform_attn", lambda: nt.ms_deform_attn(value, [[2, 2], [1, 2]], [0, 4], loc, attn),
             [value, loc, attn])]


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_eager_calls_match_the_dispatcher(grad, rng):
    """Eager calls on plain CPU tensors skip torch's dispatcher (its 30-50 us per call): the
    op's function directly, or a torch.autograd.Function over it with the op's registered
    formula. Outputs and gradients are the same bits as through the dispatcher."""
    for name, call, inputs in _calls(rng):
        results = []
        for mode in (contextlib.nullcontext(), _Through()):
            with mode, torch.set_grad_enabled(grad):
                out = call()
                assert out.requires_grad == grad, name
                gy = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
                grads = torch.autograd.grad(out, inputs, gy) if grad else ()
            results.append((out.detach(), grads))
        (a, ga), (b, gb) = results
        assert torch.equal(a, b), name
        assert all(torch.equal(u, v) for u, v in zip(ga, gb)), name


# --- dtypes, layouts, errors ----------------------------------------------------------

@pytest.mark.parametrize("tdt,ndt", [pytest.param(torch.float16, np.float16, marks=FULL), (torch.bfloat16, BF16),
                                     (torch.float32, np.float32)], ids=["float16", "bfloat16", "float32"])
def test_dtypes_forward_and_backward(tdt, ndt):
    """16-bit tensors in and out (the NumPy functions' results, bit for bit), gradients of
    the inputs' dtype."""
    x, g, th, dc, att = _small_inputs(torch.float32)
    x, g, th = (t.detach().to(tdt) for t in (x, g, th))
    dc = {k: v.detach().to(tdt) for k, v in dc.items()}

    def npy(t):
        return t.float().numpy().astype(ndt)

    def same(t, a):
        assert t.dtype == tdt and t.shape == a.shape
        np.testing.assert_array_equal(npy(t), a)

    same(nt.grid_sample(x, g, mode="cubic"), numba_ops.grid_sample(npy(x), npy(g), mode="cubic"))
    same(nt.affine_grid(th, (1, 2, 3, 4)), numba_ops.affine_grid(npy(th), (1, 2, 3, 4)))
    same(nt.affine_warp(x, th), numba_ops.affine_warp(npy(x), npy(th)))
    same(nt.deform_conv(*dc.values(), **att), numba_ops.deform_conv(*(npy(v) for v in dc.values()), **att))
    x.requires_grad_()
    th.requires_grad_()
    y = nt.affine_warp(x, th)
    y.backward(torch.ones_like(y))
    assert x.grad.dtype == tdt and th.grad.dtype == tdt and torch.isfinite(th.grad.float()).all()
    gx, gt = numba_ops.affine_warp_backward(np.ones(y.shape, ndt), npy(x.detach()), npy(th.detach()))
    np.testing.assert_array_equal(npy(x.grad), gx)
    np.testing.assert_array_equal(npy(th.grad), gt)


def test_import_loads_neither_numba_nor_ml_dtypes():
    """``import numba_ops.torch`` registers the operators without loading numba (the
    kernels load on first use) or ml_dtypes (0.7 s on its own: loaded by the first
    bfloat16 tensor, which then goes through as in ``test_dtypes_forward_and_backward``)."""
    code = ("import sys, torch, numba_ops.torch as nt\n"
            "print(sorted(m for m in ('numba', 'ml_dtypes', 'llvmlite', 'scipy') if m in sys.modules))\n"
            "th = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]], dtype=torch.bfloat16)\n"
            "g = nt.affine_grid(th, (1, 2, 3, 4))\n"
            "print(g.dtype, 'ml_dtypes' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split("\n")[:2] == ["[]", "torch.bfloat16 True"]


def test_uint8_image():
    """grid_sample and affine_warp take a uint8 x with a float grid/theta, as the NumPy functions."""
    x = torch.arange(24, dtype=torch.uint8).reshape(1, 2, 3, 4)
    th = torch.tensor([[[0.8, 0.1, 0.0], [-0.1, 0.9, 0.1]]])
    y = nt.affine_warp(x, th)
    assert y.dtype == torch.uint8
    np.testing.assert_array_equal(y.numpy(), numba_ops.affine_warp(x.numpy(), th.numpy()))


def test_layouts():
    """Non-contiguous and expanded inputs give the contiguous inputs' results, contiguous."""
    rng = np.random.default_rng(4)
    x = torch.tensor(rng.standard_normal((1, 2, 5, 4)))
    xt = x.transpose(2, 3).contiguous().transpose(2, 3)  # same values, strided
    g = torch.tensor(knot_free_grid(rng, 1, (3, 3), (5, 4), False))
    assert not xt.is_contiguous()
    y = nt.grid_sample(xt, g[:, ::1, :, :].expand(1, 3, 3, 2))
    torch.testing.assert_close(y, nt.grid_sample(x, g), rtol=0, atol=0)
    assert y.is_contiguous()
    th = torch.tensor(random_theta(rng, 1, 2)).expand(3, 2, 3)  # one matrix for a batch of 3
    y3 = nt.affine_warp(x.expand(3, 2, 5, 4), th)
    torch.testing.assert_close(y3, nt.affine_warp(x, th[:1]).expand(3, 2, 5, 4), rtol=0, atol=0)


def test_errors_pass_through():
    x, g = torch.randn(1, 1, 3, 3), torch.zeros(1, 2, 2, 2)
    with pytest.raises(ValueError, match="mode"):
        nt.grid_sample(x, g, mode="area")
    with pytest.raises(ValueError, match="padding_mode"):
        nt.grid_sample(x, g, padding_mode="wrap")
    with pytest.raises(ValueError, match="align_corners"):
        nt.grid_sample(x, g, align_corners=2)
    with pytest.raises(TypeError, match="dtype"):
        nt.grid_sample(x, g.double())
    with pytest.raises(ValueError, match="theta"):
        nt.affine_grid(torch.zeros(1, 2, 3), (1, 1, 2, 3, 4))
    with pytest.raises(ValueError, match="group"):
        nt.deform_conv(torch.zeros(1, 3, 4, 4), torch.zeros(2, 3, 2, 2), torch.zeros(1, 8, 3, 3), group=2)
    with pytest.raises(ValueError, match="offset"):
        nt.deform_conv(torch.zeros(1, 2, 4, 4), torch.zeros(2, 2, 2, 2), torch.zeros(1, 7, 3, 3))
    with pytest.raises(ValueError, match="size"):
        nt.affine_warp(torch.zeros(1, 1, 3, 3), torch.zeros(1, 2, 3), (1, 2, 3, 3))
    # a uint8 result is not differentiable (torch's rule for integer outputs)
    th = torch.zeros(1, 2, 3, requires_grad=True)
    assert not nt.affine_warp(torch.zeros(1, 1, 3, 3, dtype=torch.uint8), th).requires_grad


def test_mode_names_of_pytorch_and_onnx_opset_16():
    """grid_sample and affine_warp take "bilinear" and "bicubic" for "linear" and "cubic"
    (the same results and gradients: the operator gets numba_ops' name); "bilinear"
    matches torch.nn.functional.grid_sample."""
    rng = np.random.default_rng(17)
    x = t64(rng.standard_normal((1, 2, 4, 5)))
    grid = t64(knot_free_grid(rng, 1, (3, 2), (4, 5), False))
    theta = t64(random_theta(rng, 1, 2))
    for alias, mode, padding in (("bilinear", "linear", "zeros"), ("bicubic", "cubic", "reflection")):
        for fn, pos in ((nt.grid_sample, grid), (nt.affine_warp, theta)):
            y = fn(x, pos, mode=alias, padding_mode=padding)
            want = fn(x, pos, mode=mode, padding_mode=padding)
            assert torch.equal(y, want)
            gy = torch.randn_like(y)
            for a, b in zip(torch.autograd.grad(y, (x, pos), gy), torch.autograd.grad(want, (x, pos), gy)):
                assert torch.equal(a, b)
    ref = torch.nn.functional.grid_sample(x, grid, mode="bilinear", align_corners=False)
    torch.testing.assert_close(nt.grid_sample(x, grid, mode="bilinear"), ref, rtol=1e-12, atol=1e-12)


def test_tensors_on_different_devices():
    """Every op: tensors on two devices are a ValueError naming both (a CPU tensor with
    a meta one here; meta calls dispatch to the fake implementations, so both paths
    check), never a silent read of the other device's memory."""
    ops = torch.ops.numba_ops
    x, g, th, dc, att = _small_inputs()
    x, g, th = (t.detach() for t in (x, g, th))
    dc = {k: v.detach() for k, v in dc.items()}
    meta = lambda t: torch.empty_like(t, device="meta")  # noqa: E731
    gy = x.new_zeros((1, 2, 3, 2))
    a = [att[k] for k in ("kernel_shape", "strides", "pads", "dilations", "group", "offset_group")]
    layer = nt.DeformConv2d(2, 3, (2, 2), padding=1)
    calls = [
        lambda m: nt.grid_sample(x, m(g)),
        lambda m: nt.grid_sample(m(x), g),
        lambda m: nt.affine_warp(x, m(th)),
        lambda m: nt.affine_warp(m(x), th, mode="bicubic"),
        lambda m: nt.deform_conv(dc["x"], dc["w"], m(dc["offset"]), dc["b"], dc["mask"], **att),
        lambda m: nt.deform_conv(dc["x"], dc["w"], dc["offset"], dc["b"], m(dc["mask"]), **att),
        lambda m: nt.deform_conv(m(dc["x"]), m(dc["w"]), m(dc["offset"]), dc["b"], None, **att),
        lambda m: layer(torch.zeros(1, 2, 4, 5), m(torch.zeros(1, 8, 5, 6))),
        lambda m: ops.grid_sample_backward(m(gy), x, g, "linear", "zeros", False, True, True),
        lambda m: ops.affine_warp_backward(x, m(x), th, None, "linear", "zeros", False, True, True),
        lambda m: ops.deform_conv_backward(m(torch.zeros(1, 2, 3, 3)), dc["x"], dc["w"], dc["offset"], dc["b"],
                                           dc["mask"], *a, [True] * 5),
        lambda m: nt.ms_deform_attn(torch.zeros(1, 4, 2, 3), [[2, 2]], [0], m(torch.zeros(1, 2, 2, 1, 1, 2)),
                                    torch.zeros(1, 2, 2, 1, 1)),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(ValueError, match=r"one device.* on (cpu|meta) and .* on (meta|cpu)"):
            call(meta)
            pytest.fail(f"call {i}: no error")
    # the check itself, for a CPU and a CUDA tensor (none here: objects with their devices)
    on = lambda d: type("T", (), {"device": torch.device(d)})()  # noqa: E731
    with pytest.raises(ValueError, match=r"got x on cpu and grid on cuda:0"):
        nt._one_device(x=on("cpu"), grid=on("cuda:0"))
    nt._one_device(x=on("cuda:1"), grid=None, theta=on("cuda:1"))


def test_modules_take_numpy_integers():
    """The DeformConv modules take NumPy integers wherever torchvision takes ints (kept
    as Python ints): the same layer, parameters and results as from ints."""
    torch.manual_seed(4)
    ref = nt.DeformConv2d(4, 6, 3, stride=1, padding=(1, 1), dilation=1, groups=2)
    torch.manual_seed(4)
    i64 = np.int64
    ours = nt.DeformConv2d(i64(4), i64(6), i64(3), stride=np.int32(1), padding=(i64(1), np.uint8(1)),
                           dilation=np.array([1, 1]), groups=np.int16(2))
    assert repr(ours) == repr(ref)
    for name in ("in_channels", "out_channels", "groups"):
        assert type(getattr(ours, name)) is int
    for name in ("kernel_size", "stride", "padding", "dilation"):
        assert getattr(ours, name) == getattr(ref, name) and all(type(v) is int for v in getattr(ours, name))
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))
    x, off = torch.randn(1, 4, 5, 5), torch.randn(1, 18, 5, 5)
    assert torch.equal(ours(x, off), ref(x, off))
    assert nt.DeformConv3d(i64(2), i64(2), (i64(1), 2, np.int8(3)), bias=False).weight.shape == (2, 2, 1, 2, 3)
    for bad in (dict(in_channels=2.0), dict(groups=True), dict(kernel_size=(3, 3.0)), dict(kernel_size=np.bool_(3))):
        args = dict(in_channels=2, out_channels=2, kernel_size=3) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            nt.DeformConv2d(**args)


def test_size_arguments():
    """size as a tuple, list, torch.Size, tensor or NumPy array; align_corners as 0/1."""
    th = torch.tensor([[[1.0, 0, 0], [0, 1, 0]]])
    want = nt.affine_grid(th, (1, 1, 2, 3), align_corners=True)
    for size in ([1, 1, 2, 3], torch.Size([1, 1, 2, 3]), torch.tensor([1, 1, 2, 3]), np.array([1, 1, 2, 3])):
        torch.testing.assert_close(nt.affine_grid(th, size, align_corners=1), want, rtol=0, atol=0)


def test_docstring_examples():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(nt, "numba_ops.torch") if t.examples]
    assert len(tests) >= 8
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed (see stdout)"


# --- ONNX export ---------------------------------------------------------------------

def _export_and_run(nd):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    import numba_ops.onnx

    model = _AllOps(nd).eval()
    x, theta = _model_inputs(nd)
    with torch.no_grad():
        want = model(x, theta)
    prog = torch.onnx.export(model, (x, theta), dynamo=True, custom_translation_table=nt.onnx_translations(),
                             input_names=["x", "theta"], output_names=["y"], verbose=False)
    proto = prog.model_proto
    ops = {(n.domain, n.op_type) for n in proto.graph.node}
    assert {("", "DeformConv"), ("", "AffineGrid"), ("", "GridSample"), ("numba_ops", "AffineWarp")} <= ops, ops
    sess = numba_ops.onnx.session(proto)
    (got,) = sess.run(None, {"x": x.numpy(), "theta": theta.numpy()})
    return got, want.numpy(), proto


def test_onnx_export_2d():
    got, want, proto = _export_and_run(2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    buf = io.BytesIO(proto.SerializeToString())
    assert buf.getbuffer().nbytes > 0


def test_onnx_export_dynamic_batch():
    """A dynamic batch axis (AffineGrid's size and AffineWarp's from the graph's shapes),
    a DeformConv without B but with a mask; one exported model runs two batch sizes."""
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    import numba_ops.onnx

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dc = nt.DeformConv2d(2, 3, 3, padding=1, bias=False)

        def forward(self, x, off, mask, theta):
            y = self.dc(x, off, mask)
            return nt.grid_sample(y, nt.affine_grid(theta, (x.shape[0], 3, 4, 4))), nt.affine_warp(y, theta)

    def inputs(n):
        return (torch.randn(n, 2, 5, 5), torch.randn(n, 18, 5, 5), torch.rand(n, 9, 5, 5),
                torch.eye(2, 3).expand(n, 2, 3) + 0.1 * torch.randn(n, 2, 3))

    torch.manual_seed(0)
    m = M().eval()
    names = ["x", "off", "mask", "theta"]
    batch = torch.export.Dim("batch", min=1, max=64)
    prog = torch.onnx.export(m, inputs(2), dynamo=True, custom_translation_table=nt.onnx_translations(),
                             input_names=names, dynamic_shapes={k: {0: batch} for k in names})
    dc = [n for n in prog.model_proto.graph.node if n.op_type == "DeformConv"]
    assert len(dc) == 1 and list(dc[0].input)[3] == ""
    sess = numba_ops.onnx.session(prog.model_proto)
    for n in (1, 3):
        a = inputs(n)
        got = sess.run(None, {k: v.numpy() for k, v in zip(names, a)})
        with torch.no_grad():
            for g, w in zip(got, m(*a)):
                np.testing.assert_allclose(g, w.numpy(), rtol=1e-6, atol=1e-6)


@FULL
def test_onnx_export_3d():
    got, want, _ = _export_and_run(3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@FULL
def test_onnx_export_1d_grid_sample_and_deform_conv():
    pytest.importorskip("onnxscript")
    import numba_ops.onnx

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dc = nt.DeformConv1d(2, 2, 3, padding=1)

        def forward(self, x, off, grid):
            return nt.grid_sample(self.dc(x, off), grid, mode="cubic", padding_mode="reflection")

    torch.manual_seed(0)
    m = M().eval()
    args = (torch.randn(2, 2, 6), torch.randn(2, 6, 6) * 0.5, torch.rand(2, 4, 1) * 2 - 1)
    prog = torch.onnx.export(m, args, dynamo=True, custom_translation_table=nt.onnx_translations(),
                             input_names=["x", "off", "grid"])
    sess = numba_ops.onnx.session(prog.model_proto)
    (got,) = sess.run(None, {k: v.numpy() for k, v in zip(["x", "off", "grid"], args)})
    with torch.no_grad():
        np.testing.assert_allclose(got, m(*args).numpy(), rtol=1e-5, atol=1e-5)


# --- CUDA (where torch has a GPU and numba_ops can use it) -----------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available() or "cuda" not in numba_ops.devices(),
                               reason="needs a GPU that torch and numba_ops both use")


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_cuda_matches_cpu(dtype):
    """Every op forward and backward on CUDA tensors, on a side stream, against the CPU."""
    x, g, th, dc, att = _small_inputs(dtype)
    cpu = [x, g, th, *dc.values()]
    dev = [t.detach().cuda().requires_grad_() for t in cpu]
    stream = torch.cuda.Stream()
    results = []
    for ts, where in ((cpu, "cpu"), (dev, "cuda")):
        xx, gg, tt, dx, dw, doff, db, dm = ts
        with torch.cuda.stream(stream) if where == "cuda" else contextlib.nullcontext():
            ys = [nt.grid_sample(xx, gg, mode="cubic"), nt.affine_grid(tt, (1, 2, 3, 4)), nt.affine_warp(xx, tt),
                  nt.deform_conv(dx, dw, doff, db, dm, **att)]
            loss = sum(y.float().sum() for y in ys)
            grads = torch.autograd.grad(loss, ts)
        if where == "cuda":
            torch.cuda.current_stream().wait_stream(stream)
            assert all(y.is_cuda for y in ys)
        results.append([t.detach().cpu().float() for t in ys + list(grads)])
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, **tol)

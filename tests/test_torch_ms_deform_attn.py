"""numba_ops.torch.ms_deform_attn and MSDeformAttn (Deformable DETR's module).

- the op against a pure-PyTorch reference (mmcv's / Deformable DETR's
  ``multi_scale_deformable_attn_pytorch``: ``F.grid_sample`` per level, 4-D for 2-D
  levels, 5-D for 3-D ones), forward and every gradient;
- ``torch.autograd.gradcheck`` in float64 (2-D and 3-D levels; points at least 0.1
  from the integer positions where bilinear sampling has kinks, some of them partly
  or wholly outside their level);
- ``torch.library.opcheck``, meta tensors, ``torch.compile(fullgraph=True)``;
- ``MSDeformAttn``: parameter names, shapes and initialisation, a ``state_dict`` round
  trip with a pure-PyTorch twin written after Deformable DETR's module (outputs and
  gradients: points and boxes, a padding mask);
- ``torch.onnx.export(dynamo=True)`` through ``onnx_translations()``: one
  ``numba_ops::MMCVMultiScaleDeformableAttention`` node, run by ``numba_ops.onnx``'s
  evaluator and session;
- 16-bit dtypes, tables as lists, errors, vmap's and forward AD's refusal; CUDA tensors
  (on a side stream, the tables on either device) where torch has a GPU.
"""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import numba_ops  # noqa: E402
import numba_ops.torch as nt  # noqa: E402
from numba_ops.benchmark.cases import ms_deform_attn_torch  # noqa: E402
from helpers import BF16, FULL  # noqa: E402

F64 = torch.float64


# --- the pure-PyTorch reference --------------------------------------------------------

#: mmcv's ``multi_scale_deformable_attn_pytorch`` (4-D ``F.grid_sample`` for 2-D levels, 5-D for
#: 3-D ones): one definition, the benchmarks' peer
msda_ref = ms_deform_attn_torch


class RefMSDeformAttn(torch.nn.Module):
    """Deformable DETR's ``MSDeformAttn`` as published (parameter names, shapes and
    forward), on ``msda_ref``: the twin ``nt.MSDeformAttn`` must match."""

    def __init__(self, d_model, n_levels, n_heads, n_points):
        super().__init__()
        self.d_model, self.n_levels, self.n_heads, self.n_points = d_model, n_levels, n_heads, n_points
        self.sampling_offsets = torch.nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = torch.nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = torch.nn.Linear(d_model, d_model)
        self.output_proj = torch.nn.Linear(d_model, d_model)

    def forward(self, query, reference_points, input_flatten, input_spatial_shapes, input_level_start_index,
                input_padding_mask=None):
        N, Len_q, _ = query.shape
        N, Len_in, _ = input_flatten.shape
        assert (input_spatial_shapes[:, 0] * input_spatial_shapes[:, 1]).sum() == Len_in
        value = self.value_proj(input_flatten)
        if input_padding_mask is not None:
            value = value.masked_fill(input_padding_mask[..., None], float(0))
        value = value.view(N, Len_in, self.n_heads, self.d_model // self.n_heads)
        off = self.sampling_offsets(query).view(N, Len_q, self.n_heads, self.n_levels, self.n_points, 2)
        aw = self.attention_weights(query).view(N, Len_q, self.n_heads, self.n_levels * self.n_points)
        aw = F.softmax(aw, -1).view(N, Len_q, self.n_heads, self.n_levels, self.n_points)
        if reference_points.shape[-1] == 2:
            norm = torch.stack([input_spatial_shapes[..., 1], input_spatial_shapes[..., 0]], -1)
            loc = reference_points[:, :, None, :, None, :] + off / norm[None, None, None, :, None, :]
        else:
            loc = (reference_points[:, :, None, :, None, :2]
                   + off / self.n_points * reference_points[:, :, None, :, None, 2:] * 0.5)
        return self.output_proj(msda_ref(value, input_spatial_shapes, loc, aw))


# --- inputs ---------------------------------------------------------------------------

SHAPES = {2: [[4, 5], [2, 3]], 3: [[3, 4, 5], [2, 2, 3]]}


def tables(r):
    shapes = torch.tensor(SHAPES[r])
    sizes = shapes.prod(1)
    return shapes, torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])


def knot_free_locations(rng, n, lq, m, shapes, p):
    """Locations (n, lq, m, L, p, r) in [0, 1] coordinates whose unnormalised positions
    ``loc * size - 0.5`` lie 0.1 or more from every integer, from -1 (one corner
    outside) to size (both outside: a zero sample) on each axis."""
    shapes = np.asarray(shapes)
    L, r = shapes.shape
    out = np.empty((n, lq, m, L, p, r))
    for lvl in range(L):
        for k in range(r):
            size = shapes[lvl, r - 1 - k]  # x (innermost axis) first
            frac = rng.uniform(0.1, 0.9, (n, lq, m, p))
            pos = rng.integers(-1, size, (n, lq, m, p)) + frac
            pos[0, 0, 0, 0] = size + 0.3  # wholly outside
            out[:, :, :, lvl, :, k] = (pos + 0.5) / size
    return out


def msda_inputs(r=2, n=2, lq=3, m=2, dh=3, p=2, dtype=F64, seed=0):
    """(value, shapes, starts, locations, weights), float tensors of ``dtype`` requiring grad."""
    rng = np.random.default_rng(seed)
    shapes, starts = tables(r)
    S = int(shapes.prod(1).sum())
    L = shapes.shape[0]
    value = rng.standard_normal((n, S, m, dh))
    loc = knot_free_locations(rng, n, lq, m, shapes.numpy(), p)
    attn = rng.uniform(0.1, 1.0, (n, lq, m, L, p))
    v, lo, a = (torch.tensor(t, dtype=dtype, requires_grad=True) for t in (value, loc, attn))
    return v, shapes, starts, lo, a


# --- the op ---------------------------------------------------------------------------

@pytest.mark.parametrize("r", [2, 3], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
def test_forward_and_gradients_vs_reference(r, dtype):
    """The output and all three gradients equal the F.grid_sample reference's (float64
    computed; float32 within its accuracy)."""
    v, shapes, starts, loc, attn = msda_inputs(r, dtype=dtype)
    out = nt.ms_deform_attn(v, shapes, starts, loc, attn)
    assert out.shape == (2, 3, 2 * 3) and out.dtype == dtype and out.is_contiguous()
    ins64 = [t.detach().double().requires_grad_() for t in (v, loc, attn)]
    want = msda_ref(ins64[0], shapes, ins64[1], ins64[2])
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), want, **tol)
    gy = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (v, loc, attn), gy.to(dtype))
    wants = torch.autograd.grad(want, ins64, gy)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-4, atol=1e-4)
    for g, w in zip(got, wants):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, **tol)


@pytest.mark.parametrize("r", [2, 3], ids=["2d", "3d"])
def test_gradcheck(r):
    v, shapes, starts, loc, attn = msda_inputs(r, n=1, lq=2, m=2, dh=2, p=2)
    assert torch.autograd.gradcheck(lambda a, b, c: nt.ms_deform_attn(a, shapes, starts, b, c), (v, loc, attn))


def test_only_the_gradients_asked_for():
    """A gradient autograd does not ask for is not computed (nor returned)."""
    v, shapes, starts, loc, attn = msda_inputs()
    loc = loc.detach()
    (gv,) = torch.autograd.grad(nt.ms_deform_attn(v, shapes, starts, loc, attn).sum(), v)
    want = numba_ops.ms_deform_attn_backward(np.ones((2, 3, 6)), v.detach().numpy(), shapes.numpy(),
                                             starts.numpy(), loc.numpy(), attn.detach().numpy(), wrt=["value"])
    assert want[1] is None and want[2] is None
    np.testing.assert_array_equal(gv.numpy(), want[0])
    ops = torch.ops.numba_ops
    gv, gl, ga = ops.ms_deform_attn_backward(torch.ones(2, 3, 6, dtype=F64), v, shapes, starts, loc, attn,
                                             [False, True, False])
    assert gv.numel() == 0 and ga.numel() == 0 and gl.shape == loc.shape
    out = nt.ms_deform_attn(v.detach(), shapes, starts, loc, attn.detach())
    assert not out.requires_grad


def test_opcheck():
    """Schema, fake implementation, autograd registration and AOT dispatch (dynamic
    shapes) agree with the kernels."""
    v, shapes, starts, loc, attn = msda_inputs(n=1, lq=2)
    torch.library.opcheck(torch.ops.numba_ops.ms_deform_attn.default, (v, shapes, starts, loc, attn))


def test_meta_tensors():
    m = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    shapes = torch.empty(3, 2, dtype=torch.int64, device="meta")
    starts = torch.empty(3, dtype=torch.int64, device="meta")
    out = nt.ms_deform_attn(m(2, 50, 4, 8), shapes, starts, m(2, 7, 4, 3, 5, 2), m(2, 7, 4, 3, 5))
    assert out.shape == (2, 7, 32) and out.device.type == "meta"
    with pytest.raises(ValueError, match="sampling_locations"):
        nt.ms_deform_attn(m(2, 50, 4, 8), shapes, starts, torch.zeros(2, 7, 4, 3, 5, 2), m(2, 7, 4, 3, 5))


def test_tables_as_lists_and_arrays_and_empty():
    v, shapes, starts, loc, attn = msda_inputs()
    want = nt.ms_deform_attn(v, shapes, starts, loc, attn)
    for s, t in ((SHAPES[2], [0, 20]), (np.array(SHAPES[2], np.int32), np.array([0, 20])),
                 (shapes.int(), starts.int())):
        torch.testing.assert_close(nt.ms_deform_attn(v, s, t, loc, attn), want, rtol=0, atol=0)
    empty = nt.ms_deform_attn(v, shapes, starts, loc[:, :0], attn[:, :0])
    assert empty.shape == (2, 0, 6)


@pytest.mark.parametrize("tdt,ndt", [(torch.bfloat16, BF16), pytest.param(torch.float16, np.float16, marks=FULL),
                                     (torch.float32, np.float32)], ids=["bfloat16", "float16", "float32"])
def test_dtypes(tdt, ndt):
    """16-bit tensors in and out: the NumPy functions' results, bit for bit."""
    v, shapes, starts, loc, attn = (t.detach().to(tdt) if t.is_floating_point() else t
                                    for t in msda_inputs(dtype=torch.float32))

    def npy(t):
        return t.float().numpy().astype(ndt)

    args = (npy(v), shapes.numpy(), starts.numpy(), npy(loc), npy(attn))
    out = nt.ms_deform_attn(v, shapes, starts, loc, attn)
    assert out.dtype == tdt
    np.testing.assert_array_equal(npy(out), numba_ops.ms_deform_attn(*args))
    v, loc, attn = (t.requires_grad_() for t in (v, loc, attn))
    out = nt.ms_deform_attn(v, shapes, starts, loc, attn)
    grads = torch.autograd.grad(out, (v, loc, attn), torch.ones_like(out))
    for g, w in zip(grads, numba_ops.ms_deform_attn_backward(np.ones(out.shape, ndt), *args)):
        assert g.dtype == tdt
        np.testing.assert_array_equal(npy(g), w)


def test_errors():
    v, shapes, starts, loc, attn = (t.detach() for t in msda_inputs())
    with pytest.raises(ValueError, match="level_start_index"):
        nt.ms_deform_attn(v, shapes, torch.tensor([0, 19]), loc, attn)
    with pytest.raises(ValueError, match="attention_weights"):
        nt.ms_deform_attn(v, shapes, starts, loc, attn[..., :1])
    with pytest.raises(TypeError, match="dtype"):
        nt.ms_deform_attn(v, shapes, starts, loc.float(), attn)
    with pytest.raises(TypeError, match="spatial_shapes"):
        nt.ms_deform_attn(v, shapes.double(), starts, loc, attn)
    with pytest.raises(ValueError, match="one device"):
        nt.ms_deform_attn(v, shapes, starts, loc.to("meta"), attn)
    with pytest.raises(ValueError, match="d_model"):
        nt.MSDeformAttn(d_model=30, n_heads=8)
    layer = nt.MSDeformAttn(8, 2, 2, 2)
    with pytest.raises(ValueError, match="reference_points"):
        layer(torch.zeros(1, 3, 8), torch.zeros(1, 3, 2, 3), torch.zeros(1, 26, 8), shapes, starts)


def test_unsupported_transforms_raise():
    v, shapes, starts, loc, attn = (t.detach() for t in msda_inputs())
    with pytest.raises(NotImplementedError, match="vmap"):
        torch.func.vmap(lambda a: nt.ms_deform_attn(a, shapes, starts, loc, attn))(v[None].expand(2, -1, -1, -1, -1))
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda a: nt.ms_deform_attn(v, shapes, starts, loc, a), (attn,), (torch.ones_like(attn),))


# --- the module -----------------------------------------------------------------------

def test_module_parameters_and_init():
    """Deformable DETR's parameter names and shapes; its initialisation."""
    torch.manual_seed(0)
    d, L, M, P = 16, 3, 8, 4
    layer = nt.MSDeformAttn(d_model=d, n_levels=L, n_heads=M, n_points=P)
    shapes = {k: tuple(t.shape) for k, t in layer.state_dict().items()}
    assert shapes == {"sampling_offsets.weight": (M * L * P * 2, d), "sampling_offsets.bias": (M * L * P * 2,),
                      "attention_weights.weight": (M * L * P, d), "attention_weights.bias": (M * L * P,),
                      "value_proj.weight": (d, d), "value_proj.bias": (d,),
                      "output_proj.weight": (d, d), "output_proj.bias": (d,)}
    assert layer.sampling_offsets.weight.abs().max() == 0
    assert layer.attention_weights.weight.abs().max() == 0 and layer.attention_weights.bias.abs().max() == 0
    # head h points along the angle 2*pi*h/M, its larger coordinate +-1, point p at p + 1 times that
    bias = layer.sampling_offsets.bias.detach().view(M, L, P, 2).double()
    for h in range(M):
        a = 2 * math.pi * h / M
        direction = torch.tensor([math.cos(a), math.sin(a)], dtype=F64)
        direction /= direction.abs().max()
        for p in range(P):
            torch.testing.assert_close(bias[h, :, p], (p + 1) * direction.expand(L, 2), rtol=1e-6, atol=1e-6)
    assert bias[1, 0, 0].tolist() == [1.0, 1.0] and bias[4, 2, 3].tolist() == [-4.0, pytest.approx(0, abs=1e-6)]
    bound = math.sqrt(6 / (d + d))  # xavier_uniform_
    for lin in (layer.value_proj, layer.output_proj):
        assert lin.bias.abs().max() == 0
        assert 0 < lin.weight.abs().max() <= bound and lin.weight.std() > bound / 3
    assert (nt.MSDeformAttn().d_model, nt.MSDeformAttn().n_levels) == (256, 4)
    assert "n_points=4" in repr(layer) and layer.im2col_step == 64


def _module_inputs(boxes, mask, seed=0, n=2, lq=5, d=16):
    g = torch.Generator().manual_seed(seed)
    shapes, starts = tables(2)
    S = int(shapes.prod(1).sum())
    query = torch.randn(n, lq, d, dtype=F64, generator=g, requires_grad=True)
    ref = torch.rand(n, lq, 2, 4 if boxes else 2, dtype=F64, generator=g)
    if boxes:
        ref[..., 2:] = ref[..., 2:] * 0.5 + 0.1
    flat = torch.randn(n, S, d, dtype=F64, generator=g, requires_grad=True)
    pad = torch.rand(n, S, generator=g) < 0.3 if mask else None
    return query, ref.requires_grad_(), flat, shapes, starts, pad


def _perturbed(layer, seed=1):
    """Parameters drawn at random (the initialisation zeroes the offsets' and the
    weights' dependence on the query)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_(torch.randn(prm.shape, dtype=prm.dtype, generator=g) * 0.3)
    return layer


@pytest.mark.parametrize("boxes,mask", [(False, False), (True, True)], ids=["points", "boxes-mask"])
def test_module_matches_deformable_detr(boxes, mask):
    """A state_dict moves between MSDeformAttn and the pure-PyTorch twin both ways
    (strict); the outputs and the gradients of every input and parameter agree."""
    ours = _perturbed(nt.MSDeformAttn(16, 2, 4, 3).double())
    theirs = RefMSDeformAttn(16, 2, 4, 3).double()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    fresh = nt.MSDeformAttn(16, 2, 4, 3).double()
    fresh.load_state_dict(theirs.state_dict(), strict=True)
    for a, b in zip(fresh.state_dict().values(), ours.state_dict().values()):
        assert torch.equal(a, b)
    query, ref, flat, shapes, starts, pad = _module_inputs(boxes, mask)
    got = ours(query, ref, flat, shapes, starts, pad)
    want = theirs(query, ref, flat, shapes, starts, pad)
    assert got.shape == (2, 5, 16)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    gy = torch.randn_like(got)
    got_g = torch.autograd.grad(got, [query, ref, flat, *ours.parameters()], gy)
    want_g = torch.autograd.grad(want, [query, ref, flat, *theirs.parameters()], gy)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    if mask:  # the padding counts as zeros: changing it changes nothing
        flat2 = flat.detach().masked_fill(pad[..., None], 5.0)
        torch.testing.assert_close(ours(query, ref, flat2, shapes, starts, pad), got, rtol=0, atol=0)


def test_module_initialised_matches_and_trains():
    """As constructed (Deformable DETR's initialisation), with float32 inputs; a few
    optimiser steps lower a loss."""
    torch.manual_seed(3)
    ours = nt.MSDeformAttn(16, 2, 4, 3)
    theirs = RefMSDeformAttn(16, 2, 4, 3)
    theirs.load_state_dict(ours.state_dict())
    query, ref, flat, shapes, starts, _ = (t.float() if torch.is_tensor(t) and t.is_floating_point() else t
                                           for t in _module_inputs(False, False))
    torch.testing.assert_close(ours(query, ref, flat, shapes, starts), theirs(query, ref, flat, shapes, starts),
                               rtol=1e-5, atol=1e-5)
    target = torch.randn(2, 5, 16)
    opt = torch.optim.Adam(ours.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = (ours(query.detach(), ref.detach(), flat.detach(), shapes, starts) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert ours.sampling_offsets.weight.grad.abs().max() > 0


# --- torch.compile ----------------------------------------------------------------------

def _compiled_matches(backend, dynamic=None):
    torch._dynamo.reset()
    layer = _perturbed(nt.MSDeformAttn(16, 2, 4, 3))
    query, ref, flat, shapes, starts, pad = (t.float() if torch.is_tensor(t) and t.is_floating_point() else t
                                             for t in _module_inputs(True, True))
    compiled = torch.compile(layer, fullgraph=True, backend=backend, dynamic=dynamic)
    got = compiled(query, ref, flat, shapes, starts, pad)
    want = layer(query, ref, flat, shapes, starts, pad)
    torch.testing.assert_close(got, want)
    gy = torch.randn_like(want)
    inputs = [query, ref, flat, *layer.parameters()]
    for a, b in zip(torch.autograd.grad(got, inputs, gy), torch.autograd.grad(want, inputs, gy)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compile_fullgraph():
    """torch.compile(fullgraph=True) traces the module, forward and backward (AOT
    autograd through the fake implementations), without a graph break."""
    _compiled_matches("aot_eager")


@FULL
@pytest.mark.parametrize("dynamic", [None, True])
def test_compile_inductor(dynamic):
    _compiled_matches("inductor", dynamic)


# --- ONNX export --------------------------------------------------------------------------

def _export(layer, args, **kw):
    pytest.importorskip("onnxscript")
    names = ["query", "reference_points", "input_flatten", "spatial_shapes", "level_start_index"]
    return torch.onnx.export(layer, args, dynamo=True, custom_translation_table=nt.onnx_translations(),
                             input_names=names, verbose=False, **kw).model_proto, names


def _run(proto, feeds):
    """The model's output from ``numba_ops.onnx.evaluator`` and, where onnxruntime is
    installed, ``numba_ops.onnx.session``."""
    import numba_ops.onnx
    if not hasattr(numba_ops.onnx, "MMCVMultiScaleDeformableAttention"):
        pytest.skip("numba_ops.onnx runs no MMCVMultiScaleDeformableAttention node in this checkout")
    outs = [numba_ops.onnx.evaluator(proto).run(None, feeds)[0]]
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return outs
    return outs + [numba_ops.onnx.session(proto).run(None, feeds)[0]]


def test_onnx_export():
    """One numba_ops::MMCVMultiScaleDeformableAttention node with MMDeploy's inputs
    (value, the two int64 tables, locations, weights), which numba_ops.onnx's evaluator
    and session run."""
    torch.manual_seed(0)
    layer = _perturbed(nt.MSDeformAttn(16, 2, 4, 3)).eval()
    args = tuple(t.detach().float() if t.is_floating_point() else t for t in _module_inputs(False, False)[:5])
    proto, names = _export(layer, args)
    nodes = [n for n in proto.graph.node if n.op_type == "MMCVMultiScaleDeformableAttention"]
    assert len(nodes) == 1 and nodes[0].domain == "numba_ops" and len(nodes[0].input) == 5
    assert ("numba_ops", 1) in {(o.domain, o.version) for o in proto.opset_import}
    node_inputs = list(nodes[0].input)
    assert node_inputs[1:3] == ["spatial_shapes", "level_start_index"], node_inputs
    with torch.no_grad():
        want = layer(*args).numpy()
    for got in _run(proto, {k: v.numpy() for k, v in zip(names, args)}):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@FULL
def test_onnx_export_dynamic_batch_boxes():
    """Box reference points, a dynamic batch and query count: one exported model runs two sizes."""
    torch.manual_seed(0)
    layer = _perturbed(nt.MSDeformAttn(16, 2, 4, 3)).eval()

    def inputs(n, lq):
        return tuple(t.detach().float() if t.is_floating_point() else t
                     for t in _module_inputs(True, False, seed=n, n=n, lq=lq)[:5])

    batch, queries = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("queries", min=1, max=64)
    dyn = ({0: batch, 1: queries}, {0: batch, 1: queries}, {0: batch}, None, None)
    proto, names = _export(layer, inputs(2, 5), dynamic_shapes=dyn)
    for n, lq in ((1, 3), (3, 7)):
        args = inputs(n, lq)
        with torch.no_grad():
            want = layer(*args).numpy()
        for got in _run(proto, {k: v.numpy() for k, v in zip(names, args)}):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --- CUDA (where torch has a GPU and numba_ops can use it) -----------------------------

@pytest.mark.skipif(not torch.cuda.is_available() or "cuda" not in numba_ops.devices(),
                    reason="needs a GPU that torch and numba_ops both use")
@pytest.mark.cuda
@pytest.mark.parametrize("tables_on", ["cpu", "cuda"])
@pytest.mark.parametrize("r", [2, 3], ids=["2d", "3d"])
def test_cuda_matches_cpu(r, tables_on):
    """Forward and the three gradients on CUDA tensors, on a side stream, against the
    CPU; the int tables on the CPU or on the GPU."""
    v, shapes, starts, loc, attn = msda_inputs(r, dtype=torch.float32)
    dev = [t.detach().cuda().requires_grad_() for t in (v, loc, attn)]
    tabs = (shapes.to(tables_on), starts.to(tables_on))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = nt.ms_deform_attn(dev[0], *tabs, dev[1], dev[2])
        grads = torch.autograd.grad(out.square().sum(), dev)
    torch.cuda.current_stream().wait_stream(stream)
    assert out.is_cuda and all(g.is_cuda for g in grads)
    want = nt.ms_deform_attn(v, shapes, starts, loc, attn)
    want_g = torch.autograd.grad(want.square().sum(), (v, loc, attn))
    torch.testing.assert_close(out.cpu(), want.detach(), rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_g):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4)

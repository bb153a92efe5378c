"""Train a Deformable-DETR-style encoder layer on numba_ops' multi-scale deformable
attention, check it against the pure-PyTorch path, export it to ONNX and run it in
onnxruntime.

The layer is Deformable DETR's ``DeformableTransformerEncoderLayer`` (no dropout):
self-attention over a flattened multi-level feature pyramid with
``numba_ops.torch.MSDeformAttn`` (every position of every level is a query, its
reference point its normalised centre on every level, as the encoder's
``get_reference_points``), then residual + LayerNorm, a small FFN, residual +
LayerNorm. The task is synthetic: the target is a random smooth pyramid moved by a fixed shift
(a fraction of the image, the same on every level), which the sampling offsets learn.
A few dozen Adam steps on the CPU bring the loss down, below what the unshifted input
scores.

The same layer on mmcv's ``multi_scale_deformable_attn_pytorch`` (one
``F.grid_sample`` per level), with the trained weights, gives the same output and
gradients; the script prints the differences and times a forward + backward step on
both. The layer is exported with ``torch.onnx.export(..., dynamo=True,
custom_translation_table=numba_ops.torch.onnx_translations())``: the attention
becomes a ``numba_ops::MMCVMultiScaleDeformableAttention`` node, which
``numba_ops.onnx.session`` runs in onnxruntime on numba_ops' kernel.

    python examples/deformable_detr_encoder.py --steps 60 --size 16 --levels 3

Needs torch, onnxscript, onnxruntime and onnxruntime-extensions; without them it says
so and exits 0.
"""
import argparse
import math
import statistics
import sys
import time

import numpy as np


def multi_scale_deformable_attn_pytorch(torch, value, value_spatial_shapes, sampling_locations, attention_weights):
    """mmcv's pure-PyTorch multi-scale deformable attention (Deformable DETR's
    ``ms_deform_attn_core_pytorch``): value (N, S, M, Dh), locations (N, Lq, M, L, P, 2)
    in [0, 1], weights (N, Lq, M, L, P) -> (N, Lq, M * Dh)."""
    F = torch.nn.functional
    bs, _, num_heads, embed_dims = value.shape
    _, num_queries, num_heads, num_levels, num_points, _ = sampling_locations.shape
    shapes = [(int(h), int(w)) for h, w in value_spatial_shapes.tolist()]
    value_list = value.split([h * w for h, w in shapes], dim=1)
    sampling_grids = 2 * sampling_locations - 1
    sampling_value_list = []
    for level, (h, w) in enumerate(shapes):
        value_l = value_list[level].flatten(2).transpose(1, 2).reshape(bs * num_heads, embed_dims, h, w)
        grid_l = sampling_grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        sampling_value_list.append(F.grid_sample(value_l, grid_l, mode="bilinear", padding_mode="zeros",
                                                 align_corners=False))
    attention_weights = attention_weights.transpose(1, 2).reshape(bs * num_heads, 1, num_queries,
                                                                  num_levels * num_points)
    output = (torch.stack(sampling_value_list, dim=-2).flatten(-2) * attention_weights).sum(-1)
    return output.view(bs, num_heads * embed_dims, num_queries).transpose(1, 2).contiguous()


def build(torch, nt, d_model, d_ffn, n_levels, n_heads, n_points):
    """The encoder layer on numba_ops' MSDeformAttn, and a twin class whose attention is
    the pure-PyTorch path (same parameters: ``load_state_dict`` moves weights across)."""

    class PyTorchMSDeformAttn(nt.MSDeformAttn):
        """Deformable DETR's MSDeformAttn forward (reference points, no padding mask) on
        ``multi_scale_deformable_attn_pytorch``."""

        def forward(self, query, reference_points, input_flatten, input_spatial_shapes, input_level_start_index,
                    input_padding_mask=None):
            N, Lq, _ = query.shape
            M, L, P = self.n_heads, self.n_levels, self.n_points
            value = self.value_proj(input_flatten).view(N, input_flatten.shape[1], M, self.d_model // M)
            offsets = self.sampling_offsets(query).view(N, Lq, M, L, P, 2)
            weights = self.attention_weights(query).view(N, Lq, M, L * P).softmax(-1).view(N, Lq, M, L, P)
            normaliser = torch.stack([input_spatial_shapes[..., 1], input_spatial_shapes[..., 0]], -1)
            locations = reference_points[:, :, None, :, None, :] + offsets / normaliser[None, None, None, :, None, :]
            out = multi_scale_deformable_attn_pytorch(torch, value, input_spatial_shapes, locations, weights)
            return self.output_proj(out)

    class EncoderLayer(torch.nn.Module):
        """Deformable DETR's DeformableTransformerEncoderLayer, dropout left out."""

        def __init__(self, attention=nt.MSDeformAttn):
            super().__init__()
            self.self_attn = attention(d_model, n_levels, n_heads, n_points)
            self.norm1 = torch.nn.LayerNorm(d_model)
            self.linear1 = torch.nn.Linear(d_model, d_ffn)
            self.linear2 = torch.nn.Linear(d_ffn, d_model)
            self.norm2 = torch.nn.LayerNorm(d_model)

        def forward(self, src, pos, reference_points, spatial_shapes, level_start_index):
            src = self.norm1(src + self.self_attn(src + pos, reference_points, src, spatial_shapes,
                                                  level_start_index))
            return self.norm2(src + self.linear2(torch.relu(self.linear1(src))))

    return EncoderLayer, lambda: EncoderLayer(PyTorchMSDeformAttn)


def pyramid_tables(torch, size, levels):
    """spatial_shapes (L, 2) (H, W), halving from ``size``; level_start_index (L,)."""
    shapes = torch.tensor([[max(size >> lvl, 1)] * 2 for lvl in range(levels)])
    sizes = shapes.prod(1)
    return shapes, torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])


def get_reference_points(torch, spatial_shapes, n):
    """Deformable DETR's encoder reference points (valid ratios 1): every position's
    normalised centre, on every level: (n, S, L, 2) as (x, y)."""
    points = []
    for h, w in spatial_shapes.tolist():
        ref_y, ref_x = torch.meshgrid(torch.linspace(0.5, h - 0.5, h) / h, torch.linspace(0.5, w - 0.5, w) / w,
                                      indexing="ij")
        points.append(torch.stack([ref_x.reshape(-1), ref_y.reshape(-1)], -1))
    ref = torch.cat(points, 0)
    return ref[None, :, None, :].expand(n, -1, len(spatial_shapes), -1).contiguous()


def position_embedding(torch, spatial_shapes, d_model, generator):
    """(1, S, d_model): a sine embedding of each position's normalised centre (DETR's
    PositionEmbeddingSine) plus a fixed random vector per level (the level embedding)."""
    ref = get_reference_points(torch, spatial_shapes, 1)[0, :, 0]  # (S, 2)
    freqs = 10000 ** (-torch.arange(d_model // 4) / (d_model // 4))
    angles = ref[:, :, None] * 2 * math.pi * freqs  # (S, 2, d_model/4)
    pos = torch.cat([angles.sin(), angles.cos()], -1).flatten(1)
    level = torch.repeat_interleave(torch.arange(len(spatial_shapes)), spatial_shapes.prod(1))
    return (pos + 0.5 * torch.randn(len(spatial_shapes), d_model, generator=generator)[level])[None]


def features(torch, n, d_model, spatial_shapes, generator):
    """A smooth random pyramid: (n, d_model, H, W) per level, the finer levels upsampled
    noise, the coarser ones average-pooled from the finest."""
    F = torch.nn.functional
    h0, w0 = spatial_shapes[0].tolist()
    coarse = torch.randn(n, d_model, max(h0 // 4, 1), max(w0 // 4, 1), generator=generator)
    finest = F.interpolate(coarse, size=(h0, w0), mode="bilinear", align_corners=False)
    levels = [F.adaptive_avg_pool2d(finest, (h, w)) for h, w in spatial_shapes.tolist()]
    return [F.layer_norm(lvl.movedim(1, -1), (d_model,)).movedim(-1, 1) for lvl in levels]


def flatten(torch, levels):
    """Levels (n, C, H, W) -> (n, S, C), row-major level after level."""
    return torch.cat([lvl.flatten(2).transpose(1, 2) for lvl in levels], 1)


def shifted(torch, levels, shift):
    """Every level moved by ``shift`` (x, y) in normalised units [-1, 1] (border padding):
    the target sees at p what the input has at p + shift."""
    F = torch.nn.functional
    out = []
    for lvl in levels:
        theta = torch.tensor([[1.0, 0.0, shift[0]], [0.0, 1.0, shift[1]]]).expand(lvl.shape[0], 2, 3)
        grid = F.affine_grid(theta, list(lvl.shape), align_corners=False)
        out.append(F.grid_sample(lvl, grid, mode="bilinear", padding_mode="border", align_corners=False))
    return out


def time_steps(layers, args, repeat):
    """Each layer's median seconds of a forward + backward step (loss: the output's
    squares' mean), the layers taking turns so that a change in the machine's load
    falls on all of them."""
    times = [[] for _ in layers]
    for i in range(repeat + 1):  # the first round is a warm-up
        for layer, ts in zip(layers, times):
            layer.zero_grad()
            t0 = time.perf_counter()
            layer(*args).square().mean().backward()
            if i:
                ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="Adam steps (default 60)")
    parser.add_argument("--size", type=int, default=16, help="the finest level's side (default 16)")
    parser.add_argument("--levels", type=int, default=3, help="feature levels, halving (default 3)")
    parser.add_argument("--batch", type=int, default=2, help="pyramids per step (default 2)")
    parser.add_argument("--d-model", type=int, default=32, help="channels (default 32)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--points", type=int, default=4, help="sampling points per head and level (default 4)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--repeat", type=int, default=10, help="timed steps per path (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        import onnxruntime  # noqa: F401
        import onnxruntime_extensions  # noqa: F401
        import onnxscript  # noqa: F401
        import torch
    except ImportError as exc:
        print(f"skipped: this example needs torch, onnxscript, onnxruntime and onnxruntime-extensions ({exc})")
        return 0
    import numba_ops.onnx
    import numba_ops.torch as nt

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    d_model = args.d_model
    EncoderLayer, pytorch_twin = build(torch, nt, d_model, 2 * d_model, args.levels, args.heads, args.points)
    shapes, starts = pyramid_tables(torch, args.size, args.levels)
    ref = get_reference_points(torch, shapes, args.batch)
    pos = position_embedding(torch, shapes, d_model, gen).expand(args.batch, -1, -1)
    shift = (0.25, -0.125)  # x, y: 2 and 1 pixels of the finest level at --size 16
    print(f"levels {shapes.tolist()}: {int(shapes.prod(1).sum())} queries per pyramid, d_model {d_model}, "
          f"{args.heads} heads, {args.points} points")

    layer = EncoderLayer()
    opt = torch.optim.Adam(layer.parameters(), lr=args.lr)
    losses, unshifted = [], []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        with torch.no_grad():
            levels = features(torch, args.batch, d_model, shapes, gen)
            src, target = flatten(torch, levels), flatten(torch, shifted(torch, levels, shift))
            unshifted.append(torch.nn.functional.mse_loss(src, target).item())
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(layer(src, pos, ref, shapes, starts), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.5f}")
    print(f"{args.steps} steps of {args.batch} pyramids in {time.perf_counter() - t0:.1f} s; "
          f"loss {losses[0]:.5f} -> {losses[-1]:.5f} (the input itself, unshifted, scores "
          f"{statistics.mean(unshifted):.5f})")

    # the same layer and weights on the pure-PyTorch path: outputs and gradients
    twin = pytorch_twin()
    twin.load_state_dict(layer.state_dict())
    src = flatten(torch, features(torch, args.batch, d_model, shapes, gen))
    inputs = (src, pos, ref, shapes, starts)
    outs, grads = [], []
    for model in (layer, twin):
        model.zero_grad()
        out = model(*inputs)
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    out_err = float((outs[0] - outs[1]).abs().max())
    grad_err = float((grads[0] - grads[1]).abs().max() / grads[1].abs().max())
    print(f"max |numba_ops - pure PyTorch| = {out_err:.2e} (output); {grad_err:.2e} (parameter gradients, "
          f"relative to the largest)")

    t_numba, t_torch = time_steps([layer, twin], inputs, args.repeat)
    print(f"forward + backward, median of {args.repeat}: numba_ops {t_numba * 1e3:.1f} ms, "
          f"pure PyTorch (F.grid_sample per level) {t_torch * 1e3:.1f} ms ({t_torch / t_numba:.2f}x)")

    # export: MSDeformAttn -> numba_ops::MMCVMultiScaleDeformableAttention; run it in onnxruntime
    layer.eval()
    names = ["src", "pos", "reference_points", "spatial_shapes", "level_start_index"]
    with torch.no_grad():
        expected = layer(*inputs).numpy()
    program = torch.onnx.export(layer, inputs, dynamo=True, custom_translation_table=nt.onnx_translations(),
                                input_names=names, output_names=["memory"], verbose=False)
    onnx_model = program.model_proto
    attn = [n for n in onnx_model.graph.node if n.op_type == "MMCVMultiScaleDeformableAttention"]
    print(f"exported graph: {len(onnx_model.graph.node)} nodes, "
          f"{', '.join(f'{n.domain}::{n.op_type}' for n in attn)}")
    sess = numba_ops.onnx.session(onnx_model)
    (memory,) = sess.run(None, {name: t.numpy() for name, t in zip(names, inputs)})
    err = float(np.max(np.abs(memory - expected)))
    print(f"onnxruntime session, numba_ops' nodes {list(sess.numba_ops_nodes)}")
    print(f"max |session - torch| = {err:.2e}")
    if not (out_err < 1e-4 and grad_err < 1e-4 and err < 1e-4 and losses[-1] < losses[0]):
        print("the loss did not go down, or a result differs from torch's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

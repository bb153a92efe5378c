"""Train a small 3-D deformable network in PyTorch on numba_ops' kernels, then export it
to ONNX and run it in onnxruntime.

The network is DCNv2 in 3-D: a Conv3d predicts, at every voxel, 3 offsets and a
mask for each of the 27 points of a 3x3x3 kernel, and ``numba_ops.torch.DeformConv3d``
samples the volume there. The task is synthetic: undo a sub-voxel affine motion of
random blob volumes (the target is the volume before the warp), which the offsets
learn. A few dozen Adam steps on the CPU
bring the loss down; the curve is saved as a PNG (``--out``).

The trained model is exported with ``torch.onnx.export(..., dynamo=True,
custom_translation_table=numba_ops.torch.onnx_translations())``: its DeformConv3d
becomes a standard ONNX DeformConv node (3-D, which onnxruntime alone does not run),
and ``numba_ops.onnx.session`` runs the model with numba_ops' kernel in that node.

    python examples/train_deformable_3d.py --steps 40 --size 12 --out curve.png

Needs torch, onnxscript, onnxruntime and onnxruntime-extensions (matplotlib for the
plot); without them it says so and exits 0.
"""
import argparse
import sys
import time

import numpy as np


def blobs(torch, n, size, generator):
    """``n`` volumes (n, 1, size, size, size) of a few Gaussian blobs each."""
    ax = torch.linspace(-1, 1, size)
    z, y, x = torch.meshgrid(ax, ax, ax, indexing="ij")
    vols = torch.zeros(n, 1, size, size, size)
    for i in range(n):
        for _ in range(4):
            c = torch.rand(3, generator=generator) * 1.4 - 0.7
            s = 0.15 + 0.2 * torch.rand(1, generator=generator)
            vols[i, 0] += torch.exp(-((z - c[0]) ** 2 + (y - c[1]) ** 2 + (x - c[2]) ** 2) / (2 * s ** 2))
    return vols


def deform(torch, nt, vols):
    """The volumes moved by a fixed sub-voxel shift (1.4, -0.7, 0.9 voxels along D, H, W)
    and a slight shear, with ``numba_ops.torch.affine_warp``."""
    n, size = vols.shape[0], vols.shape[-1]
    shift = torch.tensor([0.9, -0.7, 1.4]) * 2 / size  # x (W), y (H), z (D) in normalised units
    theta = torch.cat([torch.eye(3) + torch.tensor([[0, 0.06, 0], [0, 0, 0], [0.05, 0, 0]]), shift[:, None]], 1)
    return nt.affine_warp(vols, theta.expand(n, 3, 4), mode="linear", padding_mode="border")


def build(torch, nt, hidden=8):
    K = 27

    class DeformableNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.features = torch.nn.Sequential(torch.nn.Conv3d(1, hidden, 3, padding=1), torch.nn.ReLU(),
                                                torch.nn.Conv3d(hidden, hidden, 3, padding=1), torch.nn.ReLU())
            self.offset_mask = torch.nn.Conv3d(hidden, 4 * K, 3, padding=1)
            torch.nn.init.zeros_(self.offset_mask.weight)  # start from the regular grid, mask 0.5
            torch.nn.init.zeros_(self.offset_mask.bias)
            self.deform = nt.DeformConv3d(1, hidden, 3, padding=1)
            self.head = torch.nn.Conv3d(hidden, 1, 1)
            torch.nn.init.zeros_(self.head.weight)  # starts as the identity: x + 0
            torch.nn.init.zeros_(self.head.bias)

        def forward(self, x):
            om = self.offset_mask(self.features(x))
            offset, mask = om[:, :3 * K], torch.sigmoid(om[:, 3 * K:])
            return x + self.head(torch.relu(self.deform(x, offset, mask)))

    return DeformableNet()


def plot(losses, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: no plot at {path})")
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(np.arange(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss")
    ax.set_yscale("log")
    ax.set_title("DeformConv3d on numba_ops: training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"loss curve: {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="Adam steps (default 40)")
    parser.add_argument("--size", type=int, default=12, help="volume side in voxels (default 12)")
    parser.add_argument("--batch", type=int, default=4, help="volumes per step (default 4)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="train_deformable_3d.png", help="the loss curve's PNG")
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
    model = build(torch, nt)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        with torch.no_grad():
            clean = blobs(torch, args.batch, args.size, gen)
            warped = deform(torch, nt, clean)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(warped), clean)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.5f}")
    print(f"{args.steps} steps on {args.batch} volumes of {args.size}^3 in {time.perf_counter() - t0:.1f} s; "
          f"loss {losses[0]:.5f} -> {losses[-1]:.5f}")
    plot(losses, args.out)

    # export: DeformConv3d -> a standard ONNX DeformConv node; run it in onnxruntime
    model.eval()
    with torch.no_grad():
        x = deform(torch, nt, blobs(torch, 2, args.size, gen))
        expected = model(x).numpy()
    program = torch.onnx.export(model, (x,), dynamo=True, custom_translation_table=nt.onnx_translations(),
                                input_names=["x"], output_names=["y"], verbose=False)
    onnx_model = program.model_proto
    print("exported graph:", " -> ".join(n.op_type for n in onnx_model.graph.node if n.op_type != "Constant"))
    sess = numba_ops.onnx.session(onnx_model)
    (y,) = sess.run(None, {"x": x.numpy()})
    err = float(np.max(np.abs(y - expected)))
    print(f"onnxruntime session, numba_ops' DeformConv nodes {[name for _, name in sess.numba_ops_nodes]}")
    print(f"max |session - torch| = {err:.2e}")
    if not err < 1e-4:
        print("the session's result differs from torch's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""VoxelMorph-style registration networks in onnxruntime alone and in ``numba_ops.onnx.session``.

    python bench/registration_session.py [--rounds 7] [--runs 5] [--size-2d 160 192]
                                         [--size-3d 64 64 64] [--skip-3d] [--no-profile]

Each model is built with torch and exported by PyTorch's own ONNX exporter
(``torch.onnx.export(..., dynamo=True)``, opset 20, which needs onnxscript) in a
process of its own; the network is ``make_regnet`` (one definition, shared with
``bench/registration_training.py``, which trains it):

- input: the fixed and the moving image concatenated, 1x2xHxW (2-D) or 1x2xDxHxW (3-D);
- a small U-Net: an encoder of 4 levels (3x3(x3) convolutions of stride 2 and
  LeakyReLU(0.2); 16, 32, 32, 32 channels), a decoder of 4 levels (nearest Upsample x2,
  concatenation with the encoder's features of that resolution, or the input at
  full resolution, a 3x3(x3) convolution and LeakyReLU; 32, 32, 32, 16 channels),
  then a convolution to a velocity field of 2 (3) channels at full resolution, in
  normalised coordinates, channel c along the grid's axis c (x, y[, z]);
- integration by scaling and squaring, 7 steps: v = v / 2**7, then 7 times
  v = v + GridSample(v, identity + v) (bilinear, border padding, align_corners; the
  identity grid a constant of the model, from torch's affine_grid);
- the moving image warped by GridSample(moving, identity + flow) (bilinear);
- outputs: the warped image and the flow. Weights from torch.manual_seed(0), the
  last convolution's scaled so that the flow's displacements are a few pixels.

So a model has 8 GridSample nodes. onnxruntime alone (CPUExecutionProvider, default
SessionOptions) and the session (``numba_ops.onnx.session(model)``, default options),
both on onnxruntime's default intra-op thread count, run in processes of their own
that take turns, a round of ``--runs`` calls each, with a pause between rounds
longer than any thread pool's spin (so neither process's idle threads spin into the
other's round).

Printed per model: the exported graph's op counts, the session's ``numba_ops_nodes``
routes, the flow's displacements in pixels, the outputs' largest difference relative
to their scale, each side's first call and median ms per call with the spread of the
round medians (min-max), the speed ratio onnxruntime alone / session, and (unless
``--no-profile``) from onnxruntime's profiler the share of each side's run time spent
in its GridSample nodes.

OpenBLAS runs unpinned: the script re-executes itself without OPENBLAS_CORETYPE /
OPENBLAS_L2_SIZE. Without torch (or onnxscript) nothing is measured (a message says
why); a 3-D model that fails to export, or that onnxruntime refuses, is reported and
skipped.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _harness import Worker, unpin, version  # bench/_harness.py

if __name__ == "__main__":
    unpin()  # before numpy loads OpenBLAS

import numpy as np  # noqa: E402

_HERE = os.path.abspath(__file__)
STEPS = 7  # scaling and squaring
FLOW_PIXELS = 2.0  # RMS of the velocity field, in pixels of the finest axis


def images(shape):
    """The fixed and the moving image: smooth random images in [0, 1]."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    for ax in range(2, len(shape)):  # a few passes of a [1 2 1] blur along each axis: smooth structure
        for _ in range(4):
            x = 0.25 * (np.roll(x, 1, ax) + 2 * x + np.roll(x, -1, ax))
    x = (x - x.min()) / (x.max() - x.min())
    return {"x": x.astype(np.float32)}


# --- the registration network (shared with bench/registration_training.py) -------------------

def _torch_sample(img, grid):
    """``torch.nn.functional.grid_sample``, bilinear, border padding, align_corners."""
    import torch.nn.functional as F
    return F.grid_sample(img, grid, mode="bilinear", padding_mode="border", align_corners=True)


def make_regnet(size, sample=None):
    """The registration network for images of ``size`` (H, W) or (D, H, W), a
    ``torch.nn.Module``: ``forward(x)`` -> (warped moving image, flow) for ``x`` the fixed
    and the moving image concatenated, N x 2 x *size. ``sample(img, grid)`` is the
    GridSample of the transform (bilinear, border padding, align_corners; default
    ``torch.nn.functional.grid_sample``). ``velocity(x)`` is the U-Net alone and
    ``transform(moving, v)`` the scaling and squaring (``STEPS`` GridSamples) and the
    warp (one more). Weights from ``torch.manual_seed(0)``, the last convolution's bias
    zero and its weight scaled so that the velocity field of ``images([1, 2, *size])``
    has an RMS of ``FLOW_PIXELS`` pixels: equal for every ``sample``."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    nd = len(size)
    Conv = nn.Conv2d if nd == 2 else nn.Conv3d
    sample = _torch_sample if sample is None else sample

    class RegNet(nn.Module):
        def __init__(self):
            super().__init__()
            enc, dec = (16, 32, 32, 32), (32, 32, 32, 16)
            self.enc = nn.ModuleList()
            c = 2
            for co in enc:
                self.enc.append(Conv(c, co, 3, 2, 1))
                c = co
            skips = [2] + list(enc[:-1])  # full resolution: the input; then each encoder level's output
            self.dec = nn.ModuleList()
            for co, s in zip(dec, skips[::-1]):
                self.dec.append(Conv(c + s, co, 3, 1, 1))
                c = co
            self.flow = Conv(c, nd, 3, 1, 1)
            theta = torch.zeros(1, nd, nd + 1)
            theta[0, :, :nd] = torch.eye(nd)
            self.register_buffer("identity", F.affine_grid(theta, [1, 1, *size], align_corners=True))

        def velocity(self, x):
            feats = [x]
            for conv in self.enc:
                x = F.leaky_relu(conv(x), 0.2)
                feats.append(x)
            feats.pop()
            for conv in self.dec:
                x = F.interpolate(x, scale_factor=2, mode="nearest")
                x = F.leaky_relu(conv(torch.cat([x, feats.pop()], 1)), 0.2)
            return self.flow(x)

        def _as_grid(self, v):  # N C *S -> N *S C
            return v.permute(0, 2, 3, 1) if nd == 2 else v.permute(0, 2, 3, 4, 1)

        def _sample(self, img, v):
            return sample(img, self.identity + self._as_grid(v))

        def transform(self, moving, v):
            v = v / 2 ** STEPS
            for _ in range(STEPS):
                v = v + self._sample(v, v)
            return self._sample(moving, v), v

        def forward(self, x):
            return self.transform(x[:, 1:2], self.velocity(x))

    torch.manual_seed(0)
    net = RegNet()
    x = torch.from_numpy(images([1, 2, *size])["x"])
    with torch.no_grad():
        net.flow.bias.zero_()
        rms = float(net.velocity(x).pow(2).mean().sqrt())
        net.flow.weight.mul_(FLOW_PIXELS * 2 / (max(size) - 1) / rms)  # normalised units: 2 / (n - 1) a pixel
    return net


# --- the model, exported by PyTorch (in a process of its own: torch's OpenMP and thread
# pools stay out of the timed processes) ----------------------------------------------------

def export_registration(path, size):
    import torch

    net = make_regnet(size).eval()
    x = torch.from_numpy(images([1, 2, *size])["x"])
    torch.onnx.export(net, (x,), path, opset_version=20, dynamo=True, input_names=["x"],
                      output_names=["warped", "flow"], external_data=False)


def _export(path, size):
    """Export in a child process; None on success, else why it was skipped."""
    try:
        import onnxscript  # noqa: F401  (the exporter's dependency)
        import torch  # noqa: F401
    except ImportError as exc:
        return f"torch and onnxscript are needed to build the models ({exc})"
    p = subprocess.run([sys.executable, _HERE, "--export", path, *map(str, size)], capture_output=True, text=True)
    if p.returncode:
        return f"the export failed:\n{p.stderr[-2000:]}"
    return None


# --- the timed processes --------------------------------------------------------------------

KINDS = ("onnxruntime", "session")


def _make(kind, model, so=None):
    import onnxruntime as ort
    so = ort.SessionOptions() if so is None else so
    if kind == "session":
        from numba_ops.onnx import session
        return session(model, so)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _profile(kind, model, feeds, grid_nodes, calls=10):
    """From onnxruntime's profiler over ``calls`` runs of a new session (the first two
    left out): the median run's ms and its GridSample nodes' ms (the medians' sum)."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.enable_profiling = True
    s = _make(kind, model, so)
    for _ in range(calls):
        s.run(None, feeds)
    path = s.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    runs, per = [], {}
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            runs.append(e["dur"] / 1e3)
        elif e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            name = e["name"][:-len("_kernel_time")]
            if name in grid_nodes:
                per.setdefault(name, []).append(e["dur"] / 1e3)
    return {"run": float(np.median(runs[2:])), "grid_sample": sum(float(np.median(v[2:])) for v in per.values()),
            "nodes": len(per)}


def worker(kind, model, shape):
    """Serve rounds on stdin ("run N" -> a JSON list of N seconds; "out PATH"; "profile")."""
    import onnx
    feeds = images(json.loads(shape))
    grid_nodes = {n.name for n in onnx.load(model).graph.node if n.op_type == "GridSample"}
    try:
        t0 = time.perf_counter()
        s = _make(kind, model)
        made = time.perf_counter() - t0
        t0 = time.perf_counter()
        s.run(None, feeds)
        first = time.perf_counter() - t0
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}), flush=True)
        return 1
    for _ in range(5):
        s.run(None, feeds)
    routes = [[r.op, r.node, r.route, r.reason] for r in getattr(s, "numba_ops_nodes", ())]
    print(json.dumps({"made": made, "first": first, "routes": routes}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "run":
            times = []
            for _ in range(int(cmd[1])):
                t = time.perf_counter()
                s.run(None, feeds)
                times.append(time.perf_counter() - t)
            print(json.dumps(times), flush=True)
        elif cmd[0] == "out":
            warped, flow = s.run(None, feeds)
            np.savez(cmd[1], warped=warped, flow=flow)
            print(json.dumps("ok"), flush=True)
        elif cmd[0] == "profile":
            print(json.dumps(_profile(kind, model, feeds, grid_nodes)), flush=True)


def registration(args, tmp, size):
    """Export, check and time one model; the speed ratio, or None where it was skipped."""
    import onnx
    nd = len(size)
    label = f"{nd}-D registration (input 1x2x{'x'.join(map(str, size))})"
    path = os.path.join(tmp, f"reg{nd}d.onnx")
    why = _export(path, size)
    if why:
        print(f"SKIP {label}: {why}")
        return None
    ops = {}
    for n in onnx.load(path).graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    shape = [1, 2, *size]
    procs = {}
    for k in KINDS:
        p = Worker([_HERE, "--worker", k, path, json.dumps(shape)])
        if "error" in p.info:
            p.close()
            for q in procs.values():
                q.close()
            print(f"SKIP {label}: {k} refuses the model: {p.info['error']}")
            return None
        procs[k] = p
    outs = {}
    for k, p in procs.items():
        p.ask(f"out {os.path.join(tmp, k + '.npz')}")
        with np.load(os.path.join(tmp, k + ".npz")) as z:
            outs[k] = {n: z[n] for n in ("warped", "flow")}
    times = {k: [] for k in procs}
    for r in range(args.rounds):
        for k in (KINDS if r % 2 == 0 else KINDS[::-1]):
            time.sleep(0.3)  # longer than numba's OpenMP spin (GOMP_SPINCOUNT) and onnxruntime's
            times[k].append(procs[k].ask(f"run {args.runs}"))
    prof = {k: p.ask("profile") for k, p in procs.items()} if args.profile else None
    for p in procs.values():
        p.close()

    print(f"{label}, exported by torch {version('torch')} (opset 20), onnxruntime {version('onnxruntime')}, "
          f"numba_ops {version('numba_ops')}")
    print("  ops: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))
    routes = procs["session"].info["routes"]
    counts = {}
    for op, _, route, _ in routes:
        counts[op, route] = counts.get((op, route), 0) + 1
    print("  session's numba_ops_nodes: " + ", ".join(f"{n} {op} on the {route!r} route"
                                                     for (op, route), n in counts.items()))
    for op, node, route, reason in routes:
        if route != "compiled":
            print(f"    {op} {node}: {route} ({reason})")
    flow = outs["onnxruntime"]["flow"][0]
    pix = np.stack([flow[c] * (size[nd - 1 - c] - 1) / 2 for c in range(nd)])  # channel c along grid axis c
    mag = np.sqrt((pix ** 2).sum(0))
    print(f"  flow: displacements of {np.sqrt((mag ** 2).mean()):.2f} px RMS, {mag.max():.2f} px at most")
    agree = []
    for n in ("warped", "flow"):
        a, b = outs["onnxruntime"][n], outs["session"][n]
        scale = float(np.abs(a).max())
        agree.append(f"{n} {float(np.abs(a - b).max()) / scale:.1e} (scale {scale:.3g})")
    print("  largest |session - onnxruntime| / scale: " + ", ".join(agree))
    med = {}
    for k, rounds in times.items():
        per_round = [1e3 * np.median(t) for t in rounds]
        med[k] = float(np.median(np.concatenate(rounds))) * 1e3
        info = procs[k].info
        print(f"  {k:<12} median {med[k]:8.2f} ms per call   "
              f"round medians {min(per_round):.2f}-{max(per_round):.2f} ms "
              f"({args.rounds} rounds x {args.runs} calls; created in {1e3 * info['made']:.0f} ms, "
              f"first call {1e3 * info['first']:.0f} ms)")
    ratio = med["onnxruntime"] / med["session"]
    print(f"  speed: onnxruntime alone / session = {ratio:.2f}x")
    if prof:
        for k, pr in prof.items():
            print(f"  profiler, {k:<12}: {pr['nodes']} GridSample nodes {pr['grid_sample']:7.2f} ms of a "
                  f"{pr['run']:7.2f} ms run ({100 * pr['grid_sample'] / pr['run']:.0f} %)")
    return ratio


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=5, help="calls per round")
    ap.add_argument("--size-2d", type=int, nargs=2, default=[160, 192], metavar=("H", "W"))
    ap.add_argument("--size-3d", type=int, nargs=3, default=[64, 64, 64], metavar=("D", "H", "W"))
    ap.add_argument("--skip-3d", action="store_true", help="the 2-D model only")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="leave out onnxruntime's profiler (GridSample's share)")
    ap.add_argument("--export", nargs="+", help=argparse.SUPPRESS)  # PATH SIZE...
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.export:
        return export_registration(args.export[0], [int(n) for n in args.export[1:]])
    if args.worker:
        return worker(*args.worker)
    sizes = [args.size_2d] + ([] if args.skip_3d else [args.size_3d])
    for size in sizes:
        if any(s % 16 for s in size):
            ap.error(f"sizes must be multiples of 16 (4 levels of stride 2); got {size}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            registration(args, tmp, size)


if __name__ == "__main__":
    sys.exit(main())

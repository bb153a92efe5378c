"""A PyTorch training step of a DCNv2 block: ``numba_ops.torch`` against torchvision.

    python bench/torch_training_step.py [--rounds 5] [--steps 3]

The block: input N=2, 64 channels, 56x56 (it requires grad, as a block inside a
network does); a plain ``torch.nn.Conv2d`` 3x3 (padding 1) predicts from it the
offsets (2*9 channels; about half a pixel at its default initialisation) and the mask
(9 channels, a sigmoid); a 3x3 deformable convolution, 64 -> 64 channels, padding 1,
with bias, takes the input, offsets and mask; loss = ``output.square().mean()``. One training step is ``zero_grad``, the
forward, ``loss.backward()`` and ``optimizer.step()`` (SGD, lr 0.01, momentum 0.9),
timed as a whole (and its forward, backward and step parts apart).

Side A's deformable convolution is ``numba_ops.torch.DeformConv2d``, side B's
``torchvision.ops.DeformConv2d``; everything else is the same torch code, and both
start from the same parameters (torchvision's layer drawn from one seed, its weight
and bias copied into ``numba_ops.torch.DeformConv2d``) and the same input.

Each side runs in a process of its own with ``torch.set_num_threads(2)`` and
``NUMBA_NUM_THREADS=2``; after warm-up steps (the first numba_ops call compiles its
kernels or loads them from numba's cache) the two take turns, a round of
``--steps`` steps each, the order alternating from round to round, with a pause
between rounds longer than any thread pool's spin. Printed: the environment; the
gradient check (one forward and backward of each side from the same start: the
losses, and the largest difference of every parameter's and the input's gradient
relative to that gradient's largest magnitude); per side the median ms per step
over all steps with the spread (min-max) of the round medians, and the medians of
the forward, backward and optimizer parts; the share of the deformable
convolution's own operators (forward and backward) in a step, from
``torch.profiler``; and the speed-up, torchvision / numba_ops.

OpenBLAS runs unpinned: the script re-executes itself without OPENBLAS_CORETYPE /
OPENBLAS_L2_SIZE.
"""
import argparse
import json
import os
import platform
import sys
import tempfile
import time

from _harness import Worker, cpu_model, unpin, version  # bench/_harness.py

if __name__ == "__main__":
    unpin()  # before numpy loads OpenBLAS

THREADS = 2
os.environ.setdefault("NUMBA_NUM_THREADS", str(THREADS))  # before numba is imported (the workers inherit it)

import numpy as np  # noqa: E402

_HERE = os.path.abspath(__file__)
SIDES = ("numba_ops", "torchvision")
N, C, OC, H, W, K = 2, 64, 64, 56, 56, 3


# --- the timed processes --------------------------------------------------------------------

def _build(side):
    """The block's modules, its input and an SGD optimizer, equal on both sides."""
    import torch
    from torch import nn
    from torchvision.ops import DeformConv2d as TVDeformConv2d

    torch.manual_seed(0)
    om = nn.Conv2d(C, 3 * K * K, K, padding=1)  # 18 offsets and 9 mask logits per position
    torch.manual_seed(1)
    tv = TVDeformConv2d(C, OC, K, padding=1)
    if side == "numba_ops":
        import numba_ops.torch as nt
        dc = nt.DeformConv2d(C, OC, K, padding=1)
        with torch.no_grad():
            dc.weight.copy_(tv.weight)
            dc.bias.copy_(tv.bias)
    else:
        dc = tv
    x = torch.randn(N, C, H, W, generator=torch.Generator().manual_seed(2)).requires_grad_()
    opt = torch.optim.SGD(list(om.parameters()) + list(dc.parameters()), lr=0.01, momentum=0.9)
    return om, dc, x, opt


def _forward(om, dc, x):
    import torch
    o = om(x)
    y = dc(x, o[:, :2 * K * K], torch.sigmoid(o[:, 2 * K * K:]))
    return y.square().mean()


def _step(om, dc, x, opt):
    """One training step; its forward, backward and optimizer parts in seconds."""
    t0 = time.perf_counter()
    opt.zero_grad()
    x.grad = None
    loss = _forward(om, dc, x)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def _grads(om, dc, x, path):
    """One forward and backward from the start: the loss and the gradients, saved."""
    loss = _forward(om, dc, x)
    loss.backward()
    np.savez(path, loss=loss.detach().numpy(), x=x.grad.numpy(), om_w=om.weight.grad.numpy(),
             om_b=om.bias.grad.numpy(), dc_w=dc.weight.grad.numpy(), dc_b=dc.bias.grad.numpy())


_DEFORM_FORWARD = ("numba_ops::deform_conv", "torchvision::deform_conv2d")
_DEFORM_BACKWARD = ("numba_ops::deform_conv_backward", "torchvision::_deform_conv2d_backward")


def _profile(om, dc, x, opt, steps=2):
    """ms per step in the deformable convolution's own operators (forward, backward)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            _step(om, dc, x, opt)
    fwd = bwd = 0.0
    for e in prof.key_averages():
        if e.key in _DEFORM_FORWARD:
            fwd += e.cpu_time_total / 1e3 / steps
        elif e.key in _DEFORM_BACKWARD:
            bwd += e.cpu_time_total / 1e3 / steps
    return {"forward": fwd, "backward": bwd}


def worker(side, grads_path, warmup):
    """Serve rounds on stdin ("run N" -> a JSON list of N [forward, backward, step] seconds;
    "profile")."""
    import torch
    torch.set_num_threads(THREADS)
    om, dc, x, opt = _build(side)
    _grads(om, dc, x, grads_path)  # also the first call (numba_ops: compile or load the kernels)
    for _ in range(warmup):
        _step(om, dc, x, opt)
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "run":
            print(json.dumps([_step(om, dc, x, opt) for _ in range(int(cmd[1]))]), flush=True)
        elif cmd[0] == "profile":
            print(json.dumps(_profile(om, dc, x, opt)), flush=True)


# --- the report -------------------------------------------------------------------------------

def _environment():
    print(f"environment: torch {version('torch')}, torchvision {version('torchvision')}, numba "
          f"{version('numba')}, numba_ops {version('numba-ops')}, NumPy {np.__version__}, Python "
          f"{platform.python_version()}")
    print(f"  CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; torch.set_num_threads({THREADS}), "
          f"NUMBA_NUM_THREADS={os.environ['NUMBA_NUM_THREADS']}")


def _check(tmp):
    """Print how far the two sides' loss and gradients are apart after one backward."""
    a = np.load(os.path.join(tmp, "numba_ops.npz"))
    b = np.load(os.path.join(tmp, "torchvision.npz"))
    print(f"gradient check (one forward and backward from the same start): loss numba_ops {float(a['loss']):.7g}, "
          f"torchvision {float(b['loss']):.7g}")
    names = {"dc_w": "deform weight", "dc_b": "deform bias", "om_w": "offset/mask conv weight",
             "om_b": "offset/mask conv bias", "x": "input"}
    for k, name in names.items():
        scale = float(np.abs(b[k]).max())
        rel = float(np.abs(a[k] - b[k]).max()) / max(scale, 1e-30)
        print(f"  {name:<24} max |numba_ops - torchvision| / max |torchvision| = {rel:.1e}  (scale {scale:.3g})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="training steps per round and side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side before the rounds (>= 2)")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker, warmup=args.warmup)
    _environment()
    print(f"case: DCNv2 block, N={N}, {C} -> {OC} channels, {H}x{W}, {K}x{K}, padding 1, offsets and mask from a "
          f"Conv2d, loss = mean(y^2), SGD; {args.rounds} rounds x {args.steps} steps, "
          f"{max(2, args.warmup)} warm-up steps")
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for s in SIDES:  # one after the other: the compile or cache load stays out of the other's start
            grads = os.path.join(tmp, s + ".npz")
            procs[s] = Worker([_HERE, "--worker", s, grads, "--warmup", str(max(2, args.warmup))],
                              stderr=grads + ".stderr")  # (the profiler logs there)
        _check(tmp)
        times = {s: [] for s in SIDES}
        for r in range(args.rounds):
            for s in (SIDES if r % 2 == 0 else SIDES[::-1]):
                time.sleep(0.3)  # longer than the OpenMP pools' spin (GOMP_SPINCOUNT)
                times[s].append(np.array(procs[s].ask(f"run {args.steps}")))
        time.sleep(0.3)
        share = {s: procs[s].ask("profile") for s in SIDES}
        for p in procs.values():
            p.close()
    med = {}
    for s in SIDES:
        rounds = times[s]  # rounds x steps x (forward, backward, step)
        total = [1e3 * r.sum(axis=1) for r in rounds]
        per_round = [float(np.median(t)) for t in total]
        med[s] = float(np.median(np.concatenate(total)))
        parts = 1e3 * np.median(np.concatenate(rounds), axis=0)
        print(f"  {s:<12} median {med[s]:8.1f} ms per step   round medians {min(per_round):.1f}-{max(per_round):.1f} ms"
              f"   (forward {parts[0]:.1f}, backward {parts[1]:.1f}, optimizer {parts[2]:.1f} ms)")
    for s in SIDES:
        f, b = share[s]["forward"], share[s]["backward"]
        print(f"  {s:<12} deformable convolution's operators (profiler, 2 steps): forward {f:.1f} ms, backward "
              f"{b:.1f} ms per step")
    print(f"  speed-up: torchvision / numba_ops = {med['torchvision'] / med['numba_ops']:.2f}x per training step")


if __name__ == "__main__":
    sys.exit(main())

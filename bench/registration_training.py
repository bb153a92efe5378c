"""Training a VoxelMorph-style registration network: ``numba_ops.torch.grid_sample`` against torch's.

    python bench/registration_training.py [--rounds 5] [--steps 3] [--size-2d 160 160]
                                          [--size-3d 48 48 48] [--skip-2d] [--skip-3d] [--threads 2]

The network is ``bench/registration_session.py``'s (``make_regnet``, one definition
for both scripts): a small U-Net predicting a velocity field, integrated by scaling
and squaring (7 steps: v = v / 2**7, then 7 times v = v + GridSample(v, identity + v))
and the moving image warped by GridSample(moving, identity + flow); 8 GridSamples in
all, bilinear, border padding, align_corners. Side "numba_ops" calls
``numba_ops.torch.grid_sample`` there, side "torch" ``torch.nn.functional.grid_sample``;
everything else is the same torch code, and both start from the same weights
(``make_regnet``: ``torch.manual_seed(0)``, the velocity a few pixels) and the same
batch of 2 image pairs (``registration_session.images``: smooth random images).

Loss = mean((warped - fixed)^2) + 0.01 * the mean squared finite difference of the
flow (in pixels) along each axis. One training step is ``zero_grad``, the forward,
``loss.backward()`` and ``optimizer.step()`` (SGD, lr 0.01, momentum 0.9), timed as a
whole (and its forward, backward and optimizer parts apart). The transform alone is
timed apart too: the 7 scaling-and-squaring GridSamples and the warp, forward and
backward, on a detached velocity field that requires grad (the network's at the
start) with the same loss. A third process ("free") times the transform alone with
a GridSample that costs nothing (the image itself, a zero gradient for the grid):
what the rest of the transform takes, so ``torch / free`` is the largest speed-up
any GridSample could give the transform, and the difference of each side to it that
side's GridSamples' share.

Each side runs in a process of its own with ``torch.set_num_threads(2)`` and
``NUMBA_NUM_THREADS=2`` (``--threads``: another count for both; 1 where another job
keeps a core of a small machine busy, so that neither side's thread pool waits on a
descheduled thread); after warm-up (the first numba_ops call compiles its kernels
or loads them from numba's cache) the two take turns, a round of ``--steps`` training
steps each and then ``--steps`` transforms each, the order alternating from round to
round, with a pause before each turn longer than any thread pool's spin. Printed: the
environment; per dimensionality the gradient check (one forward and backward of each
side from the same start: the losses, and per parameter the largest difference of its
gradient relative to that gradient's largest magnitude, the worst one shown, and the
same for the transform alone's velocity gradient); per side the median ms per
training step over all steps with the spread (min-max) of the round medians and the
medians of its parts, and the transform alone's median ms with its spread; and the
speed-ups, torch / numba_ops.

Sizes must be multiples of 16 (the U-Net's 4 levels of stride 2). OpenBLAS runs
unpinned: the script re-executes itself without OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE.
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

from registration_session import STEPS, images, make_regnet  # noqa: E402  (bench/registration_session.py)

_HERE = os.path.abspath(__file__)
SIDES = ("numba_ops", "torch")
#: a third process times the transform alone with a GridSample that costs nothing: what
#: the rest of the transform (the additions, the loss and their gradients) takes, and so
#: the largest speed-up over torch that any GridSample could give it
FREE = "free"
N = 2  # image pairs per batch
SMOOTH = 0.01  # weight of the flow's smoothness term


# --- the timed processes --------------------------------------------------------------------

def _sampler(side):
    """The transform's GridSample, ``sample(img, grid)``: bilinear, border, align_corners;
    for side "free" one that costs nothing (``img`` itself, a zero gradient for the grid)."""
    if side == "torch":
        return None  # make_regnet's default, torch.nn.functional.grid_sample
    if side == FREE:
        import torch

        class Free(torch.autograd.Function):
            @staticmethod
            def forward(ctx, img, grid):
                ctx.shape = grid.shape
                return img.clone()

            @staticmethod
            def backward(ctx, grad):
                return grad, grad.new_zeros(ctx.shape)
        return Free.apply
    import numba_ops.torch as nt

    def sample(img, grid):
        return nt.grid_sample(img, grid, mode="bilinear", padding_mode="border", align_corners=True)
    return sample


def _loss(warped, fixed, flow):
    """MSE of the warped moving image to the fixed one, plus SMOOTH x the flow's squared
    finite differences in pixels (channel c along the grid's axis c: x, y[, z])."""
    nd = flow.shape[1]
    size = flow.shape[2:]
    pix = [flow[:, c] * ((size[nd - 1 - c] - 1) / 2) for c in range(nd)]
    smooth = 0.0
    for p in pix:
        for ax in range(1, nd + 1):
            smooth = smooth + p.diff(dim=ax).square().mean()
    return (warped - fixed).square().mean() + SMOOTH * smooth / nd


def _build(side, size):
    """The network, the batch (fixed and moving images), an SGD optimizer, and the
    velocity field at the start (detached, requiring grad) for the transform alone."""
    import torch
    net = make_regnet(size, _sampler(side)).train()
    x = torch.from_numpy(images([N, 2, *size])["x"])
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    with torch.no_grad():
        v = net.velocity(x)
    return net, x, opt, v.requires_grad_()


def _forward(net, x):
    warped, flow = net(x)
    return _loss(warped, x[:, :1], flow)


def _step(net, x, opt):
    """One training step; its forward, backward and optimizer parts in seconds."""
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = _forward(net, x)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def _transform(net, x, v):
    """The transform alone, forward and backward of the loss in v; in seconds."""
    t0 = time.perf_counter()
    v.grad = None
    warped, flow = net.transform(x[:, 1:2], v)
    _loss(warped, x[:, :1], flow).backward()
    return time.perf_counter() - t0


def _grads(net, x, v, path):
    """One forward and backward from the start (the whole network, and the transform
    alone): the losses and the gradients, saved."""
    loss = _forward(net, x)
    loss.backward()
    warped, flow = net.transform(x[:, 1:2], v)
    tloss = _loss(warped, x[:, :1], flow)
    tloss.backward()
    grads = {"p." + k: p.grad.numpy() for k, p in net.named_parameters()}
    np.savez(path, loss=loss.detach().numpy(), tloss=tloss.detach().numpy(), v=v.grad.numpy(),
             flow=flow.detach().numpy(), **grads)
    net.zero_grad()
    v.grad = None


def worker(side, size, grads_path, warmup, threads):
    """Serve rounds on stdin ("run N" -> a JSON list of N [forward, backward, step] seconds;
    "transform N" -> a JSON list of N seconds)."""
    import torch
    torch.set_num_threads(threads)
    net, x, opt, v = _build(side, json.loads(size))
    _grads(net, x, v, grads_path)  # also the first call (numba_ops: compile or load the kernels)
    for _ in range(warmup):
        _step(net, x, opt)
        _transform(net, x, v)
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "run":
            print(json.dumps([_step(net, x, opt) for _ in range(int(cmd[1]))]), flush=True)
        elif cmd[0] == "transform":
            print(json.dumps([_transform(net, x, v) for _ in range(int(cmd[1]))]), flush=True)


# --- the report -------------------------------------------------------------------------------

def _environment(threads):
    print(f"environment: torch {version('torch')}, numba {version('numba')}, numba_ops {version('numba-ops')}, "
          f"NumPy {np.__version__}, Python {platform.python_version()}")
    print(f"  CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; torch.set_num_threads({threads}), "
          f"NUMBA_NUM_THREADS={os.environ['NUMBA_NUM_THREADS']}")


def _rel(a, b):
    return float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-30)


def _check(tmp):
    """Print how far the two sides' losses and gradients are apart after one backward."""
    a = np.load(os.path.join(tmp, "numba_ops.npz"))
    b = np.load(os.path.join(tmp, "torch.npz"))
    print(f"  gradient check (one forward and backward from the same start): loss numba_ops "
          f"{float(a['loss']):.7g}, torch {float(b['loss']):.7g}; transform alone: loss numba_ops "
          f"{float(a['tloss']):.7g}, torch {float(b['tloss']):.7g}")
    rel = {k[2:]: _rel(a[k], b[k]) for k in b.files if k.startswith("p.")}
    worst = max(rel, key=rel.get)
    print(f"    max |numba_ops - torch| / max |torch| over the network's {len(rel)} parameter gradients: "
          f"{rel[worst]:.1e} ({worst}; median over them {np.median(list(rel.values())):.1e})")
    print(f"    transform alone: velocity gradient {_rel(a['v'], b['v']):.1e}, flow {_rel(a['flow'], b['flow']):.1e}")


def registration(args, tmp, size):
    nd = len(size)
    print(f"{nd}-D: batch {N}x2x{'x'.join(map(str, size))}, {STEPS} scaling-and-squaring steps and the warp "
          f"({STEPS + 1} GridSamples: bilinear, border, align_corners), SGD; {args.rounds} rounds x {args.steps} "
          f"steps, {max(2, args.warmup)} warm-up steps")
    procs = {}
    for s in SIDES + (FREE,):  # one after the other: the compile or cache load stays out of the other's start
        grads = os.path.join(tmp, s + ".npz")
        procs[s] = Worker([_HERE, "--worker", s, json.dumps(size), grads, "--warmup", str(max(2, args.warmup)),
                           "--threads", str(args.threads)], stderr=grads + ".stderr")
    _check(tmp)
    steps = {s: [] for s in SIDES}
    trans = {s: [] for s in SIDES + (FREE,)}
    for r in range(args.rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for s in order:
            time.sleep(0.3)  # longer than the OpenMP pools' spin (GOMP_SPINCOUNT)
            steps[s].append(np.array(procs[s].ask(f"run {args.steps}")))
        for s in order + (FREE,) if r % 2 == 0 else (FREE,) + order:
            time.sleep(0.3)
            trans[s].append(1e3 * np.array(procs[s].ask(f"transform {args.steps}")))
    for p in procs.values():
        p.close()
    med, tmed = {}, {}
    for s in SIDES:
        rounds = steps[s]  # rounds x steps x (forward, backward, step)
        total = [1e3 * r.sum(axis=1) for r in rounds]
        per_round = [float(np.median(t)) for t in total]
        med[s] = float(np.median(np.concatenate(total)))
        parts = 1e3 * np.median(np.concatenate(rounds), axis=0)
        print(f"  {s:<10} median {med[s]:8.1f} ms per training step   round medians {min(per_round):.1f}-"
              f"{max(per_round):.1f} ms   (forward {parts[0]:.1f}, backward {parts[1]:.1f}, optimizer "
              f"{parts[2]:.1f} ms)")
    for s in SIDES + (FREE,):
        per_round = [float(np.median(t)) for t in trans[s]]
        tmed[s] = float(np.median(np.concatenate(trans[s])))
        print(f"  {s:<10} median {tmed[s]:8.1f} ms per transform alone (forward and backward)   round medians "
              f"{min(per_round):.1f}-{max(per_round):.1f} ms" + ("   (GridSample at no cost)" if s == FREE else ""))
    print(f"  speed-up: torch / numba_ops = {tmed['torch'] / tmed['numba_ops']:.2f}x the transform alone, "
          f"{med['torch'] / med['numba_ops']:.2f}x per training step")
    own = {s: tmed[s] - tmed[FREE] for s in SIDES}  # the GridSamples' share of each side's transform
    print(f"  bound: torch / free = {tmed['torch'] / tmed[FREE]:.2f}x the transform alone (the most that any "
          f"GridSample could give); the GridSamples' own share: torch {own['torch']:.1f} ms, numba_ops "
          f"{own['numba_ops']:.1f} ms ({own['torch'] / own['numba_ops']:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="training steps (and transforms) per round and side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side before the rounds (>= 2)")
    ap.add_argument("--size-2d", type=int, nargs=2, default=[160, 160], metavar=("H", "W"))
    ap.add_argument("--size-3d", type=int, nargs=3, default=[48, 48, 48], metavar=("D", "H", "W"))
    ap.add_argument("--skip-2d", action="store_true", help="the 3-D network only")
    ap.add_argument("--skip-3d", action="store_true", help="the 2-D network only")
    ap.add_argument("--threads", type=int, default=THREADS,
                    help="torch's and numba's threads per side (default %(default)s)")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # SIDE SIZE GRADS_PATH
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker, warmup=args.warmup, threads=args.threads)
    sizes = ([] if args.skip_2d else [args.size_2d]) + ([] if args.skip_3d else [args.size_3d])
    for size in sizes:
        if any(s % 16 for s in size):
            ap.error(f"sizes must be multiples of 16 (4 levels of stride 2); got {size}")
    os.environ["NUMBA_NUM_THREADS"] = str(args.threads)  # the workers inherit it
    _environment(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            registration(args, tmp, size)


if __name__ == "__main__":
    sys.exit(main())

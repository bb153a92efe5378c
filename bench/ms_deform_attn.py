"""Multi-scale deformable attention: ``numba_ops.ms_deform_attn`` (forward, and forward
plus backward) against the pure-PyTorch path that mmcv, HF transformers and
ultralytics run on the CPU (``multi_scale_deformable_attn_pytorch``: a
``grid_sample`` per level, every sample materialised), on Deformable DETR's shapes:
4 levels of an 800x1200 image (100x150, 50x75, 25x38, 13x19; S = 19,947), 8 heads
x 32 channels, 4 points.

* ``enc_n1`` / ``enc_n2``: the encoder, every position a query (Lq = S), N = 1 and 2;
* ``dec_300``: the decoder, 300 queries, N = 1.

Locations are each query's reference point (the encoder: its own position's centre
on every level; the decoder: random) plus offsets of a few elements, as a trained
model's are. Each side runs in its own process (no two thread pools spinning on
one machine), rounds alternating; per case the median time of each round's best of
``--reps`` calls, and the process's peak memory growth over the case (ru_maxrss).

    python bench/ms_deform_attn.py [--rounds 3] [--reps 5] [--threads 2] [--only enc_n1,dec_300]
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Worker, unpin, version  # noqa: E402

LEVELS = [(100, 150), (50, 75), (25, 38), (13, 19)]
CASES = {"enc_n1": (1, None), "enc_n2": (2, None), "dec_300": (1, 300)}
M, DH, P = 8, 32, 4


def inputs(name):
    import numpy as np
    N, Lq = CASES[name]
    rng = np.random.default_rng(0)
    S = sum(h * w for h, w in LEVELS)
    if Lq is None:
        Lq = S
        ref = np.concatenate([np.stack(np.meshgrid((np.arange(w) + 0.5) / w, (np.arange(h) + 0.5) / h), -1)
                              .reshape(-1, 2) for h, w in LEVELS])
    else:
        ref = rng.random((Lq, 2))
    wh = np.array([[w, h] for h, w in LEVELS], np.float64)
    loc = ref[None, :, None, None, None, :] + rng.normal(0, 2, (N, Lq, M, len(LEVELS), P, 2)) / wh[:, None, :]
    value = rng.standard_normal((N, S, M, DH), np.float32)
    attn = rng.random((N, Lq, M, len(LEVELS), P), np.float32)
    attn /= attn.sum(axis=(-2, -1), keepdims=True)
    grad = rng.standard_normal((N, Lq, M * DH), np.float32)
    starts = np.concatenate(([0], np.cumsum([h * w for h, w in LEVELS])[:-1]))
    return value, np.array(LEVELS), starts, loc.astype(np.float32), attn, grad


def torch_path(torch, value, shapes, loc, attn):
    """mmcv's ``multi_scale_deformable_attn_pytorch`` (one definition, shared with
    ``numba-ops bench``'s PyTorch peer: ``numba_ops.benchmark.cases.ms_deform_attn_torch``)."""
    from numba_ops.benchmark.cases import ms_deform_attn_torch
    return ms_deform_attn_torch(value, shapes, loc, attn)


def worker(side, threads):
    if side == "torch":
        import torch
        torch.set_num_threads(threads)
    else:
        import numba
        import numba_ops
        numba.set_num_threads(threads)
    print(json.dumps({"side": side}), flush=True)
    for line in sys.stdin:
        name, what, reps = line.split()
        value, shapes, starts, loc, attn, grad = inputs(name)
        if side == "torch":
            vt, lt, at = (torch.tensor(a, requires_grad=(what == "fwdbwd")) for a in (value, loc, attn))
            gt = torch.tensor(grad)

            def run():
                if what == "fwd":
                    with torch.no_grad():
                        torch_path(torch, vt, shapes, lt, at)
                else:
                    out = torch_path(torch, vt, shapes, lt, at)
                    torch.autograd.grad(out, (vt, lt, at), gt)
        else:
            def run():
                numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)
                if what == "fwdbwd":
                    numba_ops.ms_deform_attn_backward(grad, value, shapes, starts, loc, attn)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run()  # warm-up (and compile)
        times = []
        for _ in range(int(reps)):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(json.dumps({"t": min(times), "peak_mb": grown / 1024}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.threads)
    unpin()
    print(f"numba_ops {version('numba_ops')}, numba {version('numba')}, torch {version('torch')}, "
          f"{a.threads} threads, {a.rounds} rounds of the best of {a.reps}")
    here = os.path.abspath(__file__)
    sides = {s: Worker([here, "--worker", s, "--threads", str(a.threads)]) for s in ("ours", "torch")}
    print(f"{'case':<16}{'pure PyTorch ms':>18}{'numba_ops ms':>16}{'speed-up':>10}{'peak MB torch/ours':>22}")
    for name in a.only.split(","):
        for what in ("fwd", "fwdbwd"):
            res = {s: [] for s in sides}
            for _ in range(a.rounds):
                for s, w in sides.items():
                    time.sleep(0.5)  # the other side's thread pool stops spinning first
                    res[s].append(w.ask(f"{name} {what} {a.reps}"))
            t = {s: statistics.median(r["t"] for r in res[s]) * 1e3 for s in sides}
            spread = {s: (min(r["t"] for r in res[s]) * 1e3, max(r["t"] for r in res[s]) * 1e3) for s in sides}
            mem = {s: max(r["peak_mb"] for r in res[s]) for s in sides}
            print(f"{name + ' ' + what:<16}{t['torch']:>10.1f} ({spread['torch'][0]:.0f}-{spread['torch'][1]:.0f})"
                  f"{t['ours']:>9.1f} ({spread['ours'][0]:.0f}-{spread['ours'][1]:.0f})"
                  f"{t['torch'] / t['ours']:>9.1f}x{mem['torch']:>12.0f} / {mem['ours']:.0f}", flush=True)
    for w in sides.values():
        w.close()


if __name__ == "__main__":
    main()

"""What a call through ``numba_ops.torch`` costs over the NumPy call, per op.

    python bench/per_call.py [--calls 5000] [--blocks 7]

Tiny inputs (a 2x2 image or level, one channel, one point), where the kernel's
work is nothing and the per-call cost is all there is: each op called from NumPy
arrays and through ``numba_ops.torch`` on CPU tensors, with and without inputs
that require grad (the autograd layer records the call), and the backward: the
NumPy backward function against ``torch.autograd.grad`` of a recorded call (torch's
autograd engine included). The sides alternate block by block; each figure is the
best of ``--blocks`` blocks of ``--calls`` calls, one thread.
"""
import argparse
import time

import numpy as np
import torch

import numba_ops
import numba_ops.torch as nt


def cases():
    """{op: (numpy call, torch call, torch tensors that may require grad, numpy backward call
    of the result's gradient)}"""
    x = torch.arange(4.0).reshape(1, 1, 2, 2)
    grid = torch.zeros(1, 1, 1, 2)
    theta = torch.eye(2, 3)[None]
    w = torch.ones(1, 1, 1, 1)
    off = torch.zeros(1, 2, 2, 2)
    value = torch.arange(4.0).reshape(1, 4, 1, 1)
    shapes, starts = torch.tensor([[2, 2]]), torch.tensor([0])
    loc, attn = torch.full((1, 1, 1, 1, 1, 2), 0.5), torch.ones(1, 1, 1, 1, 1)
    n = {k: t.numpy() for k, t in dict(x=x, grid=grid, theta=theta, w=w, off=off, value=value, shapes=shapes,
                                       starts=starts, loc=loc, attn=attn).items()}
    return {
        "affine_grid": (lambda: numba_ops.affine_grid(n["theta"], (1, 1, 2, 2)),
                        lambda t: nt.affine_grid(t[0], (1, 1, 2, 2)), [theta],
                        lambda g: numba_ops.affine_grid_backward(g, (1, 1, 2, 2))),
        "grid_sample": (lambda: numba_ops.grid_sample(n["x"], n["grid"]),
                        lambda t: nt.grid_sample(t[0], t[1]), [x, grid],
                        lambda g: numba_ops.grid_sample_backward(g, n["x"], n["grid"])),
        "affine_warp": (lambda: numba_ops.affine_warp(n["x"], n["theta"]),
                        lambda t: nt.affine_warp(t[0], t[1]), [x, theta],
                        lambda g: numba_ops.affine_warp_backward(g, n["x"], n["theta"])),
        "deform_conv": (lambda: numba_ops.deform_conv(n["x"], n["w"], n["off"]),
                        lambda t: nt.deform_conv(t[0], t[1], t[2]), [x, w, off],
                        lambda g: numba_ops.deform_conv_backward(g, n["x"], n["w"], n["off"])),
        "ms_deform_attn": (lambda: numba_ops.ms_deform_attn(n["value"], n["shapes"], n["starts"], n["loc"], n["attn"]),
                           lambda t: nt.ms_deform_attn(t[0], shapes, starts, t[1], t[2]), [value, loc, attn],
                           lambda g: numba_ops.ms_deform_attn_backward(g, n["value"], n["shapes"], n["starts"],
                                                                      n["loc"], n["attn"])),
    }


def best_us(f, calls, blocks):
    """The best of ``blocks`` blocks of ``calls`` calls, microseconds per call."""
    best = float("inf")
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--blocks", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)  # (numba_ops runs calls this small on the caller's thread)
    print(f"us per call, best of {a.blocks} blocks of {a.calls} (torch {torch.__version__}, "
          f"numba_ops {numba_ops.__version__}, 1 thread)")
    floor = torch.ones(1, requires_grad=True)
    y1 = floor * 2
    g1 = torch.ones_like(y1)
    f_floor = lambda: torch.autograd.grad(y1, [floor], g1, retain_graph=True)  # noqa: E731
    for _ in range(100):
        f_floor()
    floor_us = min(best_us(f_floor, a.calls, 1) for _ in range(a.blocks))
    print(f"(torch.autograd.grad of one native multiply: {floor_us:.1f} us)")
    print(f"{'op':16s} {'numpy':>7s} {'torch':>7s} {'+grad':>7s} {'over':>7s} {'over+grad':>9s}  "
          f"{'bwd numpy':>9s} {'bwd torch':>9s} {'over':>7s}")
    for op, (f_np, f_t, tensors, b_np) in cases().items():
        grads = [t.clone().requires_grad_() for t in tensors]
        y = f_t(grads)
        gy, g_np = torch.ones_like(y), np.ones_like(f_np())
        sides = {"numpy": f_np, "torch": lambda: f_t(tensors), "+grad": lambda: f_t(grads),
                 "bwd numpy": lambda: b_np(g_np),
                 "bwd torch": lambda: torch.autograd.grad(y, grads, gy, retain_graph=True)}
        for f in sides.values():  # compile and warm
            for _ in range(100):
                f()
        best = {k: float("inf") for k in sides}
        for _ in range(a.blocks):  # alternate the sides block by block
            for k, f in sides.items():
                best[k] = min(best[k], best_us(f, a.calls, 1))
        print(f"{op:16s} {best['numpy']:7.1f} {best['torch']:7.1f} {best['+grad']:7.1f} "
              f"{best['torch'] - best['numpy']:7.1f} {best['+grad'] - best['numpy']:9.1f}  "
              f"{best['bwd numpy']:9.1f} {best['bwd torch']:9.1f} {best['bwd torch'] - best['bwd numpy']:7.1f}")


if __name__ == "__main__":
    main()

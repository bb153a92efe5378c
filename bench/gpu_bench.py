"""The GPU benchmark: numba_ops' CUDA kernels beside PyTorch on one GPU.

One run, a few minutes, on a machine with an NVIDIA GPU, numba-cuda and (for the
peers) torch/torchvision with CUDA:

    python bench/gpu_bench.py                    # float32, every case
    python bench/gpu_bench.py --dtype float16 --dtype bfloat16
    python bench/gpu_bench.py --only dc_ --json gpu.json

Cases are the shared case table's (``numba_ops.benchmark.cases``), made GPU-sized: the
AffineGrid cases plus the target case ``ag2d_256x512`` (a 256-batch 512 × 512
grid), and every DeformConv case with its batch scaled × 16. For each it prints
our time, torch's ``affine_grid`` / torchvision's ``deform_conv2d`` on the same
device tensors, the achieved GB/s (AffineGrid: bytes written; against the GPU's
write bandwidth, measured here with a large ``fill``) or GFLOP/s (DeformConv: the
dense convolution's 2·N·oC·P·(C/group)·K), the ratio to the peer, and the
largest difference from the peer's result. Targets: AffineGrid ≥ 80 %
of write bandwidth on ``ag2d_256x512``; DeformConv ≥ 2 × torchvision.

Inputs live on the device as torch tensors when torch has CUDA (so our zero-copy
``__cuda_array_interface__`` import is what is timed, bfloat16 included), else
as numba device arrays. Timing: CUDA events around back-to-back calls after a
warm-up (first-call JIT time is reported on its own).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numba_ops  # noqa: E402
from numba_ops import _dtypes  # noqa: E402
from numba_ops.benchmark import cases as _cases  # noqa: E402

BATCH_SCALE = 16
TARGET_AFFINE = "ag2d_256x512"
AFFINE_GPU = dict(_cases.AFFINE, **{TARGET_AFFINE: dict(size=(256, 3, 512, 512), align=0)})


def _torch():
    try:
        import torch
        if torch.cuda.is_available():
            return torch
    except Exception:  # torch absent or broken: peers are skipped
        pass
    return None


def time_gpu(fn, sync, min_s=0.3, max_reps=200):
    """Median seconds per call over back-to-back batches, timed with CUDA events."""
    from numba import cuda
    fn()
    sync()
    start, stop = cuda.event(), cuda.event()
    t0 = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max_reps, max(3, min_s / one)))
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        sync()
        samples.append(cuda.event_elapsed_time(start, stop) / 1e3 / reps)
    return statistics.median(samples)


def write_bandwidth(torch):
    """Bytes/s of a 2 GiB device fill: the write limit AffineGrid is held to."""
    from numba import cuda
    n = 1 << 29  # float32 elements
    if torch is not None:
        buf = torch.empty(n, dtype=torch.float32, device="cuda")
        t = time_gpu(lambda: buf.fill_(1.0), torch.cuda.synchronize)
    else:
        buf = cuda.device_array(n, dtype=np.float32)

        @cuda.jit
        def fill(a):
            i0 = cuda.grid(1)
            for i in range(i0, a.shape[0], cuda.gridsize(1)):
                a[i] = 1.0
        t = time_gpu(lambda: fill[4096, 256](buf), cuda.synchronize)
    return 4 * n / t


def to_dev(a, torch):
    """A host array (or None) as device input: a torch CUDA tensor if torch has CUDA."""
    if a is None:
        return None
    if torch is not None:
        if a.dtype == _dtypes.np_dtype("bfloat16"):
            return torch.from_numpy(a.astype(np.float32)).to("cuda").to(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a)).to("cuda")
    from numba import cuda
    return cuda.to_device(a)


def host(a):
    if hasattr(a, "copy_to_host"):
        return a.copy_to_host()
    if hasattr(a, "detach"):
        return a.detach().float().cpu().numpy()
    return np.asarray(a)


def affine_case(name, dtype, torch):
    size = tuple(AFFINE_GPU[name]["size"])
    align = AFFINE_GPU[name]["align"]
    nd = len(size) - 2
    theta = np.random.default_rng(0).standard_normal((size[0], nd, nd + 1)).astype(np.float32)
    theta = theta.astype(_dtypes.np_dtype(dtype))
    nbytes = int(np.prod([size[0], *size[2:]])) * nd * theta.dtype.itemsize
    dth = to_dev(theta, torch)
    ours = lambda: numba_ops.affine_grid(dth, size, align)  # noqa: E731
    from numba import cuda
    from numba_ops._dtypes import storage
    from numba_ops.kernels.cuda import _device, affine_grid as cuda_ag
    buf = cuda.device_array(nbytes // theta.dtype.itemsize, dtype=storage(theta.dtype))
    dflat = _device.as_device_array(dth, "theta") if not isinstance(dth, np.ndarray) else dth
    kernel_only = lambda: cuda_ag.launch_into(dflat, size, align, buf)  # noqa: E731
    peer = None
    if torch is not None:
        F = torch.nn.functional
        peer = lambda: F.affine_grid(dth, list(size), align_corners=bool(align))  # noqa: E731
    return ours, peer, nbytes, kernel_only


def deform_case(name, dtype, torch):
    (X, W, off, B, mask), attrs, flops = _cases.deform_inputs(name, dtype)
    reps = [1] * X.ndim
    reps[0] = BATCH_SCALE
    X, off = np.tile(X, reps), np.tile(off, reps)
    mask = None if mask is None else np.tile(mask, reps)
    flops *= BATCH_SCALE
    dX, dW, doff, dB, dmask = (to_dev(a, torch) for a in (X, W, off, B, mask))
    ours = lambda: numba_ops.deform_conv(dX, dW, doff, dB, dmask, **attrs)  # noqa: E731
    peer = None
    if torch is not None and X.ndim == 4:  # torchvision's deform_conv2d: 2-D only
        try:
            from torchvision.ops import deform_conv2d
            k = attrs["kernel_shape"]
            peer = lambda: deform_conv2d(dX, doff, dW, dB, stride=tuple(attrs["strides"]),  # noqa: E731
                                         padding=tuple(attrs["pads"][:2]), dilation=tuple(attrs["dilations"]),
                                         mask=dmask)
            assert tuple(k) == tuple(W.shape[2:])
        except ImportError:
            peer = None
    return ours, peer, flops, None


def run(names, dtypes, as_json=None):
    from numba import cuda
    torch = _torch()
    dev = cuda.get_current_device()
    dname = getattr(dev, "name", "?")
    print(f"GPU: {dname.decode() if isinstance(dname, bytes) else dname}, "
          f"cc {dev.compute_capability}, numba_ops {numba_ops.__version__}, "
          f"torch {'%s (CUDA)' % torch.__version__ if torch else 'not available'}")
    sync_t = torch.cuda.synchronize if torch is not None else (lambda: None)

    def sync():
        cuda.synchronize()
        sync_t()
    bw = write_bandwidth(torch)
    print(f"write bandwidth (device fill): {bw / 1e9:.0f} GB/s\n")
    hdr = f"{'case':<18}{'dtype':<10}{'jit s':>7}{'ours ms':>10}{'peer ms':>10}{'x peer':>8}  {'rate':>22}  {'max|diff|':>10}"
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for name in names:
        for dtype in dtypes:
            op = "affine_grid" if name in AFFINE_GPU else "deform_conv"
            build = affine_case if op == "affine_grid" else deform_case
            ours, peer, work, kernel_only = build(name, dtype, torch)
            t0 = time.perf_counter()
            out = ours()
            sync()
            jit_s = time.perf_counter() - t0
            t_ours = time_gpu(ours, sync)
            t_kernel = time_gpu(kernel_only, sync) if kernel_only is not None else None
            t_peer, diff = None, None
            if peer is not None:
                try:
                    ref = peer()
                    sync()
                    t_peer = time_gpu(peer, sync)
                    a, b = host(out).astype(np.float64), host(ref).astype(np.float64)
                    diff = float(np.max(np.abs(a - b))) if a.shape == b.shape else float("nan")
                except Exception as exc:  # e.g. a dtype the peer lacks
                    print(f"  (peer failed on {name} {dtype}: {type(exc).__name__}: {exc})")
            if op == "affine_grid":
                rate = f"{work / t_ours / 1e9:7.0f} GB/s ({100 * work / t_ours / bw:3.0f}%)"
                rate += f"; kernels alone {work / t_kernel / 1e9:.0f} GB/s ({100 * work / t_kernel / bw:.0f}%)"
            else:
                rate = f"{work / t_ours / 1e9:9.0f} GFLOP/s"
            ratio = f"{t_peer / t_ours:6.2f}x" if t_peer else "   n/a"
            print(f"{name:<18}{dtype:<10}{jit_s:7.1f}{t_ours * 1e3:10.3f}"
                  f"{(t_peer * 1e3 if t_peer else float('nan')):10.3f}{ratio:>8}  {rate:>22}  "
                  f"{(diff if diff is not None else float('nan')):10.2e}")
            rows.append(dict(case=name, op=op, dtype=dtype, jit_s=jit_s, ours_s=t_ours, peer_s=t_peer,
                             kernels_only_s=t_kernel, work=work, max_abs_diff=diff,
                             fraction_of_write_bw=(work / t_ours / bw) if op == "affine_grid" else None,
                             kernels_fraction_of_write_bw=(work / t_kernel / bw) if t_kernel else None))
    print("\ntargets:")
    for r in rows:
        if r["case"] == TARGET_AFFINE:
            ok = r["fraction_of_write_bw"] >= 0.8
            print(f"  AffineGrid {TARGET_AFFINE} {r['dtype']}: {100 * r['fraction_of_write_bw']:.0f}% of write "
                  f"bandwidth per call, {100 * r['kernels_fraction_of_write_bw']:.0f}% for the kernels alone "
                  f"(target >= 80%): {'MET' if ok else 'NOT MET'}")
        if r["op"] == "deform_conv" and r["peer_s"]:
            sp = r["peer_s"] / r["ours_s"]
            print(f"  DeformConv {r['case']} x{BATCH_SCALE} {r['dtype']}: {sp:.2f}x torchvision (target >= 2x): "
                  f"{'MET' if sp >= 2 else 'NOT MET'}")
    if as_json:
        Path(as_json).write_text(json.dumps(dict(write_bandwidth=bw, rows=rows), indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", action="append", choices=_dtypes.NAMES,
                    help="repeatable; default float32")
    ap.add_argument("--only", default="", help="run the cases whose name starts with this")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if "cuda" not in numba_ops.devices() or numba_ops._dispatch.cuda_simulator():
        raise SystemExit("gpu_bench.py needs a real CUDA GPU (and not NUMBA_ENABLE_CUDASIM)")
    names = [n for n in list(AFFINE_GPU) + list(_cases.DEFORM) if n.startswith(args.only)]
    run(names, args.dtype or ["float32"], args.json)


if __name__ == "__main__":
    main()

"""GridSample / affine_warp against their peers.

    python bench/grid_sample_peers.py [--reps N]
    python bench/grid_sample_peers.py --processes [--rounds R] [--reps N] [--threads T] [--only SUBSTRINGS]

Default: against onnxruntime, in one process, taking turns call by call. Cases
gs2d_32x256 (x 32x3x256x256, grid from ag2d_32x256's theta,
linear, zeros), gs3d_4x64 (x 4x1x64^3, ag3d_4x64's grid, trilinear, border),
gs2d_cubic_8x256 (x 8x3x256x256, cubic, reflection), aw2d_32x256 (affine_warp of
the first, against our own affine_grid + grid_sample and onnxruntime's AffineGrid
+ GridSample), and the dtypes of gs2d_32x256. Prints median and best ms per
implementation (float32, align_corners=0, onnxruntime with 2 intra-op threads).

``--processes``: the case table's GridSample and affine_warp cases (the grids users
make among them: ``gs*_aug_*``, ``gs2d_flow_*``, ``aw*_aug_*``, and the
standard-normal ones) against PyTorch's ``grid_sample`` (affine_warp: its
``affine_grid`` + ``grid_sample``) and, for affine_warp, our own affine_grid +
grid_sample; each implementation in a fresh process of its own, the processes of a
round taking turns (the first alternating between rounds), each case's figure the
median over the rounds of its median of ``--reps`` calls after warm-up (T threads
for both numba and PyTorch, default 2). Run it without this machine's OpenBLAS
pinning: ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/grid_sample_peers.py --processes``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

import numba_ops
from numba_ops.benchmark.cases import affine_inputs


def _session(nodes, inputs, opset=20):
    import onnxruntime as ort
    from onnx import TensorProto, helper
    tp = {"int64": TensorProto.INT64, "float32": TensorProto.FLOAT}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, tp[str(v.dtype)], v.shape)
                                           for k, v in inputs.items()],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda: sess.run(None, inputs)


def _gs_node(mode, padding, grid="G"):
    from onnx import helper
    return helper.make_node("GridSample", ["X", grid], ["Y"], mode=mode, padding_mode=padding, align_corners=0)


def _turns(fns, reps):
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: (1e3 * np.median(v), 1e3 * np.min(v)) for k, v in times.items()}


#: torch's names of the modes
_TORCH_MODE = {"linear": "bilinear", "nearest": "nearest", "cubic": "bicubic"}
_IMPLS = ("numba_ops", "numba_ops two-step", "torch")


def _peer_call(impl, name):
    """A zero-argument call of case ``name`` by ``impl`` (None: the case has no such peer)."""
    from numba_ops.benchmark import cases as _cases
    op = _cases.op_of(name)
    args, kw, _ = _cases.sample_inputs(name)
    x = args[0]
    align = bool(kw["align_corners"])
    if impl == "numba_ops":
        return lambda: getattr(numba_ops, op)(*args, **kw)
    if op == "grid_sample" and impl == "numba_ops two-step":
        return None
    size = tuple(int(s) for s in args[2]) if op == "affine_warp" else None
    if impl == "numba_ops two-step":
        return lambda: numba_ops.grid_sample(x, numba_ops.affine_grid(args[1], size, align_corners=align), **kw)
    if x.dtype == np.uint8:
        return None  # torch samples no uint8
    import torch
    F = torch.nn.functional
    tx = torch.from_numpy(x)
    tkw = dict(mode=_TORCH_MODE[kw["mode"]], padding_mode=kw["padding_mode"], align_corners=align)
    if op == "grid_sample":
        tg = torch.from_numpy(args[1])
        return lambda: F.grid_sample(tx, tg, **tkw)
    tt = torch.from_numpy(args[1])
    return lambda: F.grid_sample(tx, F.affine_grid(tt, size, align_corners=align), **tkw)


def _worker(impl, names, reps, threads):
    """One implementation's medians (ms) of the cases ``names``, as a JSON line."""
    import numba
    numba.set_num_threads(threads)
    if impl == "torch":
        import torch
        torch.set_num_threads(threads)
    out = {}
    for name in names:
        fn = _peer_call(impl, name)
        if fn is None:
            continue
        t_warm = time.perf_counter() + 0.3
        fn()
        while time.perf_counter() < t_warm:
            fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(ts)
    print(json.dumps(out))


def _processes(args):
    from numba_ops.benchmark import cases as _cases
    names = [n for n in _cases.SAMPLE if not args.only or any(s in n for s in args.only.split(","))]
    got = {impl: {n: [] for n in names} for impl in _IMPLS}
    for rnd in range(args.rounds):
        order = _IMPLS if rnd % 2 == 0 else _IMPLS[::-1]
        for impl in order:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--cases", ",".join(names),
                   "--reps", str(args.reps), "--threads", str(args.threads)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            for n, ms in json.loads(res.stdout.strip().splitlines()[-1]).items():
                got[impl][n].append(ms)
    med = {impl: {n: statistics.median(v) for n, v in d.items() if v} for impl, d in got.items()}
    print(f"{'case':26s} {'numba_ops ms':>13s} {'torch ms':>9s} {'torch/ours':>10s} {'two-step ms':>12s} "
          f"{'two-step/fused':>14s}   (rounds: numba_ops ms)")
    for n in names:
        ours = med["numba_ops"].get(n)
        tch = med["torch"].get(n)
        two = med["numba_ops two-step"].get(n)
        f = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        rnds = ", ".join(f"{v:.1f}" for v in got["numba_ops"][n])
        print(f"{n:26s} {f(ours):>13s} {f(tch):>9s} {f(tch / ours if tch else None):>10s} {f(two):>12s} "
              f"{f(two / ours if two else None):>14s}   ({rnds})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--processes", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="")
    ap.add_argument("--worker")
    ap.add_argument("--cases", default="")
    args = ap.parse_args()
    if args.worker:
        return _worker(args.worker, args.cases.split(","), args.reps, args.threads)
    if args.processes:
        return _processes(args)
    reps = args.reps
    rng = np.random.default_rng(0)
    (theta, size), _, _ = affine_inputs("ag2d_32x256")
    size = tuple(int(s) for s in size)
    grid = numba_ops.affine_grid(theta, size)
    x = rng.standard_normal(size).astype(np.float32)
    (th3, size3), _, _ = affine_inputs("ag3d_4x64")
    size3 = tuple(int(s) for s in size3)
    g3 = numba_ops.affine_grid(th3, size3)
    x3 = rng.standard_normal(size3).astype(np.float32)
    xc, gc = x[:8].copy(), grid[:8].copy()
    from onnx import helper
    ag_node = helper.make_node("AffineGrid", ["T", "S"], ["G"], align_corners=0)
    cases = {
        "gs2d_32x256": {"numba_ops": lambda: numba_ops.grid_sample(x, grid),
                        "onnxruntime": _session([_gs_node("linear", "zeros")], {"X": x, "G": grid})},
        "gs3d_4x64": {"numba_ops": lambda: numba_ops.grid_sample(x3, g3, padding_mode="border"),
                      "onnxruntime": _session([_gs_node("linear", "border")], {"X": x3, "G": g3})},
        "gs2d_cubic_8x256": {"numba_ops": lambda: numba_ops.grid_sample(xc, gc, mode="cubic",
                                                                        padding_mode="reflection"),
                             "onnxruntime": _session([_gs_node("cubic", "reflection")], {"X": xc, "G": gc})},
        "aw2d_32x256": {"numba_ops": lambda: numba_ops.affine_warp(x, theta),
                        "numba_ops two-step": lambda: numba_ops.grid_sample(x, numba_ops.affine_grid(theta, size)),
                        "onnxruntime two-step": _session([ag_node, _gs_node("linear", "zeros")],
                                                         {"X": x, "T": theta, "S": np.array(size, np.int64)})},
        "gs2d_32x256 dtypes": {np.dtype(dt).name: (lambda xd=x.astype(dt), gd=grid.astype(dt):
                                                   numba_ops.grid_sample(xd, gd))
                               for dt in (np.float32, np.float16, ml_dtypes.bfloat16)},
    }
    xu = np.clip(x * 40 + 128, 0, 255).astype(np.uint8)
    cases["gs2d_32x256 dtypes"]["uint8"] = lambda: numba_ops.grid_sample(xu, grid)
    for name, fns in cases.items():
        res = _turns(fns, reps)
        print(name + ": " + ", ".join(f"{k} {med:.1f} (best {best:.1f})" for k, (med, best) in res.items()))


if __name__ == "__main__":
    main()

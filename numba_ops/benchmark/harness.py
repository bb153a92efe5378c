"""The benchmark table of ``numba-ops bench``, saved runs (``--json``) and
``--compare`` with one.

``bench`` times every case of ``numba_ops.benchmark.cases`` (the case names of the shared
peer benchmark) with numba_ops and with each installed peer (onnxruntime,
PyTorch/torchvision), each implementation in a process of its own so that the
runtimes' thread pools do not fight over the cores. A case is timed warm (median
of back-to-back calls) and cold (median of calls made after 200 ms idle, as a
program calls an op between other work). The machine's limits are measured in
the same run, in a process of their own: write bandwidth (a numba ``prange``
fill), then per case the alloc+fill floor of an AffineGrid output or the GEMM
rate (NumPy's, or PyTorch's where faster) that bounds a DeformConv. The gradient
cases (``cases.BACKWARD``, ``*_bwd``) have their limits too (DeformConv's: twice
the forward's FLOPs at the GEMM rate; the others': bytes at the write bandwidth)
and PyTorch autograd's backward alone as their peer (``_torch_backward``). The
processes take turns case by case (the limit, then each implementation), so load
from elsewhere on a shared machine falls on all of a case's figures alike. The
table's figures (fraction of the limit, speed relative to each peer) are for
reading, not for gating: a ratio to a noisy peer moves with the load.

A run saved with ``--json`` (format ``FORMAT``) also holds numba_ops' own
per-round samples of each case, timed as ``--against`` times a side (rounds of
fresh processes, ``against.take_rounds``). ``--compare FILE`` takes such rounds
now and judges them against FILE's with ``--against``'s statistics and verdicts
(``stats.judge``; "undecided" when the noise is too large to say), failing only
when FILE comes from the same machine and package versions (``machine.diff``) and
other processes left about the same share of the CPUs free during both (``load_share``).
For a check that holds on any machine, see ``against`` (``--against REV``).
"""
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time

import numpy as np
from numba import prange

from . import cases as _cases
from . import machine, protocol, stats

PEERS = ("onnxruntime", "torch")
#: the version of the ``--json`` format. 2: each case holds numba_ops' per-round
#: samples (``samples``, seconds), the evidence ``--compare`` judges, and the run its
#: timing config (``sampling``); format 1 (no ``format`` key) held single figures.
FORMAT = 2


def _gemm_text(limits, sep):
    """The GEMM rate of a limits record, as the tables print it ("" if it has none)."""
    if "gemm_GFLOPs" not in limits:
        return ""
    return f"{sep}GEMM {limits['gemm_GFLOPs']:.1f} GFLOP/s ({limits['gemm_by']}, {limits['gemm_dtype']})"


# --------------------------------------------------------------------------
# workers (one process per implementation)
# --------------------------------------------------------------------------

def _timing(quick, repeat):
    """(warm repeats, warmup calls, seconds budget per case, cold repeats)."""
    if repeat is not None:
        return repeat, 1, 60.0, repeat
    return (7, 2, 2.0, 2) if quick else (9, 2, 15.0, 5)


#: warm-up lasts at least this long: after idle (another implementation's turn) this
#: VM runs the first ~10 ms of calls up to 2x slower, whatever the code (a prange fill too)
WARMUP_S = 0.05


def time_runs(fn, repeat, warmup, budget_s):
    """Seconds of each of ``repeat`` back-to-back calls, after ``warmup`` calls
    (compilation included there) and at least ``WARMUP_S`` of calls; stops early
    past ``budget_s`` once 3 are in."""
    t_warm = time.perf_counter() + WARMUP_S
    for _ in range(warmup):
        fn()
    while time.perf_counter() < t_warm:
        fn()
    ts = []
    t_end = time.perf_counter() + budget_s
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if len(ts) >= 3 and time.perf_counter() > t_end:
            break
    return ts


def time_best(fn, repeat, warmup, budget_s):
    """Fastest of back-to-back calls: what the machine can do, as noise only adds time."""
    return min(time_runs(fn, repeat, warmup, budget_s))


def time_cold(fn, repeat, idle_s=0.2):
    """Median seconds of a call made after ``idle_s`` of sleep, as a program calls
    an op between other work (caches cooled, thread pools asleep)."""
    ts = []
    for _ in range(repeat):
        time.sleep(idle_s)
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _ort_session(op, named, attrs, opset, device, nodes=None):
    """A zero-argument onnxruntime call of one ``op`` node on the inputs ``named``
    ([(name, array)]), or of the graph ``nodes`` (ending in output "y") when given."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    vi = [helper.make_tensor_value_info(
        n, TensorProto.INT64 if v.dtype == np.int64 else helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
        for n, v in named]
    if nodes is None:
        nodes = [helper.make_node(op, [n for n, _ in named], ["y"], **attrs)]
    out_t = helper.np_dtype_to_tensor_dtype(named[0][1].dtype)
    g = helper.make_graph(nodes, "g", vi, [helper.make_tensor_value_info("y", out_t, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    s = ort.InferenceSession(m.SerializeToString(), providers=providers)
    feed = dict(named)
    return lambda: s.run(None, feed)[0]


def _ort_sample(op, args, kw, device):
    """onnxruntime's GridSample (opset 20) for a grid_sample case, AffineGrid then
    GridSample for an affine_warp case; x in float32 (the peers' dtype, also for uint8 x)."""
    from onnx import helper
    x = args[0].astype(np.float32)
    attrs = {"mode": kw["mode"], "padding_mode": kw["padding_mode"], "align_corners": int(kw["align_corners"])}
    if op == "grid_sample":
        return _ort_session("GridSample", [("X", x), ("grid", args[1])], attrs, 20, device)
    theta, size = args[1], np.asarray(args[2], dtype=np.int64)
    nodes = [helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=attrs["align_corners"]),
             helper.make_node("GridSample", ["X", "grid"], ["y"], **attrs)]
    return _ort_session(None, [("X", x), ("theta", theta), ("size", size)], None, 20, device, nodes)


#: numba_ops' sampling modes by PyTorch's names (PyTorch's "bilinear" is n-linear)
_TORCH_MODE = {"linear": "bilinear", "nearest": "nearest", "cubic": "bicubic"}


def _torch_forward(op, args, kw, dev, grad=False):
    """``(f, leaves)``: ``f()`` runs forward ``op`` of a case's inputs ``args`` in PyTorch
    (torchvision's ``deform_conv2d`` for DeformConv, mmcv's pure-PyTorch path
    ``cases.ms_deform_attn_torch`` for ms_deform_attn) on ``dev``; ``leaves``, the tensors
    made of the float inputs, ``requires_grad`` when ``grad``. Or a string saying why
    PyTorch has no such case."""
    import torch
    import torch.nn.functional as F

    def tensor(a):
        return None if a is None else torch.from_numpy(a).to(dev).requires_grad_(grad)

    if op == "affine_grid":
        theta = tensor(args[0])
        shape = [int(s) for s in args[1]]
        align = bool(kw["align_corners"])
        return (lambda: F.affine_grid(theta, shape, align_corners=align)), [theta]
    if op in ("grid_sample", "affine_warp"):
        x = tensor(args[0].astype(np.float32))
        if kw["mode"] == "cubic" and x.ndim != 4:
            return "PyTorch has no cubic grid_sample beyond 2-D"
        opts = dict(mode=_TORCH_MODE[kw["mode"]], padding_mode=kw["padding_mode"],
                    align_corners=bool(kw["align_corners"]))
        pos = tensor(args[1])  # the grid, or theta
        if op == "grid_sample":
            return (lambda: F.grid_sample(x, pos, **opts)), [x, pos]
        shape = [int(s) for s in args[2]]
        return (lambda: F.grid_sample(x, F.affine_grid(pos, shape, align_corners=opts["align_corners"]),
                                      **opts)), [x, pos]
    if op == "ms_deform_attn":
        value, shapes, _, loc, attn = args
        if shapes.shape[1] != 2:
            return "mmcv's PyTorch path is 2-D only"
        vt, lt, at = (tensor(a.astype(np.float32)) for a in (value, loc, attn))
        levels = [(int(h), int(w)) for h, w in shapes]
        return (lambda: _cases.ms_deform_attn_torch(vt, levels, lt, at)), [vt, lt, at]
    if op != "deform_conv":
        return f"no PyTorch counterpart of {op} in the bench"
    if args[0].ndim != 4:
        return "torch's DeformConv is 2-D only"
    import torchvision.ops as tvo  # infers group and offset_group from W's and offset's shapes, as ONNX does
    X, W, off, B, mask = (tensor(a) for a in args)
    return (lambda: tvo.deform_conv2d(X, off, W, B, stride=kw["strides"], padding=kw["pads"][:2],
                                      dilation=kw["dilations"], mask=mask)), [X, W, off, B, mask]


def _torch_backward(name, dev, sync):
    """PyTorch autograd's backward of gradient case ``name``: the forward runs once,
    here, outside the timing; the call times ``torch.autograd.grad`` of its result
    (``retain_graph=True``, so every call walks the same graph) for every float input
    (DeformConv's five, x and the grid or theta, AffineGrid's theta, ms_deform_attn's
    value, locations and weights), with the case's
    ``grad_y``: the backward alone, the gradients numba_ops computes."""
    import torch
    op, args, kw, gy, _ = _cases.backward_parts(name, "float32")
    made = _torch_forward(op, args, kw, dev, grad=True)
    if isinstance(made, str):
        return made
    f, leaves = made
    leaves = [t for t in leaves if t is not None]
    y = f()
    g = torch.from_numpy(gy).to(dev)
    sync()
    return lambda: (torch.autograd.grad(y, leaves, g, retain_graph=True), sync())


def _peer_fn(impl, name, device):
    """A zero-argument call of peer ``impl`` on case ``name`` (float32, as the peers
    are timed), or a string saying why the peer has no such case. A gradient case's
    peer is PyTorch autograd's backward alone (``_torch_backward``)."""
    if impl not in PEERS:
        raise ValueError(f"unknown implementation {impl!r}")
    backward = _cases.is_backward(name)
    if impl == "onnxruntime" and backward:
        return "onnxruntime has no gradients (inference only)"
    if impl == "torch":
        import torch
        dev = "cuda" if device == "cuda" else "cpu"
        if dev == "cuda" and not torch.cuda.is_available():
            return "PyTorch has no CUDA here"
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        if backward:
            return _torch_backward(name, dev, sync)
        op, args, kw, _ = _cases.inputs(name, "float32")
        made = _torch_forward(op, args, kw, dev)
        if isinstance(made, str):
            return made
        f = made[0]
        return lambda: (f(), sync())
    op, args, kw, _ = _cases.inputs(name, "float32")
    if op == "deform_conv" and args[0].ndim != 4:
        return f"{impl}'s DeformConv is 2-D only"
    if device == "cuda":
        import onnxruntime as ort
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return "this onnxruntime has no CUDAExecutionProvider"
    if op == "affine_grid":
        theta, size = args
        return _ort_session("AffineGrid", [("theta", theta), ("size", size)],
                            {"align_corners": kw["align_corners"]}, 20, device)
    if op == "deform_conv":
        named = [(n, a) for n, a in zip(("X", "W", "offset", "B", "mask"), args) if a is not None]
        return _ort_session("DeformConv", named, kw, 22, device)
    if op in ("grid_sample", "affine_warp"):
        return _ort_sample(op, args, kw, device)
    return f"no onnxruntime counterpart of {op} in the bench"


def _ours_fn(name, dtype, device):
    if device != "cuda":
        return _cases.call(name, dtype, device=device)
    from numba import cuda
    op, args, kw, _ = _cases.inputs(name, dtype)
    import numba_ops
    # float inputs go to the device first, so the copy is not timed; integer ones (sizes) stay
    dargs = [a if a is None or a.dtype.kind in "iu" else cuda.to_device(a) for a in args]
    fn = getattr(numba_ops, op)
    return lambda: (fn(*dargs, device="cuda", **kw), cuda.synchronize())


def _fill_parallel(a, v):
    for i in prange(a.size):
        a[i] = v


def _fill_serial(a, v):
    for i in range(a.size):
        a[i] = v


class _Limits:
    """This machine's limits, measured in the limits worker: write bandwidth and the
    GEMM rate (in the accumulation dtype) once at the start, then, case by case
    beside the implementations' timings, the limit time of each case: the
    alloc+fill floor of an AffineGrid output, or a DeformConv's dense-conv FLOPs
    at the GEMM rate measured again then. All from fastest runs."""

    def __init__(self, cfg):
        from numba import njit

        self.cfg = cfg
        self.reps = 1 if cfg["repeat"] == 1 else 3 if cfg["quick"] else 5
        self.acc = np.float64 if cfg["dtype"] == "float64" else np.float32
        if cfg["device"] == "cuda":
            from numba import cuda

            @cuda.jit
            def fill(a, v):
                for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
                    a[i] = v

            def pfill(a, v):
                fill[256, 256](a, v)
                cuda.synchronize()
            self.empty, self.fills = cuda.device_array, (pfill,)
        else:
            from ..kernels.cpu import _runtime  # noqa: F401  (numba_ops' threading layer, before the pool starts)
            self.empty = np.empty
            self.fills = (njit(cache=True)(_fill_serial), njit(parallel=True, cache=True)(_fill_parallel))
        self.m = np.random.default_rng(0).standard_normal((2048, 2048)).astype(self.acc)
        self.tm = None
        if "torch" in cfg["peers"]:
            try:
                import torch
                if cfg["device"] != "cuda" or torch.cuda.is_available():
                    self.tm = torch.from_numpy(self.m).to(cfg["device"])
                    self.sync = torch.cuda.synchronize if cfg["device"] == "cuda" else (lambda: None)
            except ImportError:
                pass

    def gemm(self):
        """{by: GFLOP/s} of a 2048² GEMM, NumPy's (CPU) and PyTorch's (if a peer)."""
        out = {}
        flops = 2 * 2048 ** 3
        if self.cfg["device"] != "cuda":
            out["numpy"] = flops / time_best(lambda: self.m @ self.m, self.reps, 1, 20.0) / 1e9
        if self.tm is not None:
            out["torch"] = flops / time_best(lambda: (self.tm @ self.tm, self.sync()), self.reps, 1, 20.0) / 1e9
        return out

    def overall(self):
        pfill = self.fills[-1]
        a = self.empty(64 * 2 ** 20, dtype=np.float32)  # 256 MiB
        pfill(a, 0.0)
        out = {"write_GBps": a.nbytes / time_best(lambda: pfill(a, 1.0), self.reps, 1, 10.0) / 1e9}
        self.write_GBps = out["write_GBps"]
        if self.cfg["device"] != "cuda":
            out["write_GBps_numpy_fill"] = a.nbytes / time_best(lambda: a.fill(1.0), self.reps, 1, 10.0) / 1e9
        a = None  # (the 256 MiB go before the GEMM's operands come)
        gemm = self.gemm()
        for k, v in gemm.items():
            out[f"gemm_GFLOPs_{k}"] = v
        if gemm:
            best = max(gemm, key=gemm.get)
            out["gemm_GFLOPs"], out["gemm_by"] = gemm[best], best
        out["gemm_dtype"] = np.dtype(self.acc).name
        return out

    def case(self, name):
        """{"case", "bound_ms", "limit"} for one case, measured now."""
        op = _cases.op_of(name)
        if op == "affine_grid":
            # allocate the output and write every element once, serially or in
            # parallel, whichever is faster for that size
            store = {2: np.uint16, 4: np.float32, 8: np.float64}[_cases.np_dtype(self.cfg["dtype"]).itemsize]
            n = _cases.inputs(name, self.cfg["dtype"])[3] // np.dtype(store).itemsize
            r = 1 if self.cfg["repeat"] == 1 else max(self.reps, 5)
            zero = store(0)
            ms = 1e3 * min(time_best(lambda f=f: f(self.empty(n, store), zero), r, 1, 5.0) for f in self.fills)
            return {"case": name, "bound_ms": ms, "limit": "alloc+fill floor"}
        if _LIMIT_KIND.get(op) == "bytes at write bandwidth":
            # the bytes read (x, grid or theta; a gradient's grad_y) and written, at the write bandwidth
            nbytes = _cases.inputs(name, self.cfg["dtype"])[3]
            return {"case": name, "bound_ms": nbytes / (self.write_GBps * 1e9) * 1e3, "limit": _LIMIT_KIND[op]}
        if op not in ("deform_conv", "deform_conv_backward"):
            return {"case": name, "skip": f"no limit defined for {op}"}
        gemm = self.gemm()
        if not gemm:
            return {"case": name, "skip": "no GEMM to measure on this device"}
        rate = max(gemm.values())
        flops = _cases.inputs(name, self.cfg["dtype"])[3]  # a gradient's: 2x its forward's
        return {"case": name, "bound_ms": flops / (rate * 1e9) * 1e3, "limit": "GEMM-bound time",
                "gemm_GFLOPs": rate}


def _time_case(impl, name, cfg):
    warm, warmup, budget, cold = _timing(cfg["quick"], cfg["repeat"])
    try:
        if impl == "numba_ops":
            fn = _ours_fn(name, cfg["dtype"], cfg["device"])
        else:
            fn = _peer_fn(impl, name, cfg["device"])
        if isinstance(fn, str):
            return {"case": name, "skip": fn}
        ts = time_runs(fn, warm, warmup, budget)
        cold_ms = 1e3 * time_cold(fn, cold)
        row = {"case": name, "ms": 1e3 * statistics.median(ts), "best_ms": 1e3 * min(ts), "cold_ms": cold_ms}
        if impl == "numba_ops" and name in _cases.BACKWARD and cfg["device"] != "cuda":
            # our forward on the same inputs, right after: the table's backward / forward
            import numba_ops
            op, fargs, kw, _, _ = _cases.backward_parts(name, cfg["dtype"])
            fwd = getattr(numba_ops, op)
            row["fwd_ms"] = 1e3 * statistics.median(time_runs(lambda: fwd(*fargs, **kw), warm, warmup, budget))
        return row
    except Exception as exc:  # one failing case must not hide the others
        return {"case": name, "error": f"{type(exc).__name__}: {exc}"[:300]}


_PRELOAD = {"numba_ops": ("numba_ops",), "onnxruntime": ("onnx", "onnxruntime"), "torch": ("torch", "torchvision")}


def worker(cfg):
    """A worker process: import the implementation (the limits worker measures the
    overall limits), report ready, then time (or bound) each case named on stdin,
    one per line."""
    impl = cfg["impl"]
    limits = None
    try:  # imports now, so that they never overlap another implementation's timing
        for mod in _PRELOAD.get(impl, ()):
            importlib.import_module(mod)
        if impl == "limits":
            limits = _Limits(cfg)
            ready = {"ready": impl, "limits": limits.overall()}
        else:
            ready = {"ready": impl}
    except ImportError as exc:
        protocol.emit({"ready": impl, "error": f"{type(exc).__name__}: {exc}"})
        return 0
    protocol.emit(ready)
    for line in sys.stdin:
        name = line.strip()
        if name:
            protocol.emit(limits.case(name) if limits else _time_case(impl, name, cfg))
    return 0


# --------------------------------------------------------------------------
# bench: driver, table, gate
# --------------------------------------------------------------------------

def _installed_peers():
    have = []
    if importlib.util.find_spec("onnxruntime") and importlib.util.find_spec("onnx"):
        have.append("onnxruntime")
    if importlib.util.find_spec("torch") and importlib.util.find_spec("torchvision"):
        have.append("torch")
    return have


def worker_argv():
    """The command line that starts a worker process (``numba_ops.cli.main(["_worker", cfg])``)."""
    return [sys.executable, "-m", "numba_ops.cli"]


def _worker(cfg):
    """One implementation in a process of its own, timing the cases it is sent."""
    return protocol.Worker(cfg["impl"], worker_argv() + ["_worker", json.dumps(cfg)])


#: idle time before each turn of the bench (longer than any peer's spin-wait after a call)
_SETTLE_S = 0.3


def _measure(impls, cases, base_cfg, log):
    """{impl: {case: event}} and the overall limits. Every implementation's process,
    and the limits', starts and imports first; then the cases are timed case by
    case, the limit first and the implementations taking turns, so that a burst of
    load on a shared machine falls on all of a case's figures alike."""
    workers, results, limits = {}, {}, {}
    try:
        for impl in ["limits"] + impls:  # one at a time: no import overlaps the limits' measurement
            w = _worker(dict(base_cfg, impl=impl))
            ev = w.event()
            if ev is None or "error" in ev:
                log(f"  [{impl}] not timed: {ev['error'] if ev else w.died()}")
                w.close()
                continue
            workers[impl], results[impl] = w, {}
            if impl == "limits":
                limits = ev["limits"]
                log(f"  [limits] write {limits['write_GBps']:.2f} GB/s{_gemm_text(limits, ', ')}")
        for name in cases:
            for impl, w in workers.items():
                # the previous turn's thread pool may still spin (numba_ops' libgomp ~0.1 s after a
                # call, onnxruntime's and PyTorch's a while too): on a few cores it would steal this
                # turn's, so each turn starts once the last one's spinning is over
                time.sleep(_SETTLE_S)
                ev = w.ask(name)
                results[impl][name] = ev
                if "bound_ms" in ev:
                    log(f"  [limits] {name}: {ev['limit']} {ev['bound_ms']:.3f} ms")
                elif "ms" in ev:
                    log(f"  [{impl}] {name}: {ev['ms']:.3f} ms warm, {ev['cold_ms']:.3f} ms cold")
                else:
                    log(f"  [{impl}] {name}: " + ("skipped: " + ev["skip"] if "skip" in ev else "ERROR " + ev["error"]))
    finally:
        for w in workers.values():
            w.close()
    return results, limits


def figures(row):
    """The machine-independent figures of one case row: fraction of the machine's
    limit reached, and speed relative to each peer (peer time / our time).

    They use each implementation's fastest warm call (``best_ms``), as the limits
    use the fastest run of theirs: on a shared machine noise only adds time, so
    the fastest call is the steadiest estimate of what the code can do.
    """
    t = row.get("best_ms") or row["ms"]
    ours = t.get("numba_ops")
    out = {}
    if not ours:
        return out
    if row.get("bound_ms"):
        out["fraction_of_limit"] = row["bound_ms"] / ours
    for peer in PEERS:
        if t.get(peer):
            out["speed_vs_" + peer] = t[peer] / ours
    return out


#: the limit of each op's cases (``_Limits.case``); an op without one has no "% of limit"
_LIMIT_KIND = {"affine_grid": "alloc+fill floor", "deform_conv": "GEMM-bound time",
               "grid_sample": "bytes at write bandwidth", "affine_warp": "bytes at write bandwidth",
               # the gradients (cases.BACKWARD): DeformConv's at 2x its forward's FLOPs
               "deform_conv_backward": "GEMM-bound time", "grid_sample_backward": "bytes at write bandwidth",
               "affine_warp_backward": "bytes at write bandwidth", "affine_grid_backward": "bytes at write bandwidth",
               # multi-scale deformable attention: value, locations, weights and the result (the
               # gradient: grad_out and those three, read, and their gradients written)
               "ms_deform_attn": "bytes at write bandwidth", "ms_deform_attn_backward": "bytes at write bandwidth"}


def _table(results, cases):
    table = {}
    lim = results.pop("limits", {})
    for name in cases:
        op = _cases.op_of(name)
        ms = {impl: results[impl][name]["ms"] for impl in results if "ms" in results[impl].get(name, {})}
        cold = {impl: results[impl][name]["cold_ms"] for impl in ms}
        best = {impl: results[impl][name]["best_ms"] for impl in ms}
        bound = lim.get(name, {}).get("bound_ms")
        what = lim.get(name, {}).get("limit") or _LIMIT_KIND.get(op)
        row = {"op": op, "ms": ms, "best_ms": best, "cold_ms": cold, "bound_ms": bound, "limit": what}
        fwd = results.get("numba_ops", {}).get(name, {}).get("fwd_ms")
        if fwd:
            row["fwd_ms"] = fwd
        row["figures"] = figures(row)
        table[name] = row
    return table


def _fmt_ms(v):
    return "-" if v is None else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def print_table(report, out=print):
    cases = report["cases"]
    peers = [p for p in PEERS if any(p in r["ms"] for r in cases.values())]
    lim = report.get("limits", {})
    out("")
    out(f"numba-ops bench: device {report['device']}, dtype {report['dtype']} (peers float32), "
        f"{report['threads']} threads on {report['cpus']} CPUs{', quick' if report['quick'] else ''}")
    if lim:
        out(f"limits: write bandwidth {lim['write_GBps']:.2f} GB/s (numba prange fill){_gemm_text(lim, '; ')}")
    ratios = any(r.get("fwd_ms") for r in cases.values())  # gradients: backward / our forward
    head = ["case", "numba_ops ms", "cold ms"] + [f"{p} ms" for p in peers] + ["ours/best peer", "% of limit", "limit ms"]
    head += ["bwd/fwd"] if ratios else []
    rows = []
    for name, r in cases.items():
        ours = r["ms"].get("numba_ops")
        best = min((r["ms"][p], p) for p in peers if p in r["ms"]) if any(p in r["ms"] for p in peers) else None
        ratio = f"{ours / best[0]:.2f}x {best[1]}" if ours and best else "-"
        frac = r["figures"].get("fraction_of_limit")
        rows.append([name, _fmt_ms(ours), _fmt_ms(r["cold_ms"].get("numba_ops"))]
                    + [_fmt_ms(r["ms"].get(p)) for p in peers]
                    + [ratio, "-" if frac is None else f"{100 * frac:.3g}%", _fmt_ms(r["bound_ms"])]
                    + ([f"{ours / r['fwd_ms']:.1f}" if ours and r.get("fwd_ms") else "-"] if ratios else []))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for i, line in enumerate([head] + rows):
        out("  ".join(str(c).ljust(w) if j == 0 else str(c).rjust(w) for j, (c, w) in enumerate(zip(line, widths))))
    out("ms: warm medians. ours/best peer: our median over the fastest peer's (below 1: faster). "
        "% of limit: the limit's time over our fastest call (AffineGrid: alloc+fill floor; "
        "DeformConv: dense-conv FLOPs at the GEMM rate; GridSample, affine_warp, ms_deform_attn: bytes "
        "read and written at the write bandwidth).")
    if any(r.get("op", "").endswith("_backward") for r in cases.values()):
        out("*_bwd: the gradients (every input's), against PyTorch autograd's backward alone (the forward "
            "made outside the timing); their limit: DeformConv's 2x its forward's dense-conv FLOPs at the "
            "GEMM rate, the others' bytes read and written at the write bandwidth; bwd/fwd: our backward's "
            "median over our forward's on the same inputs (timed right after it, in the same process).")


def take_samples(cases, dtype, device, quick, rounds=None, log=print):
    """numba_ops' own per-round samples of each case, the evidence ``--compare``
    judges: (the timing config, {case: {"current": [seconds of each call, per
    round]} or {"error": why}}). Timed exactly as ``--against`` times a side
    (``against.take_rounds``: fresh worker processes, the same turns), in the source
    tree that holds the imported numba_ops."""
    import numba_ops

    from . import against
    tree = os.path.dirname(os.path.dirname(os.path.abspath(numba_ops.__file__)))
    mode = dict(against.QUICK if quick else against.FULL, settle_s=against.SETTLE_S)
    if rounds:
        mode["rounds"] = rounds
    cfg = {"cases_module": against.CASES_MODULE, "dtype": dtype, "device": device, **mode}
    log(f"numba_ops' samples: {mode['rounds']} rounds of fresh processes, as --against times a side")
    try:
        _, recs, _ = against.take_rounds({"current": (tree, against.worker_env(tree))}, cfg, lambda _: cases, log)
    except against.SideError as exc:
        recs = {name: {"error": f"current: {exc.why}"} for name in cases}
    return mode, recs


def _compare_rows(report, saved, threshold):
    rows = {}
    for name, row in report["cases"].items():
        base = saved["cases"].get(name)
        if base is None:
            rows[name] = {"status": "new", "verdict": "not in the saved run"}
        elif "samples" not in row:
            rows[name] = {"status": "error", "verdict": "error",
                          "error": row.get("samples_error") or "current: no samples"}
        elif "samples" not in base:
            rows[name] = {"status": "error", "verdict": "error",
                          "error": f"saved: {base.get('samples_error') or 'no samples'}"}
        else:
            rows[name] = {"status": "ok", **stats.judge(row["samples"], base["samples"], threshold,
                                                        ("current", "saved"))}
    return rows


def compare(report, saved, threshold, out=print, warn=None):
    """Compare ``report``'s per-round samples with a ``saved`` run's, case by case,
    with ``--against``'s statistics and verdicts (``stats.judge``: ratio now /
    saved, its interval, slower/faster/same/undecided). Returns the exit code: 1
    when a case is slower (or fails now), 0 otherwise, and always 0 when the runs
    come from different machines or package versions (``machine.diff``: what
    differs is printed) or when the shares of the CPUs that other processes left
    free during the two runs' turns (``load_share``) differ by more than a factor
    1 + ``threshold``; ``warn`` then gets one line: such times are not comparable.
    Raises ValueError for runs of another device or dtype."""
    from . import against
    for key in ("device", "dtype"):
        if report.get(key) != saved.get(key):
            raise ValueError(f"the saved run was measured with {key}={saved.get(key)!r}, "
                             f"this run with {key}={report.get(key)!r}")
    differs, versions = machine.diff(saved.get("machine"), report.get("machine") or {})
    # load that differs between the runs shifts every round alike, which no interval
    # over the rounds can see: gate only when the share of the CPUs that other
    # processes left free was about the same (within the threshold's factor) in both
    load = [load_share(r) for r in (saved, report)]
    free = None if None in load else sorted(1.0 - x for x in load)
    busier = free is not None and (free[0] <= 0.01 or free[1] / free[0] > 1.0 + threshold)
    gated = not differs and not versions and not busier
    out("")
    if differs or versions:
        what = "another machine" if differs else "other package versions"
        out(f"the saved run comes from {what}; what differs (saved -> now):")
        for line in differs + versions:
            out(f"  {line}")
        if warn:
            warn(f"numba-ops bench --compare: warning: the saved run comes from {what}; its times are shown "
                 "for information and never fail (use --against REV for a check that holds on any machine)")
    elif busier:
        what = "a machine under other load"
        if warn:
            warn(f"numba-ops bench --compare: warning: other processes took {load[0]:.0%} of the CPUs during the "
                 f"saved run's turns and {load[1]:.0%} now, leaving {1 - load[0]:.0%} and {1 - load[1]:.0%} free: "
                 "the times are shown for information and never fail (compare on a quieter machine, or use "
                 "--against REV: both versions in the same minutes)")
    if None not in load:
        out(f"other processes' share of the CPUs during the turns: {load[0]:.0%} saved, {load[1]:.0%} now")
    now_s, was_s = report.get("sampling") or {}, saved.get("sampling") or {}
    out(f"comparison with the saved run: numba_ops' times now over the saved run's, {now_s.get('rounds')} "
        f"rounds now, {was_s.get('rounds')} saved, threshold {threshold:.0%}"
        + ("" if gated else f" (not gated: {what})"))
    turn = ("warmup_s", "turn_s", "min_calls", "max_calls")
    if any(now_s.get(k) != was_s.get(k) for k in turn):
        out("note: the runs timed their turns differently (" + ", ".join(
            f"{k} {was_s.get(k)} -> {now_s.get(k)}" for k in turn if now_s.get(k) != was_s.get(k)) + ")")
    rows = _compare_rows(report, saved, threshold)
    against.print_verdicts(rows, (("current", "now"), ("saved", "saved")), threshold,
                           "the two runs' rounds paired in order", out=out)
    gone = sorted(set(saved["cases"]) - set(report["cases"]))
    if gone:
        out(f"cases in the saved run, not run now: {', '.join(gone)}")
    code = against.exit_code({"cases": rows}) if gated else 0
    verdict = ("FAILED" if code else "passed") if gated else f"not gated ({what})"
    out(f"comparison: {against.verdict_counts(rows)}; {verdict}")
    return code


def load_share(run):
    """The median share of the CPUs that other processes took during a run's turns
    (each turn's, from /proc/stat), or None where none was measured."""
    shares = [x for row in run["cases"].values() for x in row.get("others") or () if x is not None]
    return statistics.median(shares) if shares else None


def check_format(run, path, opt):
    """A one-line exit (status 2) unless ``run`` is a saved table run of this
    version of the format, the one ``--compare`` can judge."""
    if not isinstance(run, dict):
        why = "is not a run saved by numba-ops bench --json FILE"
    elif "rev" in run and "limits" not in run:
        why = "is an --against report; --compare takes a saved table run (numba-ops bench --json FILE)"
    elif not isinstance(run.get("cases"), dict) or "limits" not in run:
        why = "is not a run saved by numba-ops bench --json FILE"
    elif "format" not in run:
        why = ("was saved by an older numba-ops bench: it holds single figures and no per-round samples, which "
               "cannot be compared soundly; save the run again with numba-ops bench --json FILE")
    elif run["format"] != FORMAT:
        why = f"is format {run['format']} of numba-ops bench's JSON; this numba-ops bench reads format {FORMAT}"
    else:
        return
    print(f"numba-ops bench: {opt} {path!r} {why}", file=sys.stderr)
    raise SystemExit(2)


def _select(only):
    names = [n for _, n in _cases.CASES]
    if not only:
        return names
    keys = [k for k in only.split(",") if k]
    picked = [n for n in names if any(k in n for k in keys)]
    if not picked:
        raise SystemExit(f"numba-ops bench: --only {only!r} matches no case; cases: {', '.join(names)}")
    return picked


def _read_json(path, what):
    """A JSON file named on the command line, or a one-line error."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"numba-ops bench: cannot read {what} {path!r}: {exc}") from None


def _write_json(path, report):
    try:
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1, sort_keys=True)
            fh.write("\n")
    except OSError as exc:
        raise SystemExit(f"numba-ops bench: cannot write --json {path!r}: {exc}") from None
    print(f"wrote {path}")


def _check_out_path(path, opt):
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise SystemExit(f"numba-ops bench: {opt} {path!r}: no such directory")


def machine_header(meta, measure_pin=False, out=print):
    """Print the machine and BLAS lines of the bench header, and the
    OPENBLAS_CORETYPE warning (with sgemm measured pinned and unpinned now when
    ``measure_pin``: about 2 s). Stores the measurement in ``meta``."""
    for line in machine.header_lines(meta):
        out(line)
    simd = meta.get("cpu_simd") or []
    warning = machine.coretype_warning(simd if simd else None)
    if warning:
        out("WARNING: " + warning)
        if measure_pin:
            m = machine.sgemm_pinned_vs_unpinned()
            if m:
                meta["sgemm_pinned_vs_unpinned"] = m
                out(f"  measured now: NumPy sgemm 2048^2 {m['pinned']['GFLOPs']:.0f} GFLOP/s pinned "
                    f"({m['pinned']['kernel'] or '?'}) vs {m['unpinned']['GFLOPs']:.0f} GFLOP/s unpinned "
                    f"({m['unpinned']['kernel'] or '?'}): x{m['unpinned']['GFLOPs'] / m['pinned']['GFLOPs']:.2f}")


def _need_matplotlib(path):
    if path and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("numba-ops bench: --plot needs matplotlib: pip install 'numba_ops[plot]'")


def _plot(path, report):
    if path:
        from . import plot
        (plot.against if "rev" in report else plot.table)(report, path)
        print(f"wrote {path}")


def _load_note():
    """A line when the machine is busy before the run (load average above its CPUs), else None."""
    if not hasattr(os, "getloadavg"):
        return None
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > cpus:
        return (f"note: load average {load:.1f} on {cpus} CPUs: other processes compete for the cores; "
                "timings will be noisier (more cases undecided)")
    return None


def _timeable(device):
    """False (having said why on stderr) for CUDA on numba's simulator."""
    from .._dispatch import cuda_simulator
    if device == "cuda" and cuda_simulator():
        print("numba-ops bench: NUMBA_ENABLE_CUDASIM=1 runs the CUDA kernels in numba's simulator, "
              "which is for correctness, not timing; unset it to time a GPU", file=sys.stderr)
        return False
    return True


def main_against(args):
    """``numba-ops bench --against REV``: exit 0 (no regression), 1 (a case slower
    beyond the threshold), 2 (the check could not be made)."""
    from . import against
    if args.load or args.compare:
        raise SystemExit("numba-ops bench: --against measures both sides now; it takes neither --load nor --compare")
    _check_out_path(args.json, "--json")
    _check_out_path(args.plot, "--plot")
    _need_matplotlib(args.plot)
    if not _timeable(args.device or "cpu"):
        return 2
    meta = machine.collect()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"numba-ops bench --against {args.against}: the current source tree against REV, "
          f"{'quick, ' if args.quick else ''}threshold {args.threshold:.0%}", flush=True)
    machine_header(meta, measure_pin=False)
    load = _load_note()
    if load:
        print(load, flush=True)
    try:
        report = against.run(args.against, repo=args.repo, cases_module=args.cases or against.CASES_MODULE,
                             only=args.only, quick=args.quick, threshold=args.threshold, dtype=args.dtype,
                             device=args.device or "cpu", rounds=args.rounds,
                             log=lambda line: print(line, flush=True))
    except against.AgainstError as exc:
        print(f"numba-ops bench --against: {exc}", file=sys.stderr)
        return 2
    report["machine"] = meta
    report["load_average"] = {"before": load_before, "after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    against.print_report(report)
    if report["load_average"]["after"] and report["load_average"]["after"] > 1.5 * meta["cpus"]:
        print(f"note: load average {report['load_average']['after']:.1f} on {meta['cpus']} CPUs during the run: "
              "other processes competed for the cores, so more cases are undecided than on a quiet machine")
    if args.json:
        _write_json(args.json, report)
    _plot(args.plot, report)
    return against.exit_code(report)


def main(args):
    """``numba-ops bench`` (the table, ``--compare``, ``--against``) from parsed arguments."""
    if args.against:
        return main_against(args)
    import numba

    import numba_ops
    # files first: a bad path fails now, not after the measurements
    saved = _read_json(args.compare, "--compare run") if args.compare else None
    if saved is not None:
        check_format(saved, args.compare, "--compare")
    _check_out_path(args.json, "--json")
    _check_out_path(args.plot, "--plot")
    _need_matplotlib(args.plot)
    if args.load:
        report = _read_json(args.load, "--load report")
        if saved is not None:
            check_format(report, args.load, "--load")
        try:
            for row in report["cases"].values():
                row["figures"] = figures(row)
        except (KeyError, TypeError, AttributeError) as exc:
            raise SystemExit(f"numba-ops bench: {args.load!r} is not a numba-ops bench --json report "
                             f"({type(exc).__name__}: {exc})") from None
    else:
        device = args.device or "cpu"
        if not _timeable(device):
            return 2
        cases = _select(args.only)
        if args.peers is None:
            peers = _installed_peers()
        else:
            peers = [p for p in args.peers.split(",") if p and p != "none"]
            unknown = set(peers) - set(PEERS)
            if unknown:
                print(f"numba-ops bench: unknown peer(s) {sorted(unknown)}; known: {', '.join(PEERS)}", file=sys.stderr)
                return 2
        impls = ["numba_ops"] + peers
        meta = machine.collect()
        print(f"numba-ops bench: {len(cases)} cases x {len(impls)} implementations "
              f"({', '.join(impls)}), each in its own process; device {device}, dtype {args.dtype}"
              f"{', quick' if args.quick else ''}", flush=True)
        machine_header(meta, measure_pin=args.repeat != 1)
        t0 = time.perf_counter()
        cfg = {"cases": cases, "dtype": args.dtype, "device": device, "quick": args.quick,
               "repeat": args.repeat, "peers": peers}
        results, limits = _measure(impls, cases, cfg, lambda line: print(line, flush=True))
        report = {"tool": "numba-ops bench", "format": FORMAT, "version": numba_ops.__version__, "device": device,
                  "dtype": args.dtype, "quick": bool(args.quick), "threads": numba.config.NUMBA_NUM_THREADS,
                  "cpus": os.cpu_count(), "peers": peers, "seconds": round(time.perf_counter() - t0, 1),
                  "machine": meta, "limits": limits, "cases": _table(results, cases)}
        if args.json or saved is not None:  # the evidence a comparison judges, now or later
            report["sampling"], recs = take_samples(cases, args.dtype, device, args.quick, args.rounds,
                                                    lambda line: print(line, flush=True))
            for name, rec in recs.items():
                row = report["cases"][name]
                if "error" in rec:
                    row["samples_error"] = rec["error"]
                else:  # to the nanosecond, perf_counter's resolution: a full run's file stays small
                    row["samples"] = [[round(t, 9) for t in turn] for turn in rec["current"]]
                    row["others"] = rec["others"]["current"]
            report["seconds"] = round(time.perf_counter() - t0, 1)
    print_table(report)
    if args.json:
        _write_json(args.json, report)
    _plot(args.plot, report)
    if saved is not None:
        try:
            return compare(report, saved, args.threshold, warn=lambda line: print(line, file=sys.stderr))
        except ValueError as exc:
            print(f"numba-ops bench --compare: {exc}", file=sys.stderr)
            return 2
    return 0

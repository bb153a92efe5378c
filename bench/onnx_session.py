"""Whole ONNX models in onnxruntime alone and in ``numba_ops.onnx.session``.

    python bench/onnx_session.py [--rounds 15] [--runs 10] [--width 32] [--skip-3d]

1. The backbone: a DCNv2-style network built with torch and torchvision and
   exported by PyTorch's own ONNX exporter (``torch.onnx.export(..., dynamo=True)``,
   opset 19, which needs onnxscript): a 7x7 stride-2 stem and a max pool, then three
   stages at 56², 28², 14² (widths w, 2w, 4w; w = 32 by default, where onnxruntime's
   profiler puts its DeformConv nodes at about half the model), each two plain 3x3 convolutions
   and one ``torchvision.ops.DeformConv2d`` whose offsets and mask (a sigmoid) a
   3x3 convolution predicts; input 1x3x224x224. onnxruntime alone and the
   session run in processes of their own that take turns, a round of
   ``--runs`` calls each, with a pause between rounds longer than any thread
   pool's spin (so neither process's idle threads spin into the other's round).
   A third process runs the session with its DeformConv nodes on the Python
   route (``numba_ops.capi`` "0"), to tell the C API route's share.
   Printed: the outputs' largest difference, each implementation's median ms per
   call with the spread of the round medians (min-max), the speed ratios, and per
   DeformConv node its time in onnxruntime alone and in the session (onnxruntime's
   profiler), and in a direct ``numba_ops.deform_conv`` call on the same inputs
   on as many numba threads as onnxruntime's pool has.
2. A 3-D model (Conv on 5-D input, a 3-D DeformConv with offsets and mask, a 3-D
   GridSample) that onnxruntime alone refuses: in the session against
   ``numba_ops.onnx.evaluator`` (same outputs within float32 accuracy, and the
   time ratio).
3. float16 and bfloat16 DeformConv and GridSample nodes inside a float32 model
   (Cast in, Cast out): the session against the functions.

OpenBLAS runs unpinned: the script re-executes itself without OPENBLAS_CORETYPE /
OPENBLAS_L2_SIZE. Without torch (or torchvision, onnxscript) part 1 is skipped
with a message.
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


# --- the backbone, exported by PyTorch (in a process of its own: torch's OpenMP and
# thread pools stay out of the timed processes) -------------------------------------------

def export_backbone(path, width):
    import torch
    from torch import nn
    from torchvision.ops import DeformConv2d

    class DCN(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.om = nn.Conv2d(c, 27, 3, padding=1)  # 18 offsets and 9 mask logits of a 3x3 kernel
            self.dc = DeformConv2d(c, c, 3, padding=1)

        def forward(self, x):
            om = self.om(x)
            return torch.relu(self.dc(x, om[:, :18], torch.sigmoid(om[:, 18:])))

    def stage(ci, co, stride):
        return nn.Sequential(nn.Conv2d(ci, co, 3, stride, 1), nn.ReLU(), nn.Conv2d(co, co, 3, 1, 1), nn.ReLU(),
                             DCN(co))

    w = width
    net = nn.Sequential(nn.Conv2d(3, w, 7, 2, 3), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                        stage(w, w, 1), stage(w, 2 * w, 2), stage(2 * w, 4 * w, 2)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, DCN):
                m.om.weight.mul_(0.3)  # offsets of a pixel or two
    torch.onnx.export(net, (torch.randn(1, 3, 224, 224),), path, opset_version=19, dynamo=True,
                      input_names=["x"], output_names=["y"], external_data=False)


def _export(path, width):
    """Export in a child process; None on success, else why it was skipped."""
    try:
        import onnxscript  # noqa: F401  (the exporter's dependency)
        import torch  # noqa: F401
        import torchvision  # noqa: F401
    except ImportError as exc:
        return f"torch, torchvision and onnxscript are needed to build the backbone ({exc})"
    p = subprocess.run([sys.executable, _HERE, "--export", path, "--width", str(width)], capture_output=True,
                       text=True)
    if p.returncode:
        return f"the export failed:\n{p.stderr[-2000:]}"
    return None


# --- the timed processes --------------------------------------------------------------------

KINDS = ("onnxruntime", "session", "session-python")


def _make(kind, model, so=None):
    """onnxruntime alone, the session (its DeformConv nodes on onnxruntime's C API), or
    the session with those nodes on the Python route (``numba_ops.capi`` "0")."""
    import onnxruntime as ort
    so = ort.SessionOptions() if so is None else so
    if kind.startswith("session"):
        from numba_ops.onnx import session
        if kind == "session-python":
            so.add_session_config_entry("numba_ops.capi", "0")
        return session(model, so)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _profile(sess_fn, feeds, calls=20):
    """Median ms per DeformConv node name over ``calls`` profiled runs of a new session."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.enable_profiling = True
    s = sess_fn(so)
    for _ in range(calls):
        s.run(None, feeds)
    path = s.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    per = {}
    for e in events:
        args = e.get("args", {})
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and "DeformConv" in args.get("op_name", ""):
            per.setdefault(e["name"][:-len("_kernel_time")], []).append(e["dur"] / 1e3)
    return {k: float(np.median(v[2:])) for k, v in per.items()}


def worker(kind, model):
    """Serve rounds on stdin ("run N" -> a JSON list of N seconds; "profile"; "out")."""
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    s = _make(kind, model)
    for _ in range(5):
        s.run(None, feeds)
    print(json.dumps("ready"), flush=True)
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
            np.save(cmd[1], s.run(None, feeds)[0])
            print(json.dumps("ok"), flush=True)
        elif cmd[0] == "profile":
            print(json.dumps(_node_times(kind, model, feeds)), flush=True)


def _node_times(kind, model, feeds):
    """Per DeformConv node: its time in this kind's session (profiler), and for the
    session also a direct numba_ops call on the node's inputs, on as many numba threads
    as onnxruntime's pool has (numba's default count, onnxruntime's default too)."""
    import onnx
    import onnxruntime as ort
    profiled = _profile(lambda so: _make(kind, model, so), feeds)
    if kind != "session":
        return {"profiled": profiled}
    import numba

    import numba_ops
    numba.set_num_threads(numba.config.NUMBA_DEFAULT_NUM_THREADS)
    m = onnx.load(model)
    nodes = [n for n in m.graph.node if n.op_type == "DeformConv"]
    extra = sorted({i for n in nodes for i in n.input if i} - {i.name for i in m.graph.initializer})
    for name in extra:
        m.graph.output.append(onnx.ValueInfoProto(name=name))
    plain = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    values = dict(zip([o.name for o in plain.get_outputs()], plain.run(None, feeds)))
    values.update({i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer})
    direct = {}
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        args = [values[i] if i else None for i in n.input] + [None] * (5 - len(n.input))
        t = []
        for _ in range(25):
            t0 = time.perf_counter()
            numba_ops.deform_conv(*args, **attrs)
            t.append(time.perf_counter() - t0)
        direct[n.name] = 1e3 * float(np.median(t[3:]))
    return {"profiled": profiled, "direct": direct}


def backbone(args, tmp):
    path = os.path.join(tmp, "backbone.onnx")
    why = _export(path, args.width)
    if why:
        print(f"SKIP backbone: {why}")
        return
    procs = {k: Worker([_HERE, "--worker", k, path]) for k in KINDS}
    outs = {}
    for k, p in procs.items():
        p.ask(f"out {os.path.join(tmp, k + '.npy')}")
        outs[k] = np.load(os.path.join(tmp, k + ".npy"))
    diff = float(np.abs(outs["session"] - outs["onnxruntime"]).max())
    scale = float(np.abs(outs["onnxruntime"]).max())
    times = {k: [] for k in procs}
    for r in range(args.rounds):
        for k in (KINDS if r % 2 == 0 else KINDS[::-1]):
            time.sleep(0.3)  # longer than numba's OpenMP spin (GOMP_SPINCOUNT) and onnxruntime's
            times[k].append(procs[k].ask(f"run {args.runs}"))
    nodes = {k: p.ask("profile") for k, p in procs.items()}
    for p in procs.values():
        p.close()
    print(f"backbone (width {args.width}, exported by torch {version('torch')}, onnxruntime "
          f"{version('onnxruntime')}): output {outs['session'].shape}, largest |session - onnxruntime| = "
          f"{diff:.2e} (output scale {scale:.3g})")
    med = {}
    for k, rounds in times.items():
        per_round = [1e3 * np.median(t) for t in rounds]
        med[k] = float(np.median(np.concatenate(rounds))) * 1e3
        print(f"  {k:<18} median {med[k]:7.2f} ms per call   round medians {min(per_round):.2f}-{max(per_round):.2f} ms "
              f"({args.rounds} rounds x {args.runs} calls)")
    print(f"  speed: session / onnxruntime alone = {med['onnxruntime'] / med['session']:.2f}x "
          f"(the Python route: {med['onnxruntime'] / med['session-python']:.2f}x)")
    ort_nodes, ses = nodes["onnxruntime"]["profiled"], nodes["session"]
    py = nodes["session-python"]["profiled"]
    print("  DeformConv node          onnxruntime  in session  (Python route)  direct numba_ops (ms, medians)")
    for name in ses["direct"]:
        print(f"  {name:<24} {ort_nodes.get(name, float('nan')):11.2f} {ses['profiled'].get(name, float('nan')):11.2f}"
              f" {py.get(name, float('nan')):15.2f} {ses['direct'][name]:11.2f}")
    total = sum(ort_nodes.values())
    print(f"  onnxruntime's DeformConv nodes: {total:.2f} ms of its {med['onnxruntime']:.2f} ms per call "
          f"({100 * total / med['onnxruntime']:.0f} %)")


# --- the 3-D model and the 16-bit nodes -------------------------------------------------------

def model_3d(rng):
    """Conv (5-D) -> 3-D DeformConv (offsets, mask from Conv) -> 3-D GridSample."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper
    C, K = 8, 27
    inits = {"w0": 0.3 * rng.standard_normal((C, 2, 3, 3, 3)), "wo": 0.05 * rng.standard_normal((3 * K, C, 3, 3, 3)),
             "wm": 0.1 * rng.standard_normal((K, C, 3, 3, 3)), "wd": 0.2 * rng.standard_normal((C, C, 3, 3, 3)),
             "bd": rng.standard_normal(C)}
    nodes = [helper.make_node("Conv", ["x", "w0"], ["h"], pads=[1] * 6),
             helper.make_node("Conv", ["h", "wo"], ["off"], pads=[1] * 6),
             helper.make_node("Conv", ["h", "wm"], ["ml"], pads=[1] * 6),
             helper.make_node("Sigmoid", ["ml"], ["mask"]),
             helper.make_node("DeformConv", ["h", "wd", "off", "bd", "mask"], ["d"], pads=[1] * 6),
             helper.make_node("GridSample", ["d", "grid"], ["y"], mode="linear", padding_mode="border")]
    g = helper.make_graph(nodes, "m3d", [helper.make_tensor_value_info("x", TP.FLOAT, [1, 2, 12, 16, 16]),
                                         helper.make_tensor_value_info("grid", TP.FLOAT, [1, 10, 12, 12, 3])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, None)],
                          [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    feeds = {"x": rng.standard_normal((1, 2, 12, 16, 16)).astype(np.float32),
             "grid": rng.uniform(-1, 1, (1, 10, 12, 12, 3)).astype(np.float32)}
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)]), feeds


def three_d(reps):
    import onnxruntime as ort

    from numba_ops.onnx import evaluator, session
    model, feeds = model_3d(np.random.default_rng(0))
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        refused = "runs it (unexpected)"
    except Exception as exc:
        refused = f"refuses it: {str(exc).splitlines()[0][:120]}"
    s, ev = session(model), evaluator(model)
    y, = s.run(None, feeds)
    want, = ev.run(None, feeds)
    err = float(np.abs(y - want).max() / max(1e-30, np.abs(want).max()))
    t = {"session": [], "evaluator": []}
    for _ in range(reps):
        for k, f in (("session", lambda: s.run(None, feeds)), ("evaluator", lambda: ev.run(None, feeds))):
            t0 = time.perf_counter()
            f()
            t[k].append(time.perf_counter() - t0)
    ms = {k: 1e3 * float(np.median(v)) for k, v in t.items()}
    print(f"3-D model (Conv3d -> 3-D DeformConv with offsets and mask -> 3-D GridSample): onnxruntime alone {refused}")
    print(f"  session {ms['session']:.2f} ms, evaluator {ms['evaluator']:.2f} ms: {ms['evaluator'] / ms['session']:.1f}x "
          f"faster; largest |session - evaluator| / scale = {err:.1e}")


def sixteen_bit():
    import ml_dtypes
    from onnx import TensorProto as TP
    from onnx import helper

    import numba_ops
    from numba_ops.onnx import session
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 4, 9, 9)).astype(np.float32)
    w = rng.standard_normal((4, 4, 3, 3)).astype(np.float32)
    off = rng.standard_normal((1, 18, 9, 9)).astype(np.float32)
    grid = rng.uniform(-1, 1, (1, 5, 6, 2)).astype(np.float32)
    for et, dt in ((TP.FLOAT16, np.float16), (TP.BFLOAT16, ml_dtypes.bfloat16)):
        nodes = [helper.make_node("Cast", [n], [n + "h"], to=et) for n in ("x", "w", "off", "grid")]
        nodes += [helper.make_node("DeformConv", ["xh", "wh", "offh"], ["dh"], pads=[1, 1, 1, 1]),
                  helper.make_node("GridSample", ["dh", "gridh"], ["yh"], mode="cubic"),
                  helper.make_node("Cast", ["yh"], ["y"], to=TP.FLOAT)]
        g = helper.make_graph(nodes, "h", [helper.make_tensor_value_info(n, TP.FLOAT, a.shape) for n, a in
                                           (("x", x), ("w", w), ("off", off), ("grid", grid))],
                              [helper.make_tensor_value_info("y", TP.FLOAT, None)])
        s = session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)]))
        y, = s.run(None, {"x": x, "w": w, "off": off, "grid": grid})
        d = numba_ops.deform_conv(x.astype(dt), w.astype(dt), off.astype(dt), pads=[1, 1, 1, 1])
        want = numba_ops.grid_sample(d, grid.astype(dt), mode="cubic").astype(np.float32)
        print(f"{np.dtype(dt).name} DeformConv + GridSample nodes in a float32 model: session equals the functions: "
              f"{bool(np.array_equal(y, want))}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--runs", type=int, default=10, help="calls per round")
    ap.add_argument("--width", type=int, default=32, help="the first stage's channels (then 2x, 4x)")
    ap.add_argument("--skip-3d", action="store_true", help="the backbone only")
    ap.add_argument("--export", help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.export:
        return export_backbone(args.export, args.width)
    if args.worker:
        return worker(*args.worker)
    with tempfile.TemporaryDirectory() as tmp:
        backbone(args, tmp)
    if not args.skip_3d:
        three_d(reps=5)
        sixteen_bit()


if __name__ == "__main__":
    sys.exit(main())

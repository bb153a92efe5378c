"""A Deformable DETR encoder in ONNX, its attention as MMCV nodes in
``numba_ops.onnx.session`` against the pure-PyTorch path (GridSample nodes) in
onnxruntime alone; and the per-call overhead of ``numba_ops.torch.ms_deform_attn``.

    python bench/msda_session.py [--levels small|full] [--layers 6] [--rounds 7] [--runs 3]
                                 [--threads 2] [--calls 2000] [--no-profile] [--no-dynamo]
                                 [--skip-encoder | --skip-overhead]

1. The model: an MMDeploy-style Deformable DETR encoder (mmdet's
   ``DeformableDetrTransformerEncoder``, no dropout): ``--layers`` layers (6), each
   multi-scale deformable self-attention (``value_proj``, ``sampling_offsets``,
   ``attention_weights`` Linear layers, softmax over levels and points, the
   attention, ``output_proj``; the query is src + pos, the value src), residual +
   LayerNorm, an FFN 256 -> 1024 -> 256 (ReLU), residual + LayerNorm; d_model 256,
   8 heads, 4 levels, 4 points; batch 1; every position a query, its reference
   point its centre on every level. Levels ``small`` (default): a 320x480 image's
   pyramid 40x60, 20x30, 10x15, 5x8 (S = 3,190); ``full``: Deformable DETR's
   800x1200, 100x150, 50x75, 25x38, 13x19 (S = 19,947). Weights from
   ``torch.manual_seed(0)``, the offset and attention-logit weights random (std
   0.05: offsets that vary by a pixel or so around Deformable DETR's initial
   pattern, as a trained model's do, not one shared pattern). Inputs: ``src`` and
   ``pos`` (1, S, 256); the level tables and reference points are constants of the
   model.

   Exported twice by PyTorch's ONNX exporter (``torch.onnx.export(..., dynamo=True)``,
   opset 20, which needs onnxscript; where that fails, the TorchScript exporter,
   ``dynamo=False``, and the script says so), in a process of its own:

   (A) the attention on ``numba_ops.torch.MSDeformAttn`` (``ms_deform_attn``),
       ``custom_translation_table=numba_ops.torch.onnx_translations()``: a
       ``numba_ops::MMCVMultiScaleDeformableAttention`` node per layer, run in
       ``numba_ops.onnx.session``;
   (B) the same weights on mmcv's ``multi_scale_deformable_attn_pytorch`` (an
       ``F.grid_sample`` per level, the samples weighted and summed): standard
       GridSample nodes, run in ``onnxruntime.InferenceSession`` (CPU provider).

   The attention alone is exported the same two ways (inputs value (1, S, 8, 32),
   sampling_locations, attention_weights; each query's points its centre plus
   offsets of about 2 elements): one MMCV node, against the pure-PyTorch path's
   GridSample, Transpose, Reshape, Concat, Mul, ReduceSum nodes.

   Both sides: ``intra_op_num_threads`` = ``--threads`` (2); each model in a process
   of its own, the four taking turns (the order reversed every round), a round of
   ``--runs`` calls each, with a pause between rounds longer than any thread pool's
   spin. Printed per model: the graphs' op counts, the outputs' largest differences
   (A against B, and each against torch's eager output), each side's median ms per
   call with the spread of the round medians (min-max), and the speed-up
   onnxruntime alone / session (the project's target: at least 3x); then (unless
   ``--no-profile``) from onnxruntime's profiler the encoder's time per op type on
   each side (the linear layers, LayerNorm and FFN are the same work on both).

2. The overhead of the torch operator: ``numba_ops.torch.ms_deform_attn`` against
   ``numba_ops.ms_deform_attn`` (the NumPy function) on tiny inputs (one 2x2 level,
   one head of one channel, one query, one point), in a process of its own: blocks
   of ``--calls`` calls of each, alternating, 7 blocks; the median per call of each
   block, and the overhead (torch - NumPy; target at most 30 us) with its spread
   over the blocks. The torch call is timed on inputs without gradients, and on
   inputs that require them (the autograd node recorded too).

OpenBLAS runs unpinned: the script re-executes itself without OPENBLAS_CORETYPE /
OPENBLAS_L2_SIZE. Without torch, onnxscript, onnxruntime or onnxruntime-extensions
nothing is measured (a message says why).
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
LEVELS = {"small": [(40, 60), (20, 30), (10, 15), (5, 8)],  # a 320x480 image's strides 8, 16, 32, 64
          "full": [(100, 150), (50, 75), (25, 38), (13, 19)]}  # Deformable DETR's 800x1200
D_MODEL, D_FFN, HEADS, POINTS = 256, 1024, 8, 4
ATTN_OPS = ("MMCVMultiScaleDeformableAttention", "GridSample")
#: per case: its feeds' maker and input names
FEEDS = {"encoder": (lambda levels: _feeds(levels), ("src", "pos")),
         "attention": (lambda levels: _core_feeds(levels), ("value", "sampling_locations", "attention_weights"))}


def _feeds(levels):
    """src: random features; pos: a sine embedding of each position's centre plus a
    random vector per level (the level embedding). Both (1, S, 256) float32."""
    rng = np.random.default_rng(0)
    S = sum(h * w for h, w in levels)
    src = rng.standard_normal((1, S, D_MODEL)).astype(np.float32)
    centres = np.concatenate([np.stack(np.meshgrid((np.arange(w) + 0.5) / w, (np.arange(h) + 0.5) / h), -1)
                              .reshape(-1, 2) for h, w in levels])
    freqs = 10000.0 ** (-np.arange(D_MODEL // 4) / (D_MODEL // 4))
    angles = centres[:, :, None] * 2 * np.pi * freqs
    pos = np.concatenate([np.sin(angles), np.cos(angles)], -1).reshape(S, D_MODEL)
    level = np.repeat(np.arange(len(levels)), [h * w for h, w in levels])
    pos = pos + 0.5 * rng.standard_normal((len(levels), D_MODEL))[level]
    return {"src": src, "pos": pos[None].astype(np.float32)}


def _core_feeds(levels):
    """The attention alone: value (1, S, 8, 32), each query's (every position's)
    centre plus offsets of a couple of elements (the locations), softmaxed weights."""
    rng = np.random.default_rng(1)
    S, L = sum(h * w for h, w in levels), len(levels)
    ref = np.concatenate([np.stack(np.meshgrid((np.arange(w) + 0.5) / w, (np.arange(h) + 0.5) / h), -1)
                          .reshape(-1, 2) for h, w in levels])
    wh = np.array([[w, h] for h, w in levels], np.float64)
    loc = ref[None, :, None, None, None, :] + rng.normal(0, 2, (1, S, HEADS, L, POINTS, 2)) / wh[:, None, :]
    logits = rng.standard_normal((1, S, HEADS, L * POINTS))
    attn = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return {"value": rng.standard_normal((1, S, HEADS, D_MODEL // HEADS)).astype(np.float32),
            "sampling_locations": loc.astype(np.float32),
            "attention_weights": attn.reshape(1, S, HEADS, L, POINTS).astype(np.float32)}


# --- the encoder, exported by PyTorch (in a process of its own: torch's OpenMP and
# thread pools stay out of the timed processes) ------------------------------------------

def build(levels, n_layers):
    """The encoder on numba_ops' MSDeformAttn, and its twin on the pure-PyTorch path
    (the same weights)."""
    import torch

    import numba_ops.torch as nt
    from numba_ops.benchmark.cases import ms_deform_attn_torch as msda_pytorch  # mmcv's pure-PyTorch path

    L = len(levels)

    class PyTorchMSDeformAttn(nt.MSDeformAttn):
        """MSDeformAttn's parameters and forward on ``msda_pytorch``."""

        def forward(self, query, reference_points, input_flatten, input_spatial_shapes, input_level_start_index,
                    input_padding_mask=None):
            N, Lq, _ = query.shape
            M, P = self.n_heads, self.n_points
            value = self.value_proj(input_flatten).view(N, input_flatten.shape[1], M, self.d_model // M)
            offsets = self.sampling_offsets(query).view(N, Lq, M, L, P, 2)
            weights = self.attention_weights(query).view(N, Lq, M, L * P).softmax(-1).view(N, Lq, M, L, P)
            normaliser = torch.tensor([[w, h] for h, w in levels], dtype=offsets.dtype)
            locations = reference_points[:, :, None, :, None, :] + offsets / normaliser[None, None, None, :, None, :]
            return self.output_proj(msda_pytorch(value, levels, locations, weights))

    class Layer(torch.nn.Module):
        """mmdet's DeformableDetrTransformerEncoderLayer: attention, norm, FFN, norm."""

        def __init__(self, attention):
            super().__init__()
            self.self_attn = attention(D_MODEL, L, HEADS, POINTS)
            self.norm1 = torch.nn.LayerNorm(D_MODEL)
            self.linear1 = torch.nn.Linear(D_MODEL, D_FFN)
            self.linear2 = torch.nn.Linear(D_FFN, D_MODEL)
            self.norm2 = torch.nn.LayerNorm(D_MODEL)

        def forward(self, src, pos, ref, shapes, starts):
            src = self.norm1(src + self.self_attn(src + pos, ref, src, shapes, starts))
            return self.norm2(src + self.linear2(torch.relu(self.linear1(src))))

    class Encoder(torch.nn.Module):
        def __init__(self, attention):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(attention) for _ in range(n_layers)])
            shapes = torch.tensor(levels, dtype=torch.int64)
            sizes = shapes.prod(1)
            self.register_buffer("spatial_shapes", shapes)
            self.register_buffer("level_start_index", torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]]))
            points = []
            for h, w in levels:  # every position's centre, normalised, on every level (valid ratios 1)
                ry, rx = torch.meshgrid((torch.arange(h) + 0.5) / h, (torch.arange(w) + 0.5) / w, indexing="ij")
                points.append(torch.stack([rx.reshape(-1), ry.reshape(-1)], -1))
            self.register_buffer("reference_points", torch.cat(points)[None, :, None, :].expand(1, -1, L, -1)
                                 .contiguous())

        def forward(self, src, pos):
            for layer in self.layers:
                src = layer(src, pos, self.reference_points, self.spatial_shapes, self.level_start_index)
            return src

    class Core(torch.nn.Module):
        """The attention alone: numba_ops' op (``pytorch=False``) or ``msda_pytorch``."""

        def __init__(self, pytorch):
            super().__init__()
            self.pytorch = pytorch
            shapes = torch.tensor(levels, dtype=torch.int64)
            sizes = shapes.prod(1)
            self.register_buffer("spatial_shapes", shapes)
            self.register_buffer("level_start_index", torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]]))

        def forward(self, value, locations, weights):
            if self.pytorch:
                return msda_pytorch(value, levels, locations, weights)
            return nt.ms_deform_attn(value, self.spatial_shapes, self.level_start_index, locations, weights)

    torch.manual_seed(0)
    ours = Encoder(nt.MSDeformAttn).eval()
    with torch.no_grad():
        for layer in ours.layers:
            layer.self_attn.sampling_offsets.weight.normal_(0, 0.05)
            layer.self_attn.attention_weights.weight.normal_(0, 0.05)
    twin = Encoder(PyTorchMSDeformAttn).eval()
    twin.load_state_dict(ours.state_dict())
    return ours, twin, Core(False), Core(True)


def _torchscript_symbolic():
    """The TorchScript exporter's translation of ``numba_ops::ms_deform_attn`` (only
    for the fallback: numba_ops registers the dynamo exporter's)."""
    import torch

    def symbolic(g, value, shapes, starts, locations, weights):
        return g.op("numba_ops::MMCVMultiScaleDeformableAttention", value, shapes, starts, locations, weights)

    torch.onnx.register_custom_op_symbolic("numba_ops::ms_deform_attn", symbolic, 1)


def export_models(out_dir, level_name, n_layers, dynamo):
    """Export the encoder (A.onnx, B.onnx) and the attention alone (A_core.onnx,
    B_core.onnx) into out_dir; write how (the exporter per model) and torch's eager
    outputs (torch.npz)."""
    import torch

    import numba_ops.torch as nt
    levels = LEVELS[level_name]
    ours, twin, core_a, core_b = build(levels, n_layers)
    feeds, core = _feeds(levels), _core_feeds(levels)
    args = tuple(torch.from_numpy(feeds[k]) for k in FEEDS["encoder"][1])
    core_args = tuple(torch.from_numpy(core[k]) for k in FEEDS["attention"][1])
    with torch.no_grad():
        np.savez(os.path.join(out_dir, "torch.npz"), A=ours(*args).numpy(), B=twin(*args).numpy(),
                 A_core=core_a(*core_args).numpy(), B_core=core_b(*core_args).numpy())
    how = {}
    table = nt.onnx_translations()
    for name, model, a in (("A", ours, args), ("B", twin, args), ("A_core", core_a, core_args),
                           ("B_core", core_b, core_args)):
        ours_op = name.startswith("A")
        path = os.path.join(out_dir, f"{name}.onnx")
        common = dict(input_names=list(FEEDS["encoder" if name in ("A", "B") else "attention"][1]),
                      output_names=["output"], opset_version=20)
        errors = []
        if dynamo:
            try:
                kw = {"custom_translation_table": table} if ours_op else {}
                torch.onnx.export(model, a, path, dynamo=True, external_data=False, verbose=False, **kw, **common)
                how[name] = "dynamo=True"
                continue
            except Exception as exc:  # noqa: BLE001  (fall back, and say why)
                errors.append(f"dynamo=True: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        try:
            kw = {}
            if ours_op:
                _torchscript_symbolic()
                kw["custom_opsets"] = {"numba_ops": 1}
            torch.onnx.export(model, a, path, dynamo=False, **kw, **common)
            how[name] = "dynamo=False" + (f" (after {errors[0]})" if errors else "")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"dynamo=False: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            how[name] = {"error": "; ".join(errors)}
    with open(os.path.join(out_dir, "how.json"), "w") as f:
        json.dump(how, f)


def _export(out_dir, args):
    """Export in a child process; None on success, else why it was skipped."""
    try:
        import onnxruntime  # noqa: F401
        import onnxruntime_extensions  # noqa: F401  (the session needs it)
        import onnxscript  # noqa: F401  (the exporter's dependency)
        import torch  # noqa: F401
    except ImportError as exc:
        return f"torch, onnxscript, onnxruntime and onnxruntime-extensions are needed ({exc})"
    cmd = [sys.executable, _HERE, "--export", out_dir, "--levels", args.levels, "--layers", str(args.layers)]
    p = subprocess.run(cmd + ([] if args.dynamo else ["--no-dynamo"]), capture_output=True, text=True)
    if p.returncode:
        return f"the export failed:\n{p.stderr[-2000:]}"
    return None


# --- the timed processes --------------------------------------------------------------------

KINDS = ("session", "onnxruntime")  # (A) in numba_ops' session, (B) in onnxruntime alone
MODEL = {"session": "A", "onnxruntime": "B"}


def _make(kind, model, threads, so=None):
    import onnxruntime as ort
    so = ort.SessionOptions() if so is None else so
    so.intra_op_num_threads = threads
    if kind == "session":
        from numba_ops.onnx import session
        return session(model, so)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _profile(kind, model, threads, feeds, calls=8):
    """From onnxruntime's profiler over ``calls`` runs of a new session (the first two
    left out): the median run's ms, and per op type its nodes' ms (the sum of the
    nodes' medians; the session's own nodes are named ``<op>_float32``) and count."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.enable_profiling = True
    s = _make(kind, model, threads, so)
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
            op = e.get("args", {}).get("op_name", "?").split("_")[0]
            per.setdefault((op, e["name"]), []).append(e["dur"] / 1e3)
    ops = {}
    for (op, _), v in per.items():
        ms, n = ops.get(op, (0.0, 0))
        ops[op] = (ms + float(np.median(v[2:])), n + 1)
    return {"run": float(np.median(runs[2:])), "ops": ops}


def worker(kind, model, feeds_path, threads):
    """Serve rounds on stdin ("run N" -> a JSON list of N seconds; "out PATH"; "profile")."""
    threads = int(threads)
    with np.load(feeds_path) as z:
        feeds = {k: z[k] for k in z.files}
    try:
        t0 = time.perf_counter()
        s = _make(kind, model, threads)
        made = time.perf_counter() - t0
        t0 = time.perf_counter()
        s.run(None, feeds)
        first = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001  (reported, the model skipped)
        print(json.dumps({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}), flush=True)
        return 1
    for _ in range(2):
        s.run(None, feeds)
    routes = [[r.op, r.route] for r in getattr(s, "numba_ops_nodes", ())]
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
            np.save(cmd[1], s.run(None, feeds)[0])
            print(json.dumps("ok"), flush=True)
        elif cmd[0] == "profile":
            print(json.dumps(_profile(kind, model, threads, feeds)), flush=True)


def _ops(path):
    import onnx
    ops = {}
    for n in onnx.load(path).graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return ops


def encoder(args, tmp):
    """Export, check and time the encoder and the attention alone; the encoder's
    speed-up, or None where it was skipped."""
    levels = LEVELS[args.levels]
    S = sum(h * w for h, w in levels)
    label = (f"Deformable DETR encoder, {args.layers} layers, levels {args.levels} "
             f"({', '.join(f'{h}x{w}' for h, w in levels)}; S = {S})")
    why = _export(tmp, args)
    if why:
        print(f"SKIP {label}: {why}")
        return None
    with open(os.path.join(tmp, "how.json")) as f:
        how = json.load(f)
    for name, h in how.items():
        if isinstance(h, dict):
            print(f"SKIP {label}: model {name} did not export: {h['error']}")
            return None
    procs, feeds_paths = {}, {}
    for case, (make, _) in FEEDS.items():
        feeds_paths[case] = os.path.join(tmp, case + ".npz")
        np.savez(feeds_paths[case], **make(levels))
    for case in FEEDS:
        for k in KINDS:
            model = os.path.join(tmp, MODEL[k] + ("" if case == "encoder" else "_core") + ".onnx")
            p = Worker([_HERE, "--worker", k, model, feeds_paths[case], str(args.threads)],
                       stderr=os.path.join(tmp, f"{case}-{k}.err"))
            if "error" in p.info:
                p.close()
                for q in procs.values():
                    q.close()
                print(f"SKIP {label}: {k} refuses {os.path.basename(model)}: {p.info['error']}")
                return None
            procs[case, k] = p
    outs = {}
    for (case, k), p in procs.items():
        p.ask(f"out {os.path.join(tmp, f'{case}-{k}.npy')}")
        outs[case, k] = np.load(os.path.join(tmp, f"{case}-{k}.npy"))
    with np.load(os.path.join(tmp, "torch.npz")) as z:
        eager = {(case, k): z[MODEL[k] + ("" if case == "encoder" else "_core")] for case, k in procs}
    times = {key: [] for key in procs}
    order = list(procs)
    for r in range(args.rounds):
        for key in (order if r % 2 == 0 else order[::-1]):
            time.sleep(0.3)  # longer than numba's OpenMP spin (GOMP_SPINCOUNT) and onnxruntime's
            times[key].append(procs[key].ask(f"run {args.runs}"))
    prof = {k: procs["encoder", k].ask("profile") for k in KINDS} if args.profile else None
    for p in procs.values():
        p.close()

    print(f"{label}; d_model {D_MODEL}, {HEADS} heads, {POINTS} points, FFN {D_FFN}; input (1, {S}, {D_MODEL})")
    print(f"  torch {version('torch')} (opset 20), onnxscript {version('onnxscript')}, onnxruntime "
          f"{version('onnxruntime')}, numba_ops {version('numba_ops')}, numba {version('numba')}, "
          f"intra_op_num_threads {args.threads}; {args.rounds} rounds x {args.runs} calls")
    ratios = {}
    for case in FEEDS:
        print(f"  {case}{' (value, locations, weights -> output: the attention alone)' if case != 'encoder' else ''}:")
        for k in KINDS:
            name = MODEL[k] + ("" if case == "encoder" else "_core")
            ops = _ops(os.path.join(tmp, name + ".onnx"))
            top = sorted(ops.items(), key=lambda kv: -kv[1])
            shown = [f"{op} {n}" for op, n in top if op in ATTN_OPS or n >= 6]
            print(f"    ({name}) for {k}, exported with {how[name]}: {sum(ops.values())} nodes"
                  + (": " + ", ".join(shown) if shown else "") + (", ..." if len(shown) < len(ops) else ""))
        routes = {}
        for op, route in procs[case, "session"].info["routes"]:
            routes[op, route] = routes.get((op, route), 0) + 1
        print("    session's numba_ops_nodes: " + (", ".join(f"{n} {op} on the {route!r} route"
                                                         for (op, route), n in routes.items()) or "none"))
        a, b = outs[case, "session"], outs[case, "onnxruntime"]
        ea, eb = eager[case, "session"], eager[case, "onnxruntime"]
        d = lambda x, y: float(np.abs(x - y).max())  # noqa: E731
        print(f"    largest |session - onnxruntime alone| = {d(a, b):.2e} (output scale {float(np.abs(eb).max()):.3g});"
              f" |session - torch| = {d(a, ea):.2e}, |onnxruntime - torch| = {d(b, eb):.2e}, torch's two paths "
              f"{d(ea, eb):.2e}")
        med = {}
        for k in KINDS:
            rounds = times[case, k]
            per_round = [1e3 * np.median(t) for t in rounds]
            med[k] = float(np.median(np.concatenate(rounds))) * 1e3
            info = procs[case, k].info
            print(f"    {k:<12} median {med[k]:8.1f} ms per call   round medians {min(per_round):.1f}-"
                  f"{max(per_round):.1f} ms (created in {1e3 * info['made']:.0f} ms, first call "
                  f"{1e3 * info['first']:.0f} ms)")
        ratios[case] = med["onnxruntime"] / med["session"]
        print(f"    speed-up: onnxruntime alone (GridSample path) / session = {ratios[case]:.2f}x (target >= 3x)")
    if prof:
        print("  the encoder in onnxruntime's profiler (a new session of each, 8 runs, the first two left out):")
        for k, pr in prof.items():
            attn = sum(pr["ops"].get(op, (0.0, 0))[0] for op in ATTN_OPS)
            top = sorted(pr["ops"].items(), key=lambda kv: -kv[1][0])[:6]
            print(f"    {k:<12} run {pr['run']:.1f} ms; {', '.join(f'{op} {ms:.1f}' for op, (ms, _) in top)} ms; "
                  f"{' + '.join(op for op in ATTN_OPS if op in pr['ops'])} {100 * attn / pr['run']:.0f} % of the run")
    return ratios.get("encoder")


# --- the torch operator's overhead ----------------------------------------------------------

def overhead(calls, blocks=7):
    """Median seconds per call, per block, of the NumPy function and of the torch op
    (no grad; inputs requiring grad) on tiny inputs, blocks alternating."""
    import torch

    import numba_ops
    import numba_ops.torch as nt
    rng = np.random.default_rng(0)
    value = rng.standard_normal((1, 4, 1, 1)).astype(np.float32)  # one 2x2 level, one head, one channel
    shapes, starts = np.array([[2, 2]], np.int64), np.array([0], np.int64)
    loc = rng.random((1, 1, 1, 1, 1, 2)).astype(np.float32)
    attn = np.ones((1, 1, 1, 1, 1), np.float32)
    tv, tl, ta = (torch.from_numpy(a.copy()) for a in (value, loc, attn))
    ts, tst = torch.from_numpy(shapes), torch.from_numpy(starts)
    gv, gl, ga = (t.clone().requires_grad_() for t in (tv, tl, ta))
    want = numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)
    got = nt.ms_deform_attn(tv, ts, tst, tl, ta)
    assert np.array_equal(got.numpy(), want), (got, want)

    def numpy_call():
        numba_ops.ms_deform_attn(value, shapes, starts, loc, attn)

    def torch_call():
        nt.ms_deform_attn(tv, ts, tst, tl, ta)

    def torch_grad_call():
        nt.ms_deform_attn(gv, ts, tst, gl, ga)

    fns = {"numpy": numpy_call, "torch": torch_call, "torch_grad": torch_grad_call}
    out = {k: [] for k in fns}
    for f in fns.values():  # warm-up
        for _ in range(200):
            f()
    order = list(fns)
    for b in range(blocks):
        for k in (order if b % 2 == 0 else order[::-1]):
            f, ts_ = fns[k], []
            for _ in range(calls):
                t = time.perf_counter()
                f()
                ts_.append(time.perf_counter() - t)
            out[k].append(float(np.median(ts_)))
    return out


def report_overhead(args):
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        print(f"SKIP the torch operator's overhead: torch is needed ({exc})")
        return None
    p = subprocess.run([sys.executable, _HERE, "--overhead", str(args.calls)], capture_output=True, text=True)
    if p.returncode:
        print(f"SKIP the torch operator's overhead: it failed:\n{p.stderr[-2000:]}")
        return None
    res = json.loads(p.stdout.strip().splitlines()[-1])
    us = {k: 1e6 * np.array(v) for k, v in res.items()}
    print(f"numba_ops.torch.ms_deform_attn against numba_ops.ms_deform_attn, tiny inputs (value 1x4x1x1, one 2x2 "
          f"level, 1 query, 1 point), {len(us['numpy'])} blocks x {args.calls} calls, alternating; torch "
          f"{version('torch')}:")
    for k, label in (("numpy", "numba_ops.ms_deform_attn (NumPy)"), ("torch", "nt.ms_deform_attn, no grad"),
                     ("torch_grad", "nt.ms_deform_attn, inputs requiring grad")):
        print(f"  {label:<42} median {np.median(us[k]):6.1f} us per call (block medians "
              f"{us[k].min():.1f}-{us[k].max():.1f})")
    for k, label in (("torch", "no grad"), ("torch_grad", "requiring grad")):
        extra = us[k] - us["numpy"]  # per block: the blocks ran side by side
        print(f"  overhead of the torch op ({label}): {np.median(extra):.1f} us (blocks {extra.min():.1f}-"
              f"{extra.max():.1f}; target <= 30 us)")
    return float(np.median(us["torch"] - us["numpy"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", choices=sorted(LEVELS), default="small",
                    help="small: a 320x480 image's pyramid (default); full: Deformable DETR's 800x1200")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=3, help="calls per round")
    ap.add_argument("--threads", type=int, default=2, help="intra_op_num_threads of both sides")
    ap.add_argument("--calls", type=int, default=2000, help="calls per block of the overhead measurement")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="leave out onnxruntime's profiler (the attention nodes' share)")
    ap.add_argument("--no-dynamo", dest="dynamo", action="store_false",
                    help="export with the TorchScript exporter (dynamo=False) only")
    ap.add_argument("--skip-overhead", action="store_true", help="the encoder only")
    ap.add_argument("--skip-encoder", action="store_true", help="the overhead only")
    ap.add_argument("--export", help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--overhead", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.export:
        return export_models(args.export, args.levels, args.layers, args.dynamo)
    if args.worker:
        return worker(*args.worker)
    if args.overhead:
        print(json.dumps(overhead(args.overhead)))
        return 0
    if not args.skip_encoder:
        with tempfile.TemporaryDirectory() as tmp:
            encoder(args, tmp)
    if not args.skip_overhead:
        report_overhead(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

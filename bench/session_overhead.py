"""A node's overhead in ``numba_ops.onnx.session`` over a direct call of its function.

    python bench/session_overhead.py [--nodes 64] [--repeat 200]

A model of ``--nodes`` tiny GridSample nodes in a chain (1x1x4x4 bilinear, grid
1x4x4x2) and one of as many tiny DeformConv nodes (1x2x4x4, 2x2x2x2 weights): the
session's time per node against the function's time per call on the same inputs
(the same thread count), and onnxruntime alone on the GridSample chain. Medians
of ``--repeat`` runs, after warm-up.
"""
import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP, helper

import numba_ops
from numba_ops.onnx import session


def chain(op, n):
    nodes, ins = [], []
    if op == "GridSample":
        ins.append(helper.make_tensor_value_info("G", TP.FLOAT, [1, 4, 4, 2]))
        for i in range(n):
            nodes.append(helper.make_node("GridSample", [f"x{i}", "G"], [f"x{i + 1}"]))
    else:
        ins += [helper.make_tensor_value_info("W", TP.FLOAT, [2, 2, 2, 2]),
                helper.make_tensor_value_info("O", TP.FLOAT, [1, 8, 4, 4])]
        for i in range(n):
            nodes.append(helper.make_node("DeformConv", [f"x{i}", "W", "O"], [f"x{i + 1}"], pads=[0, 0, 1, 1]))
    ins.insert(0, helper.make_tensor_value_info("x0", TP.FLOAT, [1, 2 if op == "DeformConv" else 1, 4, 4]))
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info(f"x{n}", TP.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)])


def median_time(f, repeat):
    for _ in range(10):
        f()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=200)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    n = a.nodes
    grid = rng.uniform(-1, 1, (1, 4, 4, 2)).astype(np.float32)
    x1 = rng.standard_normal((1, 1, 4, 4)).astype(np.float32)
    x2 = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
    w = rng.standard_normal((2, 2, 2, 2)).astype(np.float32) * 0.3
    off = rng.standard_normal((1, 8, 4, 4)).astype(np.float32)
    rows = []
    for op, feeds, direct in (
            ("GridSample", {"x0": x1, "G": grid}, lambda: numba_ops.grid_sample(x1, grid)),
            ("DeformConv", {"x0": x2, "W": w, "O": off}, lambda: numba_ops.deform_conv(x2, w, off, pads=[0, 0, 1, 1]))):
        m = chain(op, n)
        s = session(m)
        assert all(r.route == "compiled" for r in s.numba_ops_nodes)
        t_s = median_time(lambda: s.run(None, feeds), a.repeat) / n
        t_f = median_time(direct, a.repeat * 4)
        line = f"{op}: session {t_s * 1e6:.2f} us/node, function {t_f * 1e6:.2f} us/call, " \
               f"overhead {(t_s - t_f) * 1e6:+.2f} us/node"
        if op == "GridSample":
            o = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            line += f"; onnxruntime alone {median_time(lambda: o.run(None, feeds), a.repeat) / n * 1e6:.2f} us/node"
        rows.append(line)
    print(f"{n} nodes a model, medians of {a.repeat} runs (numba_ops {numba_ops.__version__}, onnxruntime "
          f"{ort.__version__})")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

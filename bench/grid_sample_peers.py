"""GridSample / affine_warp against onnxruntime, in one process, taking turns call by call.

    python bench/grid_sample_peers.py [--reps N]

Cases (issue 21): gs2d_32x256 (x 32x3x256x256, grid from ag2d_32x256's theta,
linear, zeros), gs3d_4x64 (x 4x1x64^3, ag3d_4x64's grid, trilinear, border),
gs2d_cubic_8x256 (x 8x3x256x256, cubic, reflection), aw2d_32x256 (affine_warp of
the first, against our own affine_grid + grid_sample and onnxruntime's AffineGrid
+ GridSample), and the dtypes of gs2d_32x256. Prints median and best ms per
implementation (float32, align_corners=0, onnxruntime with 2 intra-op threads).
"""
import argparse
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=11)
    reps = ap.parse_args().reps
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

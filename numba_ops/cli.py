"""The ``numba-ops`` command (also ``python -m numba_ops``): argument parsing and dispatch.

    numba-ops info                         versions, devices, threads, BLAS, JIT cache
    numba-ops info --cuda                  CUDA kernels' registers, spills, occupancy (ptxas)
    numba-ops check [--device D]           ONNX conformance cases and a gradient check, pass/fail
    numba-ops bench [--device D] [--dtype T] [--quick] [--json FILE] [--compare FILE] [--plot PNG]
    numba-ops bench --against REV [--quick] [--only NAMES] [--threshold F]
    numba-ops warm [--op OP ...] [--dtype T ...] [--device D ...] [--jobs N] [--force]   every kernel into the JIT cache

The benchmark itself (workers, timing, limits, statistics, tables, plots) lives
in ``numba_ops.benchmark``.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

from . import _accuracy
from ._dtypes import NAMES
from .benchmark.machine import version


# --------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------

def _cache_location():
    """Where numba keeps numba_ops' compiled kernels, as numba's cache locator decides."""
    from .kernels._compat import cache_path, dispatcher_types
    from .kernels.cpu import affine_grid as k
    path = next(cache_path(v) for v in vars(k).values()
                if isinstance(v, dispatcher_types()) and v.py_func.__module__ == k.__name__)
    how = "NUMBA_CACHE_DIR" if os.environ.get("NUMBA_CACHE_DIR") else "beside the kernels; set NUMBA_CACHE_DIR to move it"
    return f"{path} ({how})"


def cmd_info(args):
    if args.cuda:  # the CUDA kernels' resources: compiled here, no GPU needed
        from .benchmark.resources import report
        return report()
    import numba

    import numba_ops
    from ._dispatch import cuda_simulator
    from .kernels.cpu import _runtime  # sets numba_ops' threading layer: before anything starts the pool

    rows = [("numba_ops", f"{numba_ops.__version__} ({os.path.dirname(numba_ops.__file__)})"),
            ("python", sys.version.split()[0]),
            ("numpy", np.__version__),
            ("numba", numba.__version__),
            ("numba-cuda", version("numba-cuda") or "not installed"),
            ("ml_dtypes", version("ml_dtypes") or "not installed")]
    for dist in ("onnx", "onnxruntime", "torch", "torchvision"):
        rows.append((dist, version(dist) or "not installed (optional)"))
    devs = numba_ops.devices()
    dev_s = ", ".join(devs)
    if "cuda" in devs:
        if cuda_simulator():
            dev_s += " (cuda = numba's CUDA simulator, NUMBA_ENABLE_CUDASIM=1)"
        else:
            try:
                from numba import cuda
                dev_s += f" (cuda = {cuda.get_current_device().name.decode()})"
            except Exception:  # the name is a nicety
                pass
    rows.append(("devices", dev_s))
    rows.append(("threads", f"{numba.get_num_threads()} numba threads on {os.cpu_count()} CPUs "
                            f"(NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS})"))
    # The pool starts on the first parallel launch: make one (a cached kernel) to name the layer.
    configured = (f"{numba.config.THREADING_LAYER}, priority {' '.join(numba.config.THREADING_LAYER_PRIORITY)}, "
                  f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT') or _runtime.SPINCOUNT + ' as the pool starts'}")
    try:
        numba_ops.affine_grid(np.zeros((1, 2, 3), np.float32), (1, 1, 256, 256))
        layer = numba.threading_layer()
    except Exception as exc:  # report, never crash
        layer = f"unknown ({type(exc).__name__}: {exc})"
    rows.append(("threading layer", f"{layer} (configured: {configured}; parallel above "
                                    f"{_runtime.PARALLEL_MIN_WORK} elements of work)"))
    rows.append(("JIT cache", _cache_location()))
    missing = _session_missing()
    if missing is None:
        from .onnx._capi import route_status
        rows.append(("onnx session", route_status()))
    else:
        rows.append(("onnx session", f"not available ({missing})"))
    from .benchmark import machine
    rows.append(("BLAS", machine.blas_text(machine.blas_info())))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    warning = machine.coretype_warning()
    if warning:
        print(f"WARNING: {warning}")
    return 0


# --------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------

def _run_case(case, device, through="evaluator"):
    """Our output for a conformance case: backend cases through ONNX's reference
    evaluator with our operators (or, ``through="session"``, as a one-node model in
    ``numba_ops.onnx.session``), seed examples through the Python API."""
    if case.node is not None:
        feeds = {n: v for n, v in zip(case.node.input, case.inputs) if n}
        if through == "session":
            from .onnx import session
            return session(_node_model(case)).run(None, feeds)[0]
        from onnx.reference import ReferenceEvaluator

        from .onnx import mmdeploy_ops, ops
        sess = ReferenceEvaluator(case.node, new_ops=ops(device) + mmdeploy_ops(device))
        return sess.run(None, feeds)[0]
    import numba_ops
    if case.op == "ms_deform_attn":
        return numba_ops.ms_deform_attn(*case.inputs, device=device)
    if case.op == "AffineGrid":
        return numba_ops.affine_grid(*case.inputs, device=device, **case.attrs)
    if case.op == "GridSample":
        return numba_ops.grid_sample(*case.inputs, device=device, **case.attrs)
    return numba_ops.deform_conv(*case.inputs, device=device, **case.attrs)


def _node_model(case):
    """A model of the backend case's one node, its inputs typed and shaped as the case's."""
    from onnx import helper
    ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for n, v in zip(case.node.input, case.inputs) if n]
    # (the output has the first input's dtype: the expected values may be float64's)
    out = helper.make_tensor_value_info(case.node.output[0], helper.np_dtype_to_tensor_dtype(case.inputs[0].dtype),
                                        None)
    opsets = [helper.make_opsetid("", 22)] + ([helper.make_opsetid(case.node.domain, 1)] if case.node.domain else [])
    return helper.make_model(helper.make_graph([case.node], case.name, ins, [out]), opset_imports=opsets)


def _session_missing():
    """Why ``numba_ops.onnx.session`` cannot run here, or None."""
    try:
        import onnxruntime  # noqa: F401
        import onnxruntime_extensions  # noqa: F401
    except ImportError as exc:
        return f"{exc}; pip install 'numba_ops[onnxruntime]'"
    return None


def _usable(device, command):
    """True if ``device`` is usable here; else False, having said so on stderr."""
    import numba_ops
    if device in numba_ops.devices():
        return True
    print(f"numba-ops {command}: device {device!r} is not usable here (usable: {', '.join(numba_ops.devices())})",
          file=sys.stderr)
    return False


def _check_one(case, device, through="evaluator"):
    try:
        got = _run_case(case, device, through)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if hasattr(got, "copy_to_host"):
        got = got.copy_to_host()
    dtype = case.inputs[0].dtype
    why = _accuracy.compare(got, case.expected, dtype)
    if why is None and case.spot:  # values quoted on the ONNX page
        flat = np.asarray(got, dtype=np.float64).ravel()
        scale = _accuracy.scale_of(np.asarray(case.expected, dtype=np.float64))
        for i, v in case.spot.items():
            if _accuracy.compare(flat[i], v, dtype, scale=scale) is not None:
                return f"value {i} is {flat[i]!r}; the ONNX page shows {v!r}"
    return why


def cmd_check(args):
    device = args.device or "cpu"
    if not _usable(device, "check"):
        return 2
    from .benchmark.cases import ms_deform_attn_cases, onnx_backend_cases, seed_cases
    cases = seed_cases() + ms_deform_attn_cases()
    skipped = None
    try:
        cases += onnx_backend_cases()
    except ImportError as exc:
        skipped = f"ONNX backend cases not run: onnx is not installed ({exc}); pip install 'numba_ops[onnx]'"
    # the backend cases once more as models in onnxruntime with numba_ops' nodes (CPU kernels)
    runs = [(case, "evaluator") for case in cases]
    missing = _session_missing() if device == "cpu" else "session runs numba_ops' CPU kernels"
    if missing is None:
        runs += [(case, "session") for case in cases if case.node is not None]
    elif skipped is None:
        skipped = f"ONNX backend cases not run through numba_ops.onnx.session: {missing}"
    print(f"numba-ops check: {len(runs)} conformance cases and the gradient check on {device}")
    failed = 0
    for case, through in runs:
        t0 = time.perf_counter()
        why = _check_one(case, device, through)
        ms = (time.perf_counter() - t0) * 1e3
        status = "PASS" if why is None else "FAIL"
        failed += why is not None
        source = "ort" if through == "session" else case.source
        line = f"{status}  {source:<4}  {case.op:<14}  {case.name}  ({ms:.1f} ms)"
        print(line if why is None else f"{line}\n      {why}", flush=True)
    if skipped:
        print("SKIP  " + skipped)
    from .benchmark import gradcheck
    grads = gradcheck.cases()
    for case in grads:  # the gradients against central differences of the float64 forward
        t0 = time.perf_counter()
        try:
            why = gradcheck.check(case, device)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        ms = (time.perf_counter() - t0) * 1e3
        failed += why is not None
        line = f"{'PASS' if why is None else 'FAIL'}  grad  {case.op:<14}  {case.name}  ({ms:.1f} ms)"
        print(line if why is None else f"{line}\n      {why}", flush=True)
    total = len(runs) + len(grads)
    passed = total - failed
    print(f"{total} cases: {passed} passed, {failed} failed" + (" (see FAIL lines)" if failed else ""))
    return 1 if failed else 0


# --------------------------------------------------------------------------
# bench (numba_ops.benchmark)
# --------------------------------------------------------------------------

def cmd_bench(args):
    from .benchmark import harness
    if not args.load and not _usable(args.device or "cpu", "bench"):
        return 2
    return harness.main(args)


# --------------------------------------------------------------------------

def _positive_int(text):
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {n}")
    return n


def _threshold(text):
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number such as 0.1; got {text!r}") from None
    if not 0 < f < 10:
        raise argparse.ArgumentTypeError(f"must be a fraction > 0 such as 0.1 (10 %); got {text}")
    return f


def _parser():
    from .benchmark.against import THRESHOLD
    from .benchmark.harness import PEERS
    ap = argparse.ArgumentParser(prog="numba-ops", description="numba_ops: ONNX AffineGrid and DeformConv in Numba.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, devices, threads, threading layer, JIT cache location")
    p.add_argument("--cuda", action="store_true",
                   help="instead: registers, spills, shared memory and occupancy of every CUDA kernel on "
                        "sm_80 (A100) and sm_90 (H100/H200), from ptxas (no GPU needed)")
    p = sub.add_parser("check", help="run the ONNX conformance cases of the ops (and ms_deform_attn's against a "
                                     "float64 oracle); exit 1 on any failure")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cpu")
    p = sub.add_parser("bench", help="the benchmark table against the installed peers, or the regression "
                                     "check against a git revision (--against REV)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cpu")
    p.add_argument("--dtype", choices=NAMES, default="float32",
                   help="numba_ops' input dtype (peers stay float32); default float32")
    p.add_argument("--quick", action="store_true", help="fewer repeats: about a minute")
    p.add_argument("--json", metavar="FILE",
                   help="write the results as JSON, with numba_ops' per-round samples for a later --compare "
                        "(timed in fresh processes as --against does: --quick 8 rounds, else 16)")
    p.add_argument("--compare", metavar="FILE",
                   help="compare numba_ops' times with a saved run's (a --json file), round by round, with "
                        "--against's statistics and verdicts: exit 1 when a case is slower by more than --threshold "
                        "with statistical confidence, if FILE comes from this machine and package versions; from "
                        "another, print what differs and exit 0 with a warning")
    p.add_argument("--against", metavar="REV",
                   help="regression check: time the current source tree against git revision REV (checked out "
                        "in a temporary worktree), alternating, over several rounds; exit 1 when a case is slower "
                        "by more than --threshold with statistical confidence")
    p.add_argument("--threshold", type=_threshold, default=THRESHOLD, metavar="F",
                   help=f"with --against or --compare: the slowdown that fails, as a fraction (default {THRESHOLD})")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw the table (or --against's ratios) to a PNG (needs matplotlib: numba_ops[plot])")
    p.add_argument("--only", metavar="NAMES", help="comma-separated substrings of case names to run")
    p.add_argument("--peers", metavar="LIST",
                   help=f"comma-separated peers to time ({', '.join(PEERS)}, or none); default: those installed")
    p.add_argument("--repeat", type=_positive_int, metavar="N", help="timed calls per case (overrides --quick's)")
    p.add_argument("--load", metavar="FILE", help="show (and --compare) a saved --json report instead of measuring")
    # internal, for tests and tools: another repository and case module for --against, the round count
    p.add_argument("--repo", help=argparse.SUPPRESS)
    p.add_argument("--cases", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=_positive_int, help=argparse.SUPPRESS)
    p = sub.add_parser("warm", help="compile every kernel variant into numba's on-disk cache; exit 1 on a failure")
    p.add_argument("--op", action="extend", nargs="+", metavar="OP",
                   help="affine_grid, deform_conv, grid_sample, affine_warp, ms_deform_attn; default: all")
    p.add_argument("--dtype", action="extend", nargs="+", metavar="T", choices=NAMES,
                   help="default: all four")
    p.add_argument("--device", action="extend", nargs="+", metavar="D", choices=("cpu", "cuda"),
                   help="default: the usable devices")
    p.add_argument("--jobs", type=_positive_int, default=min(8, os.cpu_count() or 1), metavar="N",
                   help="processes compiling at once; default: the CPU count (at most 8)")
    p.add_argument("--force", action="store_true",
                   help="make every call even where the last warm-up's stamp says the cache is up to date")
    return ap


def cmd_warm(args):
    from ._warm import main as warm_main
    return warm_main(args.op, args.dtype, args.device, args.jobs, force=args.force)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_worker"]:  # internal: one implementation's process, see benchmark.harness
        from .benchmark import harness
        return harness.worker(json.loads(argv[1]))
    args = _parser().parse_args(argv)
    try:
        return {"info": cmd_info, "check": cmd_check, "bench": cmd_bench, "warm": cmd_warm}[args.command](args)
    except BrokenPipeError:  # the reader went away (numba-ops check | head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""DeformConv size sweep on the CPU: how the cost grows with the work, from
the existing bench cases to deep channels at small spatial sizes, float32.

Per shape of the shared case table (``numba_ops.benchmark.cases.DEFORM``): numba_ops' median
ms (with the 10th-90th percentile spread), the same kernel forced to split every
parallel run along positions (the split used before the channel split existed, so
old and new are compared in this one process: ``_deform_plan.SPLIT``), onnxruntime's
median ms (a one-node DeformConv model, as ``numba-ops bench`` builds it), the ratio
onnxruntime / numba_ops (above 1: numba_ops faster), and the fraction of the GEMM
bound (the dense convolution's FLOPs at the sgemm rate measured in the same run
with a NumPy float32 matmul, over numba_ops' median time).

The three implementations are called in turn, round after round, so that a load that
comes and goes hits them alike; medians over all rounds. OpenBLAS runs unpinned: the
script re-executes itself without ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` (the
command it runs is ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python
bench/deform_sweep.py``).

    python bench/deform_sweep.py [--only dc_c512,dc3d] [--rounds 30] [--calls 3] [--cpu]

``--cpu`` times CPU seconds of the whole process per call instead of wall seconds,
with waiting threads that sleep instead of spinning (``GOMP_SPINCOUNT=0`` for numba's
OpenMP pool, ``session.intra_op.allow_spinning=0`` for onnxruntime's): the work
done, summed over the threads, whatever else runs on the machine. It stands in for
wall time on a loaded machine, where preemptions fill the wall-clock figures; it
does not see idle threads (a split that leaves one waiting looks as cheap as an
even one).
"""
import argparse
import os
import sys

_UNPIN = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_CPU = "--cpu" in sys.argv
if any(k in os.environ for k in _UNPIN) or (_CPU and os.environ.get("GOMP_SPINCOUNT") != "0"):
    # before numpy loads OpenBLAS (and numba libgomp)
    env = {k: v for k, v in os.environ.items() if k not in _UNPIN}
    if _CPU:
        env["GOMP_SPINCOUNT"] = "0"
    os.execve(sys.executable, [sys.executable] + sys.argv, env)

import time  # noqa: E402

import numpy as np  # noqa: E402

#: the sweep, smallest work first within each family
SWEEP = ["dc_seed", "dc_b8_c32_32", "dc_s2_g2", "dc_r50_c64_56", "dc_c256_28", "dc_c256_14", "dc_c512_7",
         "dc_c1024_7", "dc_c512_14", "dc_b2_c512_14", "dc_c512_25x42", "dc3d_c256_8x14"]


def sgemm_rate(cpu=False, seconds=2.0):
    """NumPy float32 matmul GFLOP/s, best of repeated 2048^3 products: wall time on all of
    its BLAS threads, or (``cpu``) CPU time on one thread (a core's rate)."""
    import contextlib
    n = 2048
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    clock = time.process_time if cpu else time.perf_counter
    limit = contextlib.nullcontext()
    if cpu:
        from threadpoolctl import threadpool_limits
        limit = threadpool_limits(1, "blas")
    with limit:
        a @ b
        best, t_end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t = clock()
            a @ b
            best = min(best, clock() - t)
    return 2.0 * n ** 3 / best / 1e9


def ort_fn(args, attrs, spin=True):
    """A onnxruntime call of the case (a one-node model, as numba_ops.cli's
    ``_ort_session`` makes it), or a string saying why there is none."""
    if args[0].ndim != 4:
        return "2-D only in onnxruntime"
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper
        named = [(n, a) for n, a in zip(("X", "W", "offset", "B", "mask"), args) if a is not None]
        vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(v.shape)) for n, v in named]
        node = helper.make_node("DeformConv", [n for n, _ in named], ["y"], **attrs)
        g = helper.make_graph([node], "g", vi, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)])
        so = ort.SessionOptions()
        if not spin:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        feed = dict(named)

        def fn():
            return s.run(None, feed)[0]
        fn()
        return fn
    except Exception as exc:  # e.g. no 3-D DeformConv in this onnxruntime
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated substrings of case names")
    ap.add_argument("--rounds", type=int, default=30, help="rounds of alternating calls (default 30)")
    ap.add_argument("--calls", type=int, default=3, help="timed calls per implementation per round")
    ap.add_argument("--cpu", action="store_true", help="CPU seconds per call, threads sleeping when idle")
    a = ap.parse_args(argv)
    import numba

    import numba_ops
    from numba_ops.benchmark import cases as _cases
    from numba_ops.kernels.cpu import _deform_plan as dc_plan

    names = SWEEP + [n for n in _cases.DEFORM if n not in SWEEP]
    if a.only:
        keys = a.only.split(",")
        names = [n for n in names if any(k in n for k in keys)]
    clock = time.process_time if a.cpu else time.perf_counter
    rate = sgemm_rate(a.cpu)
    how = ", one thread, CPU time" if a.cpu else ""
    print(f"sgemm (NumPy float32, 2048^3{how}): {rate:.0f} GFLOP/s; numba threads {numba.get_num_threads()}, "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}; "
          f"{a.rounds} rounds x {a.calls} calls; {'CPU' if a.cpu else 'wall'} ms", flush=True)
    head = (f"{'case':<16} {'numba_ops ms':>22} {'position split ms':>22} {'onnxruntime ms':>22} "
            f"{'ort/ours':>9} {'% GEMM bound':>12} {'split':>9}")
    rows = []
    for name in names:
        args, attrs, flops = _cases.deform_inputs(name, "float32")
        X, W, off, B, mask = args

        def ours():
            return numba_ops.deform_conv(X, W, off, B, mask, **attrs)
        # the shape's own plan (channel or position split, as chosen), then the position split forced
        dc_plan.STATES.clear()
        dc_plan.SPLIT = None
        ours()
        st_new = dict(dc_plan.STATES)
        dc_plan.STATES.clear()
        dc_plan.SPLIT = False
        ours()
        st_old = dict(dc_plan.STATES)
        dc_plan.SPLIT = None
        nth = numba.get_num_threads()
        chosen = [st for st in st_new.values()][0].tilings.get(nth)
        split = "channel" if chosen is not None and chosen.plan.split else "position"
        if len(st_new) and [st for st in st_new.values()][0].small:
            split = "serial"

        def use(states):
            dc_plan.STATES.clear()
            dc_plan.STATES.update(states)
        peer = ort_fn(args, attrs, spin=not a.cpu)
        impls = [("new", lambda: (use(st_new), ours())), ("old", lambda: (use(st_old), ours()))]
        if callable(peer):
            impls.append(("ort", peer))
        for _, f in impls:  # warm-up
            f()
        times = {k: [] for k, _ in impls}
        for r in range(a.rounds):
            for k, f in impls[r % len(impls):] + impls[:r % len(impls)]:  # each goes first in turn
                for _ in range(a.calls):
                    t = clock()
                    f()
                    times[k].append(clock() - t)
        use({})
        st = {k: np.percentile(np.array(v) * 1e3, [10, 50, 90]) for k, v in times.items()}
        bound = flops / (rate * 1e9) * 1e3

        def fmt(p):
            return f"{p[1]:8.3f} [{p[0]:.2f}-{p[2]:.2f}]"
        ort_txt = fmt(st["ort"]) if "ort" in st else peer[:22]
        ratio = f"{st['ort'][1] / st['new'][1]:.2f}/{st['ort'][0] / st['new'][0]:.2f}" if "ort" in st else "-"
        row = (f"{name:<16} {fmt(st['new']):>22} {fmt(st['old']):>22} {ort_txt:>22} {ratio:>9} "
               f"{100 * bound / st['new'][1]:5.0f}/{100 * bound / st['new'][0]:.0f}% {split:>9}")
        if not rows:
            print(head)
        rows.append(row)
        print(row, flush=True)
    print("ms: medians [10th-90th percentile] of all calls; ort/ours: onnxruntime's time over numba_ops', "
          "medians/10th percentiles (above 1: numba_ops faster); % GEMM bound: dense-conv FLOPs at the "
          "sgemm rate over numba_ops' median/10th percentile time (--cpu: CPU time at one core's rate); "
          "split: the parallel run's split numba_ops "
          "chose (the position split column forces the position split, the way every shape ran before). "
          "On a loaded machine the medians hold preemptions; the 10th percentiles are nearer the work.")


if __name__ == "__main__":
    main()

"""DeformConv size sweep on the CPU (issue 22): how the cost grows with the work, from
the existing bench cases to deep channels at small spatial sizes, float32.

Per shape of the shared case table (``numba_ops._cases.DEFORM``): numba_ops' median
ms (with the 10th-90th percentile spread), the same kernel forced to split every
parallel run along positions (the split used before the channel split existed, so
old and new are compared in this one process: ``deform_conv._SPLIT``), onnxruntime's
median ms (a one-node DeformConv model, as ``numba-ops bench`` builds it), the ratio
onnxruntime / numba_ops (above 1: numba_ops faster), and the fraction of the GEMM
bound (the dense convolution's FLOPs at the sgemm rate measured in the same run
with a NumPy float32 matmul, over numba_ops' median time).

The three implementations are called in turn, round after round, so that a load that
comes and goes hits them alike; medians over all rounds. OpenBLAS runs unpinned: the
script re-executes itself without ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` (the
command it runs is ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python
bench/deform_sweep.py``).

    python bench/deform_sweep.py [--only dc_c512,dc3d] [--rounds 30] [--calls 3]
"""
import argparse
import os
import sys

_UNPIN = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
if any(k in os.environ for k in _UNPIN):  # before numpy loads OpenBLAS
    env = {k: v for k, v in os.environ.items() if k not in _UNPIN}
    os.execve(sys.executable, [sys.executable] + sys.argv, env)

import time  # noqa: E402

import numpy as np  # noqa: E402

#: the sweep, smallest work first within each family
SWEEP = ["dc_seed", "dc_b8_c32_32", "dc_s2_g2", "dc_r50_c64_56", "dc_c256_28", "dc_c256_14", "dc_c512_7",
         "dc_c1024_7", "dc_c512_14", "dc_b2_c512_14", "dc_c512_25x42", "dc3d_c256_8x14"]


def sgemm_rate(seconds=2.0):
    """NumPy float32 matmul GFLOP/s (its own threads), best of repeated 2048^3 products."""
    n = 2048
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    a @ b
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best / 1e9


def ort_fn(args, attrs):
    """A onnxruntime call of the case, or a string saying why there is none."""
    try:
        from numba_ops.cli import _ort_session
        named = [(n, a) for n, a in zip(("X", "W", "offset", "B", "mask"), args) if a is not None]
        fn = _ort_session("DeformConv", named, attrs, 22, "cpu")
        fn()
        return fn
    except Exception as exc:  # e.g. no 3-D DeformConv in this onnxruntime
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated substrings of case names")
    ap.add_argument("--rounds", type=int, default=30, help="rounds of alternating calls (default 30)")
    ap.add_argument("--calls", type=int, default=3, help="timed calls per implementation per round")
    a = ap.parse_args(argv)
    import numba

    import numba_ops
    from numba_ops import _cases
    from numba_ops.kernels.cpu import deform_conv as cpu_dc

    names = SWEEP + [n for n in _cases.DEFORM if n not in SWEEP]
    if a.only:
        keys = a.only.split(",")
        names = [n for n in names if any(k in n for k in keys)]
    rate = sgemm_rate()
    print(f"sgemm (NumPy float32, 2048^3): {rate:.0f} GFLOP/s; numba threads {numba.get_num_threads()}, "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}; "
          f"{a.rounds} rounds x {a.calls} calls", flush=True)
    head = (f"{'case':<16} {'numba_ops ms':>22} {'position split ms':>22} {'onnxruntime ms':>22} "
            f"{'ort/ours':>9} {'% GEMM bound':>12} {'split':>9}")
    rows = []
    for name in names:
        args, attrs, flops = _cases.deform_inputs(name, "float32")
        X, W, off, B, mask = args

        def ours():
            return numba_ops.deform_conv(X, W, off, B, mask, **attrs)
        # the shape's own plan (channel or position split, as chosen), then the position split forced
        cpu_dc._STATES.clear()
        cpu_dc._SPLIT = None
        ours()
        st_new = dict(cpu_dc._STATES)
        cpu_dc._STATES.clear()
        cpu_dc._SPLIT = False
        ours()
        st_old = dict(cpu_dc._STATES)
        cpu_dc._SPLIT = None
        nth = numba.get_num_threads()
        chosen = [st for st in st_new.values()][0].meta.get(nth, (None,))[0]
        split = "channel" if chosen is not None and chosen[0][-1] else "position"
        if len(st_new) and [st for st in st_new.values()][0].small is not None:
            split = "serial"

        def use(states):
            cpu_dc._STATES.clear()
            cpu_dc._STATES.update(states)
        peer = ort_fn(args, attrs)
        impls = [("new", lambda: (use(st_new), ours())), ("old", lambda: (use(st_old), ours()))]
        if callable(peer):
            impls.append(("ort", peer))
        for _, f in impls:  # warm-up
            f()
        times = {k: [] for k, _ in impls}
        for r in range(a.rounds):
            for k, f in impls[r % len(impls):] + impls[:r % len(impls)]:  # each goes first in turn
                for _ in range(a.calls):
                    t = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t)
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
          "sgemm rate over numba_ops' median/10th percentile time; split: the parallel run's split numba_ops "
          "chose (the position split column forces the position split, the way every shape ran before). "
          "On a loaded machine the medians hold preemptions; the 10th percentiles are nearer the work.")


if __name__ == "__main__":
    main()

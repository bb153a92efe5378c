"""Cold start of numba_ops, as a new user meets it:

- ``import numba_ops`` (``python -X importtime``, median of fresh processes);
- first calls with an empty JIT cache: each sequence runs in a fresh process with
  a new empty ``NUMBA_CACHE_DIR``; its first call is "first", the later ones are
  "further" (another dtype, rank or path in the same process);
- the same first calls again in a fresh process once the cache holds them (warm);
- optionally ``numba-ops warm`` on the CPU into an empty cache, then again.

Times are wall seconds, with the process's CPU seconds beside them (compiling is
single-threaded, so CPU time is what it costs on an idle machine; on a loaded one
wall time is not to be trusted). Medians over ``--rounds``.

    python bench/cold_start.py [--rounds 3] [--warm] [--src DIR] [--only WORDS]

``--src DIR`` measures the numba_ops found in DIR (for example a ``git archive``
of another revision), so two trees can be compared in one run, alternating.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
import numpy as np
t0 = time.perf_counter()
import numba_ops
t_import = time.perf_counter() - t0

def bf16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)

def call(spec):
    op, dtype, nd, path, *how = spec.split("/")
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    nd = int(nd)
    if op == "affine_grid":
        size = (1, 1) + ((2,) * nd if path == "small" else (1,) * (nd - 2) + (1024, 64))
        return lambda: numba_ops.affine_grid(np.zeros((1, nd, nd + 1), dt), size, device="cpu")
    if op in ("grid_sample", "affine_warp"):  # how: "mode,padding" (default linear,zeros)
        mode, padding = how[0].split(",") if how else ("linear", "zeros")
        x = np.ones((1, 1) + (4,) * nd, dt)
        n = 3 if path == "serial" else 70000  # output positions (the parallel path from 65536 taps)
        kw = dict(mode=mode, padding_mode=padding, device="cpu")
        if op == "grid_sample":
            g = np.zeros((1, n) + (1,) * (nd - 1) + (nd,), dt)
            return lambda: numba_ops.grid_sample(x, g, **kw)
        theta = np.zeros((1, nd, nd + 1), dt)
        return lambda: numba_ops.affine_warp(x, theta, (1, 1) + (1,) * (nd - 1) + (n,), **kw)
    o = {"direct": 1, "serial": {1: 65, 2: 6, 3: 3}[nd], "parallel": {1: 5000, 2: 50, 3: 12}[nd]}[path]
    K = 2 ** nd
    x = np.ones((1, 2) + (o + 1,) * nd, dt)
    w = np.ones((2, 2) + (2,) * nd, dt)
    off = np.zeros((1, K * nd) + (o,) * nd, dt)
    return lambda: numba_ops.deform_conv(x, w, off, device="cpu")

out = {"import_s": t_import, "calls": []}
for spec in sys.argv[1:]:
    fn = call(spec)
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    out["calls"].append([spec, time.perf_counter() - w0, time.process_time() - c0])
print("@@" + json.dumps(out))
"""

#: sequences of first calls, each in a fresh process: op/dtype/n/path[/mode,padding]
SEQUENCES = [
    ["affine_grid/float32/2/small", "affine_grid/float32/3/small", "affine_grid/float32/2/large",
     "affine_grid/float16/2/small"],
    ["deform_conv/float32/2/direct", "deform_conv/float16/2/direct", "deform_conv/float32/1/direct",
     "deform_conv/float32/3/direct"],
    ["deform_conv/float32/2/serial", "deform_conv/float64/2/serial", "deform_conv/float32/3/serial"],
    ["deform_conv/float32/2/parallel", "deform_conv/bfloat16/2/parallel", "deform_conv/float32/1/parallel"],
    ["grid_sample/float32/2/serial", "grid_sample/float32/2/serial/cubic,reflection",
     "grid_sample/float32/2/parallel", "grid_sample/float16/3/serial"],
    ["affine_warp/float32/2/serial", "affine_warp/float32/2/parallel/nearest,border"],
]


def _env(src, cache):
    env = dict(os.environ)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cache is None:
        env.pop("NUMBA_CACHE_DIR", None)
    else:
        env["NUMBA_CACHE_DIR"] = cache
    return env


def import_seconds(src, runs=5):
    """Median cumulative time of the ``numba_ops`` line of ``python -X importtime``."""
    times = []
    for _ in range(runs):
        p = subprocess.run([sys.executable, "-X", "importtime", "-c", "import numba_ops"], capture_output=True,
                           text=True, env=_env(src, None), cwd=src)
        m = re.search(r"\|\s+(\d+) \| numba_ops\s*$", p.stderr, re.M)
        times.append(int(m.group(1)) / 1e6)
    return statistics.median(times)


def first_calls(src, seq, cache):
    p = subprocess.run([sys.executable, "-c", CHILD, *seq], capture_output=True, text=True,
                       env=_env(src, cache), cwd=src)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.split("@@")[-1])


def warm_cli(src, cache):
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "numba_ops", "warm", "--device", "cpu"], capture_output=True,
                       text=True, env=_env(src, cache), cwd=src)
    return time.perf_counter() - t, p.returncode, p.stdout.strip().splitlines()[-2:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--src", action="append", help="numba_ops source trees to compare (default: this one)")
    ap.add_argument("--only", help="comma-separated words: run only sequences holding one")
    ap.add_argument("--warm", action="store_true", help="also time `numba-ops warm` on the CPU (minutes)")
    args = ap.parse_args(argv)
    srcs = args.src or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    seqs = SEQUENCES
    if args.only:
        words = args.only.split(",")
        seqs = [s for s in seqs if any(w in " ".join(s) for w in words)]
    res = {src: {"import": [], "cold": {}, "warm": {}} for src in srcs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for src in srcs:  # alternating, so load from elsewhere falls on every tree alike
                res[src]["import"].append(import_seconds(src, runs=1))
                for i, seq in enumerate(seqs):
                    cache = os.path.join(tmp, f"{abs(hash(src))}-{r}-{i}")
                    cold = first_calls(src, seq, cache)
                    warm = first_calls(src, seq, cache)
                    for spec, w, c in cold["calls"]:
                        res[src]["cold"].setdefault(spec, []).append((w, c))
                    for spec, w, c in warm["calls"]:
                        res[src]["warm"].setdefault(spec, []).append((w, c))
        for src in srcs:
            print(f"== {src}")
            print(f"import numba_ops: {statistics.median(res[src]['import']):.3f} s (median of {args.rounds})")
            print(f"{'first call (empty cache, in sequence)':44s} {'wall s':>8s} {'cpu s':>8s}   "
                  f"{'warm cache wall':>15s}")
            for seq in seqs:
                for j, spec in enumerate(seq):
                    cw = statistics.median(w for w, _ in res[src]["cold"][spec])
                    cc = statistics.median(c for _, c in res[src]["cold"][spec])
                    ww = statistics.median(w for w, _ in res[src]["warm"][spec])
                    tag = "first  " if j == 0 else "further"
                    print(f"  {tag} {spec:36s} {cw:8.2f} {cc:8.2f}   {ww:15.3f}")
            if args.warm:
                cache = os.path.join(tmp, f"warm-{abs(hash(src))}")
                t1, rc1, tail1 = warm_cli(src, cache)
                t2, rc2, tail2 = warm_cli(src, cache)
                print(f"numba-ops warm --device cpu: {t1:.1f} s (rc {rc1}); again {t2:.1f} s (rc {rc2})")
                for line in tail1 + tail2:
                    print("  " + line)


if __name__ == "__main__":
    main()

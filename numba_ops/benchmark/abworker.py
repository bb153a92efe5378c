"""The timing worker of ``numba-ops bench --against``, run as a script:

    python abworker.py TREE CONFIG_JSON

It is self-contained (standard library only) and always comes from the *current*
source tree, for both sides of the comparison; from ``TREE`` (the current tree or
REV's worktree) it imports only the case module (``numba_ops.benchmark.cases``, or
``numba_ops._cases`` in a REV from before it moved, unless the config names
another), whose ``CASES`` lists (op, name) pairs and whose
``call(name, dtype, device=...)`` returns a zero-argument function that runs a
case. So an old REV, whose harness differed or did not exist, is timed by the
same code as the current tree.

Events (``protocol.py``, the benchmark's one worker line protocol): first
{"ready", "cases", "file"} (or {"error"}), then one {"case", "samples", "others"}
per case name read from stdin (seconds of each timed call; the share of the CPUs
other processes took meanwhile), or {"case", "missing"} / {"case", "error"}.
"""
import importlib
import importlib.util
import json
import os
import sys
import time


def _load_protocol():
    """``protocol.py`` from beside this file, by path: ``numba_ops`` on sys.path may
    be the tree being timed (an old REV), and importing it would import numba too."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol.py")
    spec = importlib.util.spec_from_file_location("_numba_ops_bench_protocol", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

#: the case table's module before it moved, for a REV that old
OLD_NAMES = {"numba_ops.benchmark.cases": "numba_ops._cases"}


_emit = _load_protocol().emit


def _case_names(mod):
    return [c if isinstance(c, str) else c[1] for c in mod.CASES]


def _make(mod, name, cfg):
    try:
        fn = mod.call(name, cfg["dtype"], device=cfg["device"])
    except TypeError:  # an older case table without device=
        fn = mod.call(name, cfg["dtype"])
    if cfg["device"] == "cuda":
        from numba import cuda
        call = fn
        fn = lambda: (call(), cuda.synchronize())  # noqa: E731
    return fn


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds():
    """(CPU seconds the whole machine has spent busy, steal included; CPU seconds
    this process has spent), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    t = os.times()
    return (sum(v) - v[3] - v[4]) / _TICK, t.user + t.system


def time_turn(fn, cfg):
    """One turn: {"samples": seconds of each timed call, "others": the fraction of
    the machine's CPU time that other processes took meanwhile (None where it cannot
    be read)}. First a call (JIT load or compile) and ``warmup_s`` of calls untimed
    (after idle, this VM runs the first ~10 ms of any code up to 2x slower), then
    calls until ``turn_s`` has passed and at least ``min_calls`` are in, at most
    ``max_calls``."""
    fn()
    t_warm = time.perf_counter() + cfg["warmup_s"]
    while time.perf_counter() < t_warm:
        fn()
    samples = []
    c0, w0 = _cpu_seconds(), time.perf_counter()
    t_end = w0 + cfg["turn_s"]
    while len(samples) < cfg["max_calls"]:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        samples.append(t1 - t0)
        if len(samples) >= cfg["min_calls"] and t1 > t_end:
            break
    c1, wall = _cpu_seconds(), time.perf_counter() - w0
    others = None
    if c0 and c1 and wall * _TICK >= 0.1 * _TICK:  # /proc/stat counts ticks: a shorter turn is too few of them
        others = round(min(1.0, max(0.0, (c1[0] - c0[0] - (c1[1] - c0[1])) / (wall * (os.cpu_count() or 1)))), 3)
    return {"samples": samples, "others": others}


def main(argv):
    tree, cfg = os.path.abspath(argv[0]), json.loads(argv[1])
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [tree] + [p for p in sys.path if p and os.path.abspath(p) not in (here, tree)]
    try:
        name = cfg["cases_module"]
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if name not in OLD_NAMES or not name.startswith(exc.name or "?"):
                raise
            mod = importlib.import_module(OLD_NAMES[name])
        where = os.path.abspath(mod.__file__)
        if not where.startswith(tree + os.sep):
            raise ImportError(f"{cfg['cases_module']} came from {where}, not from {tree}")
        names = _case_names(mod)
    except Exception as exc:  # the tree cannot be timed at all: say why
        _emit({"error": f"{type(exc).__name__}: {exc}"[:500]})
        return 0
    _emit({"ready": True, "cases": names, "file": where})
    fns = {}
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        if name not in names:
            _emit({"case": name, "missing": True})
            continue
        try:
            if name not in fns:
                fns[name] = _make(mod, name, cfg)
            _emit({"case": name, **time_turn(fns[name], cfg)})
        except Exception as exc:  # one failing case must not hide the others
            _emit({"case": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

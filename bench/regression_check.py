"""How well ``numba-ops bench --against`` tells a regression from noise, measured.

    python bench/regression_check.py --runs 10            # the README's figures
    python bench/regression_check.py --runs 2 --only ag2d_small,dc_seed,dc_s2_g2

Two experiments, each ``--runs`` runs of ``numba-ops bench --quick --against``:

* A/A: the source tree against HEAD. Nothing should be flagged; a run that flags
  any case is a false alarm. (With uncommitted changes the tree is not HEAD: run it
  on a clean checkout.)
* A/B: a temporary worktree of HEAD whose DeformConv front end spins 20 % of each
  call more (a commit made there, ``numba_ops/deform_conv.py`` wrapped), against
  HEAD. Every ``dc_`` forward case should be flagged (the gradient cases, ``*_bwd``,
  do not call the wrapped function); the AffineGrid cases (``ag``), which the change
  does not touch, should not.

It prints, per experiment, the runs with any flag, the flags per case, the
"undecided" counts and each run's seconds, and writes them as JSON (``--json``).
Run it on a quiet machine: the check is built to hold under noise, but a machine
that is busy elsewhere makes every case noisier and more of them "undecided".
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SPIN = '''

# --- regression_check.py: the front end spins 20 % of each call more --------
import time as _time

_unspun_deform_conv = deform_conv


def deform_conv(*args, **kwargs):  # noqa: F811
    t0 = _time.perf_counter()
    y = _unspun_deform_conv(*args, **kwargs)
    t_end = _time.perf_counter() + 0.2 * (_time.perf_counter() - t0)
    while _time.perf_counter() < t_end:
        pass
    return y
'''


def _git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=regression_check", "-c", "user.email=rc@example.com", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _runs(tree, rev, n, only, label, extra_env=None):
    """n runs of ``bench --quick --against rev`` from ``tree``; a list of per-run records."""
    env = dict(os.environ, PYTHONPATH=str(tree), **(extra_env or {}))
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            path = os.path.join(tmp, f"{label.replace('/', '')}{i}.json")
            cmd = [sys.executable, "-m", "numba_ops", "bench", "--quick", "--against", rev, "--json", path]
            if only:
                cmd += ["--only", only]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            secs = time.perf_counter() - t0
            if not os.path.exists(path):
                raise SystemExit(f"{label} run {i + 1} failed (exit {p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
            rep = json.loads(Path(path).read_text())
            verdicts = {name: row["verdict"] for name, row in rep["cases"].items()}
            ratios = {name: row.get("ratio") for name, row in rep["cases"].items()}
            out.append({"exit": p.returncode, "seconds": round(secs, 1), "verdicts": verdicts, "ratios": ratios})
            flagged = [c for c, v in verdicts.items() if v == "slower"]
            print(f"  {label} run {i + 1}/{n}: exit {p.returncode}, {secs:.0f} s, flagged: {', '.join(flagged) or '-'}; "
                  + " ".join(f"{c} {r:.2f}" for c, r in ratios.items() if r), flush=True)
    return out


def _spun(case):
    """A case the A/B spin slows: a DeformConv forward case (the spin wraps ``deform_conv``,
    which the gradient cases, ``dc*_bwd``, do not call)."""
    return case.startswith("dc_") and not case.endswith("_bwd")


def _summary(label, runs):
    cases = list(runs[0]["verdicts"])
    n = len(runs)
    any_flag = sum(any(v == "slower" for v in r["verdicts"].values()) for r in runs)
    dc_any = sum(any(v == "slower" for c, v in r["verdicts"].items() if _spun(c)) for r in runs)
    dc_all = sum(all(v == "slower" for c, v in r["verdicts"].items() if _spun(c)) for r in runs)
    ag_any = sum(any(v == "slower" for c, v in r["verdicts"].items() if c.startswith("ag")) for r in runs)
    print(f"{label}: {n} runs; runs with any case flagged: {any_flag}; with a dc_ case flagged: {dc_any} "
          f"(all dc_ cases: {dc_all}); with an ag case flagged: {ag_any}; seconds per run: "
          f"{min(r['seconds'] for r in runs):.0f}-{max(r['seconds'] for r in runs):.0f}")
    for c in cases:
        vs = [r["verdicts"][c] for r in runs]
        print(f"  {c:<16} slower {vs.count('slower')}/{n}, undecided {vs.count('undecided')}/{n}, "
              f"same {vs.count('same')}/{n}, faster {vs.count('faster')}/{n}")
    return {"runs": n, "any_flag": any_flag, "dc_flag": dc_any, "dc_all_flagged": dc_all, "ag_flag": ag_any,
            "per_run": runs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="runs per experiment (default 10)")
    ap.add_argument("--only", help="comma-separated substrings of case names (default: every case)")
    ap.add_argument("--skip-aa", action="store_true", help="run the A/B experiment only")
    ap.add_argument("--json", help="write the counts and every run's verdicts here")
    args = ap.parse_args(argv)
    head = _git(ROOT, "rev-parse", "HEAD")
    result = {"head": head, "only": args.only, "load_before": os.getloadavg()}
    if not args.skip_aa:
        print(f"A/A: the source tree {ROOT} against HEAD ({head[:10]}), {args.runs} runs", flush=True)
        result["aa"] = _summary("A/A", _runs(ROOT, "HEAD", args.runs, args.only, "A/A"))
    tmp = tempfile.mkdtemp(prefix="numba-ops-spin-")
    tree = os.path.join(tmp, "tree")
    try:
        _git(ROOT, "worktree", "add", "--detach", "-q", tree, head)
        with open(os.path.join(tree, "numba_ops", "deform_conv.py"), "a") as fh:
            fh.write(SPIN)
        _git(tree, "commit", "-q", "-am", "DeformConv front end spins 20 % of each call (regression_check.py)")
        spun = _git(tree, "rev-parse", "HEAD")
        print(f"A/B: {spun[:10]} (HEAD + a 20 % spin in DeformConv's front end) against HEAD, {args.runs} runs",
              flush=True)
        runs = _runs(Path(tree), head, args.runs, args.only, "A/B",
                     {"NUMBA_CACHE_DIR": os.path.join(tmp, "numba_cache")})
        result["ab"] = _summary("A/B", runs)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    result["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

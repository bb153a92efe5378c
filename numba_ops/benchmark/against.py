"""``numba-ops bench --against REV``: the code in the current source tree against
git revision REV of the same repository, timed on this machine in one run.

REV is checked out into a temporary ``git worktree`` (nothing is installed). Its
path is fixed per commit and repository and its files carry the commit's time, so
numba's JIT cache for it (a ``NUMBA_CACHE_DIR`` of its own, kept between runs
beside the worktree's place) stays valid from one run to the next; the current
tree keeps the user's cache. Both sides are timed by the same worker script, from
the current tree (``abworker.py``), which imports only the case table from the
tree it times.

Each round starts a fresh worker process per side; the two take turns case by
case, the side that goes first alternating between cases and rounds, each turn
after a pause in which the other side's thread pool stops spinning. Every timed
call is kept; ``stats`` turns the rounds into a ratio, an interval and a verdict.
"""
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from . import protocol, stats

try:
    import fcntl
except ImportError:  # not POSIX: no lock, so every run works in a place of its own
    fcntl = None

#: per mode: rounds, and per turn: seconds of warm-up calls, seconds of timed calls,
#: at least / at most this many timed calls. --quick: ~9 s a round for 8 cases here.
QUICK = {"rounds": 8, "warmup_s": 0.05, "turn_s": 0.1, "min_calls": 5, "max_calls": 200}
FULL = {"rounds": 16, "warmup_s": 0.05, "turn_s": 0.3, "min_calls": 10, "max_calls": 500}
#: idle before each turn: numba_ops' libgomp spins ~0.1 s after a call (kernels/cpu/_runtime.py)
SETTLE_S = 0.15
THRESHOLD = 0.10
CASES_MODULE = "numba_ops.benchmark.cases"
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "abworker.py")


class AgainstError(Exception):
    """The comparison cannot be made (no git repository, unknown REV, a tree that
    cannot be imported); the message says why."""


def _git(repo, *args):
    try:
        p = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)
    except OSError as exc:
        raise AgainstError(f"cannot run git ({exc}): --against needs git") from None
    if p.returncode != 0:
        raise AgainstError(f"git {' '.join(args)} failed in {repo}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout.strip()


def find_repo(repo=None):
    """The top of the current source tree: ``repo``'s git work tree if given, else
    the one that holds the imported numba_ops package, else the current directory's."""
    if repo:
        return _git(os.path.abspath(repo), "rev-parse", "--show-toplevel")
    import numba_ops
    for start in (os.path.dirname(os.path.dirname(os.path.abspath(numba_ops.__file__))), os.getcwd()):
        with contextlib.suppress(AgainstError, OSError):
            return _git(start, "rev-parse", "--show-toplevel")
    raise AgainstError("not in a git repository: run it from a clone of numba_ops (or an editable install of one)")


def _cache_base():
    base = os.environ.get("NUMBA_OPS_AGAINST_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "numba_ops", "against")
    return base


class RevTree:
    """REV checked out in a temporary git worktree, removed on exit. ``path`` is the
    tree; ``cache`` the NUMBA_CACHE_DIR of its workers; ``note`` says when the
    fixed, cache-keeping place was busy (another run) and a cold one was used."""

    def __init__(self, repo, sha):
        self.repo, self.sha, self.note = repo, sha, None
        common = _git(repo, "rev-parse", "--git-common-dir")
        common = os.path.abspath(os.path.join(repo, common))
        key = f"{sha[:12]}-{hashlib.sha1(common.encode()).hexdigest()[:8]}"
        self.home = os.path.join(_cache_base(), key)
        self._lock, self._temp = None, None

    def __enter__(self):
        os.makedirs(self.home, exist_ok=True)
        self._lock = open(os.path.join(self.home, "lock"), "w")
        try:
            if fcntl is None:
                raise OSError("no file locks here")
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            home = self.home
        except OSError:  # another run holds it: work in a place of our own, with a cold cache
            self._lock.close()
            self._lock = None
            home = self._temp = tempfile.mkdtemp(prefix="numba-ops-against-")
            self.note = f"{self.home} is in use by another run: REV's JIT cache starts cold in {home}"
        self.path, self.cache = os.path.join(home, "tree"), os.path.join(home, "numba_cache")
        self._remove()
        _git(self.repo, "worktree", "add", "--detach", "-f", "-q", self.path, self.sha)
        # the commit's time on every file: numba's cache entries are keyed on source mtime
        stamp = int(_git(self.repo, "show", "-s", "--format=%ct", self.sha))
        for root, _, files in os.walk(self.path):
            for f in files:
                with contextlib.suppress(OSError):
                    os.utime(os.path.join(root, f), (stamp, stamp))
        return self

    def _remove(self):
        if os.path.exists(self.path):
            with contextlib.suppress(AgainstError):
                _git(self.repo, "worktree", "remove", "--force", self.path)
            shutil.rmtree(self.path, ignore_errors=True)

    def __exit__(self, *exc):
        self._remove()
        if self._temp:
            shutil.rmtree(self._temp, ignore_errors=True)
        if self._lock:
            self._lock.close()
        return False


class SideError(AgainstError):
    """A side's worker could not start timing (``side``: its label, ``why``: what it said)."""

    def __init__(self, side, why):
        super().__init__(f"{side}: {why}")
        self.side, self.why = side, why


def _worker(label, tree, env, cfg):
    """A fresh ``abworker.py`` process timing the case module of ``tree``."""
    return protocol.Worker(label, [sys.executable, _WORKER, tree, json.dumps(cfg)], env=env, cwd=tree)


def take_rounds(sides, cfg, select, log=print):
    """Rounds of per-call samples, the evidence of ``--against`` (two sides) and of a
    saved run (one side, the current tree).

    ``sides``: {label: (tree, env)}; ``cfg``: the workers' config (case module,
    dtype, device, rounds and the turn's timing: ``QUICK``/``FULL``); ``select``:
    called once with the first side's case names, returns the names to time.
    Each round starts a fresh worker per side, one at a time (no import overlaps
    another's timing); then case by case each side takes a turn, the side that goes
    first alternating between cases and rounds, each turn after ``SETTLE_S`` idle.
    A case missing on a side or failing there is not asked again.

    Returns (names, {name: {label: [samples of each round], "others": {label: [the
    share of the CPUs other processes took in each of its turns]}, "missing": label,
    "error": "label: why"}} (the last two only when so), {label: its ready event}).
    Raises SideError when a side's worker cannot start."""
    labels = list(sides)
    names, recs, ready = None, {}, {}
    for r in range(cfg["rounds"]):
        workers = {}
        try:
            for label in labels:
                tree, env = sides[label]
                w = workers[label] = _worker(label, tree, env, cfg)
                ev = w.event()
                if ev is None or "error" in ev:
                    raise SideError(label, ev["error"] if ev else w.died())
                ready[label] = ev
                if names is None:
                    names = select(ev["cases"])
                    recs = {n: {lab: [] for lab in labels} for n in names}
            line = []
            for i, name in enumerate(names):
                rec = recs[name]
                if "missing" in rec or "error" in rec:
                    continue
                k = (r + i) % len(labels)
                for label in labels[k:] + labels[:k]:
                    time.sleep(SETTLE_S)
                    ev = workers[label].ask(name)
                    if "samples" in ev:
                        rec[label].append(ev["samples"])
                        rec.setdefault("others", {}).setdefault(label, []).append(ev.get("others"))
                    elif ev.get("missing"):
                        rec["missing"] = label
                        break
                    else:
                        rec["error"] = f"{label}: {ev.get('error')}"
                        break
                else:
                    ms = [statistics.median(rec[label][-1]) for label in labels]
                    line.append(f"{name} {ms[0] / ms[1]:.2f}" if len(ms) == 2 else f"{name} {1e3 * ms[0]:.3f} ms")
            log(f"  round {r + 1}/{cfg['rounds']}: " + ("  ".join(line) or "-"))
        finally:
            for w in workers.values():
                w.close()
    return names, recs, ready


def _select(names, only):
    if not only:
        return list(names)
    keys = [k for k in only.split(",") if k]
    picked = [n for n in names if any(k in n for k in keys)]
    if not picked:
        raise AgainstError(f"--only {only!r} matches no case; cases: {', '.join(names)}")
    return picked


def worker_env(tree, cache=None):
    """The environment of a worker timing ``tree``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = tree  # only this tree: never the other side's (nor a PYTHONPATH of the caller's)
    if cache:
        env["NUMBA_CACHE_DIR"] = cache
    return env


def run(rev, *, repo=None, cases_module=CASES_MODULE, only=None, quick=False, threshold=THRESHOLD,
        dtype="float32", device="cpu", rounds=None, log=print):
    """Time the current tree against ``rev``; returns the report (a JSON-able dict).
    Raises AgainstError when the comparison cannot be made."""
    top = find_repo(repo)
    try:
        sha = _git(top, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except AgainstError:
        raise AgainstError(f"{rev!r} is not a commit of the repository at {top}") from None
    mode = dict(QUICK if quick else FULL)
    if rounds:
        mode["rounds"] = rounds
    cfg = {"cases_module": cases_module, "dtype": dtype, "device": device, **mode}
    t_start = time.perf_counter()
    with RevTree(top, sha) as rt:
        if rt.note:
            log(f"note: {rt.note}")
        sides = {"current": (top, worker_env(top)), "rev": (rt.path, worker_env(rt.path, rt.cache))}
        try:
            names, samples, ready = take_rounds(sides, cfg, lambda cases: _select(cases, only), log)
        except SideError as exc:
            what = "the current tree" if exc.side == "current" else f"REV {rev} ({sha[:10]})"
            raise AgainstError(f"{what} cannot be timed: {exc.why}") from None
    cases = {}
    for name in names:
        rec = samples[name]
        row = {"status": "ok", "current": rec["current"], "rev": rec["rev"]}
        if rec.get("missing"):
            row.update(status="missing in REV", verdict="missing in REV")
        elif "error" in rec:
            row.update(status="error", verdict="error", error=rec["error"])
        else:
            row.update(stats.judge(rec["current"], rec["rev"], threshold, ("current", "rev")))
        cases[name] = row
    info = {side: ev["file"] for side, ev in ready.items()}
    rev_names, cur_names = set(ready["rev"]["cases"]), set(ready["current"]["cases"])
    return {"tool": "numba-ops bench --against", "rev": rev, "sha": sha, "current_tree": top,
            "rev_files": info.get("rev"), "current_files": info.get("current"), "cases_module": cases_module,
            "dtype": dtype, "device": device, "quick": bool(quick), "threshold": threshold,
            "confidence": stats.CONFIDENCE, "settle_s": SETTLE_S, **mode,
            "rev_only_cases": sorted(rev_names - cur_names),
            "seconds": round(time.perf_counter() - t_start, 1), "cases": cases}


def exit_code(report):
    """1 when a case is slower beyond the threshold (or fails in the current tree), else 0."""
    bad = [n for n, r in report["cases"].items()
           if r["verdict"] == "slower" or (r["verdict"] == "error" and r["error"].startswith("current"))]
    return 1 if bad else 0


def _ms(v):
    return "-" if v is None else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def print_verdicts(cases, sides, threshold, pairing, confidence=stats.CONFIDENCE, out=print):
    """The table of a comparison, ``--against``'s and ``--compare``'s: per case each
    side's time, the ratio, its interval and the verdict, then the legend.
    ``sides``: the two sides' (key, label), the current one first (rows hold
    ``<key>_ms``); ``pairing``: how the rounds were paired, for the legend."""
    pct = int(round(100 * confidence))
    (cur, cur_label), (base, base_label) = sides
    head = ["case", f"{cur_label} ms", f"{base_label} ms", "ratio", f"{pct}% interval", "verdict"]
    rows = []
    for name, r in cases.items():
        if r["status"] != "ok":
            why = r["verdict"] + (f": {r['error']}" if r.get("error") else "")
            rows.append([name, "-", "-", "-", "-", why])
            continue
        ci = "-" if r["low"] is None else f"{r['low']:.3f} - {r['high']:.3f}"
        rows.append([name, _ms(r[f"{cur}_ms"]), _ms(r[f"{base}_ms"]), f"{r['ratio']:.3f}", ci, r["verdict"]])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for line in [head] + rows:
        out("  ".join(str(c).ljust(w) if j in (0, 5) else str(c).rjust(w)
                      for j, (c, w) in enumerate(zip(line, widths))).rstrip())
    t = threshold
    out(f"ms: median over rounds of each round's median call. ratio: {cur_label} / {base_label}, the "
        f"Hodges-Lehmann estimate over {pairing}, with its exact {pct}% interval (Wilcoxon signed-rank). slower: "
        f"ratio > {1 + t:.2f} and the interval above 1; faster: ratio < {1 / (1 + t):.3f} and the interval below 1; "
        f"same: the interval within [{1 / (1 + t):.3f}, {1 + t:.2f}]; undecided: too noisy to say.")


def verdict_counts(cases):
    """"1 slower, 3 same, ..." over the cases' verdicts."""
    verdicts = [r["verdict"] for r in cases.values()]
    order = dict.fromkeys(["slower", "faster", "same", "undecided"] + verdicts)
    return ", ".join(f"{verdicts.count(v)} {v}" for v in order if v in verdicts)


def print_report(report, out=print):
    out("")
    out(f"numba-ops bench --against {report['rev']} ({report['sha'][:10]}): the current tree "
        f"{report['current_tree']} over REV, {report['rounds']} rounds, {report['dtype']} on {report['device']}"
        f"{', quick' if report['quick'] else ''}, threshold {report['threshold']:.0%}")
    print_verdicts(report["cases"], (("current", "current"), ("rev", "REV")), report["threshold"],
                   "paired rounds", report["confidence"], out)
    if report.get("rev_only_cases"):
        out(f"cases only in REV (not timed): {', '.join(report['rev_only_cases'])}")
    code = exit_code(report)
    out(f"regression check: {verdict_counts(report['cases'])}; {'FAILED' if code else 'passed'} "
        f"({report['seconds']:.0f} s)")

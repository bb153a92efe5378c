"""``numba-ops bench --against REV`` end to end, on a throwaway git repository made
here whose case module (``fakecases``, named with the internal ``--cases``
option) busy-waits a fixed time per call, so the verdicts do not depend on the
machine's load: 2 ms against 1 ms is flagged (exit 1), 1 ms against 1 ms is not
(exit 0). And ``--compare`` with a saved run from another machine: a warning,
what differs, exit 0; and the one line protocol of the benchmark's workers."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAVED_RUN = ROOT / "tests" / "data" / "bench_run.json"

CASES = """
import time

DELAY = {delay}
CASES = [("spin", "spin_a")]{extra}


def call(name, dtype="float32", small=False, device=None):
    def fn():
        t_end = time.perf_counter() + DELAY
        while time.perf_counter() < t_end:
            pass
    return fn
"""


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo,
                   check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    """A git repository whose one commit holds a 1 ms case."""
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    (r / "fakecases.py").write_text(CASES.format(delay=0.001, extra=""))
    _git(r, "add", "fakecases.py")
    _git(r, "commit", "-q", "-m", "1 ms")
    return r


def against(repo, tmp_path, *args):
    env = dict(os.environ, NUMBA_OPS_AGAINST_DIR=str(tmp_path / "against"))
    cmd = [sys.executable, "-m", "numba_ops", "bench", "--against", "HEAD", "--quick", "--repo", str(repo),
           "--cases", "fakecases", "--json", str(tmp_path / "ab.json"), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    report = json.loads((tmp_path / "ab.json").read_text()) if (tmp_path / "ab.json").exists() else None
    return p.returncode, p.stdout + p.stderr, report


def _no_worktree_left(repo):
    out = subprocess.run(["git", "worktree", "list"], cwd=repo, capture_output=True, text=True).stdout
    return len(out.strip().splitlines()) == 1


@pytest.mark.serial
@pytest.mark.full  # seconds of alternating timed runs
def test_2ms_against_1ms_is_flagged(repo, tmp_path):
    (repo / "fakecases.py").write_text(CASES.format(delay=0.002, extra=""))  # the working tree, uncommitted
    rc, out, report = against(repo, tmp_path)
    assert rc == 1, out
    row = report["cases"]["spin_a"]
    # wall-clock busy waits: on a loaded machine preemption stretches the longer wait more, so only bounds below
    assert row["verdict"] == "slower" and row["ratio"] > 1.5 and row["low"] > 1.1, row
    assert len(row["current"]) == report["rounds"] == 8 and all(len(s) >= 5 for s in row["current"] + row["rev"])
    assert row["rev_ms"] >= 0.99 and row["current_ms"] >= 1.99
    assert "regression check: 1 slower; FAILED" in out
    assert report["rev_files"].startswith(str(tmp_path / "against")) and report["current_files"] == str(
        repo / "fakecases.py")
    assert "cpu_model" in report["machine"]
    assert _no_worktree_left(repo)


@pytest.mark.serial
@pytest.mark.full  # a live A/B run each; the default run makes one in test_2ms_against_1ms_is_flagged
def test_1ms_against_1ms_passes_and_a_new_case_is_reported(repo, tmp_path):
    (repo / "fakecases.py").write_text(CASES.format(delay=0.001, extra='\nCASES.append(("spin", "spin_old"))'))
    _git(repo, "commit", "-q", "-am", "a case the working tree will drop")
    (repo / "fakecases.py").write_text(CASES.format(delay=0.001, extra='\nCASES.append(("spin", "spin_new"))'))
    rc, out, report = against(repo, tmp_path, "--plot", str(tmp_path / "ab.png"))
    assert rc == 0, out
    assert report["cases"]["spin_a"]["verdict"] != "slower"
    assert 0.9 < report["cases"]["spin_a"]["ratio"] < 1.1
    assert report["cases"]["spin_new"]["verdict"] == "missing in REV"
    assert "missing in REV" in out and "passed" in out
    assert report["rev_only_cases"] == ["spin_old"] and "cases only in REV (not timed): spin_old" in out
    assert (tmp_path / "ab.png").read_bytes()[:4] == b"\x89PNG"
    assert _no_worktree_left(repo)


@pytest.mark.serial
@pytest.mark.full  # a live A/B run; the default run makes one in test_2ms_against_1ms_is_flagged
def test_threshold_and_only(repo, tmp_path):
    (repo / "fakecases.py").write_text(CASES.format(delay=0.002, extra='\nCASES.append(("spin", "spin_b"))'))
    # 2x slower is within a 900 % threshold (wide: on a loaded machine preemption stretches a 2 ms wait more)
    rc, out, report = against(repo, tmp_path, "--only", "spin_a", "--threshold", "9")
    assert rc == 0, out
    assert list(report["cases"]) == ["spin_a"] and report["threshold"] == 9
    assert report["cases"]["spin_a"]["ratio"] > 1.5 and report["rev_only_cases"] == []


@pytest.mark.parametrize("rev,why", [("no-such-rev", "not a commit"), ("HEAD", "cannot be timed")])
def test_what_cannot_be_compared_exits_2(repo, tmp_path, rev, why):
    if rev == "HEAD":  # a REV without the case module
        (repo / "other.py").write_text("x = 1\n")
        _git(repo, "rm", "-q", "fakecases.py")
        _git(repo, "add", "other.py")
        _git(repo, "commit", "-q", "-m", "no cases")
        (repo / "fakecases.py").write_text(CASES.format(delay=0.001, extra=""))
    env = dict(os.environ, NUMBA_OPS_AGAINST_DIR=str(tmp_path / "against"))
    p = subprocess.run([sys.executable, "-m", "numba_ops", "bench", "--against", rev, "--quick", "--repo", str(repo),
                        "--cases", "fakecases"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 2 and why in p.stderr and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert _no_worktree_left(repo)


def test_compare_with_a_run_from_another_machine_warns_and_exits_0(tmp_path):
    saved = json.loads(SAVED_RUN.read_text())
    saved["machine"]["cpu_model"] = "Some Other CPU"
    saved["machine"]["blas"][0]["kernel"] = "SkylakeX"
    for row in saved["cases"].values():  # 3x faster there: every case is far slower here
        row["samples"] = [[t / 3 for t in turn] for turn in row["samples"]]
    path = tmp_path / "other_machine.json"
    path.write_text(json.dumps(saved))
    p = subprocess.run([sys.executable, "-m", "numba_ops", "bench", "--load", str(SAVED_RUN), "--compare", str(path)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "warning" in p.stderr and "another machine" in p.stderr
    assert "cpu_model: Some Other CPU -> AMD EPYC" in p.stdout and "kernel SkylakeX" in p.stdout
    for name in saved["cases"]:
        assert re.search(rf"^{name} .* 3\.000 +3\.000 - 3\.000 +slower$", p.stdout, re.M), p.stdout
    assert "not gated" in p.stdout and "FAILED" not in p.stdout


def test_compare_with_a_run_without_metadata_warns_and_exits_0(tmp_path):
    saved = json.loads(SAVED_RUN.read_text())
    del saved["machine"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(saved))
    p = subprocess.run([sys.executable, "-m", "numba_ops", "bench", "--load", str(SAVED_RUN), "--compare", str(path)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and "no machine metadata" in p.stdout and "warning" in p.stderr, p.stdout + p.stderr


WORKER = """
import sys
sys.path.insert(0, {here!r})
from protocol import emit
print("chatter before ready")
emit({{"ready": True}})
for line in sys.stdin:
    if line.strip() == "die":
        print("Traceback: the worker fell over")
        sys.exit(3)
    print("chatter")
    emit({{"case": line.strip(), "samples": [1.0]}})
"""


def test_one_worker_protocol(tmp_path):
    """Both kinds of worker write their events through protocol.emit, and the parent
    reads them through protocol.Worker: other output is skipped, kept only to say
    why a worker died."""
    from numba_ops.benchmark import abworker, harness, protocol
    here = os.path.dirname(protocol.__file__)
    script = tmp_path / "w.py"
    script.write_text(WORKER.format(here=here))
    w = protocol.Worker("test", [sys.executable, str(script)])
    try:
        assert w.event() == {"ready": True}
        assert w.ask("a") == {"case": "a", "samples": [1.0]}
        ev = w.ask("die")
        assert ev["case"] == "die" and "the test worker exited" in ev["error"] and "fell over" in ev["error"]
    finally:
        w.close()
    assert protocol.parse("chatter") is None and protocol.parse(protocol.MARK + '{"x": 1}\n') == {"x": 1}
    # no other framing left in either worker or its reader
    for mod in (abworker, harness):
        src = Path(mod.__file__).read_text()
        assert "@@" not in src and "json.dumps(obj)" not in src, mod.__name__

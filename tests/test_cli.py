"""The ``numba-ops`` command (the documented contract: Command line): each subcommand in a fresh
process, as a user runs it; faults are injected through a small wrapper script
that patches numba_ops, then calls ``numba_ops.cli.main``."""
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import numba_ops
from numba_ops.benchmark import protocol

ROOT = Path(__file__).resolve().parents[1]
SAVED_RUN = ROOT / "tests" / "data" / "bench_run.json"  # an example saved run (bench --json), with machine metadata
N_CHECK_CASES = 80  # 8 ONNX backend cases of AffineGrid/DeformConv, 18 of GridSample, 8 operator-page examples,
# 4 ms_deform_attn cases against a float64 oracle, the 26 backend cases and the 4 ms_deform_attn ones once more
# through numba_ops.onnx.session, and 12 gradient checks (numba_ops.gradcheck)
N_GRAD_CASES = 12


def run(*args, script=None, timeout=300, stdin=None):
    """``python -m numba_ops ARGS``, or ``python SCRIPT ARGS`` for a wrapper script."""
    cmd = [sys.executable] + ([str(script)] if script else ["-m", "numba_ops"]) + list(args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, input=stdin)
    return p.returncode, p.stdout, p.stderr


def wrapper(tmp_path, source):
    path = tmp_path / "wrapped_numba_ops.py"
    path.write_text(textwrap.dedent(source))
    return path


# A kernel fault: the CPU AffineGrid launcher returns a grid shifted by 1e-3.
BROKEN_AFFINE_GRID = """
    import sys
    import numba_ops.kernels.cpu.affine_grid as k
    real = k.launch
    def broken(*args):
        out = real(*args)
        out[...] += 1e-3
        return out
    k.launch = broken
    from numba_ops import cli
    sys.exit(cli.main(sys.argv[1:]))
"""

# A gradient fault: the CPU GridSample backward's grad_x off by 1e-3.
BROKEN_GRID_SAMPLE_BACKWARD = """
    import sys
    import numba_ops.kernels.cpu.grid_sample_backward as k
    real = k.launch
    def broken(*args):
        gx, gg = real(*args)
        if gx is not None:
            gx[...] += 1e-3
        return gx, gg
    k.launch = broken
    from numba_ops import cli
    sys.exit(cli.main(sys.argv[1:]))
"""


def test_console_script_is_declared():
    eps = importlib.metadata.entry_points(group="console_scripts")
    ep = [e for e in eps if e.name == "numba-ops"]
    assert ep and ep[0].value == "numba_ops.cli:main"


def test_console_script_runs():
    exe = Path(sys.executable).with_name("numba-ops")
    if not exe.exists():  # installed elsewhere (e.g. a user scheme): run it through its entry point
        pytest.skip("no numba-ops script beside this interpreter")
    p = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and all(c in p.stdout for c in ("info", "check", "bench"))


def test_info():
    rc, out, err = run("info")
    assert rc == 0, err
    for key in ("numba_ops", "numba", "numba-cuda", "numpy", "devices", "threads", "threading layer", "JIT cache", "BLAS"):
        assert re.search(rf"^{re.escape(key)}\s", out, re.M), f"info lacks {key!r}:\n{out}"
    assert numba_ops.__version__ in out
    devices = re.search(r"^devices\s+(.*)$", out, re.M).group(1)
    assert devices.startswith("cpu") and (("cuda" in devices) == ("cuda" in numba_ops.devices()))
    layer = re.search(r"^threading layer\s+(\S+)", out, re.M).group(1)
    assert layer in ("workqueue", "omp", "tbb"), out


@pytest.mark.full  # (the default run checks every case through the broken-kernel tests below)
def test_check_passes():
    rc, out, err = run("check")
    assert rc == 0, out + err
    lines = [ln for ln in out.splitlines() if ln.startswith(("PASS", "FAIL"))]
    assert len(lines) == N_CHECK_CASES and all(ln.startswith("PASS") for ln in lines), out
    for name in ("test_affine_grid_3d_align_corners", "test_deform_conv_with_multiple_offset_groups",
                 "test_cc_deform_conv_with_mask_bias", "ms_deform_attn_3d"):
        assert name in out
    assert f"{N_CHECK_CASES} cases: {N_CHECK_CASES} passed, 0 failed" in out


def test_check_ms_deform_attn_cases():
    """check's ms_deform_attn cases: its float64 oracle agrees with the tests' own, the
    cases reach the levels' edges, points far outside and not finite, and the function
    (and the MMDeploy node, in the evaluator) is within the API's accuracy of them."""
    import numpy as np
    from reference import ms_deform_attn_ref

    from numba_ops import _accuracy
    from numba_ops.benchmark.cases import ms_deform_attn_cases
    cases = ms_deform_attn_cases()
    assert len(cases) == 4 and {c.node.domain for c in cases} == {"mmdeploy", "mmcv", "numba_ops"}
    assert {c.inputs[1].shape[1] for c in cases} == {2, 3}
    assert np.isnan(cases[-1].expected).any()
    for c in cases:
        value, shapes, starts, loc, attn = c.inputs
        np.testing.assert_allclose(c.expected, ms_deform_attn_ref(value, shapes, loc, attn), rtol=1e-12, atol=1e-12)
        assert _accuracy.compare(numba_ops.ms_deform_attn(*c.inputs), c.expected, value.dtype) is None, c.name


def test_check_fails_on_a_broken_kernel(tmp_path):
    rc, out, err = run("check", script=wrapper(tmp_path, BROKEN_AFFINE_GRID))
    assert rc == 1, out + err
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    # 4 backend + 4 page cases (the session's nodes run the compiled kernel on onnxruntime's
    # threads, not the patched Python launcher: its 4 pass)
    assert len(fails) == 8 and all("AffineGrid" in ln for ln in fails), out
    assert f"{N_CHECK_CASES - 8} passed, 8 failed" in out


@pytest.mark.full  # a third check run (the broken-kernel test above runs the gradient cases by default)
def test_check_fails_on_a_broken_gradient(tmp_path):
    rc, out, err = run("check", script=wrapper(tmp_path, BROKEN_GRID_SAMPLE_BACKWARD))
    assert rc == 1, out + err
    grads = [ln for ln in out.splitlines() if ln.startswith(("PASS  grad", "FAIL  grad"))]
    assert len(grads) == N_GRAD_CASES, out
    fails = [ln for ln in grads if ln.startswith("FAIL")]
    assert len(fails) == 5 and all("GridSample" in ln for ln in fails), out  # every grid_sample case


@pytest.mark.skipif("cuda" in numba_ops.devices(), reason="checks the no-GPU message")
def test_check_on_an_unusable_device_says_so():
    rc, out, err = run("check", "--device", "cuda")
    assert rc == 2 and "not usable" in err


@pytest.mark.serial
@pytest.mark.full  # peers and the table: seconds of timing (CI runs the full pass and a bench smoke)
def test_bench_quick(tmp_path):
    out_json = tmp_path / "bench.json"
    rc, out, err = run("bench", "--quick", "--repeat", "1", "--only", "ag2d_small,dc_seed",
                       "--peers", "onnxruntime", "--rounds", "3", "--json", str(out_json))
    assert rc == 0, out + err
    # a progress line per case and implementation, then the table
    for impl in ("numba_ops", "onnxruntime"):
        for case in ("ag2d_small", "dc_seed"):
            assert re.search(rf"\[{impl}\] {case}: [\d.]+ ms warm, [\d.]+ ms cold", out), out
    assert re.search(r"limits: write bandwidth [\d.]+ GB/s .*GEMM [\d.]+ GFLOP/s", out), out
    head = [ln for ln in out.splitlines() if ln.startswith("case ")][0]
    for col in ("numba_ops ms", "cold ms", "onnxruntime ms", "ours/best peer", "% of limit"):
        assert col in head
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith(("ag2d_small ", "dc_seed "))}
    assert set(rows) == {"ag2d_small", "dc_seed"} and all("x onnxruntime" in r and "%" in r for r in rows.values())
    report = json.loads(out_json.read_text())
    assert report["dtype"] == "float32" and report["device"] == "cpu"
    for case in ("ag2d_small", "dc_seed"):
        figs = report["cases"][case]["figures"]
        assert figs["fraction_of_limit"] > 0 and figs["speed_vs_onnxruntime"] > 0


def test_compare_passes_on_the_same_run():
    rc, out, err = run("bench", "--load", str(SAVED_RUN), "--compare", str(SAVED_RUN))
    assert rc == 0, out + err
    assert re.search(r"^dc_r50_c64_56 .* 1\.000 +1\.000 - 1\.000 +same$", out, re.M), out
    assert "comparison: 2 same; passed" in out and "warning" not in err


def _scaled(tmp_path, factor, case=None):
    """SAVED_RUN with the samples of ``case`` (every case if None) times ``factor``."""
    report = json.loads(SAVED_RUN.read_text())
    for name, row in report["cases"].items():
        if case in (None, name):
            row["samples"] = [[t * factor for t in turn] for turn in row["samples"]]
    path = tmp_path / f"scaled_{factor}.json"
    path.write_text(json.dumps(report))
    return path


@pytest.mark.parametrize("slower,verdict", [(1.05, "same"), (1.25, "slower")])
def test_gate_on_a_slowed_report(tmp_path, slower, verdict):
    rc, out, err = run("bench", "--load", str(_scaled(tmp_path, slower, "dc_r50_c64_56")), "--compare", str(SAVED_RUN))
    assert rc == (1 if verdict == "slower" else 0), out + err
    assert re.search(rf"^dc_r50_c64_56 .* {slower:.3f} .* {verdict}$", out, re.M), out
    assert re.search(r"^ag2d_32x256 .* same$", out, re.M), out
    assert ("comparison: 1 slower, 1 same; FAILED" if verdict == "slower" else "comparison: 2 same; passed") in out


def test_a_run_saved_under_other_load_is_reported_not_failed(tmp_path):
    """Other processes took 90 % of the CPUs during the saved run's turns and 10 %
    now (or the reverse), or left 20 % free then and 14 % now: the times are shown,
    never failed on. Left 20 % and 19 % free: within the threshold, gated."""
    for was, now in ((0.9, 0.1), (0.1, 0.9), (0.8, 0.86), (0.8, 0.81)):
        saved = json.loads(_scaled(tmp_path, 0.5).read_text())  # 2x faster then: slower now
        current = json.loads(SAVED_RUN.read_text())
        for run_, share in ((saved, was), (current, now)):
            for row in run_["cases"].values():
                row["others"] = [share] * len(row["samples"])
        (tmp_path / "saved.json").write_text(json.dumps(saved))
        (tmp_path / "now.json").write_text(json.dumps(current))
        rc, out, err = run("bench", "--load", str(tmp_path / "now.json"), "--compare", str(tmp_path / "saved.json"))
        assert f"{was:.0%} saved, {now:.0%} now" in out and re.search(r"^dc_r50_c64_56 .* slower$", out, re.M), out
        if now == 0.81:
            assert rc == 1 and "FAILED" in out and "warning" not in err, out + err
        else:
            assert rc == 0 and "not gated (a machine under other load)" in out and "warning" in err, out + err


def test_an_old_format_file_is_refused_with_a_message(tmp_path):
    """A run saved before the samples (format 1: single figures, no "format" key)."""
    report = json.loads(SAVED_RUN.read_text())
    del report["format"]
    for row in report["cases"].values():
        del row["samples"]
    path = tmp_path / "format1.json"
    path.write_text(json.dumps(report))
    for load, compare in ((SAVED_RUN, path), (path, SAVED_RUN)):
        rc, out, err = run("bench", "--load", str(load), "--compare", str(compare))
        assert rc == 2 and "older numba-ops bench" in err and "numba-ops bench --json FILE" in err, out + err
        assert "Traceback" not in err
    report["format"] = 3
    path.write_text(json.dumps(report))
    rc, out, err = run("bench", "--load", str(SAVED_RUN), "--compare", str(path))
    assert rc == 2 and "format 3" in err and "reads format 2" in err, out + err
    for other in ([1], {"note": "not a run", "cases": {}}):
        path.write_text(json.dumps(other))
        rc, out, err = run("bench", "--load", str(SAVED_RUN), "--compare", str(path))
        assert rc == 2 and "is not a run saved by numba-ops bench --json FILE" in err, out + err


@pytest.mark.serial
@pytest.mark.full  # three live benchmark runs (about a minute); the default run times one in test_bench_quick
def test_a_saved_run_compared_twice_on_unchanged_code_passes(tmp_path):
    """The live path end to end, on a tiny case and the fewest rounds that give an
    interval: a run saved with --json, compared twice on the same code, exits 0
    both times; the last run made 2x faster, as a baseline, makes it a regression (exit 1). The
    threshold is 50 %: a 7 us case's rounds move by tens of percent when the load of a
    shared machine changes between two runs (its turns are too short for the load gate),
    while a halving still fails."""
    saved, now = tmp_path / "saved.json", tmp_path / "now.json"
    args = ("bench", "--quick", "--repeat", "1", "--only", "ag2d_small", "--peers", "none", "--rounds", "6",
            "--threshold", "0.5")
    rc, out, err = run(*args, "--json", str(saved))
    assert rc == 0, out + err
    report = json.loads(saved.read_text())
    assert report["format"] == 2 and report["machine"]["cpus"] >= 1 and report["sampling"]["rounds"] == 6
    samples = report["cases"]["ag2d_small"]["samples"]
    assert len(samples) == 6 and all(len(turn) >= 5 and min(turn) > 0 for turn in samples)
    for _ in range(2):
        rc, out, err = run(*args, "--compare", str(saved), "--json", str(now))
        assert rc == 0, out + err
        assert re.search(r"^ag2d_small .* (same|undecided|faster)$", out, re.M), out
        assert "passed" in out and "warning" not in err
    # the run just compared, made 2x faster: a baseline every round of the run loses to
    # by exactly 2x (a copy of the first saved run would inherit that run's load)
    fast = json.loads(now.read_text())
    fast["cases"]["ag2d_small"]["samples"] = [[t / 2 for t in turn] for turn in fast["cases"]["ag2d_small"]["samples"]]
    (tmp_path / "fast.json").write_text(json.dumps(fast))
    rc, out, err = run("bench", "--load", str(now), "--compare", str(tmp_path / "fast.json"), "--threshold", "0.5")
    assert rc == 1, out + err
    assert re.search(r"^ag2d_small .* slower$", out, re.M) and "comparison: 1 slower; FAILED" in out, out


def test_gate_refuses_a_baseline_of_another_dtype(tmp_path):
    report = json.loads(SAVED_RUN.read_text())
    report["dtype"] = "float64"
    path = tmp_path / "f64.json"
    path.write_text(json.dumps(report))
    rc, out, err = run("bench", "--load", str(SAVED_RUN), "--compare", str(path))
    assert rc == 2 and "dtype" in err


def test_python_dash_m_and_help():
    rc, out, err = run("--help")
    assert rc == 0 and "info" in out and "check" in out and "bench" in out
    rc, out, err = run("bench", "--help")
    for opt in ("--device", "--dtype", "--quick", "--json", "--compare", "--against", "--threshold", "--plot"):
        assert opt in out
    assert os.path.exists(ROOT / "numba_ops" / "__main__.py")


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in numba_ops.devices(), reason="no GPU and no CUDA simulator here")
def test_bench_worker_times_the_cuda_kernels():
    """The bench's numba_ops worker on CUDA (device arrays in, synchronised); in CI
    this runs on the simulator, where `bench --device cuda` itself refuses to time."""
    cfg = {"impl": "numba_ops", "cases": ["ag2d_small", "dc_seed"], "dtype": "float32", "device": "cuda",
           "quick": True, "repeat": 1, "peers": []}
    rc, out, err = run("_worker", json.dumps(cfg), timeout=600, stdin="ag2d_small\ndc_seed\n")
    assert rc == 0, out + err
    events = [ev for ev in map(protocol.parse, out.splitlines()) if ev is not None]
    assert events[0] == {"ready": "numba_ops"}, out
    assert [e["case"] for e in events[1:]] == ["ag2d_small", "dc_seed"] and all(e["ms"] > 0 for e in events[1:]), out
    from numba_ops._dispatch import cuda_simulator
    if cuda_simulator():
        rc, out, err = run("bench", "--device", "cuda")
        assert rc == 2 and "simulator" in err


def test_bench_bad_options_fail_fast(tmp_path):
    """Bad files and counts are refused before anything is measured, in one line."""
    for args in (["--repeat", "0"], ["--repeat", "abc"], ["--load", str(tmp_path / "missing.json")],
                 ["--compare", str(tmp_path / "missing.json")], ["--json", str(tmp_path / "no" / "x.json")],
                 ["--plot", str(tmp_path / "no" / "x.png")], ["--threshold", "0"], ["--threshold", "ten"],
                 ["--against", "no-such-revision-xyz"], ["--against", "HEAD", "--compare", str(SAVED_RUN)]):
        rc, _, err = run("bench", "--peers", "none", "--only", "ag2d_small", *args, timeout=120)
        assert rc != 0 and "Traceback" not in err and err.strip(), (args, err)
        assert "_positive_int" not in err, err


def test_a_closed_pipe_is_not_a_traceback():
    """`numba-ops check | head -1`: the reader leaves early; the command stops quietly."""
    cmd = [sys.executable, "-m", "numba_ops", "check"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    p.stdout.readline()
    p.stdout.close()  # as `head -1` does
    err = p.stderr.read().decode()
    p.wait(timeout=300)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err

"""The statistics of ``numba-ops bench --against`` (numba_ops.benchmark.stats), on
synthetic samples (equal, 5 % and 30 % apart; seeded, so deterministic) and on
samples recorded by a real A/A run on the development VM."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from numba_ops.benchmark import stats

RECORDED = Path(__file__).resolve().parent / "data" / "against_recorded.json"

#: critical values T of the two-sided Wilcoxon signed-rank test at alpha = 0.05
#: (reject when W <= T), from the published tables; the interval's rank is T + 1
WILCOXON_T_005 = {6: 0, 7: 2, 8: 3, 9: 5, 10: 8, 11: 10, 12: 13, 13: 17, 14: 21, 15: 25, 20: 52, 25: 89}


@pytest.mark.parametrize("n,t", sorted(WILCOXON_T_005.items()))
def test_interval_rank_matches_the_published_table(n, t):
    assert stats.signed_rank_rank(n, 0.95) == t + 1


def test_too_few_rounds_give_no_interval():
    assert stats.signed_rank_rank(5, 0.95) == 0
    est, lo, hi = stats.hodges_lehmann([0.1, 0.2, 0.3, 0.1, 0.2])
    assert est == pytest.approx(0.2) and lo is None and hi is None
    r = stats.ratio([[1.0]] * 5, [[1.0]] * 5)
    assert r["low"] is None and stats.verdict(r, 0.1) == "undecided"


def test_hodges_lehmann_by_hand():
    # Walsh averages of (1, 2, 3): 1, 1.5, 2, 2, 2.5, 3 -> median 2
    assert stats.hodges_lehmann([1.0, 2.0, 3.0])[0] == pytest.approx(2.0)
    # n = 6: the 95 % interval is the smallest and largest Walsh average (rank 1)
    d = [0.3, -0.1, 0.2, 0.5, 0.0, 0.1]
    est, lo, hi = stats.hodges_lehmann(d)
    walsh = sorted((d[i] + d[j]) / 2 for i in range(6) for j in range(i, 6))
    assert (lo, hi) == (walsh[0], walsh[-1]) and est == pytest.approx(np.median(walsh))


def _rounds(rng, factor, rounds=8, calls=30, base=1e-3, load=0.03, noise=0.02, outlier_round=None):
    """Per-call samples of one side: each round has a load factor shared by both
    sides (same seed) and per-call noise of its own."""
    load_rng = np.random.default_rng(7)
    out = []
    for r in range(rounds):
        level = base * factor * math.exp(load * load_rng.standard_normal())
        if r == outlier_round:
            level *= 1.5  # a process that runs slow throughout, as seen on the VM
        out.append(list(level * np.exp(noise * rng.standard_normal(calls))))
    return out


@pytest.mark.parametrize("factor,want", [(1.0, "same"), (1.05, "same"), (1.30, "slower"), (1 / 1.30, "faster")])
def test_synthetic(factor, want):
    rng = np.random.default_rng(1)
    rev = _rounds(rng, 1.0)
    cur = _rounds(rng, factor)
    r = stats.ratio(cur, rev)
    assert r["rounds"] == 8
    assert r["low"] <= factor <= r["high"]
    assert r["ratio"] == pytest.approx(factor, rel=0.03)
    assert stats.verdict(r, 0.10) == want


def test_synthetic_5_percent_is_flagged_with_a_2_percent_threshold():
    rng = np.random.default_rng(2)
    rev, cur = _rounds(rng, 1.0), _rounds(rng, 1.05)
    r = stats.ratio(cur, rev)
    assert stats.verdict(r, 0.02) == "slower" and stats.verdict(r, 0.10) == "same"


def test_one_slow_process_does_not_flag():
    """Equal code where one round's current process ran 1.5x slower throughout."""
    rng = np.random.default_rng(3)
    rev, cur = _rounds(rng, 1.0), _rounds(rng, 1.0, outlier_round=5)
    r = stats.ratio(cur, rev)
    assert stats.verdict(r, 0.10) != "slower" and r["ratio"] < 1.05


def test_noise_too_large_is_undecided():
    rng = np.random.default_rng(4)
    rev = _rounds(rng, 1.0, load=0.0, noise=0.0)
    cur = _rounds(rng, 1.12, load=0.0, noise=0.0)
    # round medians alternate 1.12/1.42 and 0.82: the ratio is above the threshold, not significantly above 1
    for i, f in enumerate([1.0, 1.27, 0.73, 1.27, 0.73, 1.27, 0.73, 1.0]):
        cur[i] = [x * f for x in cur[i]]
    r = stats.ratio(cur, rev)
    assert stats.verdict(r, 0.10) == "undecided", r


def _recorded():
    return json.loads(RECORDED.read_text())


def test_recorded_a_a_run_flags_nothing():
    rec = _recorded()
    for name, row in rec["cases"].items():
        r = stats.ratio(row["current"], row["rev"])
        assert stats.verdict(r, rec["threshold"]) != "slower", (name, r)
        assert r["low"] <= 1.10 and r["high"] >= 1 / 1.10, (name, r)


@pytest.mark.parametrize("factor,want", [(1.3, "slower"), (1 / 1.3, "faster")])
def test_recorded_samples_scaled(factor, want):
    """The recorded current side made 30 % slower (or faster) call by call."""
    rec = _recorded()
    for name, row in rec["cases"].items():
        cur = [[x * factor for x in rnd] for rnd in row["current"]]
        r = stats.ratio(cur, row["rev"])
        assert stats.verdict(r, rec["threshold"]) == want, (name, r)


def test_judge_is_ratio_and_verdict_with_each_sides_time():
    """``judge``, what --against and --compare report per case: ``ratio``'s record,
    ``verdict``'s word, and each side's median over rounds of the round medians."""
    rng = np.random.default_rng(5)
    rev, cur = _rounds(rng, 1.0), _rounds(rng, 1.30)
    r = stats.judge(cur, rev, 0.10, ("current", "saved"))
    assert {k: r[k] for k in ("ratio", "low", "high", "rounds")} == stats.ratio(cur, rev)
    assert r["verdict"] == stats.verdict(r, 0.10) == "slower"
    assert r["current_ms"] == pytest.approx(1e3 * np.median([np.median(x) for x in cur]))
    assert r["saved_ms"] == pytest.approx(1e3 * np.median([np.median(x) for x in rev]))
    assert stats.judge(rev, rev, 0.10)["verdict"] == "same" and "base_ms" in stats.judge(rev, rev, 0.10)

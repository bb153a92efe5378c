"""The statistics of ``numba-ops bench --against`` and ``--compare``: the time
ratio of two code versions with a confidence interval, and a verdict.

The unit of evidence is a *round*: each round times both versions, case by case,
alternating, in fresh processes, and keeps each case's per-call samples. Calls
within one process are not independent (a process keeps its memory layout,
thread placement and JIT state: the same code ran 0.78 ms in most processes and
1.23 ms in one on the development VM), so per-call samples would overstate the
confidence; each round is summarised by its median call, and rounds are paired
(both versions ran in the same minutes, so load that comes and goes falls on both).

Per case, with ``d_r = ln(median_current_r / median_rev_r)`` over the R rounds:

* estimate: the Hodges-Lehmann estimate of the median of ``d`` (the median of the
  Walsh averages ``(d_i + d_j) / 2``, i <= j), as a ratio ``exp(.)``;
* interval: the exact distribution-free confidence interval that goes with the
  Wilcoxon signed-rank test (order statistics of the Walsh averages). It assumes
  only that the paired differences are independent and symmetric about their
  centre: no normality, robust to one odd round, and deterministic (no
  resampling), so the tests of the statistics are exact. It needs R >= 6 for 95 %.
* verdict (threshold F): "slower" when the estimate exceeds 1 + F *and* the
  interval lies above 1 (the difference is significant); "faster" likewise below
  1 / (1 + F) with the interval below 1; "same" when the whole interval lies within
  [1 / (1 + F), 1 + F]; otherwise "undecided": the noise is too large to say
  whether the change passes F.

``--compare`` pairs a saved run's rounds with the new run's by their order. Those
pairs share no minute, but the interval still holds: the difference of two
independent rounds is symmetric about the change, which is all the signed-rank
interval assumes; it is wider than a paired run's, so more cases are undecided.
What it cannot see is load that differs between the two runs as a whole (it
shifts every round alike): only ``--against``, both versions in the same minutes,
is immune to that.
"""
import math
import statistics

CONFIDENCE = 0.95


def _signed_rank_counts(n):
    """Number of sign assignments of ranks 1..n giving each W+ = 0..n(n+1)/2."""
    counts = [1]
    for k in range(1, n + 1):
        new = counts + [0] * k
        for w, c in enumerate(counts):
            new[w + k] += c
        counts = new
    return counts


def signed_rank_rank(n, confidence=CONFIDENCE):
    """The 1-based rank C of the Walsh average at the lower end of the exact
    ``confidence`` interval for n pairs (the upper end is rank M + 1 - C, with
    M = n(n+1)/2): the largest C with P(W+ <= C - 1) <= (1 - confidence) / 2.
    0 when n is too small for that confidence."""
    if n < 1:
        return 0
    counts = _signed_rank_counts(n)
    total = 2.0 ** n
    alpha2 = (1.0 - confidence) / 2.0
    c, cum = 0, 0.0
    while c < len(counts) and cum + counts[c] / total <= alpha2 + 1e-12:
        cum += counts[c] / total
        c += 1
    return c


def hodges_lehmann(d, confidence=CONFIDENCE):
    """(estimate, low, high) of the centre of the paired differences ``d``;
    low and high are None when there are too few for the confidence."""
    d = [float(x) for x in d]
    n = len(d)
    if n == 0:
        return None, None, None
    walsh = sorted((d[i] + d[j]) / 2.0 for i in range(n) for j in range(i, n))
    est = statistics.median(walsh)
    c = signed_rank_rank(n, confidence)
    if c < 1:
        return est, None, None
    return est, walsh[c - 1], walsh[len(walsh) - c]


def round_medians(rounds):
    """The median of each round's per-call samples."""
    return [statistics.median(r) for r in rounds]


def ratio(current_rounds, rev_rounds, confidence=CONFIDENCE):
    """Time ratio current / REV of one case from paired rounds of per-call samples
    (lists of lists of seconds, one list per round, rounds in the same order):
    {"ratio", "low", "high", "rounds"}; low/high None when there are too few rounds."""
    pairs = [(a, b) for a, b in zip(round_medians(current_rounds), round_medians(rev_rounds)) if a > 0 and b > 0]
    est, lo, hi = hodges_lehmann([math.log(a / b) for a, b in pairs], confidence)
    ex = (lambda v: None if v is None else math.exp(v))
    return {"ratio": ex(est), "low": ex(lo), "high": ex(hi), "rounds": len(pairs)}


def verdict(r, threshold):
    """"slower", "faster", "same" or "undecided" for a ratio record of ``ratio``."""
    est, lo, hi = r["ratio"], r["low"], r["high"]
    if est is None or lo is None:
        return "undecided"
    up, down = 1.0 + threshold, 1.0 / (1.0 + threshold)
    if est > up and lo > 1.0:
        return "slower"
    if est < down and hi < 1.0:
        return "faster"
    if lo >= down and hi <= up:
        return "same"
    return "undecided"


def judge(current_rounds, base_rounds, threshold, names=("current", "base"), confidence=CONFIDENCE):
    """One case's comparison, as ``--against`` and ``--compare`` report it: the
    ``ratio`` record (current / base), its ``verdict``, and each side's time
    (``<name>_ms``: the median over rounds of each round's median call)."""
    r = ratio(current_rounds, base_rounds, confidence)
    r["verdict"] = verdict(r, threshold)
    for name, rounds in zip(names, (current_rounds, base_rounds)):
        r[f"{name}_ms"] = 1e3 * statistics.median(round_medians(rounds))
    return r

"""``numba-ops bench --plot FILE.png`` (matplotlib, the ``plot`` extra).

- the table: per case, our warm time beside each peer's and the machine's limit
  (log scale: the cases span four orders of magnitude);
- ``--against``: per case the ratio current / REV with its confidence interval,
  the threshold marked, coloured by verdict.
"""

_COLOURS = {"numba_ops": "#1f77b4", "onnxruntime": "#ff7f0e", "torch": "#2ca02c", "limit": "#7f7f7f"}
_VERDICT = {"slower": "#d62728", "faster": "#2ca02c", "same": "#1f77b4", "undecided": "#ff9f1c"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt
    return plt


def _order(names):
    """The case table's order (saved runs sort their keys), unknown names last."""
    from .. import _cases
    known = [n for _, n in _cases.CASES if n in names]
    return known + [n for n in names if n not in known]


def table(report, path):
    """Horizontal bars per case: numba_ops, each peer, and the limit, in ms (log x)."""
    plt = _pyplot()
    cases = _order(list(report["cases"]))
    impls = ["numba_ops"] + [p for p in ("onnxruntime", "torch")
                             if any(p in r["ms"] for r in report["cases"].values())]
    series = impls + ["limit"]
    h = 0.8 / len(series)
    timed = [v for r in report["cases"].values() for v in r["ms"].values() if v]
    floor = min(timed) / 8 if timed else 1e-3  # a limit far below every time (dc_seed's) is cut here
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(cases) * len(series) ** 0.5 + 1.6))
    for k, s in enumerate(series):
        ys, xs = [], []
        for i, name in enumerate(cases):
            row = report["cases"][name]
            v = row.get("bound_ms") if s == "limit" else row["ms"].get(s)
            if v:
                ys.append(i + (k - (len(series) - 1) / 2) * h)
                xs.append(v)
        label = "limit (" + "; ".join(sorted({r.get("limit") or "" for r in report["cases"].values()} - {""})) + ")" \
            if s == "limit" else s
        ax.barh(ys, xs, height=h, color=_COLOURS.get(s), label=label, alpha=0.55 if s == "limit" else 1.0)
        for y, x in zip(ys, xs):
            ax.text(max(x, floor) * 1.04, y, f"{x:.3g}", va="center", fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(floor, ax.get_xlim()[1] * 2)
    ax.set_yticks(range(len(cases)), cases)
    ax.invert_yaxis()
    ax.set_xlabel("ms per call (warm median; limit: the machine's floor for the case), log scale")
    ax.set_title(f"numba-ops bench: {report['device']}, {report['dtype']}"
                 f"{', quick' if report.get('quick') else ''} ({report.get('machine', {}).get('cpu_model', '')})",
                 fontsize=10)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=len(series))
    ax.grid(axis="x", which="both", alpha=0.25)
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def against(report, path):
    """Per case the ratio current / REV with its interval; the threshold band shaded."""
    plt = _pyplot()
    cases = _order(list(report["cases"]))
    t = report["threshold"]
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(cases) + 1.6))
    ax.axvspan(1 / (1 + t), 1 + t, color="#dddddd", alpha=0.6, label=f"within the threshold ({t:.0%})")
    ax.axvline(1.0, color="k", lw=0.8)
    lo_all, hi_all = [1 / (1 + t)], [1 + t]
    for i, name in enumerate(cases):
        r = report["cases"][name]
        if r.get("ratio") is None:
            ax.text(1.0, i, f"  {r['verdict']}", va="center", fontsize=8, color="#555555")
            continue
        c = _VERDICT.get(r["verdict"], "k")
        if r["low"] is not None:
            ax.plot([r["low"], r["high"]], [i, i], color=c, lw=2.5, solid_capstyle="butt")
            lo_all.append(r["low"])
            hi_all.append(r["high"])
        ax.plot([r["ratio"]], [i], "o", color=c, ms=6)
        ax.text(max(r["high"] or r["ratio"], r["ratio"]) * 1.01, i, f" {r['ratio']:.3f} {r['verdict']}",
                va="center", fontsize=8, color=c)
        lo_all.append(r["ratio"])
        hi_all.append(r["ratio"])
    ax.set_xlim(min(lo_all) - 0.05, max(hi_all) + 0.25 * (max(hi_all) - min(lo_all) + 0.2))
    ax.set_yticks(range(len(cases)), cases)
    ax.invert_yaxis()
    pct = int(round(100 * report["confidence"]))
    ax.set_xlabel(f"time ratio current / REV (dot), {pct}% interval (bar); right of 1: slower")
    ax.set_title(f"numba-ops bench --against {report['rev']} ({report['sha'][:10]}): "
                 f"{report['rounds']} rounds{', quick' if report.get('quick') else ''}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

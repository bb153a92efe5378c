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
    from . import cases as _cases
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
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(cases) * len(series) ** 0.5 + 1.8))
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
    """Per case the ratio current / REV with its interval (log x, clipped to 0.4-2.5:
    an interval beyond ends in an arrow); the threshold band shaded, colours by verdict."""
    plt = _pyplot()
    from matplotlib.transforms import blended_transform_factory
    cases = _order(list(report["cases"]))
    t = report["threshold"]
    lo_clip, hi_clip = 0.4, 2.5
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(cases) + 1.6))
    ax.axvspan(1 / (1 + t), 1 + t, color="#dddddd", alpha=0.7, label=f"within the threshold ({t:.0%})")
    ax.axvline(1.0, color="k", lw=0.8)
    right = blended_transform_factory(ax.transAxes, ax.transData)
    lo_all, hi_all = [0.8], [1.25]
    clip = (lambda v: min(max(v, lo_clip), hi_clip))
    for i, name in enumerate(cases):
        r = report["cases"][name]
        if r.get("ratio") is None:
            ax.text(1.02, i, r["verdict"], va="center", fontsize=8, color="#555555", transform=right)
            continue
        c = _VERDICT.get(r["verdict"], "k")
        if r["low"] is not None:
            a, b = clip(r["low"]), clip(r["high"])
            ax.plot([a, b], [i, i], color=c, lw=2.5, solid_capstyle="butt")
            if r["low"] < lo_clip:
                ax.plot([a], [i], marker="<", color=c, ms=7)
            if r["high"] > hi_clip:
                ax.plot([b], [i], marker=">", color=c, ms=7)
            lo_all.append(a)
            hi_all.append(b)
            ci = f" [{r['low']:.2f}, {r['high']:.2f}]"
        else:
            ci = ""
        ax.plot([clip(r["ratio"])], [i], "o", color=c, ms=6)
        lo_all.append(clip(r["ratio"]))
        hi_all.append(clip(r["ratio"]))
        ax.text(1.02, i, f"{r['ratio']:.3f}{ci} {r['verdict']}", va="center", fontsize=8, color=c, transform=right)
    ax.set_xscale("log")
    ax.set_xlim(min(lo_all) / 1.08, max(hi_all) * 1.08)
    ticks = [v for v in (0.4, 0.5, 0.67, 0.8, 0.91, 1.0, 1.1, 1.25, 1.5, 2.0, 2.5)
             if ax.get_xlim()[0] <= v <= ax.get_xlim()[1]]
    ax.set_xticks(ticks, [f"{v:g}" for v in ticks])
    ax.minorticks_off()
    ax.set_yticks(range(len(cases)), cases)
    ax.set_ylim(len(cases) - 0.5, -0.5)
    pct = int(round(100 * report["confidence"]))
    ax.set_xlabel(f"time ratio current / REV (dot) and its {pct}% interval (bar), log scale; right of 1: slower")
    ax.set_title(f"numba-ops bench --against {report['rev']} ({report['sha'][:10]}): "
                 f"{report['rounds']} rounds{', quick' if report.get('quick') else ''}", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13 - 0.4 / len(cases)), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

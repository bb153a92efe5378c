"""The performance table of docs/performance.rst, from a saved ``numba-ops bench --json`` run.

    numba-ops bench --json run.json          # every case: numba_ops, each peer, the limit
    python bench/peer_table.py run.json      # a Markdown table (--rst: the docs' list-table)

Per case: numba_ops' warm median, each installed peer's (onnxruntime,
PyTorch/torchvision), the machine's limit (the time the measured write
bandwidth or GEMM rate allows) and how many times faster numba_ops is than the
fastest peer (bigger is better; below 1 a peer is faster). A "-" is a case a
peer does not implement (3-D DeformConv, uint8 GridSample). The header line
names the version and the machine the run was measured on.
"""
import argparse
import json
import sys

OURS = "numba_ops"
#: peers in column order; others found in the file follow
PEER_ORDER = ("onnxruntime", "torch")
PEER_TITLES = {"onnxruntime": "onnxruntime", "torch": "PyTorch / torchvision"}


def fmt_ms(v):
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


def case_order():
    """Case names in the case table's order (AffineGrid, DeformConv, GridSample,
    affine_warp), or None where numba_ops cannot be imported."""
    try:
        from numba_ops.benchmark.cases import CASES
    except ImportError:
        return None
    return [name for _, name in CASES]


def rows(report):
    """(columns, rows): one row of strings per case, in the case table's order."""
    cases = report["cases"]
    order = case_order()
    if order:
        cases = dict(sorted(cases.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    found = {k for c in cases.values() for k in c["ms"] if k != OURS}
    peers = [p for p in PEER_ORDER if p in found] + sorted(found - set(PEER_ORDER))
    columns = (["case", "numba_ops ms"] + [f"{PEER_TITLES.get(p, p)} ms" for p in peers]
               + ["limit ms", "× faster than the best peer"])
    out = []
    for name, case in cases.items():
        ms = case["ms"]
        ours = ms.get(OURS)
        times = {p: ms[p] for p in peers if ms.get(p)}
        if ours and times:
            best = min(times, key=times.get)
            speed = f"**{times[best] / ours:.2f}×** ({PEER_TITLES.get(best, best)})"
        else:
            speed = "no peer"
        out.append([f"`{name}`", fmt_ms(ours)] + [fmt_ms(ms.get(p)) for p in peers]
                   + [fmt_ms(case.get("bound_ms")), speed])
    return columns, out


def header(report):
    m = report.get("machine", {})
    v = m.get("versions", {})
    bits = [f"numba_ops {report.get('version', v.get(OURS, '?'))}",
            f"{report.get('device', 'cpu')}, {report.get('dtype', 'float32')}",
            f"{m.get('cpu_model', 'unknown CPU')}, {report.get('threads', '?')} threads on "
            f"{report.get('cpus', m.get('cpus', '?'))} CPUs"]
    for pkg in ("numba", "onnxruntime", "torch"):
        if v.get(pkg):
            bits.append(f"{pkg} {v[pkg]}")
    return "; ".join(bits)


def markdown(columns, body):
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" if i == 0 else "--:" for i in range(len(columns))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def rst(columns, body):
    strip = [[c.replace("**", "").replace("`", "``") for c in r] for r in [columns] + body]
    lines = [".. list-table::", "   :header-rows: 1", ""]
    for r in strip:
        lines.append("   * - " + r[0])
        lines += ["     - " + c for c in r[1:]]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="the performance table of a numba-ops bench --json run")
    ap.add_argument("file")
    ap.add_argument("--rst", action="store_true", help="an RST list-table instead of Markdown")
    args = ap.parse_args(argv)
    with open(args.file) as fh:
        report = json.load(fh)
    columns, body = rows(report)
    print(header(report))
    print()
    print(rst(columns, body) if args.rst else markdown(columns, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())

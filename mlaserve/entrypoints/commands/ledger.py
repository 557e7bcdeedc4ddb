"""`mlaserve trace summarize | plot`: a route ledger (written with --trace FILE) read back."""

from __future__ import annotations

from pathlib import Path


def add(sub) -> None:
    p = sub.add_parser("trace", help="read a route ledger (written with --trace FILE)")
    tsub = p.add_subparsers(dest="trace_command", required=True)
    s = tsub.add_parser(
        "summarize",
        help="steps, tokens by phase x path x dense/sparse, prefix-cache hits, preemptions, effective top-k",
        description="Summarise a route ledger (JSON lines; fields in docs/LEDGER.md).",
    )
    s.add_argument("file", metavar="FILE")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.set_defaults(func=summarize)
    pl = tsub.add_parser(
        "plot",
        help="the route chart as a PNG: tokens per step by phase x path, effective top-k, hits, preemptions",
        description="Draw a route ledger (JSON lines) as the web page's route chart, for a bug report "
        "(needs matplotlib: pip install 'mlaserve[plot]'; docs/UI.md says what it shows).",
    )
    pl.add_argument("file", metavar="FILE")
    pl.add_argument("-o", "--output", default=None, metavar="PNG", help="where to write it (default: FILE with .png)")
    pl.set_defaults(func=plot)


def summarize(args) -> int:
    import json

    from mlaserve.observability.expert_load import summarize_expert_load
    from mlaserve.observability.summary import format_summary, read_ledger, summarize

    records = read_ledger(args.file)
    by_rank, experts = summarize(records), summarize_expert_load(records)
    if args.json:
        ranked = {str(r): s.to_json() for r, s in by_rank.items() if r is not None}
        whole = by_rank[None].to_json() if None in by_rank else None
        out = {"summary": whole, "ranks": ranked} if ranked else {"summary": whole}
        print(json.dumps(out | ({"expert_parallel": experts.to_json()} if experts else {}), indent=1))
    else:
        print(format_summary(by_rank, experts))
    return 0


def plot(args) -> int:
    from mlaserve.observability.route_plot import save_route_plot
    from mlaserve.observability.summary import read_ledger

    out = Path(args.output) if args.output else Path(args.file).with_suffix(".png")
    if not out.parent.is_dir():
        raise ValueError(f"-o {out}: folder {out.parent} does not exist (create it first)")
    records = read_ledger(args.file)
    print(f"wrote {save_route_plot(records, out, Path(args.file).name)} ({len(records)} records)")
    return 0

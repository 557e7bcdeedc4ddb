"""The route chart of a ledger file, offline (`mlaserve trace plot route.jsonl [-o route.png]`): the
web page's route view as a PNG for a bug report. matplotlib is an optional extra (`pip install
'mlaserve[plot]'`); nothing else in the package imports it.

Per rank (one row of panels; a ledger without ranks is one rank):
  top     stacked bars per step: tokens by phase x path x mode, the categories `trace summarize` counts
          (mode: dense | sparse top-k | sparse all rows), with a green dot above a step with a
          prefix-cache hit and a red triangle above a step that preempted a request
  bottom  the DSA effective top-k per sparse step, and (speculative ledgers) the acceptance of each
          step's drafts (accepted / proposed, right axis)
Only trunk records are bars (no spec_phase, "target", "verify"); `accept` records give the acceptance,
`draft` and `switch` records are not drawn (they are not trunk routes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# The page's colours (entrypoints/openai/ui/app.js), so a PNG and the page read alike.
COLORS = {
    ("decode", "absorbed", "dense"): "#1f77b4",
    ("decode", "absorbed", "sparse top-k"): "#17becf",
    ("decode", "absorbed", "sparse all rows"): "#9edae5",
    ("decode", "decompressed", "dense"): "#aec7e8",
    ("prefill", "decompressed", "dense"): "#ff7f0e",
    ("prefill", "absorbed", "dense"): "#ffbb78",
    ("prefill", "absorbed", "sparse top-k"): "#d62728",
    ("prefill", "absorbed", "sparse all rows"): "#ff9896",
    ("prefill", "decompressed", "sparse top-k"): "#8c564b",
    ("decode", "decompressed", "sparse top-k"): "#c49c94",
}
SPARE = ("#2ca02c", "#98df8a", "#9467bd", "#c5b0d5", "#e377c2", "#7f7f7f", "#bcbd22")
TRUNK = (None, "target", "verify")


@dataclass
class RankSeries:
    """What one rank's panels draw, as plain data (the test reads it against `trace summarize`)."""

    steps: list[int] = field(default_factory=list)
    tokens: dict = field(default_factory=dict)  # (phase, path, mode) -> [tokens per step, aligned with steps]
    hits: list[int] = field(default_factory=list)  # steps with a prefix-cache hit
    preemptions: list[int] = field(default_factory=list)  # steps that preempted a request
    topk: list[tuple[int, int]] = field(default_factory=list)  # (step, effective_topk) of sparse steps
    acceptance: list[tuple[int, float]] = field(default_factory=list)  # (step, accepted / proposed)


def _mode(rec: dict) -> str:
    if not rec["sparse"]:
        return "dense"
    return "sparse top-k" if rec["needs_selection"] else "sparse all rows"


def route_series(records: list[dict]) -> dict:
    """rank (None: a ledger without ranks) -> RankSeries."""
    out: dict = {}
    for rec in records:
        s = out.setdefault(rec.get("rank"), RankSeries())
        phase = rec.get("spec_phase")
        if phase == "accept" and rec["num_proposed_tokens"]:
            s.acceptance.append((rec["step"], rec["num_accepted_tokens"] / rec["num_proposed_tokens"]))
        if phase not in TRUNK:
            continue
        i = len(s.steps)
        s.steps.append(rec["step"])
        for seg in rec["segments"]:
            row = s.tokens.setdefault((seg["phase"], seg["path"], _mode(rec)), [])
            row.extend([0] * (i + 1 - len(row)))
            row[i] += seg["num_tokens"]
        if any(r["cached_tokens"] > 0 for r in rec["requests"]):
            s.hits.append(rec["step"])
        if rec.get("preempted"):
            s.preemptions.append(rec["step"])
        if rec["sparse"]:
            s.topk.append((rec["step"], rec["effective_topk"]))
    for s in out.values():  # every category as long as the steps
        for row in s.tokens.values():
            row.extend([0] * (len(s.steps) - len(row)))
    return dict(sorted(out.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)))


def plot_route(records: list[dict], title: str = "route ledger"):
    """-> a matplotlib Figure (Agg: no display needed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError(f"`mlaserve trace plot` needs matplotlib: pip install 'mlaserve[plot]' ({e})") from None
    series = route_series(records)
    if not series:
        raise ValueError(f"{title}: no step records to plot")
    fig, axes = plt.subplots(
        2, len(series), figsize=(7 * len(series), 5.5), squeeze=False, gridspec_kw={"height_ratios": [3, 1]}
    )
    spare = iter(SPARE * 4)
    for col, (rank, s) in enumerate(series.items()):
        bars, lower = axes[0][col], axes[1][col]
        x = list(range(len(s.steps)))
        base = [0] * len(x)
        for cat in sorted(s.tokens, key=lambda c: (c[0] != "decode", c)):
            color = COLORS.get(cat) or COLORS.setdefault(cat, next(spare))
            bars.bar(x, s.tokens[cat], bottom=base, color=color, width=0.85, label=" ".join(cat))
            base = [b + t for b, t in zip(base, s.tokens[cat])]
        top = max(base, default=0) or 1
        where = {step: i for i, step in enumerate(s.steps)}
        for steps, marker, color, label in (
            (s.hits, "o", "#2e7d32", "prefix-cache hit"),
            (s.preemptions, "v", "#c62828", "preemption"),
        ):
            if steps:
                bars.scatter(
                    [where[t] for t in steps],
                    [base[where[t]] + 0.05 * top for t in steps],
                    marker=marker,
                    color=color,
                    s=18,
                    label=label,
                    zorder=3,
                )
        bars.set_title(f"{title}" + (f" -- rank {rank}" if rank is not None else ""))
        bars.set_ylabel("tokens")
        _step_ticks(bars, s.steps)
        bars.legend(fontsize=7, loc="upper right")
        if s.topk:
            lower.plot(
                [where[t] for t, _ in s.topk], [k for _, k in s.topk], ".-", color="#2457c5", label="effective top-k"
            )
        lower.set_ylabel("effective top-k")
        lower.set_xlim(bars.get_xlim())
        _step_ticks(lower, s.steps)
        lower.set_xlabel("step")
        if s.acceptance:
            right = lower.twinx()
            right.plot(
                [where.get(t, 0) for t, _ in s.acceptance],
                [a for _, a in s.acceptance],
                "x",
                color="#9467bd",
                label="acceptance",
            )
            right.set_ylim(0, 1.05)
            right.set_ylabel("draft acceptance")
        if not s.topk and not s.acceptance:
            lower.text(
                0.5, 0.5, "no sparse step, no drafts", ha="center", va="center", transform=lower.transAxes, color="#888"
            )
    fig.tight_layout()
    return fig


def _step_ticks(ax, steps: list[int]) -> None:
    every = max(1, len(steps) // 15)
    ticks = list(range(0, len(steps), every))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(steps[i]) for i in ticks], fontsize=7)


def save_route_plot(records: list[dict], out: str | Path, title: str) -> Path:
    fig = plot_route(records, title)  # first: it names the missing extra
    import matplotlib.pyplot as plt

    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

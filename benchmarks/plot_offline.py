"""Plot mlaserve's ratios to llama.cpp (same GGUF, same run) from offline.py JSON files.

    python benchmarks/plot_offline.py docs/results/offline-*.json --out docs/offline-vs-llamacpp.png

One group of bars per metric, one bar per run (its date and label from the file name), the issue's
targets as marks. Speed ratios are mlaserve-gguf / llama.cpp (higher is better); memory is the GGUF file's
size / mlaserve's peak RSS (higher is better there too; the target is RSS <= 1.15x the file). Needs matplotlib.
`plot_matrix` draws the per-(model, file type) matrix of matrix.py's runs (called by matrix_table.py --plot).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METRICS = (  # (result key, label, target ratio, against the file: 1 / ours' value instead of ours / theirs)
    ("prefill_tok_s", "prefill 512", 1.5, False),
    ("decode_tok_s_b1", "decode b1", 1.0, False),
    ("decode_tok_s_long", "decode b1 @2048", 1.0, False),
    ("output_tok_s_c4", "4 concurrent", None, False),
    ("output_tok_s_c16", "16 concurrent", 2.0, False),
    ("rss_over_weights", "file size / peak RSS", 1 / 1.15, True),
)


def ratios(path: Path, ours: str, theirs: str) -> list[float | None]:
    results = json.loads(path.read_text())["results"]
    if ours not in results or theirs not in results:
        return [None] * len(METRICS)
    out = []
    for key, _, _, own in METRICS:
        a, b = results[ours].get(key), results[theirs].get(key)
        out.append((1 / a if a else None) if own else (None if not a or not b else a / b))
    return out


def plot_matrix(rows: list[dict], metrics, out: Path) -> None:
    """The benchmark matrix (matrix_table.py's rows): one panel per metric, per (model, file, run) cell the
    ratio mlaserve / llama.cpp (solid) and mlaserve / ik_llama.cpp (hatched, where run), green where the
    target is met, red where missed, against the target (dashed) and parity (grey)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']} {r['type'].upper()}" + (f" r{r['run']}" if r["run"] else "") for r in rows]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.0 * len(metrics), 4.0), sharey=False)
    for ax, (key, label, target, higher) in zip(axes, metrics):
        for ratio_key, met_key, dx, hatch in (("ratio", "met", -0.2, None), ("ratio_ik", "met_ik", 0.2, "//")):
            vals = [r["metrics"][key][ratio_key] for r in rows]
            xs = [i for i, v in enumerate(vals) if v is not None]
            colors = ["tab:green" if rows[i]["metrics"][key][met_key] else "tab:red" for i in xs]
            ax.bar([x + dx for x in xs], [vals[i] for i in xs], width=0.4, color=colors, hatch=hatch, edgecolor="k")
        ax.axhline(target, color="black", linestyle="dashed", linewidth=1)
        ax.axhline(1.0, color="grey", linewidth=0.5)
        long = rows[0].get("long_prompt", 2048) if rows else 2048
        ax.set_title(f"{label.format(long=long)}\n(target {'>=' if higher else '<='} {target}x)", fontsize=9)
        ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    axes[0].set_ylabel("mlaserve / other engine")
    fig.suptitle(
        "mlaserve / llama.cpp (solid) and / ik_llama.cpp (hatched) per model and GGUF type, same file, same run; "
        "green: target met, red: missed",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--ours", default="mlaserve-gguf")
    p.add_argument("--theirs", default="llama.cpp")
    p.add_argument("--out", type=Path, default=Path("docs/offline-vs-llamacpp.png"))
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(f.stem.removeprefix("offline-"), ratios(f, args.ours, args.theirs)) for f in sorted(args.files)]
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, (label, values) in enumerate(runs):
        xs = [m + i * width for m in range(len(METRICS)) if values[m] is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=label)
    for m, (_, _, target, _) in enumerate(METRICS):
        if target is not None:
            ax.hlines(target, m - width / 2, m + 0.8 - width / 2, colors="black", linestyles="dashed")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xticks([m + 0.4 - width / 2 for m in range(len(METRICS))], [lab for _, lab, _, _ in METRICS])
    ax.set_ylabel(f"{args.ours} / {args.theirs}")
    ax.set_title(f"{args.ours} vs {args.theirs}, same GGUF, same run (dashed: targets)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

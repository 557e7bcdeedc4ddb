"""The benchmark matrix's table: per (model, file type) cell, mlaserve's figure, llama.cpp's, their ratio and
issue #31's target for it, from matrix.py's JSON files (offline.py's format).

    python benchmarks/matrix_table.py docs/results/matrix-*.json [--plot docs/matrix-vs-llamacpp.png]

Ratios are mlaserve / llama.cpp for every metric; for speed higher is better, for peak RSS lower is better.
Repeats of a cell (-runN files) are separate rows; a partial run (stopped after some phases) is marked so.
Needs matplotlib for --plot only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (result key, column label, target ratio, higher is better). Targets of issue #31 on a CPU with AMX:
# decode >= 1.2x, 16 concurrent >= 2x, prefill >= 2x (AMX / AVX512-BF16 CPUs), peak RSS <= 1.15x.
METRICS = (
    ("prefill_tok_s", "prefill 512 tok/s", 2.0, True),
    ("decode_tok_s_b1", "decode b1 tok/s", 1.2, True),
    ("output_tok_s_c16", "16 concurrent tok/s", 2.0, True),
    ("peak_rss_gib", "peak RSS GiB", 1.15, False),
)


def engine_pair(results: dict) -> tuple[str, str]:
    """The mlaserve and llama.cpp engine specs of one run (a matrix cell has one of each)."""
    ours = [k for k in results if k.startswith("mlaserve")]
    theirs = [k for k in results if k.startswith("llama.cpp")]
    if len(ours) != 1 or len(theirs) != 1:
        raise ValueError(f"a matrix cell has one mlaserve and one llama.cpp engine, not {ours} / {theirs}")
    return ours[0], theirs[0]


def file_type(spec: str) -> str:
    """'mlaserve-gguf@q4_k_m' -> 'q4_k_m' (offline.py's default GGUF type is q8_0)."""
    head = spec.partition(":")[0]
    return head.partition("@")[2] or "q8_0"


def cell(doc: dict, run: str = "") -> dict:
    """One row: model, type, run, per metric (ours, theirs, ratio, met), the load average range."""
    res = doc["results"]
    ours, theirs = engine_pair({k: v for k, v in res.items() if isinstance(v, dict)})
    row = {"model": doc.get("model_name", "standard"), "type": file_type(ours), "run": run, "metrics": {}}
    row["partial"] = doc.get("complete") is False  # stopped after some phases: the others are missing
    for key, _, target, higher in METRICS:
        a, b = res[ours].get(key), res[theirs].get(key)
        ratio = a / b if a and b else None
        met = None if ratio is None else (ratio >= target if higher else ratio <= target)
        row["metrics"][key] = {"ours": a, "theirs": b, "ratio": ratio, "target": target, "met": met}
    loads = [r["loadavg"][0] for r in res.get("loadavg", [])]
    row["loadavg_1min"] = (min(loads), max(loads)) if loads else None
    return row


def _fmt(v: float | None, nd: int) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def markdown(rows: list[dict]) -> str:
    """The table: one line per cell, `ours / theirs = ratio (target)` per metric."""
    head = ["model", "file", "run"] + [label for _, label, _, _ in METRICS] + ["load avg (1 min)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["type"].upper(), (r["run"] or "1") + (" (partial)" if r.get("partial") else "")]
        for key, _, target, higher in METRICS:
            m = r["metrics"][key]
            nd = 2 if key == "peak_rss_gib" else 1
            mark = "" if m["met"] is None else (" ok" if m["met"] else " miss")
            sign = ">=" if higher else "<="
            ratio = "-" if m["ratio"] is None else f"{m['ratio']:.2f}x"
            cells.append(f"{_fmt(m['ours'], nd)} / {_fmt(m['theirs'], nd)} = {ratio} ({sign}{target}x{mark})")
        la = r["loadavg_1min"]
        cells.append("-" if la is None else f"{la[0]:.1f}-{la[1]:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_rows(files: list[Path]) -> list[dict]:
    rows = []
    for f in sorted(files):
        run = f.stem.rpartition("-run")[2] if "-run" in f.stem else ""
        rows.append(cell(json.loads(f.read_text()), run))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--plot", type=Path, default=None, help="also plot the ratios against the targets (PNG)")
    args = p.parse_args()
    rows = load_rows(args.files)
    print(markdown(rows))
    if args.plot:
        from plot_offline import plot_matrix

        plot_matrix(rows, METRICS, args.plot)


if __name__ == "__main__":
    main()

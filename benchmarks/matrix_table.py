"""The benchmark matrix's table: per (model, file type) cell and metric, mlaserve's figure, llama.cpp's,
ik_llama.cpp's (where the cell ran it), mlaserve's ratio to each and issue #31's target for it, from matrix.py's
JSON files (offline.py's format).

    python benchmarks/matrix_table.py docs/results/matrix-*.json [--plot docs/matrix-vs-llamacpp.png]

Ratios are mlaserve / the other engine for every metric; for speed higher is better, for peak RSS and start
lower is better.
Repeats of a cell (-runN files) are separate rows (with --latest, one row: each metric from the run that measured
it last); a partial run (stopped after some phases) is marked so.
Needs matplotlib for --plot only.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

# (result key, column label, target ratio, higher is better). Targets of issue #31, stated against llama.cpp: decode
# >= 1.2x (at short and long context), 16 concurrent >= 2x, prefill >= 2x on CPUs with AMX or AVX512-BF16 and >= 1.2x
# elsewhere (prefill_target, from the run's CPU flags), peak RSS <= 1.15x, start <= 1x. The ratio to ik_llama.cpp is
# held to the same bar.
METRICS = (
    ("prefill_tok_s", "prefill 512 tok/s", 2.0, True),
    ("prefill_tok_s_long", "prefill {long} tok/s", 2.0, True),
    ("decode_tok_s_b1", "decode b1 at 128 tok/s", 1.2, True),
    ("decode_tok_s_long", "decode b1 at {long} tok/s", 1.2, True),
    ("output_tok_s_c16", "16 concurrent tok/s", 2.0, True),
    ("peak_rss_gib", "peak RSS GiB", 1.15, False),
    ("load_s", "start s", 1.0, False),
)
OTHERS = ("llama.cpp", "ik_llama.cpp")  # the engines a cell compares mlaserve with (ik_llama.cpp optional)
IK_C16_NOTE = (
    "ik_llama.cpp's 16 concurrent figure is its llama-batched-bench, which feeds token 0 at every position of "
    "every sequence: all 16 route to the same experts (fewer expert weights read per step than 16 distinct requests)"
)


def engine_specs(results: dict) -> dict:
    """{"mlaserve": spec, "llama.cpp": spec, "ik_llama.cpp": spec or None} of one run: a matrix cell has one
    mlaserve and one llama.cpp engine, and at most one ik_llama.cpp."""
    ours = [k for k in results if k.startswith("mlaserve")]
    by = {kind: [k for k in results if engine_kind(k) == kind] for kind in OTHERS}
    if len(ours) != 1 or len(by["llama.cpp"]) != 1 or len(by["ik_llama.cpp"]) > 1:
        raise ValueError(
            f"a matrix cell has one mlaserve and one llama.cpp engine (and at most one ik_llama.cpp), not "
            f"{ours} / {by['llama.cpp']} / {by['ik_llama.cpp']}"
        )
    return {"mlaserve": ours[0], "llama.cpp": by["llama.cpp"][0], "ik_llama.cpp": (by["ik_llama.cpp"] or [None])[0]}


def file_type(spec: str) -> str:
    """'mlaserve-gguf@q4_k_m' -> 'q4_k_m' (offline.py's default GGUF type is q8_0)."""
    head = spec.partition(":")[0]
    return head.partition("@")[2] or "q8_0"


PREFILL_KEYS = ("prefill_tok_s", "prefill_tok_s_long")
MATRIX_UNITS = ("amx_bf16", "avx512_bf16")  # the CPU flags under which prefill's target is 2x


def prefill_target(doc: dict) -> float:
    """Issue #31's prefill target for the CPU a run measured (its JSON's env.cpu_simd): 2x with AMX-BF16 or
    AVX512-BF16, 1.2x elsewhere (an AVX2 or AVX-512 CPU without bf16 units)."""
    simd = (doc.get("env") or {}).get("cpu_simd") or []
    return 2.0 if any(f in simd for f in MATRIX_UNITS) else 1.2


def _compare(a: float | None, b: float | None, target: float, higher: bool) -> tuple[float | None, bool | None]:
    ratio = a / b if a and b else None
    return ratio, None if ratio is None else (ratio >= target if higher else ratio <= target)


def cell(doc: dict, run: str = "") -> dict:
    """One cell: model, type, run, per metric mlaserve's value (ours), llama.cpp's (theirs), ik_llama.cpp's
    (ik), the ratios of ours to each and whether each meets the target; the load average range."""
    res = doc["results"]
    specs = engine_specs({k: v for k, v in res.items() if isinstance(v, dict)})
    ours, theirs, ik = specs["mlaserve"], specs["llama.cpp"], specs["ik_llama.cpp"]
    row = {"model": doc.get("model_name", "standard"), "type": file_type(ours), "run": run, "metrics": {}}
    row["partial"] = doc.get("complete") is False  # stopped after some phases: the others are missing
    row["long_prompt"] = (doc.get("settings") or {}).get("long_prompt", 2048)
    row["has_ik"] = ik is not None
    for key, _, target, higher in METRICS:
        target = prefill_target(doc) if key in PREFILL_KEYS else target
        a, b = res[ours].get(key), res[theirs].get(key)
        c = res[ik].get(key) if ik else None
        ratio, met = _compare(a, b, target, higher)
        ratio_ik, met_ik = _compare(a, c, target, higher)
        row["metrics"][key] = {
            "ours": a,
            "theirs": b,
            "ik": c,
            "ratio": ratio,
            "met": met,
            "ratio_ik": ratio_ik,
            "met_ik": met_ik,
            "target": target,
        }
    loads = [r["loadavg"][0] for r in res.get("loadavg", [])]
    row["loadavg_1min"] = (min(loads), max(loads)) if loads else None
    return row


def _fmt(v: float | None, nd: int) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _ratio(ratio: float | None, met: bool | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x {'ok' if met else '**miss**'}"


def markdown(rows: list[dict]) -> str:
    """The table: one line per (cell, metric): each engine's figure, mlaserve's ratio to llama.cpp and to
    ik_llama.cpp with the target met (ok) or missed (**miss**), the target, the load average range."""
    head = ["model", "file", "run", "metric", "mlaserve", "llama.cpp", "ik_llama.cpp", "vs llama.cpp"]
    head += ["vs ik_llama.cpp", "target", "load avg (1 min)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    missing = []  # (cell, metric) no engine has a figure for: left out of the table, listed under it
    for r in rows:
        la = r["loadavg_1min"]
        load = "-" if la is None else f"{la[0]:.1f}-{la[1]:.1f}"
        run = (r["run"] or "1") + (" (partial)" if r.get("partial") else "")
        for key, label, _, higher in METRICS:
            m = r["metrics"][key]
            if m["ours"] is None and m["theirs"] is None and m["ik"] is None:
                missing.append(
                    f"{r['model']} {r['type'].upper()} run {run}: {label.format(long=r.get('long_prompt', 2048))}"
                )
                continue
            nd = 2 if key in ("peak_rss_gib",) else 1
            ik = "not run" if not r.get("has_ik") else _fmt(m["ik"], nd) + (" *" if key == "output_tok_s_c16" else "")
            cells = [r["model"], r["type"].upper(), run, label.format(long=r.get("long_prompt", 2048))]
            cells += [_fmt(m["ours"], nd), _fmt(m["theirs"], nd), ik]
            cells += [_ratio(m["ratio"], m["met"]), _ratio(m["ratio_ik"], m["met_ik"])]
            cells += [f"{'>=' if higher else '<='} {m['target']}x", load]
            lines.append("| " + " | ".join(cells) + " |")
    if missing:
        lines += ["", "Not measured (no engine has a figure): " + "; ".join(missing) + "."]
    if any(r.get("has_ik") for r in rows):
        lines += ["", f"\\* {IK_C16_NOTE}."]
    return "\n".join(lines)


def compact(rows: list[dict]) -> str:
    """The summary: one line per (model, file type), per metric mlaserve's ratio to llama.cpp in each run
    ("a / b" for runs 1 and 2, "**miss**" after each missed target, "-" not measured), the targets in the head."""
    head = ["model", "file"] + [
        f"{label} ({'>=' if h else '<='} {'2x with bf16 units, else 1.2' if key in PREFILL_KEYS else t}x)"
        for key, label, t, h in METRICS
    ]
    long = rows[0].get("long_prompt", 2048) if rows else 2048
    lines = ["| " + " | ".join(head).format(long=long) + " |", "|" + "---|" * len(head)]
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["model"], r["type"]), []).append(r)
    for (model, qtype), runs in cells.items():
        out = [model, qtype.upper()]
        for key, _, _, _ in METRICS:
            vals = [r["metrics"][key] for r in runs]
            out.append(
                " / ".join("-" if m["ratio"] is None else _ratio(m["ratio"], m["met"]).replace(" ok", "") for m in vals)
            )
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines)


# measured by every run of a cell (each part loads the engines): the merge keeps peak RSS's largest (each part's
# workload sets its own peak) and start's smallest (a part run after other models' files filled the page cache
# loads its file from disk: llama.cpp's 0.3-0.5 s start became 2.2-4.7 s in such parts on 2026-12-03, which the
# largest would have compared against mlaserve's warm one)
MAX_OVER_PARTS = ("peak_rss_gib",)
MIN_OVER_PARTS = ("load_s",)


SHORT_PREFILL = (
    512  # offline.py's prefill length; a part measured at another (matrix.py --long-prefill) is its own column
)


def long_prefill_keyed(doc: dict) -> dict:
    """A part whose prefill phase took a prompt other than SHORT_PREFILL tokens (matrix.py --long-prefill) with its
    prefill figures under "prefill_tok_s_long", so that uniting it with the other parts does not replace the
    512-token column; other docs as they are."""
    if (doc.get("settings") or {}).get("prefill_len", SHORT_PREFILL) == SHORT_PREFILL:
        return doc
    res = {
        spec: {("prefill_tok_s_long" if k == "prefill_tok_s" else k): v for k, v in vals.items()}
        if isinstance(vals, dict)
        else vals
        for spec, vals in doc["results"].items()
    }
    return {**doc, "results": res}


def engine_kind(spec: str) -> str:
    """'llama.cpp@q4_k_m:repack=true' -> 'llama.cpp'"""
    return spec.partition("@")[0].partition(":")[0]


def engine_key(spec: str) -> str:
    """The engine a part's result belongs to when parts are united: mlaserve's spec as it is; llama.cpp's and
    ik_llama.cpp's without their options ('llama.cpp@q4_k_m:repack=true' -> 'llama.cpp@q4_k_m'), so that a cell
    whose phases ran llama.cpp under different settings (matrix.py --llama-repack, per phase) is one engine."""
    return spec.partition(":")[0] if engine_kind(spec) in OTHERS else spec


def merge_parts(docs: list[dict]) -> dict:
    """One cell measured in parts (matrix.py --tag: some phases per run, on a loaded machine, or a phase measured
    again): every engine's figures united (a later part's figure replaces an earlier one's), the load records
    concatenated; peak RSS the largest over the parts (each part loads the engines again, and its own workload
    sets its peak), start the smallest (MIN_OVER_PARTS says why); partial if any part is. Where another engine
    ran under different settings in different parts (engine_key), its peak RSS is the smallest over them instead:
    the figure its best setting for memory reaches, not the one that favours mlaserve; out["settings"]
    ["engines"] lists every spec the parts ran."""
    if len(docs) == 1:
        return docs[0]
    specs = {k for d in docs for k in d["results"] if k.startswith("mlaserve") or engine_kind(k) in OTHERS}
    keys = Counter(engine_key(k) for k in specs)  # mlaserve's spec is its own key: one spec each
    mixed = {key for key, n in keys.items() if n > 1}
    out = {k: v for k, v in docs[0].items() if k != "results"}
    out["complete"] = all(d.get("complete", True) is not False for d in docs)
    out["settings"] = {**docs[0].get("settings", {})}
    res: dict = {"loadavg": []}
    for d in docs:
        if "long" in (d.get("phases") or []):
            out["settings"]["long_prompt"] = d.get("settings", {}).get("long_prompt", 2048)
        for spec, vals in d["results"].items():
            if spec == "loadavg":
                res["loadavg"] += vals
            elif isinstance(vals, dict):
                key = engine_key(spec)
                merged = res.setdefault(key, {})
                for k, v in vals.items():
                    if k in MAX_OVER_PARTS + MIN_OVER_PARTS and merged.get(k) is not None and v is not None:
                        largest = k in MAX_OVER_PARTS and key not in mixed
                        merged[k] = max(merged[k], v) if largest else min(merged[k], v)
                    elif v is not None or k not in merged:
                        merged[k] = v
    out["results"] = res
    out["parts"] = len(docs)
    out["settings"]["engines"] = sorted(specs)
    return out


def cell_key(path: Path, doc: dict) -> tuple[str, str, str]:
    """(model, file type, run) of a cell's JSON: the parts of one cell (matrix.py --tag) share it."""
    run = path.stem.rpartition("-run")[2] if "-run" in path.stem else ""
    specs = engine_specs({k: v for k, v in doc["results"].items() if isinstance(v, dict)})
    return doc.get("model_name", "standard"), file_type(specs["mlaserve"]), run


def load_rows(files: list[Path], latest: bool = False) -> list[dict]:
    """One row per cell and run; latest: one row per cell, every run's parts united (each metric from the run that
    measured it last; peak RSS the largest and start the smallest over them, as for parts)."""
    groups: dict = {}
    for f in sorted(files):
        doc = long_prefill_keyed(json.loads(f.read_text()))
        model, qtype, run = cell_key(f, doc)
        groups.setdefault((model, qtype, "" if latest else run), []).append(doc)
    rows = []
    for (_, _, run), docs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], int(kv[0][2] or 1))):
        # parts in the order they were measured: a metric measured again (a phase rerun after a fix, under its own
        # tag) takes the later figure, whatever the files' names
        docs.sort(key=lambda d: d.get("env", {}).get("date", ""))
        row = cell(merge_parts(docs), run)
        row["parts"] = len(docs)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--plot", type=Path, default=None, help="also plot the ratios against the targets (PNG)")
    p.add_argument("--compact", action="store_true", help="one line per (model, type): the ratios to llama.cpp only")
    p.add_argument("--latest", action="store_true", help="one row per (model, type): each metric from its latest run")
    args = p.parse_args()
    rows = load_rows(args.files, args.latest)
    print(compact(rows) if args.compact else markdown(rows))
    if args.plot:
        from plot_offline import plot_matrix

        plot_matrix(rows, METRICS, args.plot)


if __name__ == "__main__":
    main()

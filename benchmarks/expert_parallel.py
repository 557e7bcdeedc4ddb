"""Expert-parallel overhead: one process vs EP=2 vs TP=2 (vs TP=2 x EP=2) on a GGUF file, 1 thread per rank,
decode steps at batch 1 and 16. On a 2-core box the question is what the collectives cost, not speed.

    python benchmarks/expert_parallel.py [PATH.gguf] [--settings 1x1,1x2,2x1,2x2] [--repeats 3] [--new 16]

PATH defaults to the standard model's Q8_0 file (benchmarks/common.py: built on first use). A setting TxE is
tensor_parallel_size T, expert_parallel_size E: T x E processes, each `threads=1`; 2x2 starts 4 processes, which
oversubscribes 2 cores. Each repeat starts every setting's engine once, in alternating order (forward on even
repeats, reversed on odd ones), so a change in the machine's load falls on every setting alike.

Per engine and batch (16 greedy requests of 16-token prompts, or one):
  decode step ms       1000 / the requests' decode rate (metrics tokens_per_s: (n - 1) tokens from the first
                       token to the last; at batch 16 every request decodes in the same steps), median request
  all-reduces / step   from the workers' ledger records of pure decode steps (`comm`): count, payload bytes and
  bytes / step         the milliseconds spent in them (waiting for the slowest rank included), median step, per
  all-reduce ms / step worker rank (the table shows rank 1's; under TP x EP rank 1's TP and EP groups together)
  expert pairs         per rank, the (token, expert) pairs its experts ran over the run (`expert_load` records)
  greedy identical     each batch's greedy tokens == the one-process engine's of the same repeat
Results: a table on stdout and --out (default benchmarks/results/expert-parallel-<file>.json); the model's path
is written relative to the checkout.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from common import BENCH_DIR, RESULTS_DIR, ensure_model, environment, print_table, write_json
from model_files import ensure_gguf

from mlaserve import LLM, SamplingParams

BATCHES = (1, 16)
PROMPT_LEN = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default=None, help="a GGUF file (default: the standard model's Q8_0)")
    p.add_argument("--settings", default="1x1,1x2,2x1", help="TxE list: tensor x expert parallel sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new", type=int, default=16, help="tokens generated per request")
    p.add_argument("--out", default=None)
    return p.parse_args()


def prompts(batch: int, vocab: int) -> list[list[int]]:
    return [[(i * 31 + j * 7) % (vocab - 3) + 3 for j in range(PROMPT_LEN)] for i in range(batch)]


def decode(llm: LLM, batch: int, new: int) -> tuple[float, list[list[int]]]:
    """(median request's decode step ms, greedy tokens) of `batch` requests generating `new` tokens each."""
    vocab = llm.config.model.vocab_size
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate(prompts(batch, vocab), SamplingParams(max_tokens=2, **greedy))  # warm-up
    outs = llm.generate(prompts(batch, vocab), SamplingParams(max_tokens=new, **greedy))
    ms = statistics.median(1e3 / o.metrics["tokens_per_s"] for o in outs)
    return ms, [o.outputs[0].token_ids for o in outs]


def comm_per_decode_step(records: list[dict], batch: int, ranks: int) -> dict:
    """Per worker rank: the median pure decode step's all-reduce count, bytes and ms (its ledger `comm`)."""
    out = {}
    for rank in range(1, ranks):
        recs = [r for r in records if r.get("rank") == rank and r.get("num_decode_tokens") == r["num_tokens"] == batch]
        keys = ("all_reduces", "all_reduce_bytes", "all_reduce_ms")
        out[str(rank)] = {k: statistics.median(r["comm"][k] for r in recs) for k in keys} | {"steps": len(recs)}
    return out


def expert_pairs(records: list[dict], ranks: int) -> list[int]:
    """Per rank: the (token, expert) pairs its experts ran over the records' forward passes."""
    loads = [x for r in records if "expert_load" in r for x in r["expert_load"]]
    return [sum(x["pairs"] for x in loads if x["rank"] == g) for g in range(ranks)]


def run_setting(path: str, tp: int, ep: int, new: int) -> dict:
    res: dict = {"tp": tp, "ep": ep, "processes": tp * ep, "loadavg_before": list(os.getloadavg()), "batches": {}}
    with LLM(path, tensor_parallel_size=tp, expert_parallel_size=ep, threads=1, trace="memory") as llm:
        for batch in BATCHES:
            before = len(llm.runner.tracer.records)
            ms, tokens = decode(llm, batch, new)
            records = list(llm.runner.tracer.records)[before:]
            entry = {"decode_step_ms": round(ms, 2), "tokens": tokens}
            if tp * ep > 1:
                entry["comm_per_decode_step"] = comm_per_decode_step(records, batch, tp * ep)
            if ep > 1:
                entry["expert_pairs_per_rank"] = expert_pairs(records, tp * ep)
            res["batches"][str(batch)] = entry
    res["loadavg_after"] = list(os.getloadavg())
    return res


def relative(path: Path) -> str:
    """The path relative to the checkout (no machine paths in results), else its name."""
    root = BENCH_DIR.parent
    try:
        return str(path.absolute().relative_to(root))
    except ValueError:
        return path.name


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (setting, batch): medians over the repeats, each repeat's step ms, ratio to one process."""
    rows = []
    settings = sorted({(r["tp"], r["ep"]) for r in runs})
    for tp, ep in settings:
        for batch in map(str, BATCHES):
            mine = [r for r in runs if (r["tp"], r["ep"]) == (tp, ep)]
            ms = [r["batches"][batch]["decode_step_ms"] for r in mine]
            row = {"tp": tp, "ep": ep, "batch": int(batch), "decode_step_ms": ms, "median_ms": statistics.median(ms)}
            ones = [r for r in runs if (r["tp"], r["ep"]) == (1, 1)]
            if ones and (tp, ep) != (1, 1):  # each repeat against the one-process run of the same repeat
                ratios = [
                    r["batches"][batch]["decode_step_ms"] / o["batches"][batch]["decode_step_ms"]
                    for r, o in zip(mine, ones)
                ]
                row["ratio_to_one_process"] = [round(x, 2) for x in ratios]
                row["greedy_identical"] = all(
                    r["batches"][batch]["tokens"] == o["batches"][batch]["tokens"] for r, o in zip(mine, ones)
                )
            comm = [r["batches"][batch].get("comm_per_decode_step", {}).get("1") for r in mine]
            if comm[0]:
                row["rank1_comm"] = {
                    k: statistics.median(c[k] for c in comm)
                    for k in ("all_reduces", "all_reduce_bytes", "all_reduce_ms")
                }
            rows.append(row)
    return rows


def main() -> None:
    args = parse_args()
    path = Path(args.path) if args.path else ensure_gguf(ensure_model("standard", quick=False), "q8_0")
    settings = [tuple(int(x) for x in s.split("x")) for s in args.settings.split(",")]
    env = environment(1)
    runs = []
    for rep in range(args.repeats):
        for tp, ep in settings if rep % 2 == 0 else settings[::-1]:
            print(f"[repeat {rep}] TP={tp} EP={ep} (loadavg {os.getloadavg()[0]:.2f}) ...", flush=True)
            runs.append(run_setting(str(path), tp, ep, args.new) | {"repeat": rep})
    env["loadavg_end"] = list(os.getloadavg())
    rows = summarize(runs)
    for r in runs:  # the comparison is in the summary; the token lists are not kept
        for entry in r["batches"].values():
            entry.pop("tokens")
    table = []
    for r in rows:
        c = r.get("rank1_comm")
        table.append(
            [
                f"TP={r['tp']} EP={r['ep']}",
                r["batch"],
                f"{r['median_ms']:.1f}",
                " / ".join(f"{x:.1f}" for x in r["decode_step_ms"]),
                " / ".join(f"{x:.2f}" for x in r.get("ratio_to_one_process", [])) or "-",
                c["all_reduces"] if c else "-",
                f"{c['all_reduce_bytes']:,.0f}" if c else "-",
                f"{c['all_reduce_ms']:.1f}" if c else "-",
                {True: "yes", False: "NO"}.get(r.get("greedy_identical"), "-"),
            ]
        )
    print_table(
        ["setting", "batch", "step ms", "per repeat", "x one process", "all-reduces", "bytes", "ms", "greedy =="], table
    )
    out = Path(args.out) if args.out else RESULTS_DIR / f"expert-parallel-{path.stem}.json"
    res = {"model": relative(path), "new_tokens": args.new, "prompt_len": PROMPT_LEN, "environment": env}
    write_json(out, res | {"summary": rows, "runs": runs})


if __name__ == "__main__":
    main()

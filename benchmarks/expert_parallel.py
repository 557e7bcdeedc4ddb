"""Expert-parallel overhead: one process vs EP=2 (1 thread per rank) on a GGUF file, decode steps at batch 1
and 16 (the question on 2 cores: what does the per-MoE-layer all-reduce cost, not speed).

    python benchmarks/expert_parallel.py PATH.gguf [--new 16] [--tp-ep]   # --tp-ep: also TP=2 x EP=2 (4 processes)

Per setting: median decode step time at batch 1 and 16 (wall time of generate / decode steps), and from rank 1's
ledger the all-reduces, their bytes and milliseconds per decode step, and each rank's received (token, expert)
pairs (load balance). Prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlaserve import LLM, SamplingParams


def decode_step_ms(llm: LLM, batch: int, new: int) -> float:
    prompts = [[(i * 31 + j * 7) % 500 + 1 for j in range(16)] for i in range(batch)]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    return 1e3 * (time.perf_counter() - t0) / new


def comm(llm: LLM, batch: int) -> dict:
    recs = [r for r in llm.runner.tracer.records if r.get("rank") == 1 and r.get("num_decode_tokens") == batch]
    recs = [r for r in recs if r["num_tokens"] == batch]
    keys = ("all_reduces", "all_reduce_bytes", "all_reduce_ms")
    return {k: statistics.median(r["comm"][k] for r in recs) for k in keys}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--tp-ep", action="store_true", help="also TP=2 x EP=2 (4 processes, rank 1's TP and EP groups)")
    args = p.parse_args()
    rows = []
    for tp, ep in ((1, 1), (1, 2)) + (((2, 2),) if args.tp_ep else ()):
        with LLM(args.path, tensor_parallel_size=tp, expert_parallel_size=ep, threads=1, trace="memory") as llm:
            for batch in (1, 16):
                ms = decode_step_ms(llm, batch, args.new)
                c = comm(llm, batch) if ep > 1 else {}
                rows.append((tp, ep, batch, ms, c))
            if ep > 1:
                loads = [r["expert_load"] for r in llm.runner.tracer.records if "expert_load" in r]
                pairs = [sum(x["pairs"] for x in loads[-1] if x["rank"] == r) for r in range(tp * ep)]
                print(f"TP={tp} EP={ep}: last step's received pairs per rank: {pairs}")
    print("TP EP  batch  decode step ms  all-reduces/step  bytes/step  all-reduce ms/step")
    for tp, ep, batch, ms, c in rows:
        extra = f"{c['all_reduces']:>17} {c['all_reduce_bytes']:>11} {c['all_reduce_ms']:>19}" if c else ""
        print(f"{tp:>2} {ep:>2} {batch:>6} {ms:>15.2f} {extra}")


if __name__ == "__main__":
    main()

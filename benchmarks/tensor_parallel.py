"""Tensor-parallel benchmark: the standard model at TP=1 with T threads vs TP=2 with T/2 threads per
rank, on the same cores (the question: is communication the bottleneck?).

    python benchmarks/tensor_parallel.py [--quick] [--threads 2] [--dtype float32|bfloat16]

Measures, for each setting (engines run one after the other, each closed before the next loads):
  prefill tok/s           one prompt of prefill_len tokens, max_tokens=1 (median of reps)
  decode tok/s (B=1)      dec_prompt-token prompt, dec_new new tokens: the engine's tokens_per_s
  output tok/s (B=16)     16 requests of dec_prompt tokens, dec_new new tokens each / wall time
  all-reduces per step    count, bytes and milliseconds per decode step, from rank 1's ledger records
  weight bytes per rank   what each rank echoed at start (TP=1: the whole model)
Results: a table on stdout and benchmarks/results/tensor-parallel-<dtype>[-quick].json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import RESULTS_DIR, ensure_model, environment, print_table, random_prompt, timed, write_json

from mlaserve import LLM, SamplingParams

FULL = dict(prefill_len=512, prefill_reps=3, dec_prompt=128, dec_new=64, conc=16)
QUICK = dict(prefill_len=128, prefill_reps=2, dec_prompt=32, dec_new=16, conc=16)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--quick", action="store_true", help="2-layer model, short prompts: a smoke test, not a benchmark")
    p.add_argument("--threads", type=int, default=2, help="cores used in total: TP=1 runs this many threads, TP=2 half")
    p.add_argument("--out", default=None)
    return p.parse_args()


def measure(llm: LLM, s: dict, vocab: int) -> dict:
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([random_prompt(16, vocab, 1)], SamplingParams(max_tokens=2, **greedy))  # warm-up
    prompts = iter(range(100, 10_000))
    t = timed(
        lambda: llm.generate([random_prompt(s["prefill_len"], vocab, next(prompts))], SamplingParams(max_tokens=1)),
        s["prefill_reps"],
        0,
    )
    out = {"prefill_tok_s": s["prefill_len"] / t["median_s"]}
    one = llm.generate([random_prompt(s["dec_prompt"], vocab, 7)], SamplingParams(max_tokens=s["dec_new"], **greedy))
    out["decode_tok_s_b1"] = one[0].metrics["tokens_per_s"]
    out["greedy_b1"] = one[0].outputs[0].token_ids
    batch = [random_prompt(s["dec_prompt"], vocab, 1000 + i) for i in range(s["conc"])]
    t0 = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=s["dec_new"], **greedy))
    out["output_tok_s_b16"] = s["conc"] * s["dec_new"] / (time.perf_counter() - t0)
    return out


def comm_per_decode_step(llm: LLM) -> dict | None:
    recs = [r for r in llm.runner.tracer.records if r.get("rank") == 1 and r["num_tokens"] == r["num_decode_tokens"]]
    if not recs:
        return None
    return {
        k: statistics.median(r["comm"][k] for r in recs) for k in ("all_reduces", "all_reduce_bytes", "all_reduce_ms")
    } | {"decode_steps": len(recs)}


def run(folder, dtype: str, tp: int, threads: int, s: dict) -> dict:
    with LLM(str(folder), dtype=dtype, tensor_parallel_size=tp, threads=threads, trace="memory") as llm:
        res = measure(llm, s, llm.config.model.vocab_size)
        echoes = getattr(llm.runner, "rank_echoes", None)
        if echoes:
            res["weight_bytes_per_rank"] = [e["weight_bytes"] for e in echoes]
            res["comm_per_decode_step"] = comm_per_decode_step(llm)
        else:
            params = {id(p): p for p in llm.loaded.model.parameters()}.values()
            res["weight_bytes_per_rank"] = [sum(p.numel() * p.element_size() for p in params)]
    return res


def main() -> None:
    args = parse_args()
    s = QUICK if args.quick else FULL
    folder = ensure_model("standard", args.quick)
    env = environment(args.threads)
    res = {"settings": s, "environment": env}
    res["tp1"] = run(folder, args.dtype, 1, args.threads, s)
    res["tp2"] = run(folder, args.dtype, 2, max(1, args.threads // 2), s)
    res["greedy_b1_identical"] = res["tp1"]["greedy_b1"] == res["tp2"]["greedy_b1"]
    env["loadavg_end"] = list(__import__("os").getloadavg())
    a, b = res["tp1"], res["tp2"]
    rows = [
        [k, f"{a[k]:.1f}", f"{b[k]:.1f}", f"{b[k] / a[k]:.2f}x"]
        for k in ("prefill_tok_s", "decode_tok_s_b1", "output_tok_s_b16")
    ]
    rows.append(
        ["weight MiB per rank", f"{a['weight_bytes_per_rank'][0] / 2**20:.0f}"]
        + [
            f"{b['weight_bytes_per_rank'][0] / 2**20:.0f}",
            f"{b['weight_bytes_per_rank'][0] / a['weight_bytes_per_rank'][0]:.3f}x",
        ]
    )
    half = max(1, args.threads // 2)
    print_table(
        [f"{args.dtype}, {args.threads} cores", f"TP=1 ({args.threads} thr)", f"TP=2 ({half} thr/rank)", "TP2/TP1"],
        rows,
    )
    print(f"all-reduces per decode step (rank 1): {b['comm_per_decode_step']}")
    print(
        f"greedy output identical at batch 1: {res['greedy_b1_identical']}; loadavg {env['loadavg_start']} -> {env['loadavg_end']}"
    )
    out = args.out or RESULTS_DIR / f"tensor-parallel-{args.dtype}{'-quick' if args.quick else ''}.json"
    write_json(out, res)


if __name__ == "__main__":
    main()

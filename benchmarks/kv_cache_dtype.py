"""Long-context decode over an 8-bit cache (kv_cache_dtype int8 / fp8_e4m3) vs the compute-dtype cache.

    python benchmarks/kv_cache_dtype.py [--models standard dsa] [--contexts 16384] [--batches 1 8]
                                        [--quantization int8] [--threads 2] [--quick]

One model load per model; per cache dtype a ModelRunner over the same weights with its own pool, filled with
the same synthetic rows as benchmarks/long_context.py (c_kv = RMSNorm'd N(0,1) times the norm weight, k_pe and
the indexer keys as there: a 16K prefill of a 0.7B model takes minutes on 2 cores), written through the cache's
own write (so 8-bit pools hold the quantized rows), then single-token decode chunks at context N timed through
`runner.execute` (forward + logits; no scheduling or sampling), the dtypes interleaved rep by rep so load drift
hits them alike. Reported per (model, context, batch, cache dtype): the step's median ms, the cache's measured
bytes per token, the tokens a fixed budget (the compute-dtype pool of that row) holds, and the decode step's
logits against the compute-dtype cache's (max |diff|, top-1 agreement over the batch; same context rows).
--quantization int8 puts the weights in Q8_0 at load, which brings the native kernels and the native attention
backend (its C latent MQA and DSA top-k read fp32 rows, or the 8-bit codes, in place). These folders' layers run
decode steps per op: the one-call decode layer needs a GGUF's attn_k_b / attn_v_b blocks (the load report says
so), so the figures are the per-op native path's, the same for both caches.
Results: a table on stdout and benchmarks/results/kv_cache_dtype[-quick].json.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    RESULTS_DIR,
    count_params,
    ensure_model,
    environment,
    mem_available_gib,
    print_table,
    random_prompt,
    rss_gib,
    slots_for,
    synthetic_index_keys,
    synthetic_latent_rows,
    write_json,
)

PAGE_SIZE = 16
CODES = ("auto", "int8", "fp8_e4m3")


def runner_for(llm, kv: str, n: int, batch: int):
    """A ModelRunner over llm's weights with a pool of batch requests of n + 1 tokens, in kv's layout."""
    from mlaserve.executor.model_runner import ModelRunner

    pages = math.ceil((n + 1) / PAGE_SIZE)
    cfg = llm.config
    cfg = replace(
        cfg,
        cache=replace(cfg.cache, kv_cache_dtype=kv, num_pages=batch * pages, page_size=PAGE_SIZE),
        scheduler=replace(cfg.scheduler, max_num_seqs=batch),
    )
    runner = ModelRunner(llm.loaded.model, cfg)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for table in tables:  # the same rows for every layout (same seed, same order)
            slots = slots_for(table, n, PAGE_SIZE)
            for layer, state in zip(runner.model.model.layers, runner.cache.layers):
                state.latent.index_copy_(0, slots, synthetic_latent_rows(n, layer.self_attn, cfg.runtime.dtype, g))
                if state.index_keys is not None:
                    keys = synthetic_index_keys(n, layer.self_attn.indexer, cfg.runtime.dtype, g)
                    state.index_keys.index_copy_(0, slots, keys)
    return runner, tables


def decode_chunks(tables: list[list[int]], n: int) -> list:
    from mlaserve.executor.forward_batch import SeqChunk

    return [SeqChunk(f"kv8-{i}", (5 + i,), n, tuple(t)) for i, t in enumerate(tables)]


def measure(llm, n: int, batch: int, reps: int, warmup: int, codes: tuple[str, ...]) -> dict:
    runners = {}
    for kv in codes:
        t0 = time.perf_counter()
        runners[kv] = runner_for(llm, kv, n, batch)
        print(f"  [{kv}] pool filled in {time.perf_counter() - t0:.1f} s, RSS {rss_gib():.1f} GiB", flush=True)
    logits, times = {}, {kv: [] for kv in codes}
    for kv, (runner, tables) in runners.items():
        for _ in range(warmup):
            _, logits[kv] = runner.execute(decode_chunks(tables, n))
    for _ in range(reps):
        for kv, (runner, tables) in runners.items():
            t0 = time.perf_counter()
            runner.execute(decode_chunks(tables, n))
            times[kv].append(time.perf_counter() - t0)
    base = runners["auto"][0].cache.measured_bytes_per_token()
    out = {}
    for kv, (runner, _) in runners.items():
        per_token = runner.cache.measured_bytes_per_token()
        diff = (logits[kv] - logits["auto"]).abs().max().item()
        top1 = (logits[kv].argmax(-1) == logits["auto"].argmax(-1)).float().mean().item()
        out[kv] = {
            "step_ms": statistics.median(times[kv]) * 1e3,
            "all_ms": [t * 1e3 for t in times[kv]],
            "bytes_per_token": per_token,
            "tokens_in_same_memory": base / per_token,
            "logits_max_abs_diff": diff,
            "top1_agreement": top1,
        }
    del runners
    gc.collect()
    return out


def greedy_agreement(folder, args, codes: tuple[str, ...]) -> dict:
    """Greedy generation of args.greedy tokens after a random prompt of args.greedy_prompt tokens, once per layout
    (a fresh engine each: the same weights, prefill and decode through the engine): the first position where an
    8-bit layout's tokens leave the float32 cache's, and the share of equal positions."""
    from mlaserve import LLM
    from mlaserve.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.greedy, ignore_eos=True)
    tokens = {}
    for kv in ("auto", *codes):
        llm = LLM(
            model=str(folder), dtype="float32", kv_cache_dtype=kv, threads=args.threads,
            **({"quantization": args.quantization} if args.quantization else {}),
        )  # fmt: skip
        prompt = random_prompt(args.greedy_prompt, llm.config.model.vocab_size, seed=0)
        t0 = time.perf_counter()
        tokens[kv] = llm.generate([prompt], params)[0].outputs[0].token_ids
        print(f"  [{kv}] {args.greedy} greedy tokens in {time.perf_counter() - t0:.0f} s", flush=True)
        del llm
        gc.collect()
    out = {}
    for kv in codes:
        same = [a == b for a, b in zip(tokens[kv], tokens["auto"])]
        first = same.index(False) if False in same else len(same)
        out[kv] = {"first_divergence": first, "equal_share": sum(same) / len(same)}
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=["standard", "dsa"], choices=["standard", "dsa"])
    p.add_argument("--contexts", type=int, nargs="*", default=[16384])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    p.add_argument("--quantization", choices=["int8"], default=None, help="weights in Q8_0 at load (native kernels)")
    p.add_argument("--codes", nargs="*", default=list(CODES[1:]), choices=CODES[1:], help="8-bit layouts to run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--greedy", type=int, default=0, help="also greedy-decode this many tokens per layout, compared")
    p.add_argument("--greedy-prompt", type=int, default=512, help="the random prompt's length for --greedy")
    p.add_argument("--quick", action="store_true", help="2-layer models, context 2048: a smoke test")
    return p.parse_args()


def main() -> None:
    from mlaserve import LLM

    args = parse_args()
    torch.set_num_threads(args.threads)
    contexts = [2048] if args.quick else args.contexts
    env = environment(args.threads)
    results, rows = {}, []
    for kind in args.models:
        folder = ensure_model(kind, args.quick)
        llm = LLM(
            model=str(folder),
            dtype="float32",
            page_size=PAGE_SIZE,
            num_pages=1,
            threads=args.threads,
            malloc_tuning=True,
            **({"quantization": args.quantization} if args.quantization else {}),
        )
        cfg = llm.config
        print(
            f"[{kind}] {count_params(folder) / 1e6:.0f} M parameters, backend {cfg.attention.backend}, "
            f"kernels {cfg.kernels.impl}, sparse {cfg.attention.sparse}; RSS {rss_gib():.1f} GiB",
            flush=True,
        )
        for n in contexts:
            for batch in args.batches:
                # the float32 pool (latent rows [320] and keys [128] x 12 layers) and two 8-bit pools of ~0.4x it
                need = batch * n * (320 + 128) * 12 * 4 * 1.8 / 2**30
                if need > 0.8 * mem_available_gib():
                    print(f"[{kind}] context {n} batch {batch}: ~{need:.1f} GiB of pools won't fit -- skipped")
                    continue
                print(f"[{kind}] context {n}, batch {batch}", flush=True)
                res = measure(llm, n, batch, args.reps, 1, ("auto", *args.codes))
                results[f"{kind}/{n}/{batch}"] = res
                auto = res["auto"]["step_ms"]
                for kv, r in res.items():
                    rows.append(
                        [
                            kind,
                            f"{n:,}",
                            str(batch),
                            "float32" if kv == "auto" else kv,
                            f"{r['step_ms']:.0f}",
                            f"{auto / r['step_ms']:.2f}x",
                            str(r["bytes_per_token"]),
                            f"{r['tokens_in_same_memory']:.2f}x",
                            "-" if kv == "auto" else f"{r['logits_max_abs_diff']:.3g}",
                            "-" if kv == "auto" else f"{r['top1_agreement']:.0%}",
                        ]
                    )
        del llm
        gc.collect()
        if args.greedy:
            print(f"[{kind}] greedy agreement over {args.greedy} tokens", flush=True)
            agree = greedy_agreement(folder, args, tuple(args.codes))
            results[f"{kind}/greedy"] = agree
            for kv, a in agree.items():
                print(f"[{kind}] {kv}: first divergence at token {a['first_divergence']}, {a['equal_share']:.0%} equal")
    if not rows:  # every row skipped (memory): nothing to tabulate
        return
    print()
    quant = f", weights {args.quantization}" if args.quantization else ""
    print(f"decode step, float32 compute{quant}, {args.threads} threads{', QUICK' if args.quick else ''}")
    table = print_table(
        ["model", "context", "batch", "cache", "step ms", "speed vs fp32", "bytes/token", "tokens, same memory",
         "max |dlogit|", "top-1"],
        rows,
    )  # fmt: skip
    name = "kv_cache_dtype" + ("-quick" if args.quick else "") + (f"-{args.quantization}" if args.quantization else "")
    write_json(RESULTS_DIR / f"{name}.json", {"env": env, "args": vars(args), "results": results, "table": table})


if __name__ == "__main__":
    main()

"""Batch-1 decode on a GGUF file with the latent cache in float32 (kv_cache_dtype auto) vs 16 bits (float16, the
same row llama.cpp's F16 cache keeps; bfloat16 on request), at a short and a long context.

    python benchmarks/kv16_decode.py --gguf FILE [--contexts 128 4096] [--caches auto float16] [--threads 2]
                                     [--rounds 5] [--steps 3] [--out JSON]

One model load (the native kernels and the one-call decode layers of a GGUF); per (context, cache layout) a
ModelRunner over the same weights with its own pool, filled through the cache's own write with the synthetic rows
of benchmarks/long_context.py (common.synthetic_latent_rows: a real N-token prefill per layout would dominate the
run on 2 cores; a decode step's cost does not depend on the rows' values), then single-token steps at context N
through `runner.execute` (forward + logits; no scheduling or sampling). The layouts take turns within a round
(--steps each), the order reversed every other round, so load drift hits them alike. Reported per (context,
layout): the median wall and CPU (process) time per step and tokens/s from each, the cache's measured bytes per
token, and the step's logits against the float32 cache's (max |diff|, top-1). Load average before and after.
With --kernel (no file): the latent MQA alone, one query of H heads over L rows at the standard model's shapes
(H 16, r 256, dr 64; --heads/--rank/--rope), mls_latent_mqa over fp32 rows vs mls_latent_mqa16 over the same rows
in 16 bits, one thread, alternating call by call; best and median CPU time per call over --calls (the cache's
share of a decode step, measured apart from the weights' products, which dominate a step at these shapes).
Results: a table on stdout and --out (default benchmarks/results/kv16_decode-<file stem | kernel>.json).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, environment, print_table, write_json  # noqa: E402
from kv_cache_dtype import decode_chunks, runner_for  # noqa: E402


def measure(llm, n: int, caches: list[str], rounds: int, steps: int) -> dict:
    runners = {kv: runner_for(llm, kv, n, 1) for kv in caches}
    logits, wall, cpu = {}, {kv: [] for kv in caches}, {kv: [] for kv in caches}
    with torch.inference_mode():
        for kv, (runner, tables) in runners.items():  # warm-up, and the logits of the step at context n
            _, logits[kv] = runner.execute(decode_chunks(tables, n))
        for rnd in range(rounds):
            order = caches if rnd % 2 == 0 else caches[::-1]
            for kv in order:
                runner, tables = runners[kv]
                for _ in range(steps):
                    t0, c0 = time.perf_counter(), time.process_time()
                    runner.execute(decode_chunks(tables, n))
                    wall[kv].append(time.perf_counter() - t0)
                    cpu[kv].append(time.process_time() - c0)
    out = {}
    for kv, (runner, _) in runners.items():
        ref = logits[caches[0]]
        out[kv] = {
            "step_ms_wall": statistics.median(wall[kv]) * 1e3,
            "step_ms_cpu": statistics.median(cpu[kv]) * 1e3,
            "best_ms_wall": min(wall[kv]) * 1e3,
            "tok_s_wall": 1.0 / statistics.median(wall[kv]),
            "tok_s_cpu_per_thread": torch.get_num_threads() / statistics.median(cpu[kv]),
            "bytes_per_token": runner.cache.measured_bytes_per_token(),
            "logits_max_abs_diff_vs_first": (logits[kv] - ref).abs().max().item(),
            "top1_vs_first": (logits[kv].argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "all_ms_wall": [t * 1e3 for t in wall[kv]],
        }
    del runners
    gc.collect()
    return out


def kernel_times(n: int, h: int, r: int, dr: int, calls: int, caches: list[str]) -> dict:
    from mlaserve.cache.quantized_rows import QuantizedRows
    from mlaserve.config.row_format import latent_format
    from mlaserve.kernels import native_layers

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(n + 1, r + dr, generator=g)
    q_lat, q_pe = torch.randn(1, h, r, generator=g), torch.randn(1, h, dr, generator=g)
    q_index = torch.zeros(1, 1, dtype=torch.int64)
    slots = torch.randperm(n, generator=g).view(1, n)  # rows scattered over the pool, as pages are
    mask = torch.ones(1, 1, n, dtype=torch.bool)
    stored = {kv: rows if kv == "auto" else QuantizedRows.of(rows, latent_format(kv, r + dr, dr)) for kv in caches}
    fn = {kv: native_layers.latent_mqa if kv == "auto" else native_layers.latent_mqa16 for kv in caches}
    times = {kv: [] for kv in caches}
    torch.set_num_threads(1)
    for i in range(calls):
        for kv in caches if i % 2 == 0 else caches[::-1]:
            c0 = time.process_time()
            fn[kv](q_lat, q_pe, q_index, stored[kv], slots, mask, 0.1)
            times[kv].append(time.process_time() - c0)
    return {kv: {"best_ms_cpu": min(t) * 1e3, "median_ms_cpu": statistics.median(t) * 1e3,
                 "cache_bytes": n * (r + dr) * (4 if kv == "auto" else 2)} for kv, t in times.items()}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None)
    p.add_argument("--kernel", action="store_true", help="the latent MQA alone (no file)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--contexts", type=int, nargs="*", default=[128, 4096])
    p.add_argument("--caches", nargs="*", default=["auto", "float16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from mlaserve import LLM

    env = environment(args.threads)
    if args.kernel:
        results, rows = {}, []
        for n in args.contexts:
            results[str(n)] = kernel_times(n, args.heads, args.rank, args.rope, args.calls, args.caches)
            for kv, r in results[str(n)].items():
                rows.append([n, kv, f"{r['best_ms_cpu']:.3f}", f"{r['median_ms_cpu']:.3f}", r["cache_bytes"]])
        env["loadavg_end"] = list(os.getloadavg())
        print(print_table(["rows", "cache", "best cpu ms", "median cpu ms", "bytes read"], rows))
        out = Path(args.out) if args.out else RESULTS_DIR / "kv16_decode-kernel.json"
        write_json(out, {"environment": env, "args": vars(args) | {"out": None}, "results": results})
        print(f"[results] wrote {out}")
        return
    if not args.gguf:
        raise SystemExit("--gguf FILE (or --kernel)")
    llm = LLM(args.gguf, threads=args.threads, enable_prefix_caching=False, num_pages=1)
    results = {}
    rows = []
    for n in args.contexts:
        print(f"[context {n}] loadavg {os.getloadavg()}", flush=True)
        res = measure(llm, n, args.caches, args.rounds, args.steps)
        results[str(n)] = res
        for kv, r in res.items():
            rows.append([n, kv, f"{r['tok_s_wall']:.1f}", f"{r['step_ms_wall']:.1f}", f"{r['step_ms_cpu']:.1f}",
                         r["bytes_per_token"], f"{r['logits_max_abs_diff_vs_first']:.2g}"])  # fmt: skip
    env["loadavg_end"] = list(os.getloadavg())
    print(print_table(["context", "cache", "tok/s", "step ms", "cpu ms", "bytes/token", "max|dlogit|"], rows))
    name = Path(args.gguf).stem
    out = Path(args.out) if args.out else RESULTS_DIR / f"kv16_decode-{name}.json"
    write_json(out, {"file": Path(args.gguf).name, "environment": env, "args": vars(args) | {"gguf": name, "out": None},
                     "results": results})  # fmt: skip
    print(f"[results] wrote {out}")


if __name__ == "__main__":
    main()

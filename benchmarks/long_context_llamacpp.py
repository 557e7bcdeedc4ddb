"""Long-context decode on one GGUF file: llama.cpp with its cache in Q8_0 and F16 beside mlaserve with
kv_cache_dtype auto (float32), int8 and fp8_e4m3.

    python benchmarks/long_context_llamacpp.py [--model standard|dsa] [--contexts 16384 32768] [--batches 1 8]
        [--llama-caches q8_0 f16] [--caches auto int8 fp8_e4m3] [--threads 1] [--rounds 3] [--steps 2]

The file: the standard model (common.py STANDARD) says max_position_embeddings 8192, so it runs as
`mla-std-l12-seed0-pos65536` (common.with_max_positions: the same safetensors, 65536 in config.json) written to
Q8_0 by `mlaserve convert` (model_files.ensure_gguf); the DSA model (`--model dsa`) already says 65536.

Notation: N = context (cells / rows per request), B = requests per step, P = --prefill tokens.
- llama.cpp (benchmarks/llamacpp_session.py, a process of its own, flash attention on, one stream per sequence):
  its cache is one K row per token and layer, [c_kv 256 | k_pe 64] in the cache type (Q8_0: 340 bytes, F16:
  640; a Q8_0 K is Hadamard-rotated before it is stored), no V (a view of K); a DSA file adds the indexer's keys
  in the same type. It prefills P real tokens (timed: its prefill figure), then its cache is given N cells by
  llama_state_seq_set_data: those P rows, written by llama.cpp itself, repeated to positions 0..N-1. A real N-token
  prefill was measured first and does not fit in a run on this machine (see benchmarks/README.md); a decode
  step's cost does not depend on the rows' values. Batch B: sequence 0 copied to B-1 more streams
  (llama_memory_seq_cp), B tokens per llama_decode.
- mlaserve (this process, the same GGUF, the native kernels and the one-call decode layers): one runner per cache
  layout over the same weights, its pool filled with synthetic rows at the right scale through the cache's own
  write (benchmarks/kv_cache_dtype.py runner_for), single-token steps of B requests at context N through
  `runner.execute`.
Engines take turns step by step within a round (every engine's --steps, then the next engine), the order
reversed every other round; the figure is the median over rounds x steps.
Before the timing, the logits check: a --check-tokens random prompt through llama.cpp (F16 cache) and through
mlaserve (float32 cache) on the same file: max |dlogit| and top-1 agreement per position, with mlaserve's
activations float (exact Q8_0 products) and int8 (quantized as llama.cpp quantizes them for its Q8_0 dot products).
Results: a table on stdout and benchmarks/results/long_context_llamacpp-<model>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    BENCH_DIR,
    RESULTS_DIR,
    ensure_model,
    environment,
    mem_available_gib,
    print_table,
    random_prompt,
    rss_gib,
    with_max_positions,
    write_json,
)
from kv_cache_dtype import PAGE_SIZE, decode_chunks, runner_for  # noqa: E402
from model_files import ensure_gguf  # noqa: E402

MAX_POSITIONS = 65536
LLAMA_BYTES = {"q8_0": 34 / 32, "f16": 2.0}  # bytes per cached value


def model_file(kind: str) -> Path:
    folder = ensure_model(kind, False)
    if kind == "standard":
        folder = with_max_positions(folder, MAX_POSITIONS)
    return ensure_gguf(folder, "q8_0")


class LlamaCpp:
    """The parent's handle on one llamacpp_session.py process."""

    def __init__(self, path: Path, cache: str, threads: int, n_seq: int, per_seq: int, flash_attn: bool = True) -> None:
        self.cache = cache
        init = {"path": str(path), "threads": threads, "cache": cache, "n_seq": n_seq, "per_seq": per_seq}
        init["flash_attn"] = flash_attn
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCH_DIR / "llamacpp_session.py"), json.dumps(init)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        reply = json.loads(self.proc.stdout.readline() or '{"ok": false, "error": "the process exited"}')
        if not reply["ok"]:
            raise SystemExit(f"llama.cpp ({cache} cache) did not start: {reply['error']}")

    def call(self, op: str, *args):
        self.proc.stdin.write(json.dumps({"op": op, "args": list(args)}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        reply = json.loads(line) if line else {"ok": False, "error": f"exited ({self.proc.wait()})"}
        if not reply["ok"]:
            raise SystemExit(f"llama.cpp ({self.cache} cache): {op} failed: {reply['error']}")
        return reply["result"]

    def stop(self) -> None:
        self.proc.stdin.write('{"op": "quit"}\n')
        self.proc.stdin.close()
        self.proc.wait()


def mlaserve_llm(path: Path, threads: int, activations: str = "auto"):
    from mlaserve import LLM

    return LLM(
        model=str(path),
        dtype="float32",
        page_size=PAGE_SIZE,
        num_pages=1,
        threads=threads,
        malloc_tuning=True,
        activations=activations,
    )


def mlaserve_logits(llm, tokens: list[int]) -> np.ndarray:
    """Every position's logits of one prefill chunk of `tokens` over a float32 cache."""
    from mlaserve.executor.forward_batch import SeqChunk

    runner, tables = runner_for(llm, "auto", len(tokens), 1)
    chunk = SeqChunk("check", tuple(tokens), 0, tuple(tables[0]), all_logits=True)
    _, logits = runner.execute([chunk])
    return logits.float().numpy()


def llama_logits(path: Path, cache: str, flash_attn: bool, tokens: list[int], threads: int) -> np.ndarray:
    lcpp = LlamaCpp(path, cache, threads, 1, 256, flash_attn)
    with tempfile.TemporaryDirectory() as tmp:
        lcpp.call("logits", tokens, os.path.join(tmp, "logits.npy"))
        out = np.load(os.path.join(tmp, "logits.npy"))
    lcpp.stop()
    return out


def compare(name: str, a: np.ndarray, b: np.ndarray) -> dict:
    diff = np.abs(a - b).max(-1)
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    print(
        f"[check] {name}: max |dlogit| {diff.max():.4g} (positions: {' '.join(f'{d:.2g}' for d in diff)}), "
        f"top-1 {top1:.0%}",
        flush=True,
    )
    return {"max_abs_diff": float(diff.max()), "per_position": diff.tolist(), "top1_agreement": top1}


def logits_check(path: Path, llm, args, vocab: int) -> dict:
    """Every position's logits of one random prompt, llama.cpp vs mlaserve on the same file. On the Q8_0 file:
    llama.cpp with an F16 cache (flash attention, as timed) and an F32 one (no flash attention) against mlaserve's
    float32 cache with float activations (exact Q8_0 products: the default) and int8 ones (llama.cpp's scheme);
    beside them each engine against itself (mlaserve float vs int8, llama.cpp F32 vs F16 cache): how far 8-bit
    roundings move this model's logits. With --exact-check, the same weights unquantized (an F32 file: no 8-bit
    activations in either engine, an F32 llama.cpp cache): the engines should then agree to fp32 rounding."""
    tokens = random_prompt(args.check_tokens, vocab, seed=3)
    lf16 = llama_logits(path, "f16", True, tokens, args.threads)
    lf32 = llama_logits(path, "f32", False, tokens, args.threads)
    ours = mlaserve_logits(llm, tokens)
    int8 = mlaserve_llm(path, args.threads, "int8")
    ours8 = mlaserve_logits(int8, tokens)
    del int8
    gc.collect()
    out = {
        "tokens": len(tokens),
        "logit_abs_max": float(np.abs(lf32).max()),
        "mlaserve float vs llama.cpp f16 cache": compare("mlaserve float vs llama.cpp f16 cache", ours, lf16),
        "mlaserve float vs llama.cpp f32 cache": compare("mlaserve float vs llama.cpp f32 cache", ours, lf32),
        "mlaserve int8 vs llama.cpp f32 cache": compare("mlaserve int8 vs llama.cpp f32 cache", ours8, lf32),
        "mlaserve float vs mlaserve int8": compare("mlaserve float vs mlaserve int8 activations", ours, ours8),
        "llama.cpp f32 vs f16 cache": compare("llama.cpp f32 vs f16 cache", lf32, lf16),
    }
    if args.exact_check:
        exact = ensure_gguf(path.parent / path.name.removesuffix("-q8_0.gguf"), "f32")
        ref = llama_logits(exact, "f32", False, tokens, args.threads)
        f32 = mlaserve_llm(exact, args.threads)
        out["f32 file: mlaserve vs llama.cpp"] = compare(
            "F32 file: mlaserve vs llama.cpp", mlaserve_logits(f32, tokens), ref
        )
        out["f32 file"] = os.path.relpath(exact, BENCH_DIR.parent)
        del f32
        gc.collect()
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["standard", "dsa"], default="standard")
    p.add_argument("--contexts", type=int, nargs="*", default=[16384, 32768])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    p.add_argument("--llama-caches", nargs="*", default=["q8_0", "f16"], choices=["q8_0", "f16"])
    p.add_argument(
        "--caches",
        nargs="*",
        default=["auto", "int8", "fp8_e4m3"],
        choices=["auto", "int8", "fp8_e4m3", "float16", "bfloat16"],  # float16: llama.cpp's F16 cache, like for like
    )
    p.add_argument("--threads", type=int, default=1, help="threads for both engines (1: steadier on a loaded machine)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of alternating engines")
    p.add_argument("--steps", type=int, default=2, help="timed decode steps per engine per round")
    p.add_argument("--prefill", type=int, default=512, help="llama.cpp's real prefill (P), repeated to N cells")
    p.add_argument("--check-tokens", type=int, default=16, help="the logits check's prompt (0: no check)")
    p.add_argument("--exact-check", action="store_true", help="also check on an F32 file of the same weights")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/long_context_llamacpp-<model>)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    path = model_file(args.model)
    env = environment(args.threads)
    env["loadavg_samples"] = [[time.strftime("%H:%M:%S"), *os.getloadavg()]]
    print(f"[file] {path.name}, {path.stat().st_size / 2**20:.0f} MiB; {env['cpu']}, {' '.join(env['cpu_simd'])}")
    llm = mlaserve_llm(path, args.threads)
    cfg = llm.config
    print(
        f"[mlaserve] kernels {cfg.kernels.impl}, backend {cfg.attention.backend}, RSS {rss_gib():.1f} GiB", flush=True
    )
    check = logits_check(path, llm, args, cfg.model.vocab_size) if args.check_tokens else None
    out = Path(args.out) if args.out else RESULTS_DIR / f"long_context_llamacpp-{args.model}.json"
    rel = os.path.relpath(path, BENCH_DIR.parent)
    args.out = os.path.relpath(out, BENCH_DIR.parent) if out.resolve().is_relative_to(BENCH_DIR.parent) else out.name

    if not args.contexts:  # the logits check alone
        write_json(out, {"env": env, "args": vars(args), "file": rel, "logits_check": check})
        return
    n_seq, per_seq = max(args.batches), max(args.contexts) + args.steps + 8
    lcpp = {c: LlamaCpp(path, c, args.threads, n_seq, per_seq) for c in args.llama_caches}
    prompt = random_prompt(args.prefill, cfg.model.vocab_size, seed=0)
    prefill = {c: e.call("prefill", prompt) for c, e in lcpp.items()}
    for c, r in prefill.items():
        print(
            f"[llama.cpp {c}] prefill {r['tokens']} tokens: {r['seconds']:.1f} s ({r['tokens'] / r['seconds']:.1f} tok/s)"
        )
    tile_check = {c: e.call("tile_check") for c, e in lcpp.items()}
    for c, r in tile_check.items():
        print(f"[llama.cpp {c}] next-token logits, prefill vs the restored state: max |diff| {r['max_abs_diff']:.3g}")
    info = {c: e.call("info") for c, e in lcpp.items()}

    m = cfg.model  # values cached per token: the latent row, and a DSA model's index key, in every layer
    values = m.num_layers * (m.latent_dim + (m.indexer.head_dim if m.indexer is not None else 0))
    results, rows = {}, []
    for n in args.contexts:
        for e in lcpp.values():
            e.call("tile", n)
        for batch in args.batches:
            share = sum(1.0 if kv == "auto" else 0.41 for kv in args.caches)  # an 8-bit pool: ~0.41x float32's
            need = batch * n * values * 4 * share / 2**30
            if need > 0.8 * mem_available_gib():
                print(f"context {n} batch {batch}: ~{need:.1f} GiB of pools won't fit -- skipped")
                continue
            print(f"[run] context {n}, batch {batch}", flush=True)
            for e in lcpp.values():
                if batch > 1:
                    e.call("fork", batch)
            runners = {kv: runner_for(llm, kv, n, batch) for kv in args.caches}
            times = {f"llama.cpp {c}": [] for c in lcpp} | {f"mlaserve {kv}": [] for kv in runners}
            last = {}
            engines = list(times)
            for r in range(args.rounds):
                for name in engines if r % 2 == 0 else engines[::-1]:
                    kind, cache = name.split(" ")
                    if kind == "llama.cpp":
                        times[name] += lcpp[cache].call("decode", batch, args.steps, 1 if r == 0 else 0, n)["step_s"]
                        continue
                    runner, tables = runners[cache]
                    for k in range(args.steps + (1 if r == 0 else 0)):
                        t0 = time.perf_counter()
                        _, last[cache] = runner.execute(decode_chunks(tables, n))
                        if r > 0 or k > 0:
                            times[name].append(time.perf_counter() - t0)
                env["loadavg_samples"].append([time.strftime("%H:%M:%S"), *os.getloadavg()])
            res = {}
            for name, ts in times.items():
                kind, cache = name.split(" ")
                if kind == "llama.cpp":
                    per_token = values * LLAMA_BYTES[cache]
                else:
                    per_token = runners[cache][0].cache.measured_bytes_per_token()
                res[name] = {"step_ms": statistics.median(ts) * 1e3, "all_ms": [t * 1e3 for t in ts]}
                res[name]["cache_bytes_per_token"] = per_token
            for kv in runners:
                if kv != "auto" and "auto" in last:
                    res[f"mlaserve {kv}"]["logits_vs_float32_cache"] = float((last[kv] - last["auto"]).abs().max())
            results[f"{n}/{batch}"] = res
            base = res.get("llama.cpp q8_0", res[engines[0]])["step_ms"]
            for name, v in res.items():
                rows.append(
                    [f"{n:,}", str(batch), name, f"{v['step_ms']:.0f}", f"{batch * 1e3 / v['step_ms']:.2f}",
                     f"{base / v['step_ms']:.2f}x", f"{v['cache_bytes_per_token']:.0f}"]
                )  # fmt: skip
            del runners
            gc.collect()
            steps = "; ".join(f"{k} {v['step_ms']:.0f} ms" for k, v in res.items())
            print(f"  {steps}; load average {os.getloadavg()[0]:.1f}", flush=True)
    for e in lcpp.values():
        e.stop()
    env["loadavg_end"] = list(os.getloadavg())
    print()
    print(f"decode step, {args.model} model, {path.name}, {args.threads} thread(s), median of {args.rounds} rounds x "
          f"{args.steps} steps, engines alternating")  # fmt: skip
    table = print_table(
        ["context", "batch", "engine, cache", "step ms", "tok/s", "speed vs llama.cpp q8_0", "cache bytes/token"], rows
    )
    write_json(
        out,
        {
            "env": env,
            "args": vars(args),
            "file": rel,
            "llama_cpp": info,
            "llama_cpp_prefill": prefill,
            "llama_cpp_tile_check": tile_check,
            "logits_check": check,
            "results": results,
            "table": table,
        },
    )


if __name__ == "__main__":
    main()

"""Time to first token of a repeated prompt after a restart, with the prefix cache on disk, vs the cold prefill.

    python benchmarks/prefix_cache_disk.py [--prompt 8191] [--threads 2] [--quick] [--model-dir PATH]

Engine A (prefix_cache_dir = a fresh temp directory) prefills the prompt cold and samples one token (the cold
time to first token); its pages are written by the background writer (flushed before A is dropped, and
that wait reported, not counted). Engine B, a new engine over the same weights and directory (a restart: its
load time reported apart), answers the same prompt: every full page but the one holding the last token is read
from disk and one chunk is computed (the warm time to first token). The first tokens must agree (greedy), and
B's ledger must count the disk hits. --model-dir runs another (already built) model folder.
Results: a table on stdout and benchmarks/results/prefix_cache_disk[-quick].json.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, ensure_model, environment, print_table, random_prompt, write_json  # noqa: E402

from mlaserve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--prompt", type=int, default=8191
    )  # the standard model's max_position_embeddings is 8192: room for one token
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the 2-layer standard model")
    ap.add_argument("--model-dir", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model_dir or ensure_model("standard", args.quick)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    d = tempfile.mkdtemp(prefix="prefix-cache-")
    opts = dict(prefix_cache_dir=d, num_pages=args.prompt // 16 + 8, threads=args.threads)
    try:
        t0 = time.perf_counter()
        a = LLM(str(folder), **opts)
        load_a = time.perf_counter() - t0
        ids = random_prompt(args.prompt, a.config.model.vocab_size, seed=1)
        t0 = time.perf_counter()
        out_a = a.generate([ids], one)[0]
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        a.runner.disk_tier.flush()
        flush = time.perf_counter() - t0
        files = [f for f in os.listdir(d) if f.endswith(".page")]
        disk_bytes = sum(os.path.getsize(os.path.join(d, f)) for f in files)
        del a
        gc.collect()
        t0 = time.perf_counter()
        b = LLM(str(folder), **opts)
        load_b = time.perf_counter() - t0
        t0 = time.perf_counter()
        out_b = b.generate([ids], one)[0]
        warm = time.perf_counter() - t0
    finally:
        shutil.rmtree(d, ignore_errors=True)
    same = out_a.outputs[0].token_ids == out_b.outputs[0].token_ids
    disk_tokens = out_b.metrics["num_disk_cached_tokens"]
    if not same or disk_tokens == 0:
        raise SystemExit(f"restart check failed: same first token {same}, disk-cached tokens {disk_tokens}")
    rows = [
        ["cold prefill (engine A)", f"{cold:.2f}", "-", f"{load_a:.1f}"],
        ["after restart (engine B)", f"{warm:.3f}", f"{disk_tokens}", f"{load_b:.1f}"],
    ]
    print(f"model {folder.name}, prompt {args.prompt} tokens, {args.threads} threads")
    table = print_table(["", "time to first token s", "tokens from disk", "engine load s"], rows)
    print(
        f"ratio {warm / cold:.3f}; {len(files)} page files, {disk_bytes / 2**20:.0f} MiB; writer drained in {flush:.2f} s"
    )
    write_json(
        RESULTS_DIR / f"prefix_cache_disk{'-quick' if args.quick else ''}.json",
        {
            "model": folder.name,
            "prompt": args.prompt,
            "cold_ttft_s": cold,
            "restart_ttft_s": warm,
            "ratio": warm / cold,
            "disk_cached_tokens": disk_tokens,
            "page_files": len(files),
            "disk_bytes": disk_bytes,
            "writer_drain_s": flush,
            "load_s": [load_a, load_b],
            "same_first_token": same,
            "table": table,
            "environment": environment(args.threads),
        },
    )


if __name__ == "__main__":
    main()

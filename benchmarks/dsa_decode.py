"""Batch-1 sparse (DSA) decode on a GGUF: the one-call native decode layers vs the per-op path, alternating.

    python benchmarks/dsa_decode.py [--gguf PATH] [--contexts 3072 8192] [--reps 5] [--threads 2] [--dense]
                                    [--index-scores auto|fp32|bf16] [--fp32-scores]

One engine (the GGUF, kernels native, attention sparse), its cache filled with synthetic rows (as
long_context.py: latent rows and index keys for positions [0, N)), then a single-token decode step at
context N timed through `runner.execute` (forward + logits), the modes taking turns rep by rep so that load
from other processes hits them alike:
  fused          the one-call decode layers (indexer, top-k and MQA over the selected rows inside the call)
  per_op         every layer per op (model.native_decode off): the native backend's sparse MQA in C
  per_op_torch   per op with the sparse MQA of the torch backend (the per-op path before the fused sparse
                 layer: NativeBackend.sparse_absorbed was the torch backend's)
  dense          (--dense) the same file forced dense (`attention="dense"`: no indexer, the absorbed MQA over all
                 N rows), a second engine whose cache holds the same latent rows; its one-call decode layers.
                 Issue #31's target: at 16K, sparse (fused) >= 1.5x faster than this.
  fused_fp32     (--fp32-scores) the one-call layers of a third engine with index_scores="fp32" (the reference's
                 scores), its cache filled alike: beside `fused` when that one scores in bf16 (--index-scores; auto
                 is bf16 for a GGUF on a CPU with AVX512-BF16 or AMX-BF16, config/index_scores.py)
Contexts past index_topk (2048 on the benchmark model) select; the step's ledger would say decode_layer native
for `fused`. Default GGUF: benchmarks/models/mla-dsa-l12-seed0-q8_0.gguf (offline.py writes it).
Results: a table on stdout and benchmarks/results/dsa_decode.json (every timing, CPU flags, load average).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fill_mlaserve_cache, run_end, run_start  # noqa: E402

PAGE_SIZE = 16
DEFAULT = Path(__file__).resolve().parent / "models" / "mla-dsa-l12-seed0-q8_0.gguf"
MODES = ("fused", "per_op", "per_op_torch")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=DEFAULT)
    p.add_argument("--contexts", type=int, nargs="*", default=[3072, 8192])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dense", action="store_true", help="also the same file forced dense (a second engine)")
    p.add_argument("--index-scores", default="auto", help="the sparse engine's index_scores (auto, fp32, bf16)")
    p.add_argument("--fp32-scores", action="store_true", help="also a sparse engine with index_scores='fp32'")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from mlaserve import LLM
    from mlaserve.attention.backends.native_backend import NativeBackend
    from mlaserve.attention.backends.torch_backend import TorchBackend
    from mlaserve.executor.forward_batch import SeqChunk

    n_max = max(args.contexts)
    pages_needed = math.ceil((n_max + 1) / PAGE_SIZE)

    def engine(attention: str, index_scores: str = "auto"):
        e = LLM(
            model=str(args.gguf), kernels="native", attention=attention, page_size=PAGE_SIZE, max_num_seqs=1,
            num_pages=pages_needed + 1, threads=args.threads, malloc_tuning=True, index_scores=index_scores,
        )  # fmt: skip
        assert e.runner.model.native_decode is not None, e.loaded.report.notes
        held = e.engine.pool.allocate(pages_needed)
        fill_mlaserve_cache(e, held, n_max, seed=1)  # the same seed: the same latent rows in both engines
        return e, held

    llm, pages = engine("sparse", args.index_scores)
    dense, dense_pages = engine("dense") if args.dense else (None, None)
    exact, exact_pages = engine("sparse", "fp32") if args.fp32_scores else (None, None)
    modes = MODES + (("dense",) if args.dense else ()) + (("fused_fp32",) if args.fp32_scores else ())
    model = llm.runner.model
    fused, native_sparse = model.native_decode, NativeBackend.sparse_absorbed
    topk = llm.config.attention.index_topk

    def use(mode: str) -> None:
        model.native_decode = fused if mode == "fused" else None
        NativeBackend.sparse_absorbed = staticmethod(
            TorchBackend.sparse_absorbed if mode == "per_op_torch" else native_sparse
        )

    res: dict = {"gguf": str(args.gguf), "threads": args.threads, "index_topk": topk, "contexts": {}}
    res["index_scores"] = llm.config.attention.index_scores
    res |= run_start()

    def step(mode: str, n: int) -> float:
        """One decode step at context n; returns its seconds."""
        e, held = {"dense": (dense, dense_pages), "fused_fp32": (exact, exact_pages)}.get(mode, (llm, pages))
        if mode in MODES:
            use(mode)
        chunk = [SeqChunk("dsa", (5,), n, tuple(held[: math.ceil((n + 1) / PAGE_SIZE)]))]
        t0 = time.perf_counter()
        e.runner.execute(chunk)
        return time.perf_counter() - t0

    for n in args.contexts:
        ts: dict = {m: [] for m in modes}
        for m in modes:  # warm-up, one step each
            step(m, n)
        for _ in range(args.reps):
            for m in modes:
                ts[m].append(step(m, n))
        row = {m: {"median_ms": statistics.median(v) * 1e3, "all_ms": [t * 1e3 for t in v]} for m, v in ts.items()}
        res["contexts"][n] = row
        cells = ", ".join(
            f"{m} {r['median_ms']:.1f} ms ({1e3 / r['median_ms']:.2f} tok/s; {min(r['all_ms']):.1f}-{max(r['all_ms']):.1f})"
            for m, r in row.items()
        )
        if args.dense:
            cells += f"; dense / fused {row['dense']['median_ms'] / row['fused']['median_ms']:.2f}x"
        if args.dense and args.fp32_scores:
            cells += f", dense / fused_fp32 {row['dense']['median_ms'] / row['fused_fp32']['median_ms']:.2f}x"
        print(f"context {n} (selects: {n + 1 > topk}, index_scores {res['index_scores']}): {cells}", flush=True)
    use("fused")
    run_end(res, "dsa_decode", args.threads)


if __name__ == "__main__":
    main()

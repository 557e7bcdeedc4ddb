"""The DSA indexer's bf16 scores against the file's own rounding: how far each moves the kept positions.

    python benchmarks/index_scores.py [--gguf PATH] [--tokens 1024] [--topk 128] [--threads 2]

One prompt (random ids) prefilled in one step through three engines on the DSA benchmark model, index_topk lowered
to --topk so that most of the prompt's queries select:
  float  the float checkpoint (benchmarks/models/mla-dsa-l12-seed0), fp32 scores: the reference
  file   a GGUF of it (default mla-dsa-l12-seed0-q8_0.gguf, the same weights in blocks; --gguf another, e.g. a
         Q4_K_M that llama.cpp's llama-quantize --allow-requantize made from it), fp32 scores
  bf16   the same GGUF with index_scores="bf16" (q and keys rounded to bf16, fp32 sums)
Every indexer layer's kept positions per selecting query are recorded (Indexer.select) and the overlaps reported:
file vs float (the file's own rounding: its weights' error carried through the layers into the indexer's q and
keys) and bf16 vs file (what bf16 scores add on top). config/index_scores.py's auto takes bf16 for GGUF files on
a rule of this measure (the file's own moves against bf16's).
Results: benchmarks/results/index_scores.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS_DIR, RESULTS_DIR, environment, random_prompt, write_json  # noqa: E402

FLOAT = MODELS_DIR / "mla-dsa-l12-seed0"
GGUF = MODELS_DIR / "mla-dsa-l12-seed0-q8_0.gguf"


def kept_sets(path: Path, ids: list[int], topk: int, threads: int, index_scores: str) -> list[torch.Tensor]:
    """Per indexer call of the prompt's step: the kept positions of its selecting queries, [V, L] bool."""
    from mlaserve import LLM
    from mlaserve.models.indexer import Indexer
    from mlaserve.sampling.params import SamplingParams

    llm = LLM(
        str(path), attention="sparse", index_topk=topk, index_scores=index_scores, threads=threads,
        max_num_batched_tokens=max(2048, len(ids)), enable_prefix_caching=False,
    )  # fmt: skip
    seen: list[torch.Tensor] = []
    real = Indexer.select

    def select(self, q, w, keys, seg, k, backend):
        sel = real(self, q, w, keys, seg, k, backend)
        kept = torch.zeros_like(seg.mask).scatter_(2, sel.index, sel.valid)
        selecting = seg.q_valid & (seg.mask.sum(-1) > k)
        seen.append(kept[selecting])
        return sel

    Indexer.select = select
    try:
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        Indexer.select = real
    return seen


def overlap(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """Per selecting query of every call: |kept_a & kept_b| / |kept_a|."""
    assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b))
    return torch.cat([(x & y).sum(-1).float() / x.sum(-1).clamp(min=1) for x, y in zip(a, b)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=GGUF)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--topk", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ids = random_prompt(args.tokens, 32768, seed=3)
    runs = {
        "float": kept_sets(FLOAT, ids, args.topk, args.threads, "fp32"),
        "file": kept_sets(args.gguf, ids, args.topk, args.threads, "fp32"),
        "bf16": kept_sets(args.gguf, ids, args.topk, args.threads, "bf16"),
    }
    res: dict = {"gguf": args.gguf.name, "tokens": args.tokens, "topk": args.topk, "threads": args.threads, "pairs": {}}
    for name, (a, b) in {"file vs float": ("float", "file"), "bf16 vs file": ("file", "bf16")}.items():
        ov = overlap(runs[a], runs[b])
        moved = 1.0 - ov
        res["pairs"][name] = {
            "queries": len(ov),
            "mean_overlap": ov.mean().item(),
            "lowest_overlap": ov.min().item(),
            "mean_moved": moved.mean().item(),
            "queries_unchanged": (ov == 1.0).float().mean().item(),
        }
        r = res["pairs"][name]
        print(
            f"{name}: kept positions moved {r['mean_moved']:.3%} on average (lowest overlap {r['lowest_overlap']:.1%}; "
            f"{r['queries_unchanged']:.1%} of {r['queries']} selecting queries unchanged)"
        )
    res["environment"] = environment(args.threads)
    write_json(RESULTS_DIR / "index_scores.json", res)


if __name__ == "__main__":
    main()

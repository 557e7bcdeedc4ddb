"""A long prompt's prefill on a DSA GGUF, sparse: the whole prefill and its two DSA parts.

    python benchmarks/dsa_prefill.py [--gguf PATH] [--tokens 4096] [--index-scores auto fp32] [--reps 2]
                                     [--threads 2]

One engine per index_scores value (kernels native, attention sparse, no prefix caching), a prompt of random ids
prefilled by `generate(max_tokens=1)`, the engines taking turns rep by rep. Besides the whole prefill, the seconds
spent in the native backend's two DSA calls of the prompt's steps, timed around them: `index_topk` (the indexer's
scores and top-k of every query past index_topk) and `sparse_absorbed` (the MQA of each query over its selected
rows). A prompt's first index_topk tokens attend every row (the absorbed path, no selection). Default GGUF:
benchmarks/models/mla-dsa-l12-seed0-q8_0.gguf (offline.py writes it).
Results: a line per engine and benchmarks/results/dsa_prefill.json (every timing, CPU flags, load average).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS_DIR, random_prompt, run_end, run_start  # noqa: E402

DEFAULT = MODELS_DIR / "mla-dsa-l12-seed0-q8_0.gguf"


class Timed:
    """Seconds spent in a static method of a class while installed (the method restored on exit)."""

    def __init__(self, cls, name: str) -> None:
        self.cls, self.name, self.real, self.seconds = cls, name, getattr(cls, name), 0.0

    def __enter__(self) -> Timed:
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return self.real(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t

        setattr(self.cls, self.name, staticmethod(timed))
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.cls, self.name, staticmethod(self.real))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=DEFAULT)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--index-scores", nargs="+", default=["auto"], help="one engine per value (auto, fp32, bf16)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from mlaserve import LLM
    from mlaserve.attention.backends.native_backend import NativeBackend
    from mlaserve.sampling.params import SamplingParams

    ids = random_prompt(args.tokens, 32768, seed=5)
    engines = {}
    for scores in args.index_scores:
        llm = LLM(
            str(args.gguf), kernels="native", attention="sparse", index_scores=scores, threads=args.threads,
            enable_prefix_caching=False, num_pages=args.tokens // 16 + 64,
        )  # fmt: skip
        llm.generate([ids[:64]], SamplingParams(max_tokens=1))  # warm-up
        engines[f"{scores} ({llm.config.attention.index_scores})"] = llm
    res: dict = {"gguf": args.gguf.name, "tokens": args.tokens, "threads": args.threads, "engines": {}}
    res |= run_start()
    runs: dict = {name: [] for name in engines}
    for _ in range(args.reps):
        for name, llm in engines.items():
            with Timed(NativeBackend, "index_topk") as ix, Timed(NativeBackend, "sparse_absorbed") as mqa:
                t = time.perf_counter()
                llm.generate([ids], SamplingParams(max_tokens=1))
                total = time.perf_counter() - t
            runs[name].append({"seconds": total, "index_topk_s": ix.seconds, "sparse_absorbed_s": mqa.seconds})
    for name, rs in runs.items():
        med = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        res["engines"][name] = {"median": med, "runs": rs}
        each = ", ".join(f"{r['seconds']:.1f}" for r in rs)
        print(
            f"index_scores {name}: prefill {args.tokens} tokens {med['seconds']:.2f} s "
            f"({args.tokens / med['seconds']:.0f} tok/s; runs {each}), "
            f"index_topk {med['index_topk_s']:.2f} s, sparse_absorbed {med['sparse_absorbed_s']:.2f} s",
            flush=True,
        )
    run_end(res, "dsa_prefill", args.threads)


if __name__ == "__main__":
    main()

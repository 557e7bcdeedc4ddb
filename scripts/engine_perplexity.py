#!/usr/bin/env python3
"""Held-out perplexity of the embedded model computed by mlaserve's engine (paged cache, routed
attention), on exactly the windows `eval_embedded_model.py` gives transformers.

    python scripts/engine_perplexity.py [--attention auto|dense] [--corpus /usr/lib/bible.data]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_embedded_model as ev  # noqa: E402
import tiny_dsa  # noqa: E402

from mlaserve import LLM  # noqa: E402
from mlaserve.embedded import EMBEDDED  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", default="auto", choices=["auto", "dense"])
    ap.add_argument("--corpus", nargs="+", default=["/usr/lib/bible.data"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from tokenizers import Tokenizer

    _, held_docs = tiny_dsa.load_corpus(args.corpus)
    held_ids = tiny_dsa.encode_docs(Tokenizer.from_file(str(EMBEDDED / "tokenizer.json")), held_docs)
    wins = ev.windows(held_ids, tiny_dsa.CONTEXT)
    llm = LLM(str(EMBEDDED), attention=args.attention)
    total, count = 0.0, 0
    for w in wins:
        ids = w.tolist()
        logits = llm.prompt_logits(ids)
        total += F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    print(
        f"engine held-out perplexity ({args.attention}, {len(wins)} windows of {tiny_dsa.CONTEXT}): "
        f"{math.exp(total / count):.4f}"
    )


if __name__ == "__main__":
    main()

"""One node of the two-namespace tensor-parallel test, started by torchrun inside a network
namespace: rank 0 writes the TP=2 prompt logits of the ids to OUT; rank 1 serves its steps.

    python tests/distributed/tp_node.py MODEL_DIR OUT IDS(comma-separated)
"""

from __future__ import annotations

import sys

import torch

from mlaserve import LLM
from mlaserve.config.engine import make_options
from mlaserve.distributed.launch import serve_torchrun_rank, torchrun_rank

OPTIONS = dict(tensor_parallel_size=2, page_size=8, max_num_batched_tokens=24)

if __name__ == "__main__":
    path, out, ids = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
    torch.set_num_threads(1)
    if torchrun_rank():
        serve_torchrun_rank(path, make_options(**OPTIONS))
    else:
        with LLM(path, **OPTIONS) as llm:
            torch.save(llm.prompt_logits(ids), out)

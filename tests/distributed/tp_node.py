"""One node of the two-namespace tests, started by torchrun inside a network namespace: rank 0 writes the
prompt logits of the ids to OUT; rank 1 serves its steps. OPTIONS (JSON, optional) replace the engine options
(default: TP=2; the expert-parallel test passes expert_parallel_size=2).

    python tests/distributed/tp_node.py MODEL OUT IDS(comma-separated) [OPTIONS]
"""

from __future__ import annotations

import json
import sys

import torch

from mlaserve import LLM
from mlaserve.config.engine import make_options
from mlaserve.distributed.launch import serve_torchrun_rank, torchrun_rank

OPTIONS = dict(tensor_parallel_size=2, page_size=8, max_num_batched_tokens=24)

if __name__ == "__main__":
    path, out, ids = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else OPTIONS
    torch.set_num_threads(1)
    if torchrun_rank():
        serve_torchrun_rank(path, make_options(**options))
    else:
        with LLM(path, **options) as llm:
            torch.save(llm.prompt_logits(ids), out)

"""One node of the two-namespace tests, started by torchrun inside a network namespace: rank 0 writes the
prompt logits of the ids to OUT; rank 1 serves its steps. OPTIONS (JSON, optional) replace the engine options
(default: TP=2; the expert-parallel test passes expert_parallel_size=2). Each rank prints DONE and its rank when
its work is done; the test also requires every rank's exit code 0 (network_namespaces.run_two_nodes).

    python tests/distributed/tp_node.py MODEL OUT IDS(comma-separated) [OPTIONS]
"""

from __future__ import annotations

import json
import sys

import torch

from mlaserve import LLM
from mlaserve.config.engine import make_options
from mlaserve.distributed.launch import serve_torchrun_rank, torchrun_rank

DONE = "tp_node: rank done"  # printed by each rank once its work is done, before the interpreter exits
OPTIONS = dict(tensor_parallel_size=2, page_size=8, max_num_batched_tokens=24)

if __name__ == "__main__":
    path, out, ids = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else OPTIONS
    torch.set_num_threads(1)
    rank = torchrun_rank()
    if rank:
        serve_torchrun_rank(path, make_options(**options))
    else:
        with LLM(path, **options) as llm:
            torch.save(llm.prompt_logits(ids), out)
    # its work is done: the test then requires exit code 0 (a teardown that aborts fails it, DONE or not)
    print(f"{DONE} {rank}", flush=True)

"""The ledger's communication counts on plain data (no process group): a draft message's catch-up rows
(CommStats.add_rows: rows x hidden x element size, per dtype) and an expert_load record's layout (rank 0's
pairs first, then each worker's, labelled by pass). The spawned checks are in tests/distributed
(test_tp_speculative.py, test_ep_speculative.py, test_ep_deepseek_v4.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mlaserve.distributed.collectives import CommStats
from mlaserve.distributed.group import expert_load, rows_read
from mlaserve.executor.forward_batch import SeqChunk


@pytest.mark.parametrize("dtype, size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_catch_up_bytes_are_rows_x_hidden_x_dtype_size(dtype, size):
    hidden = torch.arange(40 * 24, dtype=torch.float32).reshape(40, 24).to(dtype)
    chunks = [
        SeqChunk("a", (1, 2, 3), 5, (0,)),
        SeqChunk("b", (4,), 9, (1,)),
    ]
    packed, first = rows_read(chunks, hidden, {"a": 10, "b": 30})
    assert first == {"a": 0, "b": 3} and torch.equal(packed, hidden[[10, 11, 12, 30]])
    stats = CommStats(all_reduces=2, all_reduce_bytes=64)
    before = replace(stats)
    stats.add_rows(packed)
    step = stats.since(before)
    assert (step["catch_up_rows"], step["catch_up_bytes"]) == (4, 4 * 24 * size)
    assert (step["all_reduces"], step["all_reduce_bytes"]) == (0, 0)  # only what happened since


def test_expert_load_lists_rank_0_then_the_workers():
    mine = {"pairs": 3, "tokens": 2, "identity": 0}
    recs = [{"rank": 1, "experts_received": {"pairs": 5, "tokens": 4, "identity": 0}}]
    assert expert_load(7, mine, recs, "mtp") == {
        "step": 7,
        "pass": "mtp",
        "expert_load": [{"rank": 0, **mine}, {"rank": 1, "pairs": 5, "tokens": 4, "identity": 0}],
    }


def test_a_ledger_with_expert_parallel_records_summarizes(tmp_path):
    """`trace summarize` (and `generate --trace`'s closing table) read an expert-parallel ledger: its expert_holdings
    and expert_load records are read, and are not steps."""
    import json

    from mlaserve.observability.summary import read_ledger, summarize

    step = {"step": 0, "rank": 0, "segments": [], "requests": [], "sparse": False, "num_decode_tokens": 0}
    records = [
        {"expert_holdings": [{"rank": 0, "routed_experts": [], "file_bytes_read": 1, "peak_rss_bytes": 1}]},
        step,
        {**step, "rank": 1},
        expert_load(0, {"pairs": 3, "tokens": 2, "identity": 0}, [{"rank": 1, "experts_received": {}}], "trunk"),
    ]
    path = tmp_path / "ledger.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    by_rank = summarize(read_ledger(path))
    # no rank-less block of 0 steps for the expert records: they are the expert-load summary's
    assert {rank: s.steps for rank, s in by_rank.items()} == {0: 1, 1: 1}

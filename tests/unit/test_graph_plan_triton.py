"""The graph plan of a decode step on the triton attention backend: replayed, with the latent MQA's split of the
key axis taken from the graph's padded key axis (context_pages * page_size), not from the step's real length, and
recorded in the ledger's graph field (plain data, decided before the step)."""

from __future__ import annotations

from dataclasses import replace

from test_graph_plan import ON, _decode, _plan

from mlaserve.attention.backends.triton_kernels.key_split import split_plan


def test_triton_decode_is_replayed_with_the_padded_split():
    # longest sequence 1,501 keys: 376 pages -> context bucket 512 pages, 2,048 keys
    settings = replace(ON, num_pages=1024)
    plan = _plan([_decode(i, ctx=1500 - 700 * i) for i in range(2)], settings, backend="triton")
    assert plan.replay and (plan.bucket, plan.context_pages, plan.real_rows) == (2, 512, 2)
    assert split_plan(2048).splits == 4 and split_plan(1501).splits == 3  # the padded axis' split, not the real one
    assert plan.key_splits == 4
    assert plan.to_record() == {"replayed": True, "bucket": 2, "context_pages": 512, "rows": 2, "key_splits": 4}


def test_torch_decode_records_no_split():
    plan = _plan([_decode(0)])
    assert plan.replay and plan.key_splits is None and "key_splits" not in plan.to_record()

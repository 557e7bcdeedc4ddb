"""The pooled DSA route as plain data (attention/router.py route with kpool, pooled_rows, pooled_sums;
attention/pooled_metadata.py): counts against a query-by-query loop, when a step selects, which pools it completes
and where their rows go, and the masked-MHA form of a pooled selection (its unused entries parked at position 0).
Exact integer and boolean identities: no tolerance.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.attention.pooled_metadata import build_pooled_tensors
from mlaserve.attention.router import pooled_sums, route
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.models.indexer import Selection


@pytest.mark.parametrize("kpool", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("k", [0, 1, 3, 8])
def test_closed_form_sums_equal_the_loop(kpool, k):
    for n in range(0, 5 * kpool * (k + 2)):
        scored = sum((t + 1) // kpool for t in range(n))
        selected = sum(min(k, (t + 1) // kpool) for t in range(n))
        tail = sum((t + 1) % kpool for t in range(n))
        assert pooled_sums(n, kpool, k) == (scored, selected, tail), (n, kpool, k)


def _batch(*chunks: tuple[str, int, int, tuple[int, ...]], page: int = 8) -> ForwardBatch:
    seqs = [SeqChunk(rid, tuple(range(3, 3 + q)), ctx, table) for rid, q, ctx, table in chunks]
    return ForwardBatch.build(seqs, page, 1, "cpu", pad_slot=16 * page)


def test_the_plan_counts_and_selects_exactly_when_a_query_drops_a_pool():
    """index_topk 8, kpool 4: a query keeps 2 pools; the step selects once some query has 3 complete pools
    (a sequence of 12 tokens), not at 9 .. 11 (2 pools + a tail: every token)."""
    for longest, select in ((8, False), (11, False), (12, True), (40, True)):
        batch = _batch(("a", 1, longest - 1, tuple(range(8))), ("b", 5, 0, (9,)))
        plan = route(batch, "auto", True, 8, kind="mla_dsa", layers=(3, 7), kpool=4, sharing=(7,))
        assert plan.needs_selection == select, longest
        assert plan.effective_topk == min(2, longest // 4) * 4
        rec = plan.pooled.to_record()
        a, b = rec["requests"]
        assert (a["pools_scored"], a["pools_selected"], a["tail"]) == (longest // 4, min(2, longest // 4), longest % 4)
        assert (b["pools_scored"], b["pools_selected"], b["tail"]) == (1, 1, 1)
        assert rec["pools_scored"] == longest // 4 + sum((t + 1) // 4 for t in range(5))
        assert rec["new_pools"] == (longest // 4 - (longest - 1) // 4) + 1
        assert (rec["selecting_layers"], rec["sharing_layers"]) == ("3", "7")
        impl = {s.implementation for s in plan.segments}
        assert impl == (
            {"torch:pooled_sparse_absorbed"}
            if select
            else {"torch:pooled_sparse_absorbed(every pool within index_topk)"}
        )
        assert {s.index_scoring for s in plan.segments} == ({"fp32"} if select else {None})
    dense = route(batch, "auto", False, None, kind="mla_dsa", kpool=4)
    assert dense.pooled is None and not dense.needs_selection


def test_completed_pools_and_their_rows_from_scattered_pages():
    """A chunk of tokens 5 .. 13 of a sequence in pages (6, 2) of 8 tokens, kpool 4: it completes pools 1 (tokens
    4 .. 7, the first of them cached by an earlier chunk) and 2 (8 .. 11); the tokens' slots follow the block table
    and each pool's row is page * 2 + its place in the page; the selecting segment's pool table pads with the pad
    row after the pages."""
    batch = _batch(("a", 9, 5, (6, 2)), ("b", 12, 0, (4, 5)))
    plan = route(batch, "auto", True, 4, kind="mla_dsa", layers=(0,), kpool=4)
    assert plan.needs_selection
    t = build_pooled_tensors(batch, plan)
    a_tokens = [6 * 8 + i for i in range(4, 8)] + [2 * 8 + i for i in range(0, 4)]
    b_tokens = [4 * 8 + i for i in range(8)] + [5 * 8 + i for i in range(4)]
    assert t.new_tokens.tolist() == a_tokens + b_tokens
    assert t.new_rows.tolist() == [6 * 2 + 1, 2 * 2 + 0, 4 * 2, 4 * 2 + 1, 5 * 2]
    (seg,) = t.segments  # both are prefills: one segment
    pad = 16 * 8 // 4
    assert seg.pool_rows.tolist() == [[6 * 2, 6 * 2 + 1, 2 * 2], [4 * 2, 4 * 2 + 1, 5 * 2]]
    assert seg.positions.tolist() == [[*range(5, 14), 0, 0, 0], list(range(12))]
    batch = _batch(("a", 1, 3, (6,)), ("b", 6, 0, (4,)))
    plan = route(batch, "auto", True, 4, kind="mla_dsa", layers=(0,), kpool=4)
    assert not plan.needs_selection and build_pooled_tensors(batch, plan).segments == ()
    batch = _batch(("a", 1, 8, (6, 2)), ("b", 2, 0, (4,)))
    plan = route(batch, "auto", True, 4, kind="mla_dsa", layers=(0,), kpool=4)
    dec, pre = build_pooled_tensors(batch, plan).segments
    assert dec.pool_rows.tolist() == [[6 * 2, 6 * 2 + 1]] and pre.pool_rows.tolist() == [[pad]]


def test_a_parked_entry_does_not_hide_a_selected_position_zero():
    """as_mask (the masked-MHA form): an unused entry parked at position 0 beside a valid one naming position 0
    leaves 0 selected, whatever order a scatter writes them in."""
    index = torch.tensor([[[0, 0, 0, 2, 0]]])
    valid = torch.tensor([[[False, True, False, True, False]]])
    assert Selection(index, valid).as_mask(4).tolist() == [[[True, False, True, False]]]
    assert Selection(index, torch.zeros_like(valid)).as_mask(4).tolist() == [[[False] * 4]]


def test_the_pool_tables_equal_pool_rows_per_sequence():
    """The selecting segment's [B, N] table (one tensor op over the block tables) == pool_rows (the plain
    reference) per sequence, scattered pages, kpool 2 and 4, pages of 4 and 8 tokens."""
    from mlaserve.attention.pooled_metadata import pool_rows

    g = torch.Generator().manual_seed(0)
    for kpool, page in ((2, 4), (4, 8), (4, 4), (2, 8)):
        lens = [(1, 37), (6, 0), (1, 12), (9, 20)]
        chunks = [
            (f"r{i}", q, c, tuple(torch.randperm(16, generator=g)[: -(-(q + c) // page)].tolist()))
            for i, (q, c) in enumerate(lens)
        ]
        batch = _batch(*chunks, page=page)
        plan = route(batch, "auto", True, kpool, kind="mla_dsa", layers=(0,), kpool=kpool)
        tables = build_pooled_tensors(batch, plan).segments
        for seg, tensors in zip(plan.segments, tables):
            for i, s in enumerate(batch.seqs[seg.seq_start : seg.seq_end]):
                n = s.seq_len // kpool
                row = tensors.pool_rows[i].tolist()
                assert row[:n] == pool_rows(s.block_table, range(n), page, kpool)
                assert set(row[n:]) <= {16 * page // kpool}

"""build_segment_tensors on its own: q_index, q_valid, kv_slots, mask and seq_lens of a segment with
mixed query and context lengths over scattered pages, checked against values written out by hand
(or by a per-element loop over the definition, independent of the vectorised build)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.attention.metadata import build_segment_tensors
from mlaserve.attention.router import route
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk

PS = 2

# decodes (query 1): context 4 over pages 6, 1, 3 (third page half full); a one-token prompt on page 0
D1 = SeqChunk("d1", (1,), 4, (6, 1, 3))
D2 = SeqChunk("d2", (2,), 0, (0,))
# prefills: a 3-token chunk after 2 cached tokens (pages 5, 2, 4); a 2-token prompt (page 7)
P1 = SeqChunk("p1", (3, 4, 5), 2, (5, 2, 4))
P2 = SeqChunk("p2", (6, 7), 0, (7,))


def _segments(*chunks, threshold=1):
    batch = ForwardBatch.build(list(chunks), PS, threshold)
    plan = route(batch, "auto")
    return batch, [build_segment_tensors(batch, s) for s in plan.segments]


def test_decode_segment_by_hand():
    _, (dec, _) = _segments(P1, D1, P2, D2)
    assert dec.segment.phase == "decode"
    assert dec.q_index.tolist() == [[0], [1]]
    assert dec.q_valid.tolist() == [[True], [True]]
    assert dec.seq_lens.tolist() == [5, 1]
    # d1: positions 0-4 on pages 6, 6, 1, 1, 3; d2: position 0 on page 0, padding -> slot 0
    assert dec.kv_slots.tolist() == [[12, 13, 2, 3, 6], [0, 0, 0, 0, 0]]
    assert dec.mask.tolist() == [[[True] * 5], [[True, False, False, False, False]]]


def test_prefill_segment_by_hand():
    _, (_, pre) = _segments(P1, D1, P2, D2)
    assert pre.segment.phase == "prefill"
    # p1's 3 queries are flat rows 2-4, p2's 2 queries rows 5-6; padding points at row 0
    assert pre.q_index.tolist() == [[2, 3, 4], [5, 6, 0]]
    assert pre.q_valid.tolist() == [[True, True, True], [True, True, False]]
    assert pre.out_index.tolist() == [2, 3, 4, 5, 6]
    assert pre.seq_lens.tolist() == [5, 2]
    assert pre.kv_slots.tolist() == [[10, 11, 4, 5, 8], [14, 15, 0, 0, 0]]
    T, F = True, False
    assert pre.mask.tolist() == [
        # p1 queries at positions 2, 3, 4: causal over its 5 keys
        [[T, T, T, F, F], [T, T, T, T, F], [T, T, T, T, T]],
        # p2 queries at 0, 1; the padding query sits at position 0 so its softmax stays finite
        [[T, F, F, F, F], [T, T, F, F, F], [T, F, F, F, F]],
    ]


def _expected(batch, seg):
    """The definitions of the notation block, one element at a time."""
    seqs = batch.seqs[seg.seq_start : seg.seq_end]
    q_max, l_max = max(s.query_len for s in seqs), max(s.seq_len for s in seqs)
    q_index = [[s.query_start + j if j < s.query_len else 0 for j in range(q_max)] for s in seqs]
    q_valid = [[j < s.query_len for j in range(q_max)] for s in seqs]
    kv = [[s.block_table[p // PS] * PS + p % PS if p < s.seq_len else 0 for p in range(l_max)] for s in seqs]
    mask = [
        [
            [p <= (s.context_len + j if j < s.query_len else 0) and p < s.seq_len for p in range(l_max)]
            for j in range(q_max)
        ]
        for s in seqs
    ]
    return q_index, q_valid, kv, mask, [s.seq_len for s in seqs]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("threshold", [1, 4])
def test_random_mixed_segments_match_the_definition(seed, threshold):
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(64, generator=g).tolist()  # scattered, never reused
    chunks = []
    for i in range(int(torch.randint(1, 6, (1,), generator=g))):
        ctx, q = int(torch.randint(0, 9, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        n_pages = -(-(ctx + q) // PS)
        table, pages = tuple(pages[:n_pages]), pages[n_pages:]
        chunks.append(SeqChunk(f"r{i}", tuple(range(q)), ctx, table))
    batch, segs = _segments(*chunks, threshold=threshold)
    assert sum(int(t.q_valid.sum()) for t in segs) == batch.num_tokens
    for t in segs:
        q_index, q_valid, kv, mask, lens = _expected(batch, t.segment)
        assert t.q_index.tolist() == q_index and t.q_valid.tolist() == q_valid
        assert t.kv_slots.tolist() == kv and t.mask.tolist() == mask and t.seq_lens.tolist() == lens
        assert t.q_index.dtype == t.kv_slots.dtype == torch.long and t.mask.dtype == torch.bool


def test_every_new_token_row_is_the_slot_it_was_written_to():
    """The cache row a query's own key is read from equals the slot ForwardBatch writes it to."""
    batch, segs = _segments(P1, D1, P2, D2)
    for t in segs:
        for b, s in enumerate(batch.seqs[t.segment.seq_start : t.segment.seq_end]):
            for j in range(s.query_len):
                row = s.query_start + j
                assert int(t.kv_slots[b, s.context_len + j]) == int(batch.slot_mapping[row])
                assert int(t.q_index[b, j]) == row


def test_tensors_live_on_the_batch_device():
    batch, segs = _segments(P1, D1)
    assert all(x.device == batch.input_ids.device for t in segs for x in (t.q_index, t.kv_slots, t.mask))

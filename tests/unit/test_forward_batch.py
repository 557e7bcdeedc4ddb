"""ForwardBatch.build on its own: tokens ordered [decodes | prefills], positions, the cache slot of
every new token over scattered pages, logits rows (last, all, none) and query_start."""

from __future__ import annotations

import pytest

from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk

PS = 4

# prefill chunk: 3 new tokens after 2 cached ones, pages 7 then 2
P1 = SeqChunk("p1", (11, 12, 13), 2, (7, 2))
# decode: 1 token at position 5, pages 3 then 9
D1 = SeqChunk("d1", (21,), 5, (3, 9))
# one-token prompt: a decode by the default threshold
D2 = SeqChunk("d2", (31,), 0, (5,))
# prompt chunk that does not end the prompt: no logits
P2 = SeqChunk("p2", (41, 42, 43, 44, 45), 0, (0, 6), needs_logits=False)
# prompt_logits: every position
P3 = SeqChunk("p3", (51, 52), 3, (1, 4), all_logits=True)


def _l(t) -> list:
    return t.tolist()


def test_decodes_first_then_prefills_in_given_order():
    b = ForwardBatch.build([P1, D1, P2, D2, P3], PS, decode_threshold=1)
    assert [s.request_id for s in b.seqs] == ["d1", "d2", "p1", "p2", "p3"]
    assert b.num_decode_seqs == 2 and b.num_decode_tokens == 2 and b.num_tokens == 12
    assert [s.query_start for s in b.seqs] == [0, 1, 2, 5, 10]
    assert _l(b.input_ids) == [21, 31, 11, 12, 13, 41, 42, 43, 44, 45, 51, 52]


def test_positions_continue_each_context():
    b = ForwardBatch.build([P1, D1, P2, D2, P3], PS, 1)
    assert _l(b.positions) == [5, 0, 2, 3, 4, 0, 1, 2, 3, 4, 3, 4]


def test_slot_mapping_follows_each_block_table():
    b = ForwardBatch.build([P1, D1, P2, D2, P3], PS, 1)
    expected = [
        9 * PS + 1,  # d1 position 5: page index 1 -> page 9, offset 1
        5 * PS + 0,  # d2 position 0: page 5
        7 * PS + 2,  # p1 positions 2, 3 on page 7, position 4 on its second page, 2
        7 * PS + 3,
        2 * PS + 0,
        0 * PS + 0,  # p2 positions 0-3 on page 0, position 4 on page 6
        0 * PS + 1,
        0 * PS + 2,
        0 * PS + 3,
        6 * PS + 0,
        1 * PS + 3,  # p3 position 3 on page 1, position 4 on page 4
        4 * PS + 0,
    ]
    assert _l(b.slot_mapping) == expected


def test_slot_mapping_crosses_a_page_boundary_into_a_scattered_page():
    chunk = SeqChunk("x", tuple(range(10)), 0, (8, 1, 5))
    b = ForwardBatch.build([chunk], PS, 1)
    assert _l(b.slot_mapping) == [32, 33, 34, 35, 4, 5, 6, 7, 20, 21]
    assert _l(b.positions) == list(range(10))


@pytest.mark.parametrize(
    "chunks,rows,owner",
    [
        ([P1], [2], [("p1", 2)]),  # last query position only
        ([P2], [], []),  # mid-prompt chunk: none
        ([D1, D2], [0, 1], [("d1", 0), ("d2", 0)]),
        (
            [P3, P1],
            [0, 1, 4],  # every row of p3, then p1's last (prefills keep their order)
            [("p3", 0), ("p3", 1), ("p1", 2)],
        ),
    ],
)
def test_logits_rows(chunks, rows, owner):
    b = ForwardBatch.build(chunks, PS, 1)
    by_start = {s.request_id: s.query_start for s in b.seqs}
    got = list(zip(_l(b.logits_indices), b.logits_owner))
    for idx, (rid, off) in got:
        assert idx == by_start[rid] + off
    assert sorted(_l(b.logits_indices)) == sorted(rows) and sorted(b.logits_owner) == sorted(owner)


def test_logits_rows_are_in_batch_order():
    b = ForwardBatch.build([P3, P2, D1, P1], PS, 1)
    # d1 (row 0), p3 (rows 1, 2), p2 (none), p1 (last of rows 8-10)
    assert _l(b.logits_indices) == [0, 1, 2, 10]
    assert b.logits_owner == (("d1", 0), ("p3", 0), ("p3", 1), ("p1", 2))


@pytest.mark.parametrize(
    "threshold,decodes",
    # each group keeps the order it was given in
    [(1, ["d1", "d2"]), (2, ["d1", "p3", "d2"]), (3, ["p1", "d1", "p3", "d2"]), (0, [])],
)
def test_decode_threshold_decides_the_split(threshold, decodes):
    p3 = SeqChunk("p3", (51, 52), 3, (1, 4))
    b = ForwardBatch.build([P1, D1, p3, D2], PS, threshold)
    ids = [s.request_id for s in b.seqs]
    assert ids[: b.num_decode_seqs] == decodes
    assert all(s.query_len <= threshold for s in b.seqs[: b.num_decode_seqs])
    assert all(s.query_len > threshold for s in b.seqs[b.num_decode_seqs :])
    assert [s.query_start for s in b.seqs] == [sum(x.query_len for x in b.seqs[:i]) for i in range(len(ids))]


def test_empty_batch():
    b = ForwardBatch.build([], PS, 1)
    assert b.num_tokens == 0 and b.seqs == () and _l(b.logits_indices) == []


def test_seq_chunk_lengths():
    assert (P1.query_len, P1.seq_len) == (3, 5) and (D2.query_len, D2.seq_len) == (1, 1)

"""The KDA kind's route (attention/router.py route_kda) is plain data from the chunks' lengths: the leading
one-token sequences form the batched "recurrent" segment, every other sequence the "chunked" one."""

from __future__ import annotations

from mlaserve.attention.router import route_kda
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk


def _batch(lengths: list[int], decode_threshold: int = 1) -> ForwardBatch:
    chunks = [SeqChunk(f"r{i}", tuple(range(n)), 10, (0, 1, 2, 3), state_slot=i) for i, n in enumerate(lengths)]
    return ForwardBatch.build(chunks, 16, decode_threshold)


def test_one_token_sequences_take_the_batched_step_and_the_rest_the_chunked_form():
    plan = route_kda(_batch([5, 1, 1, 3]), (0, 2), bytes_per_request=100)
    rec, chunked = plan.segments
    assert (rec.path, rec.phase, rec.request_ids, rec.token_start, rec.token_end) == (
        "recurrent",
        "decode",
        ("r1", "r2"),
        0,
        2,
    )
    assert (chunked.path, chunked.phase, chunked.request_ids, chunked.token_start, chunked.token_end) == (
        "chunked",
        "prefill",
        ("r0", "r3"),
        2,
        10,
    )
    assert rec.implementation == "torch:kda_step" and chunked.implementation == "torch:kda_chunked(64)"
    assert plan.kind == "kda" and plan.layers == (0, 2) and plan.chunk == 64 and plan.state_bytes_per_request == 100
    record = plan.to_record()
    assert record["num_mqa_tokens"] == record["num_mha_tokens"] == 0  # neither MLA path


def test_a_multi_token_decode_goes_to_the_chunked_form():
    """decode_threshold 2: a two-token "decode" is not one step of the recurrence; it runs the chunked form."""
    plan = route_kda(_batch([2, 1, 7], decode_threshold=2), (1,))
    assert [(s.path, s.request_ids) for s in plan.segments] == [("chunked", ("r0", "r1", "r2"))]
    plan = route_kda(_batch([1, 2, 7], decode_threshold=2), (1,))
    assert [(s.path, s.request_ids) for s in plan.segments] == [("recurrent", ("r0",)), ("chunked", ("r1", "r2"))]

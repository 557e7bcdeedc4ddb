"""route() on its own: phase, path and sparse decisions per segment (a one-token prompt included),
decode_threshold, forced paths, needs_selection and effective_topk, the backend each segment names,
its implementation label and index scoring by key dtype. Plain data in, plain data out."""

from __future__ import annotations

import pytest
import torch

from mlaserve.attention.backends import BACKENDS
from mlaserve.attention.router import path_for, route
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk

PS = 4
DEC = SeqChunk("dec", (5,), 9, (0, 1, 2))  # decode at position 9: seq_len 10
ONE = SeqChunk("one", (7,), 0, (3,))  # a one-token prompt: seq_len 1
PRE = SeqChunk("pre", (1, 2, 3, 4, 5, 6), 0, (4, 5))  # a 6-token prompt
CHK = SeqChunk("chk", (1, 2, 3), 17, (6, 7, 8, 9, 10))  # a prompt chunk after 17 cached tokens: seq_len 20


def _batch(*chunks, threshold: int = 1) -> ForwardBatch:
    return ForwardBatch.build(list(chunks), PS, threshold)


def _summary(plan) -> list[tuple]:
    return [(s.phase, s.path, s.sparse, s.request_ids, s.token_start, s.token_end) for s in plan.segments]


@pytest.mark.parametrize(
    "chunks,mla_path,expected",
    [
        # auto: decode -> absorbed, prefill -> decompressed
        (
            (PRE, DEC, ONE),
            "auto",
            [
                ("decode", "absorbed", False, ("dec", "one"), 0, 2),
                ("prefill", "decompressed", False, ("pre",), 2, 8),
            ],
        ),
        # a one-token prompt alone is a decode
        ((ONE,), "auto", [("decode", "absorbed", False, ("one",), 0, 1)]),
        # only prompts: one prefill segment
        ((PRE, CHK), "auto", [("prefill", "decompressed", False, ("pre", "chk"), 0, 9)]),
        # forced paths send both phases one way
        (
            (PRE, DEC),
            "absorbed",
            [("decode", "absorbed", False, ("dec",), 0, 1), ("prefill", "absorbed", False, ("pre",), 1, 7)],
        ),
        (
            (PRE, DEC),
            "decompressed",
            [("decode", "decompressed", False, ("dec",), 0, 1), ("prefill", "decompressed", False, ("pre",), 1, 7)],
        ),
        ((), "auto", []),
    ],
)
def test_dense_segments(chunks, mla_path, expected):
    plan = route(_batch(*chunks), mla_path)
    assert _summary(plan) == expected
    assert not plan.sparse and plan.index_topk is None and plan.effective_topk is None and not plan.needs_selection
    assert all(s.index_scoring is None for s in plan.segments)
    assert all(s.implementation == f"torch:{s.path}" for s in plan.segments)


def test_segments_cover_the_batch_and_its_seqs():
    b = _batch(PRE, DEC, CHK, ONE)
    plan = route(b, "auto")
    assert [(s.seq_start, s.seq_end) for s in plan.segments] == [(0, 2), (2, 4)]
    assert plan.segments[-1].token_end == b.num_tokens
    assert sum(s.num_tokens for s in plan.segments) == b.num_tokens
    assert plan.counts() == {"num_mqa_tokens": 2, "num_mha_tokens": 9, "num_sparse_tokens": 0}


@pytest.mark.parametrize(
    "threshold,expected",
    [
        (1, [("decode", "absorbed", ("dec",)), ("prefill", "decompressed", ("chk", "pre"))]),
        (3, [("decode", "absorbed", ("dec", "chk")), ("prefill", "decompressed", ("pre",))]),
        (6, [("decode", "absorbed", ("dec", "chk", "pre"))]),
        (0, [("prefill", "decompressed", ("dec", "chk", "pre"))]),
    ],
)
def test_decode_threshold_moves_short_queries_to_the_absorbed_path(threshold, expected):
    plan = route(_batch(DEC, CHK, PRE, threshold=threshold), "auto")
    assert [(s.phase, s.path, s.request_ids) for s in plan.segments] == expected


@pytest.mark.parametrize(
    "chunks,topk,needs,effective",
    [
        ((DEC, PRE), 16, False, 10),  # longest sequence 10 <= 16: every row is kept, no scoring
        ((DEC, PRE), 10, False, 10),  # equal: still fits
        ((DEC, PRE), 9, True, 9),
        ((DEC, CHK), 16, True, 16),  # the chunk's sequence (20 tokens) is longer than index_topk
        ((ONE,), 1, False, 1),
    ],
)
def test_sparse_selection_only_when_a_sequence_exceeds_index_topk(chunks, topk, needs, effective):
    plan = route(_batch(*chunks), "auto", sparse=True, index_topk=topk)
    assert plan.sparse and plan.index_topk == topk
    assert plan.needs_selection is needs and plan.effective_topk == effective
    assert all(s.sparse and s.path == "absorbed" for s in plan.segments)  # sparse: absorbed for every phase
    assert plan.counts()["num_sparse_tokens"] == plan.counts()["num_mqa_tokens"] == _batch(*chunks).num_tokens
    suffix = "" if needs else "(all rows within index_topk)"
    assert all(s.implementation == "torch:sparse_absorbed" + suffix for s in plan.segments)
    assert all((s.index_scoring is not None) is needs for s in plan.segments)


def test_sparse_with_forced_decompressed_path_is_masked_mha():
    plan = route(_batch(DEC, CHK), "decompressed", sparse=True, index_topk=4)
    assert [(s.phase, s.path, s.implementation) for s in plan.segments] == [
        ("decode", "decompressed", "torch:sparse_decompressed"),
        ("prefill", "decompressed", "torch:sparse_decompressed"),
    ]


@pytest.mark.parametrize(
    "phase,mla_path,sparse,expected",
    [
        ("decode", "auto", False, "absorbed"),
        ("prefill", "auto", False, "decompressed"),
        ("decode", "auto", True, "absorbed"),
        ("prefill", "auto", True, "absorbed"),
        ("decode", "decompressed", False, "decompressed"),
        ("prefill", "absorbed", False, "absorbed"),
        ("prefill", "decompressed", True, "decompressed"),
    ],
)
def test_path_for(phase, mla_path, sparse, expected):
    assert path_for(phase, mla_path, sparse) == expected


@pytest.mark.parametrize(
    "backend,key_dtype,scoring",
    [
        ("torch", torch.float32, "fp32"),
        ("torch", torch.float16, "fp32"),
        ("torch", torch.bfloat16, "bf16_then_fp32"),
        ("reference", torch.float32, "fp32"),
        ("reference", torch.bfloat16, "fp32"),  # the oracle never takes the bf16 shortcut
    ],
)
def test_backend_and_index_scoring_by_key_dtype(backend, key_dtype, scoring):
    plan = route(_batch(DEC, CHK), "auto", sparse=True, index_topk=4, key_dtype=key_dtype, backend=backend)
    assert all(s.backend == backend for s in plan.segments)
    assert all(s.implementation == f"{backend}:sparse_absorbed" for s in plan.segments)
    assert all(s.index_scoring == scoring for s in plan.segments)
    assert BACKENDS[backend].index_scoring(key_dtype) == scoring


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_dense_route_names_the_backend(backend):
    plan = route(_batch(DEC, PRE), "auto", backend=backend)
    assert [s.implementation for s in plan.segments] == [f"{backend}:absorbed", f"{backend}:decompressed"]
    assert [r["backend"] for r in plan.to_record()["segments"]] == [backend, backend]


def test_record_is_plain_data():
    rec = route(_batch(DEC, CHK), "auto", sparse=True, index_topk=4).to_record()
    assert rec["needs_selection"] and rec["effective_topk"] == 4 and rec["index_topk"] == 4
    seg = rec["segments"][1]
    assert seg["request_ids"] == ["chk"] and seg["num_tokens"] == 3 and seg["phase"] == "prefill"
    assert seg["index_scoring"] == "fp32"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mla_path": "fast"}, "mla_path must be one of"),
        ({"mla_path": "auto", "sparse": True}, "a sparse route needs index_topk"),
        ({"mla_path": "auto", "backend": "nope"}, "unknown attention backend 'nope'"),
        ({"mla_path": "auto", "sparse": True, "index_topk": 1, "backend": "nope"}, "unknown attention backend"),
    ],
)
def test_bad_route_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        route(_batch(DEC, CHK), **kwargs)

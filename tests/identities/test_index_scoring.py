"""Two-stage index scoring (bf16 GEMM with a rounding bound, fp32 rescoring of the candidates) picks
the same top-k as scoring every key in fp32, including on near-ties where plain bf16 scoring does not."""

from __future__ import annotations

import pytest
import torch
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.attention.backends import torch_index
from mlaserve.attention.backends.torch_index import _scores, _top_k, _top_k_bf16_then_fp32
from mlaserve.sampling.params import SamplingParams


def _case(kind: str, seed: int):
    """bf16 q [B, Q, Hi, Di], keys [B, L, Di], fp32 w [B, Q, Hi], mask [B, Q, L], k."""
    g = torch.Generator().manual_seed(seed)
    b, nq, hi, di, length, k = 3, 2, 16, 32, 300, 64
    q = torch.randn(b, nq, hi, di, generator=g)
    keys = torch.randn(b, length, di, generator=g)
    if kind == "near_ties":  # every key a tiny perturbation of one: scores cluster at the top-k boundary
        keys = keys[:, :1] + 1e-3 * keys
    w = torch.randn(b, nq, hi, generator=g)
    lens = torch.tensor([length, 250, 40 if kind == "short_row" else 200])  # causal length per request
    mask = torch.arange(length)[None, None, :] < lens[:, None, None]
    return q.bfloat16(), keys.bfloat16(), w, mask.expand(b, nq, length), k


def _exact_scores(q, keys, w, mask):
    return _scores(q.float(), keys.float(), w).masked_fill_(~mask, float("-inf"))


def _chosen(scores, index):
    """The selected scores, sorted: equal for two selections that differ only among exact ties."""
    return scores.gather(2, index).sort(dim=-1).values


@pytest.mark.parametrize("kind", ["random", "near_ties", "short_row"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("decode", [True, False])  # the two GEMM layouts
def test_two_stage_top_k_equals_fp32_top_k(kind, seed, decode):
    q, keys, w, mask, k = _case(kind, seed)
    exact = _exact_scores(q, keys, w, mask)
    want = _top_k(exact.clone(), mask, k)
    got = _top_k_bf16_then_fp32(q, keys, w, mask, k, decode)
    torch.testing.assert_close(_chosen(exact, got), _chosen(exact, want), rtol=1e-6, atol=0)


def test_plain_bf16_top_k_differs_on_near_ties():
    """The near-tie case discriminates: ranking by the bf16 GEMM alone picks a different set."""
    q, keys, w, mask, k = _case("near_ties", 0)
    exact = _exact_scores(q, keys, w, mask)
    plain = _top_k(_scores(q, keys, w), mask, k)
    assert not torch.equal(_chosen(exact, plain), _chosen(exact, _top_k(exact.clone(), mask, k)))


def test_bf16_engine_decodes_with_two_stage_scoring_and_fp32_selection(hf_model_dir, monkeypatch):
    """A bf16 DSA engine routes decode and prompt segments to two-stage scoring (ledger); inside the
    real model every two-stage selection equals the fp32 one."""
    folder, _ = hf_model_dir("v32")  # index_topk 16
    calls, differ = [], []

    def checked(q, keys, w, mask, k, decode):
        # recorded, not asserted here: inside generate's steps an exception only fails the request
        got = _top_k_bf16_then_fp32(q, keys, w, mask, k, decode)
        exact = _exact_scores(q, keys, w, mask)
        want = _chosen(exact, _top_k(exact.clone(), mask, k))
        if not torch.allclose(_chosen(exact, got), want, rtol=1e-6, atol=0):
            differ.append(q.shape)
        calls.append(q.shape)
        return got

    monkeypatch.setattr(torch_index, "_top_k_bf16_then_fp32", checked)
    llm = LLM(str(folder), dtype="bfloat16", max_num_batched_tokens=24, trace="memory")
    llm.prompt_logits(random_ids(24, seed=3))  # one prompt chunk past index_topk
    out = llm.generate([random_ids(20, seed=4)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].error is None and len(out[0].outputs[0].token_ids) == 12
    assert differ == []
    segs = [s for r in llm.runner.tracer.records for s in r["segments"]]
    selecting = [s for s in segs if s["index_scoring"] is not None]
    assert sorted(s["phase"] for s in selecting) == ["decode"] * 11 + ["prefill"] * 2
    assert {s["index_scoring"] for s in selecting} == {"bf16_then_fp32"}
    n_indexers = sum(layer.self_attn.indexer is not None for layer in llm.runner.model.model.layers)
    assert n_indexers >= 2 and len(calls) == len(selecting) * n_indexers

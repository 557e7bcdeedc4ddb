"""The equivalences the engine rests on, each checked on the same inputs:
absorbed == decompressed; chunked prefill + token-by-token decode == one full forward;
a one-token prompt via the decode path == via the prefill path; scattered pages == contiguous."""

from __future__ import annotations

import pytest
import torch
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.executor.forward_batch import SeqChunk

TOL = 1e-5  # fp32 reassociation noise between two orders of the same sums


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("kind", ["v3_yarn", "v2_noq"])
def test_absorbed_equals_decompressed(hf_model_dir, kind):
    folder, _ = hf_model_dir(kind)
    ids = random_ids(48, seed=3)
    a = LLM(str(folder), mla_path="absorbed").prompt_logits(ids)
    d = LLM(str(folder), mla_path="decompressed").prompt_logits(ids)
    assert _max_diff(a, d) <= TOL


@pytest.mark.parametrize("mla_path", ["auto", "absorbed", "decompressed"])
@pytest.mark.parametrize("budget", [1, 7])
def test_chunked_prefill_equals_full(hf_model_dir, mla_path, budget):
    """budget=1 feeds the prompt one token per step: every step is a decode (query length 1)."""
    folder, _ = hf_model_dir("v3_yarn")
    ids = random_ids(36, seed=4)  # 36 = 5 * 7 + 1: with budget 7 the last chunk is a one-token decode
    full = LLM(str(folder), mla_path=mla_path, max_num_batched_tokens=4096).prompt_logits(ids)
    llm = LLM(str(folder), mla_path=mla_path, max_num_batched_tokens=budget, page_size=4, trace="memory")
    chunked = llm.prompt_logits(ids)
    assert _max_diff(full, chunked) <= TOL
    phases = {seg["phase"] for rec in llm.runner.tracer.records for seg in rec["segments"]}
    assert phases == ({"decode"} if budget == 1 else {"prefill", "decode"})


def test_one_token_prompt_decode_path_equals_prefill_path(hf_model_dir):
    folder, _ = hf_model_dir("glm_lite")
    auto = LLM(str(folder), trace="memory")
    mha = LLM(str(folder), mla_path="decompressed", trace="memory")
    a, m = auto.prompt_logits([5]), mha.prompt_logits([5])
    assert auto.runner.tracer.records[0]["segments"][0]["phase"] == "decode"
    assert auto.runner.tracer.records[0]["num_mqa_tokens"] == 1
    assert mha.runner.tracer.records[0]["num_mha_tokens"] == 1
    assert _max_diff(a, m) <= TOL


@pytest.mark.parametrize("mla_path", ["absorbed", "decompressed"])
def test_scattered_pages_equal_contiguous(hf_model_dir, mla_path):
    folder, _ = hf_model_dir("v2_qlora")
    llm = LLM(str(folder), mla_path=mla_path, page_size=4, num_pages=64)
    ids = tuple(random_ids(30, seed=5))

    def run(table):
        _, first = llm.runner.execute([SeqChunk("r", ids[:17], 0, table[:5], all_logits=True)])
        _, rest = llm.runner.execute([SeqChunk("r", ids[17:], 17, table, all_logits=True)])
        return torch.cat([first, rest])

    contiguous = run(tuple(range(8)))
    scattered = run((41, 3, 60, 17, 9, 33, 2, 50))
    assert _max_diff(contiguous, scattered) <= TOL


@pytest.mark.parametrize("kind", ["v3_yarn", "v2_qlora"])
def test_grouped_gemm_experts_equal_reference_loop(hf_model_dir, kind):
    """The fast MoE path (tokens sorted by expert, grouped GEMM) against the per-expert reference."""
    folder, _ = hf_model_dir(kind)
    ids = random_ids(50, seed=9)
    fast = LLM(str(folder), experts_impl="grouped_mm").prompt_logits(ids)
    ref = LLM(str(folder), experts_impl="loop").prompt_logits(ids)
    assert _max_diff(fast, ref) <= TOL


@pytest.mark.parametrize(
    "kind,mla_path",
    [("v3_yarn", "absorbed"), ("v3_yarn", "decompressed"), ("v32", "auto"), ("glm_dsa", "decompressed")],
)
def test_query_blocks_equal_one_block(hf_model_dir, kind, mla_path, monkeypatch):
    """Long prompts attend in blocks of queries (bounded temporaries); a tiny workspace forces one query
    per block in every attention path and in the indexer's prompt scoring: same logits."""
    from mlaserve.attention.backends import blocks, torch_backend, torch_index

    folder, _ = hf_model_dir(kind)
    ids = random_ids(48, seed=5)  # > index_topk 16 for the DSA kinds: the indexer selects
    whole = LLM(str(folder), mla_path=mla_path).prompt_logits(ids)
    sizes = []
    real = blocks.query_blocks

    def counted(n, per_query, most=None):
        blocks = real(n, per_query, most)
        sizes.append(len(blocks))
        return blocks

    monkeypatch.setattr(blocks, "WORKSPACE_BYTES", 1)
    monkeypatch.setattr(torch_backend, "query_blocks", counted)
    monkeypatch.setattr(torch_index, "query_blocks", counted)
    blocked = LLM(str(folder), mla_path=mla_path).prompt_logits(ids)
    assert max(sizes) == 48  # one query per block
    assert _max_diff(whole, blocked) <= TOL


def test_rmsnorm_fp32_one_op_equals_two_steps():
    """RMSNorm in fp32 passes its weight into F.rms_norm (one op): bit-identical to the reference's
    normalise-then-scale, for shapes the models use."""
    import torch.nn.functional as F

    from mlaserve.models.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    for rows, d in ((1, 384), (7, 1024), (300, 7168), (5, 512)):
        norm = RMSNorm(d, 1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(d, generator=g))
        x = torch.randn(rows, d, generator=g) * 3
        two_steps = norm.weight * F.rms_norm(x, (d,), eps=1e-6)
        assert torch.equal(norm(x), two_steps)

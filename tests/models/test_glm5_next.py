"""GLM-5.3-Flash (glm5_next) through the engine (the wrapper's config reader, the text part of its checkpoint with the
vision tower skipped, KDA request states, NoPE MLA over paged latent rows, mHC streams, clamped SwiGLU dense and MoE
layers) against transformers' Glm5NextForConditionalGeneration on the same random weights (tests/glm5_next_models.py:
two layer patterns, kpool 4 and 2, head counts 3 and 5).

Bound: 1e-5 max abs against transformers run in float64, 100% top-1. Measured at the 197-token prompt (logits of
magnitude ~3.8): transformers' own fp32 run 1.9e-6 / 4.4e-6 from float64 (the two patterns), ours 1.8e-6 .. 2.2e-6 /
3.0e-6 .. 5.2e-6 over budgets 1, 5, 64, 512: fp32 rounding of these sizes, the same for both, so the float64 run is
the reference. A defect moves logits by 1e-2 .. 1 (a clamp left out, a stream mixed
the wrong way round, the mean head replaced by one stream, a KDA state not carried across a chunk).

Every prompt here is <= index_topk (256): the pooled route keeps every token there (its steps select nothing, the
route says so); past index_topk, where it selects, tests/models/test_glm5_next_sparse.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.glm5_next")

from glm5_next_models import SPECS, float64_copy, hf_logits, random_ids, save_hf_glm5_next  # noqa: E402
from hf_models import hf_greedy  # noqa: E402
from state_engine import assert_close, model_fixture  # noqa: E402

from mlaserve.config.layer_kinds import declare_layers  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

BOUND = 1e-5
LONG = 3 * 64 + 5  # 197: three full 64-token KDA chunks and a tail
# around the 64-token KDA chunks, the conv width and the pools (kpool 2 and 4)
LENGTHS = (1, 2, 3, 4, 5, 7, 8, 9, 63, 64, 65, 129, LONG)


glm = model_fixture("glm", SPECS, save_hf_glm5_next, float64_copy, seed=3)


@pytest.mark.parametrize("budget", [1, 5, 64, 512])  # 1: token by token; 512: one pass
def test_prompt_logits_equal_transformers(glm, budget):
    """Chunked prefill (chunks of `budget` tokens) == transformers' one pass at every position of a 197-token prompt,
    and prompts of lengths around the KDA chunks and the pools run as their own prompts (on two budgets)."""
    spec, ref, folder = glm
    llm = LLM(str(folder), max_num_batched_tokens=budget)
    vocab = ref.config.text_config.vocab_size
    for n in LENGTHS if budget in (5, 512) else (LONG,):
        ids = random_ids(n, vocab, n)
        assert_close(llm.prompt_logits(ids), hf_logits(ref, ids), BOUND, f"{spec} length {n} budget {budget}")


def test_load_reports_the_vision_tower_and_declares_the_layer_kinds(glm):
    """The vision tower is skipped and reported by name and size; the layers' kinds are declared as data: KDA with its
    two request states, MLA+DSA with its pooled indexer (index_rows per token, index_pools per kpool tokens when the
    route runs sparse, the default; dense: the latent rows only). The context is not capped at index_topk."""
    spec, ref, folder = glm
    llm = LLM(str(folder))
    report = llm.loaded.report
    assert any(n.startswith("model.visual.") for n in report.skipped)
    assert any("skipped" in n and "vision" in n and "bytes" in n for n in report.notes)
    cfg = llm.config.model
    text = ref.config.text_config
    assert cfg.indexer.kpool == text.index_kpool
    assert cfg.max_position_embeddings == text.max_position_embeddings > text.index_topk
    assert llm.config.attention.sparse
    for kind, layer_type in zip(declare_layers(cfg, sparse=True), text.layer_types):
        if layer_type == "linear_attention":
            assert (kind.attention, kind.indexer) == ("kda", None)
            assert [s.name for s in kind.states] == ["recurrent", "conv"]
        else:
            assert (kind.attention, kind.indexer) == ("mla_dsa", "pooled")
            assert [(s.name, s.tokens_per_row) for s in kind.states] == [
                ("latent", 1),
                ("index_rows", 1),
                ("index_pools", text.index_kpool),
            ]
    dense = LLM(str(folder), attention="dense")
    assert not dense.config.attention.sparse
    assert all(s.name == "latent" for k in dense.runner.layer_kinds for s in k.states if k.attention == "mla_dsa")


def test_greedy_in_a_batch_equals_transformers(glm):
    """Two requests in flight together (decodes batched beside the other's prefill chunks) generate transformers'
    greedy tokens (its full recompute, no cache)."""
    spec, ref, folder = glm
    llm = LLM(str(folder), max_num_batched_tokens=9)
    vocab = ref.config.text_config.vocab_size
    prompts = [random_ids(70, vocab, 70), random_ids(4, vocab, 4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(ref, p, 10, hf_logits), f"{spec}: prompt of {len(p)} tokens"


def test_a_shared_indexer_layer_after_a_full_one(tmp_path):
    """indexer_types read per layer (a KDA layer's entry unread, even "shared" at layer 0): the full layer holds the
    pooled indexer, the shared one none; logits == transformers' (which runs a shared layer right after a full one)."""
    hf = save_hf_glm5_next("shared_after_full", tmp_path, seed=3)
    ref = float64_copy(hf)
    llm = LLM(str(tmp_path), max_num_batched_tokens=37)
    assert llm.config.model.indexer.layer_types == ("none", "full", "shared", "none")
    kinds = [(k.attention, k.indexer) for k in declare_layers(llm.config.model, sparse=True)]
    assert kinds == [("kda", None), ("mla_dsa", "pooled"), ("mla_dsa", "shared"), ("kda", None)]
    assert llm.runner.model.model.layers[2].self_attn.indexer is None
    ids = random_ids(150, ref.config.text_config.vocab_size, 9)
    assert_close(llm.prompt_logits(ids), hf_logits(ref, ids), BOUND, "shared_after_full length 150 budget 37")

"""GLM-5.3-Flash's MTP layer, loaded from a checkpoint's layer N (model.language_model.layers.N.*), computes
  logits_i = lm_head(shared_head.norm(g_i)),  g_i = Block(eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]))
with h_i the trunk's final hidden state (norm of the mHC streams' mean) and Block an MLA+DSA layer with a plain
residual (the released block has no hc_* tensors): r = x + attn(input_layernorm(x)), g = r + mlp(post_attention_
layernorm(r)). The reference is written out over transformers' own modules of that layer (Glm5NextTextAttention with
its pooled indexer, Glm5NextTextMoE with swiglu_limit's clamps, the norms) and transformers' trunk, in float64
(tests/glm5_next_mtp_models.py).

Bound 1e-5 with 100% top-1, the family's (tests/models/test_glm5_next.py: fp32 rounding at these sizes 1e-6 .. 5e-6);
measured 2.1e-6 (dense) and 1.8e-6 (selecting). 30 tokens: past index_topk 16 in the selecting config, where both the
trunk's and the MTP block's indexers keep 4 pools + the tail. Checked when written: the block's MoE without
swiglu_limit's clamps is 1.6 away, eh_proj's input halves swapped 4.9.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.glm5_next")

from glm5_next_models import float64_copy, random_ids  # noqa: E402
from glm5_next_mtp_models import save_glm5_next_with_mtp  # noqa: E402

from mlaserve import LLM  # noqa: E402
from mlaserve.config.model import ConfigError  # noqa: E402
from mlaserve.executor.forward_batch import SeqChunk  # noqa: E402

BOUND = 1e-5


@pytest.fixture(scope="module", params=["kda3_mla_kpool4", "sparse_kda3_kpool4"])
def glm(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"glm5mtp_layer_{request.param}")
    trunk, block, full = save_glm5_next_with_mtp(request.param, folder, seed=11)
    return request.param, folder, float64_copy(trunk), block, full


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp_logits(trunk, block: dict, full, ids: list[int]) -> torch.Tensor:
    """[L-1, V] float64: the MTP's logits at positions 0..L-2 (each predicting t_{i+2}), written out."""
    text = trunk.config.text_config
    n, eps = text.num_hidden_layers, text.rms_norm_eps
    p = f"model.language_model.layers.{n}."
    layer = full.model.language_model.layers[n].double()
    if hasattr(layer.mlp, "experts") and hasattr(full, "set_experts_implementation"):
        full.set_experts_implementation("eager")  # grouped_mm has no float64
    w = {k: v.double() for k, v in block.items()}
    with torch.no_grad():
        lm = trunk.model.language_model
        h = lm(input_ids=torch.tensor([ids])).last_hidden_state[0]  # norm(mean of the streams), [L, D]
        emb = lm.embed_tokens(torch.tensor(ids[1:]))  # Emb(t_{i+1})
        cat = torch.cat([_rms(emb, w[p + "enorm.weight"], eps), _rms(h[:-1], w[p + "hnorm.weight"], eps)], -1)
        x = (cat @ w[p + "eh_proj.weight"].T)[None]  # [1, L-1, D]
        mask = torch.ones(1, x.shape[1], dtype=torch.bool)
        pos = torch.arange(x.shape[1])[None]
        a, _, _ = layer.self_attn(hidden_states=layer.input_layernorm(x), attention_mask=mask, position_ids=pos)
        r = x + a
        g = r + layer.mlp(layer.post_attention_layernorm(r))
        return trunk.lm_head(_rms(g[0], w[p + "shared_head.norm.weight"], eps)).float()


def engine_mtp_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The trunk over ids (its KDA states in slot 0), then the MTP layer over positions 0..L-2 with the next tokens,
    through the engine's paged caches and routes."""
    ps, pool = llm.config.cache.page_size, llm.engine.pool
    pages = tuple(pool.allocate(-(-len(ids) // ps)))
    try:
        trunk = SeqChunk("r", tuple(ids), 0, pages, all_logits=True, state_slot=0, reset_state=True)
        _, _, hidden = llm.runner.execute_with_hidden([trunk])
        chunk = SeqChunk("r", tuple(ids[1:]), 0, pages, all_logits=True)
        return llm.runner.drafter.forward([chunk], hidden, {"r": 0}, 0)[1]
    finally:
        pool.release(list(pages))


def test_mtp_layer_equals_the_formula_over_transformers_modules(glm):
    spec, folder, trunk, block, full = glm
    llm = LLM(str(folder), speculative="mtp", page_size=8)
    n = llm.config.model.num_layers
    assert not [x for x in llm.loaded.report.skipped if x.startswith(f"model.layers.{n}.")]  # the block was loaded
    assert not hasattr(llm.runner.model.mtp[0], "attn_hc")  # a plain residual: no mHC in the block
    kinds = llm.runner.drafter.layer_kinds
    assert [(k.attention, k.indexer, k.kpool) for k in kinds] == [("mla_dsa", "pooled", 4)]
    assert not llm.runner.drafter.cache.num_slots  # the block keeps no request state
    ids = random_ids(30, trunk.config.text_config.vocab_size, 5)
    ref = reference_mtp_logits(trunk, block, full, ids)
    got = engine_mtp_logits(llm, ids)
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err <= BOUND, f"{spec}: MTP logits {err:.2e} from the formula"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_mtp_tensors_skipped_without_speculation(glm):
    _, folder, *_ = glm
    llm = LLM(str(folder), page_size=8)
    n = llm.config.model.num_layers
    assert not hasattr(llm.runner.model, "mtp") and llm.runner.drafter is None
    assert len([x for x in llm.loaded.report.skipped if x.startswith(f"model.layers.{n}.")]) > 10


def test_kimi_linear_refuses_speculation(tmp_path):
    """Kimi-Linear ships no MTP layer: refused at load, naming what is missing (and, were a layer there, its KDA
    states have no rollback: refused naming the state, tests/unit/test_kimi_linear_config.py)."""
    from kimi_linear_models import SPECS, save_hf_kimi

    save_hf_kimi(next(iter(SPECS)), tmp_path, seed=1)
    with pytest.raises(ConfigError, match="speculative='mtp' needs the checkpoint's MTP layer"):
        LLM(str(tmp_path), speculative="mtp")

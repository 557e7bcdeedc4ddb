"""Layer kinds and the route of a model with two attention sublayers per decoder layer (LongCat-Flash), as
plain data: two latent states per layer, the plan and its record naming each sublayer's state; a model of one
attention per layer keeps its records as they were (no `sublayers` key)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.attention.router import route_step
from mlaserve.config.layer_kinds import declare_layers, describe
from mlaserve.config.model import ModelConfig
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk

LONGCAT = dict(
    model_type="longcat_flash", vocab_size=64, hidden_size=32, num_layers=3, num_attention_heads=2,
    ffn_hidden_size=48, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, head_dim=4,
    v_head_dim=8, moe_topk=2, n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=16,
)  # fmt: skip
DEEPSEEK = dict(
    model_type="deepseek_v3", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
    intermediate_size=48, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
)  # fmt: skip
BATCH = ForwardBatch.build([SeqChunk("a", (5,), 9, (0, 1, 2)), SeqChunk("b", (1, 2, 3), 0, (3,))], 4, 1)


def test_two_latent_states_per_layer_and_their_bytes():
    cfg = ModelConfig.from_hf(LONGCAT)
    kinds = declare_layers(cfg, sparse=False)
    assert len(kinds) == 3  # decoder layers, not sublayers
    for k in kinds:
        assert k.attention == "mla" and k.sublayers == ("latent", "latent_1")
        assert [(s.name, s.width, s.addressing) for s in k.states] == [("latent", 12, "page"), ("latent_1", 12, "page")]
    assert describe(kinds, 4) == ["layers 0-2: mla; cache: latent [12] + latent_1 [12] (288 bytes/token)"]
    one = declare_layers(ModelConfig.from_hf(DEEPSEEK), sparse=False)
    assert all(k.sublayers == () and [s.name for s in k.states] == ["latent"] for k in one)


def test_route_names_each_sublayer_state():
    route = route_step(BATCH, declare_layers(ModelConfig.from_hf(LONGCAT), sparse=False), "auto")
    (plan,) = route.plans
    assert plan.sublayers == ("latent", "latent_1") and plan.layers == (0, 1, 2)
    rec = route.to_record()
    assert rec["kinds"][0]["sublayers"] == [{"sublayer": 0, "state": "latent"}, {"sublayer": 1, "state": "latent_1"}]
    assert [s["sublayers"] for s in rec["segments"]] == [["latent", "latent_1"]] * 2
    # a token counts once, not once per sublayer
    assert (rec["num_mqa_tokens"], rec["num_mha_tokens"]) == (1, 3)


def test_one_attention_per_layer_records_no_sublayers():
    rec = route_step(BATCH, declare_layers(ModelConfig.from_hf(DEEPSEEK), sparse=False), "auto").to_record()
    assert "sublayers" not in rec["kinds"][0] and all("sublayers" not in s for s in rec["segments"])


def test_the_cache_allocates_both_states():
    from mlaserve.cache.model_cache import ModelCache

    kinds = declare_layers(ModelConfig.from_hf(LONGCAT), sparse=False)
    cache = ModelCache(kinds, num_pages=2, page_size=4, dtype=torch.float32)
    for layer in cache.layers:
        assert {n: tuple(t.shape) for n, t in layer.tensors.items()} == {"latent": (9, 12), "latent_1": (9, 12)}
    assert cache.measured_bytes_per_token() == ModelCache.bytes_per_token(kinds, torch.float32) == 3 * 2 * 12 * 4


def test_scale_placement_and_the_native_latent_write():
    """A power-of-two scale is folded (plain modules, weights multiplied once at load); another stays a multiply
    after q_b_proj / kv_a_layernorm, and then the native latent write (which applies kv_a_layernorm's weight
    only) is refused with the reason, so the KernelPlan keeps the torch write."""
    from mlaserve.models.longcat import LongcatAttention, ScaledLinear, ScaledRMSNorm

    folded = LongcatAttention(ModelConfig.from_hf({**LONGCAT, "q_lora_rank": 8, "kv_lora_rank": 8}), 0, "latent")
    assert type(folded.q_b_proj) is torch.nn.Linear and not isinstance(folded.kv_a_layernorm, ScaledRMSNorm)
    assert folded.native_unfit() is None
    w = folded.q_b_proj.weight.detach().clone()
    folded.fold_latent_scales()
    assert torch.equal(folded.q_b_proj.weight, w * 2.0)  # sqrt(32 / 8)
    with pytest.raises(RuntimeError, match="folded into these weights already"):
        folded.fold_latent_scales()
    runtime = LongcatAttention(ModelConfig.from_hf({**LONGCAT, "q_lora_rank": 16, "kv_lora_rank": 16}), 0, "latent_1")
    assert isinstance(runtime.q_b_proj, ScaledLinear) and isinstance(runtime.kv_a_layernorm, ScaledRMSNorm)
    assert runtime.q_b_proj.scale == runtime.kv_a_layernorm.scale == 2**0.5 and runtime.cache_state == "latent_1"
    assert "not a power of two" in runtime.native_unfit()

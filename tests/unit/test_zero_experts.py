"""The identity (zero-computation) experts and LongCat's latent scales, module by module, against transformers'
LongcatFlash modules on the same random weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.config.model import ModelConfig, power_of_two
from mlaserve.models.zero_experts import ZeroExpertExperts, ZeroExpertRouter

E, Z, K, D, FFN = 5, 3, 3, 24, 16


def _hf_config(**kw):
    from transformers import AutoConfig

    base = dict(
        hidden_size=D, n_routed_experts=E, zero_expert_num=Z, moe_topk=K, expert_ffn_hidden_size=FFN,
        routed_scaling_factor=2.5, num_layers=1, num_attention_heads=2, q_lora_rank=8, kv_lora_rank=8,
        qk_nope_head_dim=4, qk_rope_head_dim=4, head_dim=4, v_head_dim=4, vocab_size=16, ffn_hidden_size=8,
    )  # fmt: skip
    return AutoConfig.for_model("longcat_flash", **{**base, **kw})


def _pair(impl: str):
    """transformers' experts and router, and ours holding the same weights."""
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts, LongcatFlashTopkRouter

    hf_cfg = _hf_config()
    g = torch.Generator().manual_seed(0)
    hf_exp, hf_router = LongcatFlashExperts(hf_cfg), LongcatFlashTopkRouter(hf_cfg)
    with torch.no_grad():
        hf_exp.gate_up_proj.copy_(torch.randn(hf_exp.gate_up_proj.shape, generator=g) * D**-0.5)
        hf_exp.down_proj.copy_(torch.randn(hf_exp.down_proj.shape, generator=g) * FFN**-0.5)
        hf_router.classifier.weight.copy_(torch.randn(E + Z, D, generator=g))
        hf_router.e_score_correction_bias.copy_(0.1 * torch.randn(E + Z, generator=g))
    moe = ModelConfig.from_hf({**hf_cfg.to_dict(), "model_type": "longcat_flash"}).moe
    ours, router = ZeroExpertExperts(D, moe), ZeroExpertRouter(D, moe)
    ours.impl = impl
    with torch.no_grad():
        ours.gate_up_proj.copy_(hf_exp.gate_up_proj[:E])  # transformers allocates (never reads) rows for Z too
        ours.down_proj.copy_(hf_exp.down_proj)
        router.classifier.weight.copy_(hf_router.classifier.weight)
        router.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
    return hf_exp, hf_router, ours, router


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_router_and_experts_match_transformers(impl):
    """40 tokens; the router's choice and weights are transformers' exactly (the same fp32 ops); the experts'
    output measured 0 from transformers' loop (the same products summed in the same order; bound 1e-6, fp32 rounding of a few terms)."""
    hf_exp, hf_router, ours, router = _pair(impl)
    x = torch.randn(40, D, generator=torch.Generator().manual_seed(1))
    _, hf_w, hf_idx = hf_router(x)
    w, idx = router(x)
    assert torch.equal(idx.sort(-1).values, hf_idx.sort(-1).values)
    assert torch.equal(w.gather(1, idx.argsort(-1)), hf_w.gather(1, hf_idx.argsort(-1)))
    assert (idx >= E).any() and (idx < E).any()  # both kinds of expert are chosen
    want = hf_exp(x, hf_idx, hf_w)
    diff = (ours(x, w, idx) - want).abs().max().item()
    print(f"{impl}: max |diff| {diff:.2e}")
    assert diff <= 1e-6


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_identity_only_tokens_are_weight_times_input(impl):
    """Tokens routed to identity experts only: out = (sum of their weights) x input, no expert weight read."""
    _, _, ours, _ = _pair(impl)
    x = torch.randn(6, D)
    idx = torch.tensor([[E, E + 1, E + 2]] * 6)
    w = torch.rand(6, K)
    with torch.no_grad():
        ours.gate_up_proj.fill_(float("nan"))  # any real expert computed would show
        ours.down_proj.fill_(float("nan"))
    out = ours(x, w, idx)
    assert torch.allclose(out, x * w.sum(-1, keepdim=True), rtol=1e-6, atol=0)


def test_mixed_step_with_identity_only_tokens():
    """One step where some tokens pick only identity experts and others real ones: the grouped op equals the
    plain loop per token (bound 1e-6: the same products, summed in the same order)."""
    _, _, grouped, _ = _pair("grouped_mm")
    _, _, loop, _ = _pair("loop")
    x = torch.randn(4, D)
    idx = torch.tensor([[E, E + 1, E + 2], [0, 3, E], [1, 2, 4], [E + 2, E, E + 1]])
    w = torch.rand(4, K)
    assert (grouped(x, w, idx) - loop(x, w, idx)).abs().max().item() <= 1e-6


def test_power_of_two_scales_fold_exactly_and_others_would_not():
    """Why the loader folds only power-of-two scales: a weight x 2 gives the product x 2 bit for bit; a weight
    x sqrt(3) does not equal the product x sqrt(3) (rounding), so sqrt(3) stays a run-time multiply."""
    assert power_of_two(2.0) and power_of_two(0.5) and not power_of_two(3**0.5) and not power_of_two(12**0.5)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 96, generator=g), torch.randn(48, 96, generator=g)
    assert torch.equal(torch.nn.functional.linear(x, w * 2.0), torch.nn.functional.linear(x, w) * 2.0)
    s = 3**0.5
    assert not torch.equal(torch.nn.functional.linear(x, w * s), torch.nn.functional.linear(x, w) * s)
    norm_w = 1 + 0.1 * torch.randn(96, generator=g)
    rms = torch.nn.functional.rms_norm
    assert torch.equal(rms(x, (96,), norm_w * 2.0, 1e-6), rms(x, (96,), norm_w, 1e-6) * 2.0)

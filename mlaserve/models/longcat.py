"""LongCat-Flash (longcat_flash): MLA decoder layers of two attention sublayers, two dense MLPs and a
shortcut MoE with zero-computation identity experts (models/zero_experts.py).

Notation
  T tokens (flat), D hidden, r = kv_lora_rank, r_q = q_lora_rank; per decoder layer, x [T, D]:
  a0 = x + attn_0(ln_in_0(x))                   attn_0 writes the layer's "latent" rows
  y  = ln_post_0(a0);  s = moe(y)               the shortcut MoE reads the first sublayer's output ...
  b  = a0 + mlp_0(y)
  c  = b + attn_1(ln_in_1(b))                   attn_1 writes the layer's "latent_1" rows
  out = c + mlp_1(ln_post_1(c)) + s             ... and is added at the very end
  Each attention is MLA (models/deepseek.py MLAAttention) with q x sqrt(D / r_q) (nope and rope parts,
  before the rope) and c_kv = kv_a_layernorm(.) x sqrt(D / r) before caching, k_pe unscaled (transformers'
  LongcatFlashMLA.forward); the cached row is the scaled one, so every attention path reads it unchanged.
  Where a scale is a power of two it is folded into the weight at load (q_b_proj, kv_a_layernorm: exact,
  config/model_parts.py LatentScale); otherwise q_b_proj / kv_a_layernorm multiply by it after their own op,
  in the reference's order.
Parameter names follow the checkpoint: model.layers.N.self_attn.{0,1}.*, mlps.{0,1}.*,
input_layernorm.{0,1}, post_attention_layernorm.{0,1}, mlp.router.classifier, mlp.experts.E.*.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config.layer_kinds import sublayer_states
from mlaserve.config.model import ModelConfig
from mlaserve.models.deepseek import AllReduce, MLAAttention, MLAForCausalLM, Selections, single_process
from mlaserve.models.layers import RMSNorm, RotaryEmbedding, SwiGLU
from mlaserve.models.zero_experts import ZeroExpertMoE

if TYPE_CHECKING:
    from mlaserve.cache.model_cache import LayerState
    from mlaserve.executor.step_context import StepContext


class ScaledLinear(nn.Linear):
    """x W^T, then x scale: q_b_proj when sqrt(D / r_q) is not a power of two (the reference scales the output)."""

    def __init__(self, inp: int, out: int, scale: float) -> None:
        super().__init__(inp, out, bias=False)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) * self.scale


class ScaledRMSNorm(RMSNorm):
    """RMSNorm, then x scale: kv_a_layernorm when sqrt(D / r) is not a power of two (the reference's order)."""

    def __init__(self, dim: int, eps: float, scale: float) -> None:
        super().__init__(dim, eps)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * self.scale


class LongcatAttention(MLAAttention):
    """MLAAttention with LongCat's LoRA-rank scaling (folded into the weights at load, or applied after)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, cache_state: str) -> None:
        super().__init__(cfg, layer_idx, cache_state)
        s = cfg.latent_scale
        h = cfg.num_heads
        if not s.q_folded:
            self.q_b_proj = ScaledLinear(cfg.q_lora_rank, h * cfg.qk_head_dim, s.q)
        if not s.kv_folded:
            self.kv_a_layernorm = ScaledRMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps, s.kv)
        self.scales_folded = False  # fold_latent_scales sets it, once

    def native_unfit(self) -> str | None:
        if not self.cfg.latent_scale.kv_folded:
            return (
                f"c_kv x {self.cfg.latent_scale.kv:.6g} (sqrt(hidden / kv_lora_rank), not a power of two) follows "
                "kv_a_layernorm, which the native latent write does not apply"
            )
        return super().native_unfit()

    def fold_latent_scales(self) -> None:
        """Multiply the weights by the scales that are powers of two (exact), once, after the weights are filled."""
        if self.scales_folded:
            raise RuntimeError("the LongCat latent scales were folded into these weights already")
        s = self.cfg.latent_scale
        with torch.no_grad():
            if s.q_folded:
                self.q_b_proj.weight.mul_(s.q)
            if s.kv_folded:
                self.kv_a_layernorm.weight.mul_(s.kv)
        self.scales_folded = True


class LongcatDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, all_reduce: AllReduce = single_process) -> None:
        super().__init__()
        if all_reduce is not single_process:
            raise ValueError("LongCat-Flash layers are not split across ranks (tensor_parallel_size 1)")
        d, names = cfg.hidden_size, sublayer_states(cfg)
        self.self_attn = nn.ModuleList(LongcatAttention(cfg, layer_idx, name) for name in names)
        self.mlps = nn.ModuleList(SwiGLU(d, cfg.intermediate_size) for _ in names)
        self.input_layernorm = nn.ModuleList(RMSNorm(d, cfg.rms_norm_eps) for _ in names)
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(d, cfg.rms_norm_eps) for _ in names)
        self.mlp = ZeroExpertMoE(d, cfg.moe)
        self.native_layer = None  # no one-call decode layer for this structure (MLAForCausalLM.forward asks)

    def forward(
        self, x: torch.Tensor, step: StepContext, rope: RotaryEmbedding, state: LayerState, prev: Selections
    ) -> tuple[torch.Tensor, Selections]:
        h, _ = self.self_attn[0](self.input_layernorm[0](x), step, rope, state, None)
        x = x + h
        del h  # not read again: freed before the MLPs make their temporaries (as DecoderLayer)
        y = self.post_attention_layernorm[0](x)
        shortcut = self.mlp(y)
        x = x + self.mlps[0](y)
        h, _ = self.self_attn[1](self.input_layernorm[1](x), step, rope, state, None)
        x = x + h
        del h
        return x + self.mlps[1](self.post_attention_layernorm[1](x)) + shortcut, prev


class LongcatForCausalLM(MLAForCausalLM):
    def __init__(self, cfg: ModelConfig, vocab_start: int = 0, all_reduce: AllReduce = single_process) -> None:
        super().__init__(cfg, vocab_start, all_reduce, layer_cls=LongcatDecoderLayer)

    def fold_latent_scales(self) -> str:
        """After the weight fill: the power-of-two scales into their weights. -> the load report's line."""
        for layer in self.model.layers:
            for attn in layer.self_attn:
                attn.fold_latent_scales()
        s = self.cfg.latent_scale
        parts = [
            f"q x {s.q:.6g} " + ("folded into q_b_proj" if s.q_folded else "after q_b_proj"),
            f"c_kv x {s.kv:.6g} " + ("folded into kv_a_layernorm" if s.kv_folded else "after kv_a_layernorm"),
        ]
        return "LongCat latent scales: " + "; ".join(parts)

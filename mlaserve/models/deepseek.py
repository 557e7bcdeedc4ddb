"""MLA causal LM for DeepSeek-V2/V3/V3.2, Kimi-K2, GLM-4.7-Flash and GLM-5, one class selected by config.

Notation
  T tokens (flat), D hidden, H heads, r = kv_lora_rank, dn/dr/dv = nope/rope/v head dims
  x      [T, D]             hidden states
  c_q    [T, q_lora_rank]   query latent (q_a_layernorm(q_a_proj(x))), also the DSA indexer's input
  q_nope [T, H, dn], q_pe [T, H, dr]
  c_kv   [T, r]             kv_a_layernorm of the compressed kv; k_pe [T, dr] rotated, shared by heads
  cache  [S, r + dr]        this layer's paged latent rows [c_kv | k_pe]
Parameter names follow the Hugging Face checkpoints (in-memory layout: experts stacked).
The forward pass executes `step.plan`; no layer looks at a shape to pick its path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..attention.metadata import SegmentTensors, build_segment_tensors
from ..attention.router import AttentionPlan
from ..attention.torch_ref import absorbed_attention, decompressed_attention
from ..config import ModelConfig
from ..forward_batch import ForwardBatch
from .layers import RMSNorm, RotaryEmbedding, SwiGLU
from .moe import MoE


@dataclass(frozen=True)
class StepContext:
    """Everything a layer needs about this step, computed once before the layers run."""

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    plan: AttentionPlan
    segments: tuple[SegmentTensors, ...]
    cos: torch.Tensor  # [T, dr/2]
    sin: torch.Tensor

    @staticmethod
    def build(batch: ForwardBatch, plan: AttentionPlan, rope: RotaryEmbedding, dtype: torch.dtype) -> "StepContext":
        cos, sin = rope.cos_sin(batch.positions, dtype)
        segs = tuple(build_segment_tensors(batch, s) for s in plan.segments)
        return StepContext(batch.positions, batch.slot_mapping, plan, segs, cos, sin)


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.num_heads, cfg.hidden_size
        bias = cfg.attention_bias
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=bias)

    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj per head: W_UK [H, dn, r] and W_UV [H, dv, r] (no copies)."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def project_q(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (q [T, H, dn + dr], c_q [T, q_lora_rank] or None)."""
        if self.cfg.q_lora_rank:
            c_q = self.q_a_layernorm(self.q_a_proj(x))
            return self.q_b_proj(c_q).unflatten(-1, (self.cfg.num_heads, -1)), c_q
        return self.q_proj(x).unflatten(-1, (self.cfg.num_heads, -1)), None

    def forward(self, x: torch.Tensor, step: StepContext, rope: RotaryEmbedding, cache: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        q, _ = self.project_q(x)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = rope(q_pe, step.cos, step.sin)
        k_pe = rope(k_pe, step.cos, step.sin)
        # Write first: each segment then reads its context *and* this step's rows from the cache.
        cache.index_copy_(0, step.slot_mapping, torch.cat([c_kv, k_pe], dim=-1).to(cache.dtype))
        out = x.new_empty(x.shape[0], cfg.num_heads, cfg.v_head_dim)
        for seg in step.segments:
            out[seg.out_index] = self.attend(q_nope, q_pe, cache, seg)[seg.q_valid]
        return self.o_proj(out.flatten(1))

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, seg: SegmentTensors,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        if seg.segment.path == "absorbed":
            w_uk, w_uv = self.w_uk_uv()
            return absorbed_attention(q_nope, q_pe, cache, w_uk, w_uv, seg, cfg.softmax_scale, allowed)
        return decompressed_attention(q_nope, q_pe, cache, self.kv_b_proj.weight, seg, cfg.softmax_scale,
                                      cfg.qk_nope_head_dim, allowed)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(cfg)
        if cfg.mlp_layer_types[layer_idx] == "moe":
            self.mlp = MoE(cfg.hidden_size, cfg.moe)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, step: StepContext, rope: RotaryEmbedding, cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), step, rope, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MLAForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.rope)

    def forward(self, input_ids: torch.Tensor, step: StepContext, caches: list[torch.Tensor]) -> torch.Tensor:
        """-> final hidden states [T, D] (normed)."""
        x = self.model.embed_tokens(input_ids)
        for layer, cache in zip(self.model.layers, caches):
            x = layer(x, step, self.rope, cache)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

"""GLM-5.3-Flash's text model (glm5_next): KDA and NoPE MLA(+ pooled DSA indexer) layers inside an mHC residual.

Notation
  T tokens (flat), N hc_mult streams, D hidden
  h      [T, N, D]   the residual streams: the embedding copied into all N, mixed around every block
  block input  x = attn_hc(h) (pre-weighted sum of the streams) -> input_layernorm -> KDA | MLA -> y [T, D]
  streams      h' = post * y + comb^T h   (models/deepseek_v4/hyper.py expand), then the same around the MLP
  final        norm(mean_N(h))            (MeanHead: the streams' unweighted mean, no weights)
Each layer's attention is the engine's module of its declared kind (config/layer_kinds.py): a KDA layer is
models/kda's KimiDeltaAttention with `A_log` stored [H], an MLA layer models/deepseek.py's
MLAAttention (NoPE: qk_rope_head_dim 0). The MLP of each layer is dense or MoE as mlp_layer_types says, both with
swiglu_limit's clamps. The pooled indexer is held by its MLA layers (models/pooled_indexer.py) and runs the step's
pooled route (attention/router.py: top index_topk // kpool pools + the incomplete tail; docs/GLM5_NEXT.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mlaserve.config.layer_kinds import attention_kind
from mlaserve.config.model import ModelConfig
from mlaserve.models.deepseek import AllReduce, MLAAttention, MLAForCausalLM, Selections, single_process
from mlaserve.models.deepseek_v4.hyper import HyperConnection, expand, make_head
from mlaserve.models.kda.layer import KimiDeltaAttention
from mlaserve.models.layers import RMSNorm, RotaryEmbedding, SwiGLU
from mlaserve.models.moe import MoE

if TYPE_CHECKING:
    from mlaserve.cache.model_cache import LayerState, ModelCache
    from mlaserve.executor.step_context import StepContext


class Glm5NextLinearAttention(KimiDeltaAttention):
    """KDA with GLM-5.3-Flash's checkpoint layout: `A_log` stored [H] (Kimi-Linear's is [1, 1, H, 1]); the gate reads
    it as [H, 1] either way. Everything else, the q/k/v_conv1d and the flat forget-gate tensors included, is named
    as Kimi-Linear's (transformers' conversion mapping writes them so)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.A_log = nn.Parameter(torch.empty(cfg.kda.num_heads))


class Glm5NextDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, all_reduce: AllReduce = single_process) -> None:
        super().__init__()
        if all_reduce is not single_process:
            raise ValueError("glm5_next runs on one process (its KDA layers and mHC streams are not split)")
        kda = attention_kind(cfg, layer_idx) == "kda"
        self.self_attn = Glm5NextLinearAttention(cfg, layer_idx) if kda else MLAAttention(cfg, layer_idx)
        limit = cfg.swiglu_limit
        if cfg.mlp_layer_types[layer_idx] == "moe":
            self.mlp = MoE(cfg.hidden_size, cfg.moe, limit)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, limit)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg.hidden_size, cfg.hyper, cfg.rms_norm_eps)
        self.ffn_hc = HyperConnection(cfg.hidden_size, cfg.hyper, cfg.rms_norm_eps)
        self.native_layer = None  # no fused native decode layer for this family: every step runs per op

    def forward(
        self, h: torch.Tensor, step: StepContext, rope: RotaryEmbedding, state: LayerState, prev: Selections
    ) -> tuple[torch.Tensor, Selections]:
        """h [T, N, D] -> [T, N, D]. A KDA layer passes `prev` (the last full indexer layer's selection) on."""
        post, comb, x = self.attn_hc(h)
        y, selections = self.self_attn(self.input_layernorm(x), step, rope, state, prev)
        h = expand(post, comb, y, h)
        post, comb, x = self.ffn_hc(h)
        return expand(post, comb, self.mlp(self.post_attention_layernorm(x)), h), selections


class Glm5NextForCausalLM(MLAForCausalLM):
    def __init__(self, cfg: ModelConfig, vocab_start: int = 0, all_reduce: AllReduce = single_process) -> None:
        super().__init__(cfg, vocab_start, all_reduce, layer_cls=Glm5NextDecoderLayer)
        self.hc_head = make_head(cfg.hidden_size, cfg.hyper, cfg.rms_norm_eps)  # MeanHead: no weights

    def forward(self, input_ids: torch.Tensor, step: StepContext, cache: ModelCache, native=None) -> torch.Tensor:
        """-> final hidden states [T, D] (normed). `native` is always None here (no fused decode layers)."""
        x = self.embed(input_ids)
        h = x.unsqueeze(1).expand(-1, self.cfg.hyper.hc_mult, -1).contiguous()
        selections: Selections = None
        for i, layer in enumerate(self.model.layers):
            h, selections = layer(h, step, self.rope, cache.layers[i], selections)
        return self.model.norm(self.hc_head(h))

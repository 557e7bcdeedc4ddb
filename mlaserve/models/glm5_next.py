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
Speculative decoding: the MTP layer (models/mtp.py, a plain-residual MLA+DSA block on the final hidden state) drafts;
a verify step's tape and rollback put the KDA states back after rejected drafts (models/rollback.py's protocol,
models/kda/rollback.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mlaserve.config.layer_kinds import attention_kind
from mlaserve.config.model import ModelConfig
from mlaserve.models.deepseek import AllReduce, MLAAttention, MLAForCausalLM, Selections, single_process
from mlaserve.models.deepseek_v4.hyper import HyperConnection, make_head
from mlaserve.models.kda.layer import KimiDeltaAttention
from mlaserve.models.kda.rollback import KDATape, rollback
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
        self.kda = attention_kind(cfg, layer_idx) == "kda"  # decided once: a KDA layer also fills a verify tape
        self.self_attn = Glm5NextLinearAttention(cfg, layer_idx) if self.kda else MLAAttention(cfg, layer_idx)
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
        self,
        h: torch.Tensor,
        step: StepContext,
        rope: RotaryEmbedding,
        state: LayerState,
        prev: Selections,
        tape: KDATape | None = None,
    ) -> tuple[torch.Tensor, Selections]:
        """h [T, N, D] -> [T, N, D]. A KDA layer passes `prev` (the last full indexer layer's selection) on and keeps
        its inputs of the verifying rows on a verify step's `tape` (the MLA layers' rows need no rollback)."""
        post, comb, x = self.attn_hc(h)
        if self.kda:
            y, selections = self.self_attn(self.input_layernorm(x), step, rope, state, prev, tape)
        else:
            y, selections = self.self_attn(self.input_layernorm(x), step, rope, state, prev)
        h = self.attn_hc.expand(post, comb, y, h)
        del y  # not read again: freed before the MLP makes its temporaries (as DecoderLayer)
        post, comb, x = self.ffn_hc(h)
        return self.ffn_hc.expand(post, comb, self.mlp(self.post_attention_layernorm(x)), h), selections


class Glm5NextForCausalLM(MLAForCausalLM):
    def __init__(self, cfg: ModelConfig, vocab_start: int = 0, all_reduce: AllReduce = single_process) -> None:
        super().__init__(cfg, vocab_start, all_reduce, layer_cls=Glm5NextDecoderLayer)
        self.hc_head = make_head(cfg.hidden_size, cfg.hyper, cfg.rms_norm_eps)  # MeanHead: no weights

    # the rollback protocol (models/rollback.py): a verify step's KDA states can be put back (models/kda/rollback.py)
    rolls_back = True

    def forward(
        self, input_ids: torch.Tensor, step: StepContext, cache: ModelCache, native=None, tape: KDATape | None = None
    ) -> torch.Tensor:
        """-> final hidden states [T, D] (normed; the MTP layer's input). `native` is always None here (no fused
        decode layers); tape: a verify step's KDATape (verify_tape), which the KDA layers fill."""
        x = self.embed(input_ids)
        h = x.unsqueeze(1).expand(-1, self.cfg.hyper.hc_mult, -1).contiguous()
        selections: Selections = None
        for i, layer in enumerate(self.model.layers):
            h, selections = layer(h, step, self.rope, cache.layers[i], selections, tape)
        return self.model.norm(self.hc_head(h))

    def verify_tape(self, step: StepContext, cache: ModelCache, request_ids: tuple[str, ...]) -> KDATape | None:
        """The verifying slots' KDA states before the step (None when no sequence verifies drafts)."""
        return KDATape.build(step, cache, self.cfg.kda.layers, request_ids)

    def rollback(self, tape: KDATape, kept: list[int], cache: ModelCache, page_size: int) -> None:
        """After the verdict: kept[j] tokens of the tape's sequence j stay; the KDA states of the rest are put back.
        page_size is the protocol's (the KDA states have no paged rows to drop)."""
        layers = {i: self.model.layers[i].self_attn for i in self.cfg.kda.layers}
        with torch.inference_mode():
            rollback(tape, kept, cache, layers)

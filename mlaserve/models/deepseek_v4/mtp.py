"""DeepSeek-V4's multi-token-prediction (MTP) layer: one more V4 decoder block after the last layer, fed the
trunk's mHC streams and the next token, used as the built-in draft model (speculative="mtp").

transformers 5.24 does not build it (it ignores `mtp.*` at load); the layer follows DeepSeek's release
(`MTPBlock` of its inference code, as vLLM's DeepSeekV4MultiTokenPredictorLayer runs it):

Notation (i a position, t a token, N hc_mult, D hidden)
  H_i       [N, D]  the trunk's residual streams after its last layer, before its hc_head collapse
  Emb       the trunk's token embedding (shared: the release stores none for the MTP layer)
  x_i       [N, D]  e_proj(enorm(Emb(t_{i+1})))  (one row, added to every stream)  +  h_proj(hnorm(H_i))
                    (hnorm and h_proj act on each stream: D -> D, the same weights for every stream)
  G_i       [N, D]  Block(x_i): a V4 decoder layer (mHC around attention and MoE), sliding window only
                    (the release's MTP block has no compressor tensors), learned routing
  logits_i  = head(norm(hc_head(G_i)))     its own hc_head_{fn,base,scale} and norm; the trunk's head
Row i predicts t_{i+2}. Deeper drafts reuse the layer on its own output streams: H <- G_i, t <- the draft.
The release keeps e_proj and h_proj apart (DeepSeek-V3's MTP concatenates [e; h] into one eh_proj).

Checkpoint names (loading/deepseek_v4_names.py): released `mtp.{j}.{e_proj,h_proj,enorm,hnorm,norm}.weight`,
`mtp.{j}.hc_head_{fn,base,scale}` and the block under the layer's own released names (`mtp.{j}.attn.wq_a`,
`mtp.{j}.ffn.experts.E.w1`, `mtp.{j}.hc_attn_fn`, ...); or the module names below (`mtp.{j}.self_attn.*`, ...).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from mlaserve.config.deepseek_v4 import DeepseekV4Config
from mlaserve.models.deepseek_v4.attention import Span
from mlaserve.models.deepseek_v4.hyper import HyperHead
from mlaserve.models.deepseek_v4.model import V4DecoderLayer
from mlaserve.models.deepseek_v4.norm import RMSNorm
from mlaserve.models.deepseek_v4.rope import V4RopeTables
from mlaserve.models.deepseek_v4.step_update import LayerStep


def block_config(cfg: DeepseekV4Config) -> DeepseekV4Config:
    """The trunk's config extended by the MTP block: layer num_layers, sliding window only, learned routing."""
    return replace(
        cfg,
        num_layers=cfg.num_layers + 1,
        layer_kinds=cfg.layer_kinds + ("sliding",),
        mlp_layer_types=cfg.mlp_layer_types + ("moe",),
    )


def mtp_config(cfg: DeepseekV4Config) -> DeepseekV4Config:
    """A one-layer config of the MTP block alone (its cache: one sliding layer's ring per request)."""
    return replace(cfg, num_layers=1, layer_kinds=("sliding",), mlp_layer_types=("moe",))


class V4MTPLayer(V4DecoderLayer):
    """The block's parameters keep the decoder layer's names (self_attn.*, mlp.*, attn_hc.*, ...)."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__(block_config(cfg), cfg.num_layers)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hc_mult = cfg.hc.hc_mult
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.norm = RMSNorm(d, eps)
        self.hc_head = HyperHead(d, cfg.hc, eps)

    def combine(self, embedded: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """embedded [T, D] = Emb(t_{i+1}), streams [T, N, D] = H_i -> the block's input streams [T, N, D]."""
        return self.e_proj(self.enorm(embedded)).unsqueeze(1) + self.h_proj(self.hnorm(streams))

    def draft(
        self,
        embedded: torch.Tensor,
        streams: torch.Tensor,
        ids: torch.Tensor,
        positions: torch.Tensor,
        spans: list[Span],
        tables: V4RopeTables,
        step: LayerStep | None = None,
    ) -> torch.Tensor:
        """-> G [T, N, D]: the block over the combined streams (spans: each sequence's sliding state)."""
        return super().forward(self.combine(embedded, streams), ids, positions, spans, tables, False, step)

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """G [T, N, D] -> [T, D]: the layer's own hc_head, then its norm (the trunk's head follows)."""
        return self.norm(self.hc_head(streams))

"""DeepSeek Sparse Attention's lightning indexer: which cached rows each query may attend to.

Notation
  Hi index heads, Di index_head_dim, dr = qk_rope_head_dim (rope on the first dr dims: [rope | pass])
  q_idx  [T, Hi, Di]   wq_b(c_q), c_q = the main attention's query latent
  k_idx  [T, Di]       LayerNorm(wk(x)) (with bias, eps 1e-6), cached per token like the latent rows
  w      [T, Hi]       weights_proj(x) * Hi^-0.5 (fp32)
  score(t, s) = sum_h w[t, h] * ReLU(q_idx[t, h] . k_idx[s] * Di^-0.5)     (fp32, causal)
  keep the top min(index_topk, L) positions per query (L = the segment's padded key length; padded
  and future keys score -inf, so a query with fewer valid keys than index_topk keeps all of them).
Rope layout: half-split for deepseek_v32, interleaved for glm_moe_dsa (transformers is the reference).

How the keys are scored (fp32, or bf16 with fp32 rescoring) is the attention backend's job:
see attention/backends/torch_index.py and the segment's `index_scoring`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mlaserve.attention.metadata import SegmentTensors
from mlaserve.config.model import IndexerConfig
from mlaserve.models.layers import apply_rope


@dataclass(frozen=True)
class Selection:
    """Top-k rows per query of one segment: positions [B, Q, k] into the segment's key axis."""

    index: torch.Tensor
    valid: torch.Tensor  # [B, Q, k] the chosen position is a real, causal key

    def as_mask(self, length: int) -> torch.Tensor:
        """[B, Q, L] True at selected positions (for the masked-MHA form). An entry that is not valid is sent to a
        spare column L and dropped: a pooled selection (models/pooled_indexer.py) parks its unused entries at
        position 0, which a valid entry may also name, and a scatter of both values there has no defined winner."""
        b, q, _ = self.index.shape
        mask = torch.zeros(b, q, length + 1, dtype=torch.bool, device=self.index.device)
        return mask.scatter_(2, self.index.masked_fill(~self.valid, length), True)[..., :length]


class Indexer(nn.Module):
    def __init__(self, hidden: int, q_lora_rank: int, rope_dim: int, cfg: IndexerConfig) -> None:
        super().__init__()
        self.cfg, self.rope_dim = cfg, rope_dim
        self.wq_b = nn.Linear(q_lora_rank, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(hidden, cfg.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, cfg.n_heads, bias=False)  # kept fp32, as the reference

    def project(
        self, x: torch.Tensor, c_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q_idx [T, Hi, Di], k_idx [T, Di] (both roped), w [T, Hi] fp32."""
        dr = self.rope_dim
        q = self.wq_b(c_q).unflatten(-1, (self.cfg.n_heads, -1))
        k = self.k_norm(self.wk(x))
        il = self.cfg.rope_interleaved
        q = torch.cat([apply_rope(q[..., :dr], cos, sin, il), q[..., dr:]], dim=-1)
        k = torch.cat([apply_rope(k[..., :dr], cos, sin, il), k[..., dr:]], dim=-1)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.cfg.n_heads**-0.5
        return q, k, w

    def select(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, seg: SegmentTensors, topk: int, backend
    ) -> Selection:
        """keys: this layer's indexer key cache [S, Di]. The backend scores every key of the segment
        and keeps the top-k."""
        # Di^-0.5 > 0 commutes with ReLU, so it is folded into the small w instead of a pass over [Q, Hi, L].
        index = backend.index_topk(q, w * self.cfg.head_dim**-0.5, keys, seg, topk)
        return Selection(index, seg.mask.gather(2, index))

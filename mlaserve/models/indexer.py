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

Scoring (the segment's `index_scoring`, decided by the router)
  fp32            q and every key upcast to fp32, one GEMM: the reference's arithmetic.
  bf16_then_fp32  over bf16 keys: score every key with bf16 GEMMs (exact products, each
                  result rounded once to bf16: relative error u = 2^-8 per head score, weight and
                  sum), which bounds each fp32 score within +-E, E = BF16_SCORE_ERROR *
                  sum_h |w_h| ReLU(s~_h). Any key whose upper bound reaches the k-th largest lower
                  bound may be in the fp32 top-k; only those C candidates (C ~ k) are rescored in
                  fp32. Same top-k as fp32 scoring; the full pass reads bf16 keys, not an fp32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mlaserve.attention.backends.torch_backend import gather_rows, query_blocks
from mlaserve.attention.metadata import SegmentTensors
from mlaserve.config.model import IndexerConfig
from mlaserve.models.layers import apply_rope


@dataclass(frozen=True)
class Selection:
    """Top-k rows per query of one segment: positions [B, Q, k] into the segment's key axis."""

    index: torch.Tensor
    valid: torch.Tensor  # [B, Q, k] the chosen position is a real, causal key

    def as_mask(self, length: int) -> torch.Tensor:
        """[B, Q, L] True at selected positions (for the masked-MHA form)."""
        b, q, _ = self.index.shape
        return torch.zeros(b, q, length, dtype=torch.bool).scatter_(2, self.index, self.valid)


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

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, seg: SegmentTensors, topk: int) -> Selection:
        """keys: this layer's indexer key cache [S, Di]. Scores every key of the segment, keeps top-k."""
        qb = q[seg.q_index]  # [B, Q, Hi, Di]
        kb = gather_rows(keys, seg.kv_slots)  # [B, L, Di]
        # Di^-0.5 > 0 commutes with ReLU, so it is folded into the small w instead of a pass over [Q, Hi, L].
        wb = w[seg.q_index] * self.cfg.head_dim**-0.5  # [B, Q, Hi]
        (b, nq, hi, di), length = qb.shape, kb.shape[1]
        k = min(topk, length)
        # Per block of queries: a long prompt chunk would hold [Q, Hi, L] scores at once.
        if seg.segment.index_scoring == "bf16_then_fp32":
            per_query = b * (2 * hi * length + 24 * length + (k + k // 4) * (6 * di + 4 * hi))
            decode = seg.segment.phase == "decode"
            index = torch.cat(
                [
                    _top_k_bf16_then_fp32(qb[:, s], kb, wb[:, s], seg.mask[:, s], k, decode)
                    for s in query_blocks(nq, per_query)
                ],
                dim=1,
            )
        else:
            kf = kb.float()
            index = torch.cat(
                [
                    _top_k(_scores(qb[:, s].float(), kf, wb[:, s]), seg.mask[:, s], k)
                    for s in query_blocks(nq, 4 * b * (hi + 2) * length)
                ],
                dim=1,
            )
        return Selection(index, seg.mask.gather(2, index))


# Bound on |approximate - fp32 score| relative to E~ = sum_h |w_h| ReLU(s~_h), both from bf16 GEMMs.
# Three roundings to bf16 (u = 2^-8 each: the head scores, w, the head-weighted sum) give ~3.03u;
# 4u leaves room for fp32 accumulation-order differences between the two stages.
BF16_SCORE_ERROR = 2.0**-6


def _scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q [B, Q, Hi, Di], k [B, L, Di], w [B, Q, Hi] -> sum_h w_h ReLU(q_h . k) [B, Q, L] (k's dtype GEMM)."""
    b, nq, hi, di = q.shape
    # One GEMM over all (query, head) pairs, then ReLU in place: this is the per-key cost of DSA.
    per_head = torch.matmul(q.reshape(b, nq * hi, di), k.transpose(1, 2)).view(b, nq, hi, -1).relu_()
    return torch.matmul(w.unsqueeze(2), per_head.float()).squeeze(2)


def _top_k(scores: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k best allowed scores [B, Q, k]. The set is all that matters (attention sums
    over it), so it is not sorted."""
    return scores.masked_fill_(~mask, float("-inf")).topk(k, dim=-1, sorted=False).indices


def _bf16_head_sums(q: torch.Tensor, keys: torch.Tensor, w2: torch.Tensor, decode: bool) -> torch.Tensor:
    """sum_h w2[..., h, j] ReLU(q_h . key) for j in (w, |w|), all bf16 GEMMs: -> [B, Q, L, 2].
    The layout follows the phase, as measured on CPU BLAS: a decode query (Q*Hi = 32 rows) runs
    keys @ q^T, several times faster than q @ keys^T, which copies the keys; a block of prompt queries
    runs q @ keys^T, whose [Q, Hi, L] result feeds the head sums without a transposed copy (22 vs 32 ms
    for 59 queries x 10K keys)."""
    b, nq, hi, di = q.shape
    if decode:
        per_head = torch.matmul(keys, q.reshape(b, nq * hi, di).transpose(1, 2)).relu_()  # [B, L, Q*Hi]
        return torch.matmul(per_head.view(b, -1, nq, hi).transpose(1, 2), w2)
    per_head = torch.matmul(q.reshape(b, nq * hi, di), keys.transpose(1, 2)).relu_()  # [B, Q*Hi, L]
    return torch.matmul(w2.transpose(2, 3), per_head.view(b, nq, hi, -1)).transpose(2, 3)


def _top_k_bf16_then_fp32(
    q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, k: int, decode: bool = True
) -> torch.Tensor:
    """The fp32 top-k of bf16 q/keys without an fp32 pass over every key (see the notation block)."""
    b, nq, hi, di = q.shape
    both = _bf16_head_sums(q, keys, torch.stack([w, w.abs()], dim=-1).to(keys.dtype), decode)  # [B, Q, L, 2]
    approx, err = both[..., 0].float(), both[..., 1].float() * BF16_SCORE_ERROR
    upper = (approx + err).masked_fill_(~mask, float("-inf"))
    lower = (approx - err).masked_fill_(~mask, float("-inf"))
    kth_lower = lower.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    # k keys score at least kth_lower, so a key whose upper bound is below it cannot be in the top-k.
    # A query with fewer than k allowed keys (kth_lower = -inf) keeps all of them, and they rank first
    # by upper bound, so it needs no more than k candidates: it must not widen everyone's rescoring to L.
    need = (upper >= kth_lower).sum(dim=-1).masked_fill_(kth_lower.squeeze(-1) == float("-inf"), k)
    n_cand = int(need.max())  # host sync: the rescoring's width
    cand = upper.topk(n_cand, dim=-1, sorted=False).indices  # [B, Q, C]
    flat = (cand + torch.arange(b).view(b, 1, 1) * keys.shape[1]).view(-1)  # rows of keys viewed [B * L, Di]
    rows = gather_rows(keys.reshape(-1, di), flat).view(b, nq, n_cand, di)
    exact = torch.matmul(q.float(), rows.float().transpose(2, 3)).relu_()  # [B, Q, Hi, C]
    exact = torch.matmul(w.unsqueeze(2), exact).squeeze(2)  # [B, Q, C]
    pick = _top_k(exact, mask.gather(2, cand), k)
    return cand.gather(2, pick)

"""DSA index scoring for the torch backend: the top-k of sum_h w_h ReLU(q_h . key) over the key cache.

Notation
  Hi index heads, Di index_head_dim; B, Q, L the segment's requests, max query and sequence length
  q [B, Q, Hi, Di] queries, keys [B, L, Di] gathered key rows, w [B, Q, Hi] head weights (Di^-0.5 folded in)
Scoring (the segment's `index_scoring`, decided by the router)
  fp32            q and every key upcast to fp32, one GEMM: the reference's arithmetic.
  bf16            q and every key rounded to bf16 (to nearest even), then scored as fp32 is: the engine's
                  index_scores="bf16" (config/index_scores.py), the C kernel's values (csrc/indexer.c).
  bf16_then_fp32  over bf16 keys: score every key with bf16 GEMMs (exact products, each
                  result rounded once to bf16: relative error u = 2^-8 per head score, weight and
                  sum), which bounds each fp32 score within +-E, E = BF16_SCORE_ERROR *
                  sum_h |w_h| ReLU(s~_h). Any key whose upper bound reaches the k-th largest lower
                  bound may be in the fp32 top-k; only those C candidates (C ~ k) are rescored in
                  fp32. Same top-k as fp32 scoring; the full pass reads bf16 keys, not an fp32 copy.
Long prompt chunks are scored per block of queries (a [Q, Hi, L] score tensor would not fit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mlaserve.attention.backends.blocks import gather_rows, query_blocks

if TYPE_CHECKING:
    from mlaserve.attention.metadata import SegmentTensors


def index_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, seg: SegmentTensors, topk: int) -> torch.Tensor:
    """q [N, Hi, Di], w [N, Hi], keys: the layer's key cache [S, Di] -> positions [B, Q, min(topk, L)]."""
    qb = gather_rows(q, seg.q_index)  # [B, Q, Hi, Di]
    kb = gather_rows(keys, seg.kv_slots)  # [B, L, Di]
    wb = gather_rows(w, seg.q_index)  # [B, Q, Hi]
    (b, nq, hi, di), length = qb.shape, kb.shape[1]
    k = min(topk, length)
    if seg.segment.index_scoring == "bf16_then_fp32":
        per_query = b * (2 * hi * length + 24 * length + (k + k // 4) * (6 * di + 4 * hi))
        decode = seg.segment.phase == "decode"
        blocks = query_blocks(nq, per_query)
        return torch.cat([_top_k_bf16_then_fp32(qb[:, s], kb, wb[:, s], seg.mask[:, s], k, decode) for s in blocks], 1)
    rounded = seg.segment.index_scoring == "bf16"
    kf = round_bf16(kb) if rounded else kb.float()
    qf = round_bf16(qb) if rounded else qb.float()
    blocks = query_blocks(nq, 4 * b * (hi + 2) * length)
    return torch.cat([_top_k(_scores(qf[:, s], kf, wb[:, s]), seg.mask[:, s], k) for s in blocks], dim=1)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (to nearest even) and widened back to fp32: the values index_scoring "bf16" scores."""
    return x.to(torch.bfloat16).float()


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
    flat = (cand + torch.arange(b, device=keys.device).view(b, 1, 1) * keys.shape[1]).view(
        -1
    )  # rows of keys viewed [B * L, Di]
    rows = gather_rows(keys.reshape(-1, di), flat).view(b, nq, n_cand, di)
    exact = torch.matmul(q.float(), rows.float().transpose(2, 3)).relu_()  # [B, Q, Hi, C]
    exact = torch.matmul(w.unsqueeze(2), exact).squeeze(2)  # [B, Q, C]
    pick = _top_k(exact, mask.gather(2, cand), k)
    return cand.gather(2, pick)

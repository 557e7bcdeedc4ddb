"""GLM-5.3-Flash's pooled DSA indexer: queries score pools of `kpool` consecutive tokens, not single tokens; the
top index_topk // kpool pools are expanded to their tokens, and the query's own incomplete pool (the tail) is
always kept.

Notation
  T tokens, D hidden, Hi index heads, Di index_head_dim, P kpool, c_q [T, q_lora_rank] the query latent
  q      [T, Hi, Di]  wq_b(c_q)                          (no rope: GLM-5.3-Flash is NoPE)
  k      [T, Di]      k_norm(wk(x)) (LayerNorm with bias, eps 1e-6)       cached per token
  gate   [T, Di]      x @ index_kpool_compress_gate^T                      cached per token
  w      [T, Hi]      weights_proj(x) Hi^-0.5 (fp32)
  pool p = tokens pP .. pP + P - 1 of the sequence, complete once its last token exists:
  pooled_p [Di] = sum_j softmax_j(gate_{pP+j} + ape_j) * k_{pP+j}   (softmax per channel over the pool's j;
                  ape = index_kpool_compress_ape [P, Di]); a complete pool never changes, so it is computed once
  score(t, p) = sum_h w[t, h] ReLU(q[t, h] . pooled_p Di^-0.5)   for pools complete at t ((p + 1) P <= t + 1)
  keep the top min(index_topk // P, pools complete at t) pools, expanded to their P tokens, plus the tail
  (t + 1 - (t + 1) % P .. t, at most P - 1 tokens): what the query's MLA attends.
transformers' Glm5NextTextIndexer rebuilds every pool from the cached per-token [k | gate] on every step; the
result is the same. Sequences start at token 0 here (no left padding), so pools are anchored at 0 as there.
In the engine (config/layer_kinds.py pooled_indexer_states): [k | gate] rows per token and one pooled row per
kpool tokens, both paged; a chunk of tokens context_len .. seq_len - 1 completes pools completed_pools(...) and
writes each one's row at pool_rows(...) of the block table (both in attention/pooled_metadata.py, which the
route and this layer read). The route (attention/router.py) is plain data: which
pools a step completes, whether it selects (some query has more complete pools than it keeps) and the ledger's
counts; `step` executes one layer's part; attention then reads the selected rows as DSA's sparse route does
(a Selection: positions on the segment's key axis).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from mlaserve.attention.backends.blocks import gather_rows, query_blocks
from mlaserve.config.model import IndexerConfig
from mlaserve.models.indexer import Selection

if TYPE_CHECKING:
    from mlaserve.attention.metadata import SegmentTensors
    from mlaserve.attention.pooled_metadata import PooledTensors


@dataclass(frozen=True)
class PooledSelection:
    """One sequence's queries' kept tokens: index [Q, K * P + P - 1] positions, valid [Q, K * P + P - 1]; and what
    the ledger records: pools scored per query (complete at its position), pools selected, tail lengths."""

    index: torch.Tensor
    valid: torch.Tensor
    pools_scored: torch.Tensor  # [Q]
    pools_selected: torch.Tensor  # [Q]
    tail: torch.Tensor  # [Q]


class PooledIndexer(nn.Module):
    """Parameters under the checkpoint's names (transformers' Glm5NextTextIndexer)."""

    def __init__(self, hidden: int, q_lora_rank: int, cfg: IndexerConfig) -> None:
        super().__init__()
        if cfg.kpool < 1:
            raise ValueError(f"a pooled indexer needs index_kpool >= 1, got {cfg.kpool}")
        self.cfg = cfg
        self.wq_b = nn.Linear(q_lora_rank, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(hidden, cfg.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, cfg.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(cfg.kpool, cfg.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(cfg.head_dim, hidden))

    def project(
        self, x: torch.Tensor, c_q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D], c_q [T, q_lora_rank] -> q [T, Hi, Di], k [T, Di], gate [T, Di], w [T, Hi] fp32."""
        q = self.wq_b(c_q).unflatten(-1, (self.cfg.n_heads, -1))
        k = self.k_norm(self.wk(x))
        gate = torch.nn.functional.linear(x, self.index_kpool_compress_gate)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.cfg.n_heads**-0.5
        return q, k, gate, w

    def pool(self, k: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Complete pools' keys: k, gate [n P, Di] (n whole pools' tokens) -> pooled [n, Di]. Each pool on its own:
        the caller computes a pool once, when its last token arrives, and keeps the row."""
        p = self.cfg.kpool
        logits = gate.float().unflatten(0, (-1, p)) + self.index_kpool_compress_ape.float()  # [n, P, Di]
        return (logits.softmax(dim=1).to(k.dtype) * k.unflatten(0, (-1, p))).sum(dim=1)

    def select(
        self, q: torch.Tensor, w: torch.Tensor, pooled: torch.Tensor, positions: torch.Tensor
    ) -> PooledSelection:
        """Queries of one sequence, or of B sequences (a leading [B] on every argument): q [(B,) Q, Hi, Di],
        w [(B,) Q, Hi], pooled [(B,) N, Di] (each sequence's complete pools up to its last query, in pool order;
        pools past a query's complete ones are never selected, so padding rows are unread), positions [(B,) Q]
        (the queries' token positions) -> the kept tokens per query (positions on the sequence's key axis)."""
        p, topk = self.cfg.kpool, self.cfg.topk
        scale = self.cfg.head_dim**-0.5
        scores = torch.relu(torch.einsum("...qhd,...nd->...qhn", q.float(), pooled.float()) * scale)  # [Q, Hi, N]
        scores = torch.einsum("...qh,...qhn->...qn", w, scores)
        n = pooled.shape[-2]
        complete = (positions + 1) // p  # pools complete at each query
        selectable = torch.arange(n, device=q.device) < complete[..., None]  # [Q, N]
        top = scores.masked_fill(~selectable, float("-inf")).topk(min(topk // p, n), dim=-1).indices  # [Q, k]
        return self.expand(top, selectable.gather(-1, top), positions, n)

    def expand(self, top: torch.Tensor, chosen: torch.Tensor, positions: torch.Tensor, n: int) -> PooledSelection:
        """The kept pools top [(B,) Q, k] (chosen: which of them are complete at the query) -> their tokens and the
        query's tail (the selection select returns; verify's selection pins rebuild one from pinned pools)."""
        p = self.cfg.kpool
        offsets = torch.arange(p, device=top.device)
        tokens = (top[..., None] * p + offsets).flatten(-2)  # [Q, k P]
        token_valid = chosen[..., None].expand(*chosen.shape, p).flatten(-2)
        tail_len = (positions + 1) % p
        tail_start = positions + 1 - tail_len
        tail = tail_start[..., None] + offsets[: p - 1]  # [Q, P - 1]
        tail_valid = offsets[: p - 1] < tail_len[..., None]
        index = torch.cat([tokens, tail], dim=-1)
        valid = torch.cat([token_valid, tail_valid], dim=-1)
        complete = ((positions + 1) // p).clamp(max=n)
        return PooledSelection(index.masked_fill(~valid, 0), valid, complete, chosen.sum(-1), tail_len)

    def step(
        self,
        x: torch.Tensor,
        c_q: torch.Tensor,
        slot_mapping: torch.Tensor,
        pooled: PooledTensors,
        segments: tuple[SegmentTensors, ...],
        index_rows: torch.Tensor,
        index_pools: torch.Tensor,
    ) -> tuple[Selection, ...] | None:
        """One layer's part of a pooled sparse step (attention/pooled_metadata.py has the index tensors): this step's
        [k | gate] rows written; each pool the step completes pooled once from the cached rows of its tokens (one
        gather over every sequence) and written to index_pools; then, on a selecting step, per segment (decode,
        prefill) one gather of its sequences' pooled keys and the batched selection, in query blocks whose scores
        fit the attention workspace. -> a Selection per segment (positions on its key axis), or None when the
        step selects nothing (every pool and the tail are kept: dense attention is the same attention)."""
        q, k, gate, w = self.project(x, c_q)
        index_rows.index_copy_(0, slot_mapping, torch.cat([k, gate], dim=-1).to(index_rows.dtype))
        if pooled.new_rows.numel():
            kg = index_rows.index_select(0, pooled.new_tokens)
            done = self.pool(*kg.split(self.cfg.head_dim, dim=-1))
            index_pools.index_copy_(0, pooled.new_rows, done.to(index_pools.dtype))
        if not pooled.segments:
            return None
        out = []
        for seg, tensors in zip(segments, pooled.segments):  # at most two: the decode and the prefill segment
            rows = tensors.pool_rows
            keys = index_pools.index_select(0, rows.flatten()).view(*rows.shape, -1)  # [B, N, Di]
            qs, ws = gather_rows(q, seg.q_index), gather_rows(w, seg.q_index)  # [B, Q, Hi, Di], [B, Q, Hi]
            pos = tensors.positions  # [B, Q]
            per_query = 3 * 4 * rows.shape[0] * self.cfg.n_heads * rows.shape[1]  # the [B, Hi, N] fp32 scores
            parts = [self.select(qs[:, s], ws[:, s], keys, pos[:, s]) for s in query_blocks(pos.shape[1], per_query)]
            out.append(Selection(torch.cat([p.index for p in parts], 1), torch.cat([p.valid for p in parts], 1)))
        return tuple(out)

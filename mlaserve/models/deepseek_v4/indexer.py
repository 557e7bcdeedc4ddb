"""The CSA lightning indexer: its own overlapping compressor at index_head_dim, a scorer, and top-k of the
causally visible compressed rows per query.

Notation
  S queries (positions t), T compressed rows of the layer so far, H index_n_heads, c index_head_dim
  m the CSA ratio, k = min(index_topk, T)
  q      [S, H, c]  q_b_proj(query latent), compress-table rope at t (no norm), then round_rows
  K      [T, c]     the indexer's compressed rows (its own pool), round_rows applied as they close
  round_rows        identity, or the official code's Hadamard rotation + FP4 rounding (official.py)
  w      [S, H]     weights_proj(x) * H^-1/2
  score  [S, T]     sum_h w_h * relu(q_h . K_s) * c^-1/2        (fp32)
Causal rule: row s pools tokens up to (s+1) m - 1, so query t may see it only when s < (t+1) // m.
Selection: top-k of the scores with the invisible rows at -inf; a pick that lands on an invisible row (a
query with fewer than k visible rows) is dropped. Returns the [S, T] boolean mask of attended rows.
Batched over a step's sequences (choose_step, the engine's path): queries padded to [B, S], each sequence's rows
padded to [B, Kp] (pad columns beyond its R_b rows, invisible by the causal rule), one scoring and one top-k for
the step. Ties: torch's top-k breaks a tie by the row's length (measured on the CPU: a row of 8 scores with five
exact zeros keeps a different zero once padded with -inf), so where the k-th and (k+1)-th scores of a query with
more than k visible rows are equal (in practice exact zeros: every head's relu at 0), the rows chosen are not
fixed by the scores alone: that sequence's selection is redone by the reference's own top-k over its unpadded
[n_b, R_b] scores, and the chosen rows are the reference's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.models.deepseek_v4.compressor import Compressor
from mlaserve.models.deepseek_v4.rope import V4RopeTables, rotate_trailing
from mlaserve.models.deepseek_v4.state import CompressedPool, CompressorCarry


def visible_rows(positions: torch.Tensor, num_rows: int, ratio: int) -> torch.Tensor:
    """[S] positions -> [S, T] True where query t may see compressed row s: s < (t + 1) // ratio."""
    rows = torch.arange(num_rows, device=positions.device)
    return rows[None, :] < ((positions + 1) // ratio)[:, None]


class Scorer(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.softmax_scale = head_dim**-0.5
        self.weights_scaling = heads**-0.5
        self.weights_proj = nn.Linear(hidden, heads, bias=False)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, hidden] -> w [S, H] (fp32)."""
        return self.weights_proj(x).float() * self.weights_scaling

    def forward(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """q [S, H, c], keys [T, c], weights [S, H] -> scores [S, T] (fp32)."""
        scores = F.relu(torch.matmul(q.float(), keys.float().t())) * self.softmax_scale  # [S, H, T]
        return (scores * weights.unsqueeze(-1)).sum(dim=1)

    def batch(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward for B sequences at once: q [B, S, H, c], keys [B, T, c], weights [B, S, H] -> [B, S, T]."""
        scores = F.relu(torch.matmul(q.float(), keys.float().transpose(1, 2).unsqueeze(1))) * self.softmax_scale
        return (scores * weights.unsqueeze(-1)).sum(dim=2)


class Indexer(Compressor):
    """An overlapping compressor at index_head_dim (parameter names as transformers' DeepseekV4Indexer, which
    inlines its compressor) plus the query projection and the scorer."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, topk: int, ratio: int, eps: float):
        super().__init__(hidden, head_dim, ratio, overlap=True, eps=eps)
        self.heads, self.head_dim, self.topk = heads, head_dim, topk
        self.q_b_proj = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.scorer = Scorer(hidden, heads, head_dim)

    def select(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        carry: CompressorCarry,
        pool: CompressedPool,
        tables: V4RopeTables,
    ) -> torch.Tensor:
        """-> [S, T] mask of the compressed rows each query attends (T = the layer's rows after this chunk)."""
        q, w = self.queries(x, q_latent, positions, tables)
        return self.select_rows(self.kv_proj(x), self.gate_proj(x), q, w, positions, carry, pool, tables)

    def queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, tables: V4RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's queries [S, H, c] (compress-table rope at their positions) and head weights [S, H]."""
        s = x.shape[0]
        cos, sin = tables.cos_sin("compress", positions, x.dtype)
        q = rotate_trailing(self.q_b_proj(q_latent).view(s, self.heads, self.head_dim), cos, sin)
        return self.round_rows(q), self.scorer.head_weights(x)

    def select_rows(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        q: torch.Tensor,
        weights: torch.Tensor,
        positions: torch.Tensor,
        carry: CompressorCarry,
        pool: CompressedPool,
        tables: V4RopeTables,
    ) -> torch.Tensor:
        """One sequence's projected rows and queries (projected with the step's tokens at once) -> [S, T] mask."""
        self.close(kv, gate, carry, pool, tables)  # the indexer's own compressed rows first
        return self.choose(q, weights, positions, pool)

    def choose(
        self, q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, pool: CompressedPool
    ) -> torch.Tensor:
        """Queries [S, H, c] and head weights [S, H] over the pool's rows (the chunk's windows already closed
        into it) -> [S, T] mask of the rows each query attends."""
        keys = pool.view()
        s, t = q.shape[0], keys.shape[0]
        if t == 0:
            return torch.zeros(s, 0, dtype=torch.bool, device=q.device)
        scores = self.scorer(q, keys, weights)
        visible = visible_rows(positions, t, self.ratio)
        return self.pick(scores.masked_fill(~visible, float("-inf")), visible)

    def pick(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """scores [..., T] (invisible rows at -inf), visible [..., T] -> the chosen rows' mask: top-k, k =
        min(index_topk, T), a pick on an invisible row dropped."""
        picks = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        return torch.zeros_like(visible).scatter_(-1, picks, True) & visible

    def choose_step(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        sizes: tuple[tuple[int, int], ...],
    ) -> torch.Tensor:
        """choose for a step's sequences at once: queries q [B, S, H, c] and weights [B, S, H] padded (zeros),
        positions [B, S] (-1 on pad slots), keys [B, Kp, c] each sequence's pool rows padded, sizes (n_b, R_b)
        per sequence (its queries and rows, plain ints) -> [B, S, Kp] mask of the rows each query attends."""
        b, s, kp = positions.shape[0], positions.shape[1], keys.shape[1]
        visible = visible_rows(positions.reshape(-1), kp, self.ratio).view(b, s, kp)
        if kp <= self.topk:  # every visible row fits: the reference chooses them all (its picks cover them)
            return visible
        scores = self.scorer.batch(q, keys, weights).masked_fill(~visible, float("-inf"))
        top = scores.topk(self.topk + 1, dim=-1)
        chosen = torch.zeros_like(visible).scatter_(-1, top.indices[..., : self.topk], True) & visible
        # a tie at the cutoff of a query with more than k visible rows: the reference's top-k on its own shape
        tied = (visible.sum(-1) > self.topk) & (top.values[..., self.topk - 1] == top.values[..., self.topk])
        for i in tied.any(dim=-1).nonzero().flatten().tolist():  # rare: exact equal scores
            n, rows = sizes[i]
            chosen[i, :n, :rows] = self.pick(scores[i, :n, :rows], visible[i, :n, :rows])
        return chosen

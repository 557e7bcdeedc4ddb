"""Index tensors of the pooled DSA route (GLM-5.3-Flash, models/pooled_indexer.py), built once per step from the
plan's plain data (the chunks' positions and block tables) and shared by every pooled layer of the step; and the
pools' geometry in plain ints (`completed_pools`: the pools a chunk completes, `pool_rows`: their paged rows), which
the route (attention/router.py) and the layer read.

Notation
  P kpool, ps page_size, n the pools this step completes (over every sequence), B a segment's sequences,
  N the most complete pools of a segment's sequences at their last query, Q the segment's longest chunk
  new_tokens [n P]  the per-token rows (index_rows: the latent rows' slots) of each completed pool's tokens, pool by
                    pool (a pool's first tokens may be in earlier chunks: their [k | gate] rows are cached)
  new_rows   [n]    each completed pool's row in index_pools (pool_rows: page * ps / P + offset / P)
  per selecting segment
  pool_rows  [B, N] the rows of each sequence's complete pools 0 .. seq_len // P - 1, then the pad row (zero, never
                    written): a query at t scores only pools p < (t + 1) // P <= seq_len // P, so padding is unread
  positions  [B, Q] each query's token position (padding queries: 0; their outputs are discarded)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mlaserve.attention.plan import AttentionPlan
    from mlaserve.executor.forward_batch import ForwardBatch


def completed_pools(context_len: int, seq_len: int, kpool: int) -> range:
    """The pools whose last token is in this chunk (positions context_len .. seq_len - 1): p with
    context_len < (p + 1) kpool <= seq_len. Plain ints: the step's plan, not read from a tensor."""
    return range(context_len // kpool, seq_len // kpool)


def pool_rows(block_table: tuple[int, ...], pools: range, page_size: int, kpool: int) -> list[int]:
    """Each pool's row in the paged index_pools state: a page holds page_size / kpool pooled rows, pool p lies in
    the page of its tokens (page_size is a multiple of kpool, so a pool never straddles two pages)."""
    per_page = page_size // kpool
    return [block_table[p * kpool // page_size] * per_page + (p * kpool % page_size) // kpool for p in pools]


@dataclass(frozen=True)
class PooledSegment:
    pool_rows: torch.Tensor  # [B, N]
    positions: torch.Tensor  # [B, Q]


@dataclass(frozen=True)
class PooledTensors:
    kpool: int
    pools_per_query: int  # index_topk // kpool
    new_tokens: torch.Tensor  # [n P]
    new_rows: torch.Tensor  # [n]
    segments: tuple[PooledSegment, ...]  # per segment of the plan; () on a step that selects nothing


def build_pooled_tensors(batch: ForwardBatch, plan: AttentionPlan) -> PooledTensors:
    p, ps = plan.pooled.kpool, batch.page_size
    pad_row = batch.pad_slot // p  # index_pools' zero row after its pages (ModelCache: rows(...) + 1)
    tokens: list[int] = []
    rows: list[int] = []
    for s in batch.seqs:  # plain ints from the plan's chunks (as ForwardBatch's slot mapping is built)
        done = completed_pools(s.context_len, s.seq_len, p)
        tokens.extend(s.block_table[t // ps] * ps + t % ps for t in range(done.start * p, done.stop * p))
        rows.extend(pool_rows(s.block_table, done, ps, p))
    segments = []
    if plan.needs_selection:
        for seg in plan.segments:
            seqs = batch.seqs[seg.seq_start : seg.seq_end]
            table = _pool_table(seqs, p, ps, pad_row)
            q_max = max(s.query_len for s in seqs)
            off = torch.arange(q_max)
            ctx = torch.tensor([s.context_len for s in seqs])
            q_len = torch.tensor([s.query_len for s in seqs])
            positions = torch.where(off[None, :] < q_len[:, None], ctx[:, None] + off[None, :], 0)
            segments.append(PooledSegment(table, positions))
    dev = batch.input_ids.device
    return PooledTensors(
        p,
        plan.pooled.pools_per_query,
        torch.tensor(tokens, dtype=torch.long, device=dev),
        torch.tensor(rows, dtype=torch.long, device=dev),
        tuple(PooledSegment(s.pool_rows.to(dev), s.positions.to(dev)) for s in segments),
    )


def _pool_table(seqs, p: int, ps: int, pad_row: int) -> torch.Tensor:
    """[B, N] rows of each sequence's complete pools (pool_rows, as one tensor op over the block tables rather than a
    Python list per pool: N reaches context / kpool), the pad row past a sequence's own."""
    n = torch.tensor([s.seq_len // p for s in seqs])
    n_max = max(int(n.max()), 1)
    pages = torch.zeros(len(seqs), max(len(s.block_table) for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        pages[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
    first = torch.arange(n_max) * p  # each pool's first token
    page_idx = (first // ps).clamp(max=pages.shape[1] - 1)
    rows = pages[:, page_idx] * (ps // p) + (first % ps // p)[None, :]
    return torch.where(torch.arange(n_max)[None, :] < n[:, None], rows, pad_row)

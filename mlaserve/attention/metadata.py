"""Index tensors for one segment, built once per step and shared by every layer.

Notation
  B   requests in the segment, Q = max query length, L = max sequence length (context + query)
  q_index  [B, Q]     flat token row of each (request, query offset); padding points at row 0
  q_valid  [B, Q]     False for padding
  kv_slots [B, L]     cache row of each (request, key position); padding points at the pad slot (a zero
                      row no request writes: ModelCache.pad_slot), never at another request's row
  mask     [B, Q, L]  key allowed: causal (key_pos <= query_pos) and inside the sequence
  q_pos    [B, Q]     each query's position (padding: 0), the causal bound kernels compute the mask from
  valid_flat [V]      positions in the flattened [B * Q] of the V valid queries (row-major)
  out_index  [V]      their flat token rows (q_index at valid_flat)
  key_ends   (Q,)     host ints: queries at offsets <= j read keys below key_ends[j] only (every request's
                      min(context + j + 1, sequence length), the largest): a block of queries ending at j
                      may leave out the keys from there on, all masked for it
Padding queries are given key 0 so their softmax stays finite; their outputs are discarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mlaserve.attention.plan import Segment
    from mlaserve.executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class SegmentTensors:
    segment: Segment
    q_index: torch.Tensor
    q_valid: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor
    seq_lens: torch.Tensor  # [B]
    # Built once per step, not per layer (a boolean-mask index costs a nonzero and a gather each time):
    valid_flat: torch.Tensor  # [V] where the valid queries are in [B * Q]
    out_index: torch.Tensor  # [V] flat token rows of the valid queries, in q_valid order
    q_pos: torch.Tensor  # [B, Q] positions: mask[b, q, l] == (l <= q_pos[b, q]) (q_pos < seq_lens[b])
    key_ends: tuple[int, ...]  # (Q,) on the host, from the plan's plain data: see the notation above


def build_segment_tensors(batch: ForwardBatch, segment: Segment) -> SegmentTensors:
    seqs = batch.seqs[segment.seq_start : segment.seq_end]
    ps = batch.page_size
    q_max = max(s.query_len for s in seqs)
    l_max = max(s.seq_len for s in seqs)
    q_off = torch.arange(q_max)
    q_len = torch.tensor([s.query_len for s in seqs])
    ctx = torch.tensor([s.context_len for s in seqs])
    seq_lens = ctx + q_len
    q_valid = q_off[None, :] < q_len[:, None]
    starts = torch.tensor([s.query_start for s in seqs])
    q_index = torch.where(q_valid, starts[:, None] + q_off[None, :], torch.zeros((), dtype=torch.long))
    q_pos = torch.where(q_valid, ctx[:, None] + q_off[None, :], torch.zeros((), dtype=torch.long))
    k_pos = torch.arange(l_max)
    kv_slots = _slots(seqs, k_pos, ps, seq_lens, batch.pad_slot)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
    # Built on the host from the plan's plain data, then moved once to the batch's device.
    valid_flat = q_valid.flatten().nonzero().flatten()
    out_index = q_index.flatten()[valid_flat]
    dev = batch.input_ids.device
    tensors = (q_index, q_valid, kv_slots, mask, seq_lens, valid_flat, out_index, q_pos)
    # plain ints from the chunks (no tensor ops: a decode step builds this too, with Q = 1)
    key_ends = tuple(max(min(s.context_len + j + 1, s.seq_len) for s in seqs) for j in range(q_max))
    return SegmentTensors(segment, *(t.to(dev) for t in tensors), key_ends)


def _slots(seqs, k_pos: torch.Tensor, page_size: int, seq_lens: torch.Tensor, pad_slot: int) -> torch.Tensor:
    n_pages = max(len(s.block_table) for s in seqs)
    table = torch.zeros(len(seqs), n_pages, dtype=torch.long)
    for i, s in enumerate(seqs):
        table[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
    page_idx = (k_pos // page_size).clamp(max=n_pages - 1)
    slots = table[:, page_idx] * page_size + (k_pos % page_size)[None, :]
    return torch.where(k_pos[None, :] < seq_lens[:, None], slots, torch.tensor(pad_slot, dtype=torch.long))

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

import numpy as np
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
    # Built on the host in numpy from the plan's plain data, then moved once to the batch's device: every step
    # builds these (a decode step too, with Q = 1), and on small host arrays a numpy op costs ~1 us where a torch
    # op costs ~5 (~140 -> ~40 us a batch-1 step; more with the caches cold after the weights went through them).
    n = len(seqs)
    q_len = np.fromiter((s.query_len for s in seqs), np.int64, n)
    ctx = np.fromiter((s.context_len for s in seqs), np.int64, n)
    starts = np.fromiter((s.query_start for s in seqs), np.int64, n)
    seq_lens = ctx + q_len
    q_off = np.arange(int(q_len.max()), dtype=np.int64)
    q_valid = q_off[None, :] < q_len[:, None]
    q_index = np.where(q_valid, starts[:, None] + q_off[None, :], 0)
    q_pos = np.where(q_valid, ctx[:, None] + q_off[None, :], 0)
    k_pos = np.arange(max(s.seq_len for s in seqs), dtype=np.int64)
    kv_slots = _slots(seqs, k_pos, batch.page_size, seq_lens, batch.pad_slot)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
    valid_flat = np.flatnonzero(q_valid)
    out_index = q_index.reshape(-1)[valid_flat]
    dev = batch.input_ids.device
    arrays = (q_index, q_valid, kv_slots, mask, seq_lens, valid_flat, out_index, q_pos)
    # plain ints from the chunks (no array ops)
    key_ends = tuple(max(min(s.context_len + j + 1, s.seq_len) for s in seqs) for j in range(len(q_off)))
    return SegmentTensors(segment, *(torch.from_numpy(a).to(dev) for a in arrays), key_ends)


def _slots(seqs, k_pos: np.ndarray, page_size: int, seq_lens: np.ndarray, pad_slot: int) -> np.ndarray:
    n_pages = max(len(s.block_table) for s in seqs)
    table = np.zeros((len(seqs), n_pages), dtype=np.int64)
    for i, s in enumerate(seqs):
        table[i, : len(s.block_table)] = s.block_table
    page_idx = np.minimum(k_pos // page_size, n_pages - 1)
    slots = table[:, page_idx] * page_size + (k_pos % page_size)[None, :]
    return np.where(k_pos[None, :] < seq_lens[:, None], slots, np.int64(pad_slot))

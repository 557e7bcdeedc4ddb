"""How latent_mqa splits its key axis (split-K), as plain data: a function of the key count only (a shape, never a
tensor's values), so a CUDA graph captured for a padded decode step fixes it with the step's padded key axis.
No Triton import here: the graph plan (executor/graph_plan.py) records the split of a replayed step before any
kernel module is defined.

Notation
  n_keys   the launch's key axis: kv_slots.shape[1] (dense; in a padded step context_pages * page_size), or the
           index's width k (sparse)
  splits   programs per (query, head block) along the keys, 1 .. MAX_SPLITS; keys_per_split a multiple of KEY_TILE
"""

from __future__ import annotations

from dataclasses import dataclass

KEY_TILE = 32  # keys per tile of the kernel (latent_mqa.BLOCK_N)
KEYS_PER_SPLIT = 512  # the key axis is split so that one split reads about this many keys
MAX_SPLITS = 16  # partials per (query, head) the reduce kernel merges


@dataclass(frozen=True)
class SplitPlan:
    """How the key axis of one launch is split: decided on the host from the key count before launch."""

    splits: int
    keys_per_split: int  # a multiple of KEY_TILE


def split_plan(n_keys: int) -> SplitPlan:
    """ceil(n_keys / KEYS_PER_SPLIT) splits (1 .. MAX_SPLITS) of equal length, rounded up to whole tiles."""
    splits = max(1, min(MAX_SPLITS, -(-n_keys // KEYS_PER_SPLIT)))
    per = -(-n_keys // splits)
    per = -(-per // KEY_TILE) * KEY_TILE
    return SplitPlan(-(-n_keys // per) if n_keys else 1, per)

"""The keys every sequence of a DeepSeek-V4 step attends, as index tensors computed once per step from the step's
plain data (the runner's spans): each attention layer then reads all sequences' keys with one gather per source
and builds their masks with tensor ops (attention.py `_step_keys`, then `attend_step`), no loop over sequences.

Notation
  B sequences of the step; per sequence b: rows a_b .. a_b+n_b-1 of the step's T rows, positions c_b ..
  c_b+n_b-1, state slot s_b; S = max_b n_b (queries padded to [B, S])
  W sliding_window; f_b = max(0, c_b - (W - 1)) the oldest position the chunk's first query sees, o_b = c_b - f_b
    ring rows read (the reference's SlidingRing.keys), then the chunk's n_b new rows
  m a compress ratio; P_b = c_b // m pool rows before the step, R_b = (c_b + n_b) // m after it

Queries (StepQueries, one per step)
  seq, slot, rows [sum n_b]  step row rows[i] sits at [seq[i], slot[i]] of the padded queries
  pos [B, S]                 c_b + j; -1 on pad slots (a pad query sees no key, only its sink)
  index [B, S]               a_b + j, the step row at slot j of b; -1 on pad slots
Keys (LayerKeys, one per ratio; ratio 0 for the sliding layers: no pool rows), packed per sequence in the
reference's order: its o_b ring rows by position, its n_b new rows, its R_b pool rows, then padding up to
K = max_b (o_b + n_b + R_b) (the layout the loop's padded softmax builds, so the two compute alike):
  ring_slots [B]   the slots whose rings are read: one index_select of [B, W, D] before the step's ring writes
  source [B, K]    into [those rings flat (B W rows) | the step's K=V rows (T) | the pool rows before the step,
                   in sequence order (state.StepRows: sum_b P_b) | the rows the step closes (step_update.WindowPlan's
                   order: sum_b R_b - P_b) | one zero row]: k < o_b -> b W + (f_b + k) % W; k < o_b + n_b ->
                   B W + a_b + k - o_b; pool row r = k - o_b - n_b < P_b -> B W + T + (P_<b) + r, < R_b ->
                   B W + T + sum P + (R-P)_<b + r - P_b; pad -> the zero row (a pad key is 0, never visible)
  key_pos [B, K]   f_b + k on window columns; PAD elsewhere (after every query: never visible as a window key)
  pool_row [B, K]  r on pool columns; PAD elsewhere (never below (t + 1) // m)
  pool_source [B, Kp], Kp = max_b R_b: column r of b -> its pool row r in [before | closed] (the indexer's keys,
                   gathered alike); sizes (n_b, R_b) per sequence, plain ints
  direct [B, K, 2] the same columns as (part, row) of the tensors where they lie, for the native gather (one copy
                   instead of the rings' gather, the concatenation and the gather): RING row s_b W + (f_b + k) % W
                   of the ring cache, STEP row a_b + k - o_b, POOL the pool row's slot in the paged tensor, CLOSED
                   its place among the rows the step closes, ZERO row 0; None where the step's pool slots were not
                   given (a device other than the CPU)
Masks (attention.py): a window column visible to query (b, j) at t = pos[b, j] iff t - W < key_pos <= t; a pool
  column iff pool_row < (t + 1) // m (HCA, CSA dense), and chosen by the indexer's top-k (CSA sparse).
The per-sequence reference (attention.py's loop over spans: SlidingRing.keys, the pools' view, Indexer.choose)
reads the same keys in the same order; tests/models/test_deepseek_v4_varlen.py holds the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# the runner's per-sequence plain data: (first row, tokens, context_len, state slot)
SeqSpan = tuple[int, int, int, int]
PAD = 2**62  # a key position or pool row no query reaches
RING, STEP, POOL, CLOSED, ZERO = range(5)  # the parts of LayerKeys.direct, in the native gather's order


@dataclass(frozen=True)
class StepQueries:
    seq: torch.Tensor  # [sum n_b] the sequence of each step row
    slot: torch.Tensor  # [sum n_b] its place in the sequence's chunk
    rows: torch.Tensor  # [sum n_b] the step row
    pos: torch.Tensor  # [B, S] positions, -1 on pad slots
    index: torch.Tensor  # [B, S] the step row of each padded slot, -1 on pad slots (the native attention's queries)


@dataclass(frozen=True)
class LayerKeys:
    ratio: int  # 0: a sliding layer's (no pool rows)
    ring_slots: torch.Tensor  # [B]
    source: torch.Tensor  # [B, K]
    key_pos: torch.Tensor  # [B, K]
    pool_row: torch.Tensor  # [B, K]
    pool_source: torch.Tensor  # [B, Kp]
    sizes: tuple[tuple[int, int], ...]  # (n_b, R_b)
    direct: torch.Tensor | None = None  # [B, K, 2] (part, row) where the columns lie

    def scored(self, topk: int) -> bool:
        """Whether a CSA layer's top-k of k = topk chooses among this step's pool rows: some sequence has more than
        k rows after the step. Otherwise every visible row is chosen (the reference's picks cover them all), so the
        indexer's queries and scores are not needed: plain data of the step, known before the forward."""
        return any(rows > topk for _, rows in self.sizes)


@dataclass(frozen=True)
class StepKeys:
    """The step's query layout and its keys per ratio (0: the sliding layers'); `masks` the position rules' masks
    per ratio, made by the first layer of that ratio that reads them (`visible`) and kept for the step's others."""

    queries: StepQueries
    layers: dict[int, LayerKeys]
    masks: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def visible(self, ratio: int, window: int) -> tuple[torch.Tensor, ...]:
        """-> the columns [B, S, K] each query sees by position: (window, pool, both) for a ratio, (window,) for
        0. Window columns: t - W < key_pos <= t; pool columns before any top-k: pool_row < (t + 1) // m (pads and
        window columns hold PAD there)."""
        if ratio not in self.masks:
            plan, t = self.layers[ratio], self.queries.pos[:, :, None]
            key_pos = plan.key_pos[:, None, :]
            seen = (key_pos <= t) & (key_pos > t - window)
            if ratio:
                pool = plan.pool_row[:, None, :] < (t + 1) // ratio
                self.masks[ratio] = (seen, pool, seen | pool)
            else:
                self.masks[ratio] = (seen,)
        return self.masks[ratio]


def _ints(spans: tuple[SeqSpan, ...]) -> tuple[np.ndarray, ...]:
    a, n, c, s = zip(*spans)
    return tuple(np.array(v, dtype=np.int64) for v in (a, n, c, s))


def _tensor(v: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(v)).to(device)


# The plans below are plain int arithmetic on a few values per sequence, done in numpy (~1 us an op against torch's
# ~5 us dispatch: ~40 ops per ratio each step, 3 ratios; a decode step's plan 737 -> 252 us on a 2-core AMX Xeon; the
# same int64 values), handed to torch once at the end.


def step_queries(spans: tuple[SeqSpan, ...], device) -> StepQueries:
    a, n, c, _ = _ints(spans)
    b = len(spans)
    seq = np.repeat(np.arange(b), n)
    slot = np.arange(seq.shape[0]) - (np.cumsum(n) - n)[seq]
    j = np.arange(int(n.max()))[None, :]
    pos = np.where(j < n[:, None], c[:, None] + j, -1)
    rows = a[seq] + slot
    index = np.full(pos.shape, -1, dtype=np.int64)
    index[seq, slot] = rows
    return StepQueries(*(_tensor(v, device) for v in (seq, slot, rows, pos, index)))


def layer_keys(
    spans: tuple[SeqSpan, ...], window: int, ratio: int, device, pool_gather: np.ndarray | None = None
) -> LayerKeys:
    """The keys of the layers of one ratio (0: sliding) for every sequence of the step. pool_gather: the pool slots
    of every sequence's rows before the step, in batch order (serving.pool_slots; the CPU's: `direct`)."""
    a, n, c, slots = _ints(spans)
    b, rows = len(spans), max(a_ + n_ for a_, n_, _, _ in spans)  # the step's T rows
    first = np.maximum(c - (window - 1), 0)
    old = c - first
    before = c // ratio if ratio else np.zeros_like(c)
    after = (c + n) // ratio if ratio else np.zeros_like(c)
    closed = after - before
    held = old + n  # window columns
    k = np.arange(int((held + after).max()))[None, :]
    r = k - held[:, None]  # the pool row of a pool column
    ring = np.arange(b)[:, None] * window + (first[:, None] + k) % window
    new = b * window + a[:, None] + k - old[:, None]
    base = b * window + rows
    old_start, new_start = np.cumsum(before) - before, np.cumsum(closed) - closed
    pooled = base + np.where(
        r < before[:, None], old_start[:, None] + r, int(before.sum()) + new_start[:, None] + r - before[:, None]
    )
    zero = base + int(after.sum())
    source = np.where(
        k < old[:, None], ring, np.where(k < held[:, None], new, np.where(r < after[:, None], pooled, zero))
    )
    is_window, is_pool = k < held[:, None], (r >= 0) & (r < after[:, None])
    key_pos = np.where(is_window, first[:, None] + k, PAD)
    pool_row = np.where(is_pool, r, PAD)
    p = np.arange(int(after.max()))[None, :]
    pool_source = np.where(
        p < before[:, None], old_start[:, None] + p, int(before.sum()) + new_start[:, None] + p - before[:, None]
    )
    pool_source = np.where(p < after[:, None], pool_source, 0)
    sizes = tuple((n_, (c_ + n_) // ratio if ratio else 0) for _, n_, c_, _ in spans)
    t = (_tensor(v, device) for v in (slots, source, key_pos, pool_row, pool_source))
    direct = None
    if pool_gather is not None or not ratio:
        gather = pool_gather if ratio and len(pool_gather) else np.zeros(1, dtype=np.int64)  # (indexed when non-empty)
        ring_row = slots[:, None] * window + (first[:, None] + k) % window
        pool_slot = gather[np.clip(old_start[:, None] + r, 0, len(gather) - 1)]
        cols = (k < old[:, None], k < held[:, None], r < before[:, None], r < after[:, None])
        rows_of = (ring_row, a[:, None] + k - old[:, None], pool_slot, new_start[:, None] + r - before[:, None])
        direct = _tensor(_part_rows(cols, rows_of), device)
    return LayerKeys(ratio, *t, sizes, direct)


def _part_rows(cols: tuple[np.ndarray, ...], rows_of: tuple[np.ndarray, ...]) -> np.ndarray:
    """[B, K, 2] (part, row): each column's first part whose rule holds, in the order RING, STEP, POOL, CLOSED
    (cols: the rules [B, K]; rows_of: the row in that part), else the ZERO row."""
    part = np.select(cols, [RING, STEP, POOL, CLOSED], ZERO)
    return np.stack([part, np.select(cols, rows_of, 0)], -1)


def step_keys(
    spans: tuple[SeqSpan, ...], window: int, ratios: set[int], device, pool_gathers: dict[int, np.ndarray] | None = None
) -> StepKeys:
    """pool_gathers: per ratio, the pool slots of the rows before the step (for the native gather; None: none)."""
    gathers = pool_gathers or {}
    layers = {m: layer_keys(spans, window, m, device, gathers.get(m)) for m in {0, *ratios}}
    return StepKeys(step_queries(spans, device), layers)

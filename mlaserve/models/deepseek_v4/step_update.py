"""The batched state update of a DeepSeek-V4 step: every sequence's ring writes, compressor windows (kv and the
CSA indexer's keys), carries, overlap halves and page-boundary snapshots, as index tensors computed once per step
from the step's plain data (the runner's spans and snapshot boundaries), then applied with one gather / scatter per
tensor for all of the step's sequences (no loop over sequences in the math).

Notation
  T tokens of the step; per sequence b: rows a_b .. a_b+n_b-1 of the step, positions c_b .. c_b+n_b-1, state
  slot s_b, snapshot boundaries (k, page) (the state after its first k tokens is that page's snapshot row)
  W sliding_window, m a compress ratio, width a compressor's projected row (2D CSA, D HCA; 2c, c indexer)
  cache tensors (config/layer_kinds.py): window [slots, W, D], carry [slots, 2, m, width] (kv rows, gate rows),
    overlap [slots, 2, m, D'] (CSA: the Ca half of the last closed window, position bias added), their
    snapshots [pages + 1, ...]

Ring (RingPlan, one per step: W is the model's):
  writes  (s_b, p % W) <- kv row a_b + p - c_b  for the last min(n_b, W) positions p of the chunk
  snapshot at (k, page): the slot's ring before the step, overlaid with positions max(c_b, c_b+k-W) .. c_b+k-1
          (the W rows ending at c_b + k: rows older than the step keep their ring slot, as in the reference)
Windows (WindowPlan, one per ratio): sequence b closes windows w = c_b // m .. (c_b + n_b) // m - 1, N in all
  (flat, in sequence order, as its pool rows). Slot j of window w is position p = w m + j: the carry row j of
  slot s_b when p < c_b (only the first window can hold carry rows), else step row a_b + p - c_b; so
  from_carry [N, m] picks between step_row [N, m] (into the step's rows) and row j of the carry of slot
  win_slot [N]: gathers of N m rows, whatever the number of sequences or their carry fills.
  CSA: window w-1's Ca half is the slot's stored overlap half when w-1 closed before the step (prev_stored [N],
  prev_slot [N]), else the closed window prev_win [N] of this step; has_prev [N] is False for window 0 (its Ca
  slots get gate -inf, kv 0, as the reference). Carry writes: the open window's rows the step adds,
  (s_b, p - m ((c_b+n_b)//m)) <- step row a_b + p - c_b (carry_from); overlap writes: (s_b) <- the sequence's last closed
  window; overlap snapshot at (k, page) <- the window that closes at c_b + k (a page boundary is a multiple of
  m, so one closes there: the Ca half of the window w = (c_b+k)/m - 1).
The per-sequence form (attention.py `_advance`, compressor.py `close`) stays the plain reference; this form
equals it bit for bit (the same values pooled by the same ops; tests/identities/test_deepseek_v4_state_batched.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlaserve.cache.model_cache import take
from mlaserve.models.deepseek_v4.state import StepRows
from mlaserve.models.deepseek_v4.step_keys import StepKeys

# the runner's per-sequence plain data: (first row, tokens, context_len, state slot)
SeqSpan = tuple[int, int, int, int]
Boundaries = tuple[tuple[int, int], ...]  # (k, page) per sequence


@dataclass(frozen=True)
class RingPlan:
    write_slot: torch.Tensor  # [Nw] state slots
    write_pos: torch.Tensor  # [Nw] ring rows (p % W)
    write_row: torch.Tensor  # [Nw] step rows
    snap_slot: torch.Tensor  # [Ns] the slot each snapshot starts from
    snap_page: torch.Tensor  # [Ns] the page whose snapshot row it is
    over_snap: torch.Tensor  # [No] which snapshot an overlay row lands in
    over_pos: torch.Tensor  # [No] its ring row
    over_row: torch.Tensor  # [No] the step row


def ring_plan(spans: tuple[SeqSpan, ...], snapshots: tuple[Boundaries, ...], window: int, device) -> RingPlan:
    ws, wp, wr, ss, sp, os_, op, or_ = [], [], [], [], [], [], [], []
    for (a, n, c, slot), at in zip(spans, snapshots):
        for p in range(c + n - min(n, window), c + n):
            ws.append(slot), wp.append(p % window), wr.append(a + p - c)
        for k, page in at:
            for q in range(max(c, c + k - window), c + k):
                os_.append(len(ss)), op.append(q % window), or_.append(a + q - c)
            ss.append(slot), sp.append(page)
    t = [torch.tensor(v, dtype=torch.long, device=device) for v in (ws, wp, wr, ss, sp, os_, op, or_)]
    return RingPlan(*t)


def apply_ring(plan: RingPlan, kv: torch.Tensor, window: torch.Tensor, snapshot: torch.Tensor | None) -> None:
    """kv [T, D] the step's K=V rows -> the ring slots (and the page snapshots, first: they start from the ring
    before the step). Run after every read of the old ring rows (the chunk's keys). window / snapshot: tensors,
    or 8-bit rows (cache/quantized_rows.py, kv_cache_dtype fp8_e4m3): the same calls, each row quantized once, at
    its write; a snapshot starts from the ring's rows as stored (`take`: codes and scales copied, not read back
    and quantized again, which gives the same values but may pick the other of two equal encodings: a code of
    224 at 2^(k+1) re-quantizes as 448 at 2^k), so its bytes are those the per-sequence reference saves."""
    kv = kv.to(window.dtype)
    if snapshot is not None:
        snap = take(window, plan.snap_slot)
        snap.index_put_((plan.over_snap, plan.over_pos), kv[plan.over_row])
        snapshot.index_copy_(0, plan.snap_page, snap)
    window.index_put_((plan.write_slot, plan.write_pos), kv[plan.write_row])


@dataclass(frozen=True)
class WindowPlan:
    ratio: int
    from_carry: torch.Tensor  # [N, m] bool: the window's slot j is a carry row (else a step row)
    step_row: torch.Tensor  # [N, m] the step row (0 where from_carry: unread)
    win_slot: torch.Tensor  # [N] the state slot of the window's sequence (its carry rows are rows j)
    prev_stored: torch.Tensor  # [N] bool: window w-1's Ca half is the slot's stored overlap (else closed here)
    prev_slot: torch.Tensor  # [N] that slot (0 where not prev_stored)
    prev_win: torch.Tensor  # [N] window w-1's flat index when it closed this step (0 otherwise)
    has_prev: torch.Tensor  # [N] bool: w > 0
    positions: torch.Tensor  # [N] w m: where each compressed row's rope is taken
    pool_slots: torch.Tensor  # [N] the paged pool's row slots
    starts: tuple[int, ...]  # [B + 1] each sequence's part of the N rows
    carry_slot: torch.Tensor  # [Nc]
    carry_pos: torch.Tensor  # [Nc] row of the open window
    carry_from: torch.Tensor  # [Nc] step row
    overlap_slot: torch.Tensor  # [No] sequences that closed a window: their state slot
    overlap_win: torch.Tensor  # [No] their last closed window (flat)
    snap_page: torch.Tensor  # [Ns]
    snap_win: torch.Tensor  # [Ns] the window closing at the boundary (flat)


def window_plan(
    spans: tuple[SeqSpan, ...], snapshots: tuple[Boundaries, ...], ratio: int, pool_slots: torch.Tensor
) -> WindowPlan:
    """pool_slots [N]: the slots of the rows the step closes, in sequence order (serving.py pool_slots)."""
    m, device = ratio, pool_slots.device
    fc, sr, cw, pst, psl, pwn, has, pos, starts = [], [], [], [], [], [], [], [], [0]
    cs, cp, cr, ovs, ovw, snp, snw = [], [], [], [], [], [], []
    for (a, n, c, slot), at in zip(spans, snapshots):
        w0, w1, first = c // m, (c + n) // m, starts[-1]
        for w in range(w0, w1):
            slots = range(w * m, w * m + m)
            fc.append([p < c for p in slots])
            sr.append([a + p - c if p >= c else 0 for p in slots])
            cw.append(slot)
            stored = w == w0 and w > 0  # window w-1 closed before the step: its Ca half is in the slot
            pst.append(stored), psl.append(slot if stored else 0), pwn.append(first + w - w0 - 1 if w > w0 else 0)
            has.append(w > 0)
            pos.append(w * m)
        for p in range(max(c, w1 * m), c + n):
            cs.append(slot), cp.append(p - w1 * m), cr.append(a + p - c)
        if w1 > w0:
            ovs.append(slot), ovw.append(first + w1 - w0 - 1)
        for k, page in at:
            if (c + k) % m:
                raise ValueError(f"snapshot boundary {c + k} is not a multiple of the compress ratio {m}")
            snp.append(page), snw.append(first + (c + k) // m - 1 - w0)
        starts.append(first + w1 - w0)

    def t(v, dtype=torch.long):
        return torch.tensor(v, dtype=dtype, device=device)

    return WindowPlan(
        m,
        t(fc, torch.bool).view(-1, m),
        t(sr).view(-1, m),
        t(cw),
        t(pst, torch.bool),
        t(psl),
        t(pwn),
        t(has, torch.bool),
        t(pos),
        pool_slots,
        tuple(starts),
        t(cs),
        t(cp),
        t(cr),
        t(ovs),
        t(ovw),
        t(snp),
        t(snw),
    )


@dataclass(frozen=True)
class LayerStep:
    """One layer's batched update for the step: the step's ring plan, its ratio's window plan (None for a
    sliding layer), the layer's cache tensors by state name (window, kv_carry, kv_overlap, index_*, and their
    `_snapshot` rows when the cache keeps them) and its paged pools' StepRows (the closed rows' one write);
    `tape`: a verify step's rollback.RollbackTape, on which the layer (index `layer`) keeps its projections of
    the verifying rows (None: no sequence of the step verifies drafts); `keys`: the step's key reads
    (step_keys.py: the query layout, window keys, pool keys per ratio), which the batched attention reads."""

    ring: RingPlan
    plan: WindowPlan | None
    tensors: dict[str, torch.Tensor]
    kv_rows: StepRows | None
    index_rows: StepRows | None
    tape: object | None = None
    layer: int = 0
    keys: StepKeys | None = None

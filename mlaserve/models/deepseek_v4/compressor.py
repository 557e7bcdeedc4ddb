"""Compressor: pools every m tokens' projected rows into one compressed row (CSA: overlapping 2m-token
windows; HCA: non-overlapping m'-token windows), then kv_norm and compress-table rope at the window start.

Notation
  S   tokens of the chunk, m the ratio, D the pooled row width (head_dim; index_head_dim in the indexer)
  kv, gate [S, width]   projections of the chunk; width = 2D when overlapping (Ca = [:D] | Cb = [D:]), else D
  B [m, width]          the learned position bias (checkpoint `ape`), added to the gate of slot j of a window
  n                     windows closed by this chunk: (fill + S) // m, fill = tokens buffered before it
Window w (absolute) with its m slots' kv_j, gate z_j (+ B_j):
  HCA  row_w = sum_j softmax_j(z_j) * kv_j                   over the m slots of window w, per channel
  CSA  row_w = sum_j softmax_j(z_j) * kv_j                   over 2m slots: Ca of window w-1, Cb of window w
       (window 0 has no predecessor: its Ca slots get gate -inf, weight 0)
  row_w <- rope_compress(kv_norm(row_w), position w m), then `round_rows` (the official-code rounding of a run
           that asks for it, official.py: FP8 of the non-rope part; Hadamard + FP4 in the indexer)
The carry (state.CompressorCarry) holds the open window's raw rows and, for CSA, the Ca half of the last
closed window, so a chunked sequence pools exactly the windows of one pass.
Two forms of the same pooling: `close`, one sequence's rows (the plain reference), and `close_step`, the windows
every sequence of a step closes at once, [N, m (2m), D] with one softmax, over the cache's carry tensors through
a step_update.WindowPlan (index tensors computed once per step).
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.models.deepseek_v4.norm import RMSNorm
from mlaserve.models.deepseek_v4.official import KeepRows
from mlaserve.models.deepseek_v4.rope import V4RopeTables, rotate_trailing
from mlaserve.models.deepseek_v4.state import CompressedPool, CompressorCarry
from mlaserve.models.deepseek_v4.step_update import WindowPlan


class Compressor(nn.Module):
    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)
        # the pooled rows' official-code rounding (official.py; set by the attention layer, identity by default)
        self.round_rows: nn.Module = KeepRows()

    def forward(self, x: torch.Tensor, carry: CompressorCarry, pool: CompressedPool, tables: V4RopeTables) -> None:
        """x [S, hidden]: project, close the windows the chunk completes, append their rows to `pool`, keep the
        rest in `carry`."""
        self.close(self.kv_proj(x), self.gate_proj(x), carry, pool, tables)

    def close(
        self, kv: torch.Tensor, gate: torch.Tensor, carry: CompressorCarry, pool: CompressedPool, tables: V4RopeTables
    ) -> None:
        """One sequence's projected rows kv, gate [S, width] (projected with the whole step's tokens at once):
        close the windows they complete into `pool`, keep the rest in `carry`."""
        m, device = self.ratio, kv.device
        kv = torch.cat([carry.kv[: carry.fill], kv], dim=0)
        gate = torch.cat([carry.gate[: carry.fill], gate], dim=0)
        n = kv.shape[0] // m
        rest = kv.shape[0] - n * m
        carry.kv[:rest], carry.gate[:rest], carry.fill = kv[n * m :], gate[n * m :], rest
        if n == 0:
            return
        kv = kv[: n * m].view(n, m, -1)
        gate = gate[: n * m].view(n, m, -1) + self.position_bias
        if self.overlap:
            kv, gate = self._overlap(kv, gate, carry, had_window=pool.n > 0)
        # softmax over the window's slots in fp32, per channel (as the reference)
        pooled = self.kv_norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
        positions = (torch.arange(n, device=device) + pool.n) * m
        cos, sin = tables.cos_sin("compress", positions, pooled.dtype)
        pool.append(self.round_rows(rotate_trailing(pooled, cos, sin)))

    def close_step(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        plan: WindowPlan,
        carry: torch.Tensor,
        overlap: torch.Tensor | None,
        overlap_snapshot: torch.Tensor | None,
        tables: V4RopeTables,
    ) -> torch.Tensor:
        """The step's projected rows kv, gate [T, width] -> the N rows every sequence's closed windows pool to
        [N, D] (in plan order); updates the cache's carry [slots, 2, m, width] and (CSA) overlap [slots, 2, m, D]
        and its page snapshots. The same values through the same ops as `close` per sequence."""
        d = self.dim
        kv, gate = kv.to(carry.dtype), gate.to(carry.dtype)
        if plan.starts[-1] == 0:  # no window closes this step (the plan's count): the open windows take the rows
            self._carry_rows(carry, plan, kv, gate)  # (a decode step closes one in `ratio`: ~25 torch ops saved)
            return kv.new_empty(0, d)
        # the windows' slots: row j of the sequence's carry (read before the carry writes below) or a step row
        # (row gathers by index_select throughout: CPU's advanced indexing is several times slower for rows)
        own = carry.index_select(0, plan.win_slot)  # [N, 2, m, width]: N windows' carries, not every sequence's
        pick = plan.from_carry[..., None]
        rows = plan.step_row.flatten()
        new_kv = kv.index_select(0, rows).view(*plan.step_row.shape, kv.shape[-1])
        new_gate = gate.index_select(0, rows).view(*plan.step_row.shape, gate.shape[-1])
        wkv = torch.where(pick, own[:, 0], new_kv)  # [N, m, width]
        wgate = torch.where(pick, own[:, 1], new_gate) + self.position_bias
        self._carry_rows(carry, plan, kv, gate)
        if self.overlap:  # [N, 2m, D]: the previous window's Ca half, then this window's Cb half
            stored = plan.prev_stored[:, None, None]
            halves = overlap.index_select(0, plan.prev_slot)  # [N, 2, m, D]
            ca_kv = torch.where(stored, halves[:, 0], wkv.index_select(0, plan.prev_win)[..., :d])
            ca_gate = torch.where(stored, halves[:, 1], wgate.index_select(0, plan.prev_win)[..., :d])
            has = plan.has_prev[:, None, None]
            ca_kv = torch.where(has, ca_kv, torch.zeros((), dtype=ca_kv.dtype, device=ca_kv.device))
            ca_gate = torch.where(has, ca_gate, torch.full((), float("-inf"), dtype=ca_gate.dtype, device=kv.device))
            # stored in the cache's dtype (the gate carries the fp32 position bias), as the reference's copy_
            last = torch.stack([wkv.index_select(0, plan.overlap_win), wgate.index_select(0, plan.overlap_win)], 1)
            overlap.index_copy_(0, plan.overlap_slot, last[..., :d].to(overlap.dtype))  # [No, 2, m, D]
            if overlap_snapshot is not None:
                at = torch.stack([wkv.index_select(0, plan.snap_win), wgate.index_select(0, plan.snap_win)], 1)
                overlap_snapshot.index_copy_(0, plan.snap_page, at[..., :d].to(overlap_snapshot.dtype))
            wkv = torch.cat([ca_kv, wkv[..., d:]], dim=1)
            wgate = torch.cat([ca_gate, wgate[..., d:]], dim=1)
        pooled = self.kv_norm((wkv * wgate.softmax(dim=1, dtype=torch.float32).to(wkv.dtype)).sum(dim=1))
        cos, sin = tables.cos_sin("compress", plan.positions, pooled.dtype)
        return self.round_rows(rotate_trailing(pooled, cos, sin))

    @staticmethod
    def _carry_rows(carry: torch.Tensor, plan: WindowPlan, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """The step's rows that stay in open windows into the cache's carry [slots, 2, m, width]."""
        carry[plan.carry_slot, 0, plan.carry_pos] = kv.index_select(0, plan.carry_from)
        carry[plan.carry_slot, 1, plan.carry_pos] = gate.index_select(0, plan.carry_from)

    def _overlap(
        self, kv: torch.Tensor, gate: torch.Tensor, carry: CompressorCarry, had_window: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, m, 2D] -> [n, 2m, D]: slots 0..m-1 the previous window's Ca, slots m..2m-1 this window's Cb."""
        n, m, d = kv.shape[0], self.ratio, self.dim
        slots_kv = kv.new_zeros(n, 2 * m, d)
        slots_gate = gate.new_full((n, 2 * m, d), float("-inf"))
        slots_kv[:, m:], slots_gate[:, m:] = kv[..., d:], gate[..., d:]
        slots_kv[1:, :m], slots_gate[1:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]
        if had_window:
            slots_kv[0, :m], slots_gate[0, :m] = carry.overlap_kv, carry.overlap_gate
        carry.overlap_kv.copy_(kv[-1, :, :d])
        carry.overlap_gate.copy_(gate[-1, :, :d])
        return slots_kv, slots_gate

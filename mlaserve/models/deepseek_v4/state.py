"""Per-sequence state of DeepSeek-V4's layer kinds: exactly what transformers' caches hold
(DeepseekV4HCACache / DeepseekV4CSACache), as fixed-size tensors where the reference's is bounded.

Notation
  W   sliding_window, D head width, m a layer's compress ratio (CSA m, HCA m'), c index_head_dim
  P   pool capacity in rows = max_tokens // m (a pool grows one row per m tokens; allocated up front)
  width  a compressor's projected row: 2D for CSA (series Ca | Cb), D for HCA; 2c for the indexer

  SlidingRing     rows [W, D]   K=V of the last W positions, row of position p in slot p % W
  CompressedPool  rows [P, D]   (or [P, c] for indexer keys), `n` rows filled, row w pools tokens
                                [w m, (w+1) m) (CSA also reads the Ca half of window w-1)
  CompressorCarry kv, gate [m, width]  raw projections of the fill = seen % m tokens of the open window;
                  overlap kv, gate [m, D] (CSA, c for the indexer): the Ca half of the last closed window,
                  position bias added, valid once a window has closed (n > 0)

How each maps to the engine's rooms (config/layer_kinds.py, docs/ARCHITECTURE.md "Layer and cache kinds"):
  SlidingRing      "request" addressing: one [W, D] slot per running request, snapshotted at page boundaries
                   (a prefix hit restores the ring of the hit's last W tokens from its last page's row).
  CompressedPool   the model's own form (a contiguous [P, D] block: tests, the reference path). In the engine
                   the pools are "page" addressed with tokens_per_row = m: PagedPool, the same interface over
                   the paged cache (a page of page_size tokens holds page_size / m rows), the rows before the
                   step gathered once per layer for all sequences (StepRows).
  CompressorCarry  "request" addressing, fixed size: not recomputable from the pools (the raw hidden states
                   are gone). page_size is a multiple of every m, so at a page boundary the open window is
                   empty (fill 0: the carry needs no snapshot) and the overlap half (CSA) is the only carry,
                   snapshotted there.
  Snapshots        where a layer saves its page-boundary snapshots in the engine (one row per page).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from mlaserve.config.deepseek_v4 import DeepseekV4Config


class SlidingRing:
    def __init__(self, window: int, dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.window = window
        self.rows = torch.zeros(window, dim, dtype=dtype, device=device)

    @classmethod
    def over(cls, rows: torch.Tensor) -> SlidingRing:
        """A ring whose rows are `rows` [W, D] (a view of an engine cache slot: writes land in the cache)."""
        ring = cls.__new__(cls)
        ring.window, ring.rows = rows.shape[0], rows
        return ring

    def keys(self, new: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """new [S, D] at positions start.. -> the keys a chunk's queries can see: the previous min(start, W-1)
        rows then `new`, and their positions [K] (a query at t sees t-W < p <= t)."""
        first = max(0, start - (self.window - 1))
        old = torch.arange(first, start, device=new.device)
        keys = torch.cat([self.rows.index_select(0, old % self.window), new], dim=0)
        return keys, torch.arange(first, start + new.shape[0], device=new.device)

    def append(self, new: torch.Tensor, start: int) -> None:
        """Keep the last W rows of positions start .. start + S - 1."""
        s = new.shape[0]
        keep = min(s, self.window)
        pos = torch.arange(start + s - keep, start + s, device=new.device)
        self.rows.index_copy_(0, pos % self.window, new[s - keep :].to(self.rows.dtype))


class CompressedPool:
    def __init__(self, capacity: int, dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.rows = torch.zeros(capacity, dim, dtype=dtype, device=device)
        self.n = 0

    @classmethod
    def over(cls, rows: torch.Tensor, n: int) -> CompressedPool:
        """A pool over `rows` [P, D] (a cache slot's view) with its first n rows filled."""
        pool = cls.__new__(cls)
        pool.rows, pool.n = rows, n
        return pool

    def append(self, rows: torch.Tensor) -> None:
        k = rows.shape[0]
        if self.n + k > self.rows.shape[0]:
            raise ValueError(
                f"compressed pool full: {self.n} + {k} rows > capacity {self.rows.shape[0]} "
                "(the sequence is longer than the state's max_tokens)"
            )
        self.rows[self.n : self.n + k] = rows.to(self.rows.dtype)
        self.n += k

    def view(self) -> torch.Tensor:
        return self.rows[: self.n]


class StepRows:
    """One layer's compressed rows of every sequence of a step, in the paged cache: the rows each sequence had
    before the step, gathered with one index_select through the block tables (at the first read), and the
    rows the step's chunks close, written with one index_copy_ after the step's forward (`flush`; within the
    step a sequence reads its new rows from its PagedPool, so the cache needs them only for the next step).

    Notation: pool [S + 1, D] the layer's paged tensor (row slot = page * page_size / m + offset); per
    sequence b, old_b its rows before the step (context_len // m); gather [sum_b old_b] their slots in batch
    order; starts [B + 1] the offsets of each sequence's part of the gather."""

    def __init__(self, pool: torch.Tensor, gather: torch.Tensor, starts: list[int]) -> None:
        self.pool, self.gather_slots, self.starts = pool, gather, starts
        self._rows: torch.Tensor | None = None
        self._writes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slots, rows) closed this step

    def before(self) -> torch.Tensor:
        """Every sequence's rows before the step [sum_b old_b, D], in batch order."""
        if self._rows is None:  # one gather for the whole step, at the layer's first read
            self._rows = self.pool.index_select(0, self.gather_slots)
        return self._rows

    def old(self, b: int) -> torch.Tensor:
        return self.before()[self.starts[b] : self.starts[b + 1]]

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self._writes.append((slots, rows))

    def flush(self) -> None:
        """The step's closed rows of every sequence into the cache, one index_copy_."""
        if self._writes:
            slots, rows = zip(*self._writes)
            self.pool.index_copy_(0, torch.cat(slots), torch.cat(rows))
            self._writes = []


class PagedPool:
    """A sequence's compressed rows in the paged cache (CompressedPool's interface: n, append, view): the rows
    it had before the step (StepRows, gathered once for the step's sequences) and those its chunk closes, kept
    here for the step's reads and queued for the cache at their slots (`new_slots`, rows n0 .. of the chunk)."""

    def __init__(self, step: StepRows, b: int, n: int, new_slots: torch.Tensor) -> None:
        self.step, self.b, self.n0, self.n = step, b, n, n
        self.new_slots = new_slots
        self.new: list[torch.Tensor] = []

    def append(self, rows: torch.Tensor) -> None:
        k, done = rows.shape[0], self.n - self.n0
        if done + k > self.new_slots.shape[0]:
            raise ValueError(
                f"paged pool: {done + k} new rows, the block table has slots for {self.new_slots.shape[0]}"
            )
        rows = rows.to(self.step.pool.dtype)
        self.step.write(self.new_slots[done : done + k], rows)
        self.new.append(rows)
        self.n += k

    def extend(self, rows: torch.Tensor) -> None:
        """The rows the step's batched update closed for this sequence (step_update.py), already queued for the
        cache with every sequence's rows at once: kept here for the step's reads only."""
        rows = rows.to(self.step.pool.dtype)
        self.new.append(rows)
        self.n += rows.shape[0]

    def view(self) -> torch.Tensor:
        return torch.cat([self.step.old(self.b), *self.new], dim=0) if self.new else self.step.old(self.b)


class Snapshots:
    """Where one sequence's layer saves its page-boundary snapshots (engine caches with prefix caching on):
    `at` the (k, page) boundaries its chunk reaches (the state after the chunk's first k tokens is page's row),
    `pairs` (a snapshotted state's view of the sequence's slot, that state's snapshot rows [P + 1, ...])."""

    def __init__(self, at: tuple[tuple[int, int], ...], pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.at, self.pairs = at, pairs

    def save(self, page: int) -> None:
        for state, rows in self.pairs:
            rows[page].copy_(state)


class CompressorCarry:
    def __init__(
        self, ratio: int, width: int, overlap_dim: int | None, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        self.ratio = ratio
        self.kv = torch.zeros(ratio, width, dtype=dtype, device=device)
        self.gate = torch.zeros(ratio, width, dtype=dtype, device=device)
        self.fill = 0
        # CSA only: the Ca half of the last closed window (kv, and gate with the position bias added)
        self.overlap_kv = torch.zeros(ratio, overlap_dim, dtype=dtype, device=device) if overlap_dim else None
        self.overlap_gate = torch.zeros(ratio, overlap_dim, dtype=dtype, device=device) if overlap_dim else None

    @classmethod
    def over(cls, kv_gate: torch.Tensor, overlap: torch.Tensor | None, fill: int) -> CompressorCarry:
        """A carry over cache slot views: kv_gate [2, m, width] (kv rows, then gate rows), overlap [2, m, D]
        (CSA; None for HCA), `fill` tokens buffered."""
        carry = cls.__new__(cls)
        carry.ratio, carry.kv, carry.gate, carry.fill = kv_gate.shape[1], kv_gate[0], kv_gate[1], fill
        carry.overlap_kv = overlap[0] if overlap is not None else None
        carry.overlap_gate = overlap[1] if overlap is not None else None
        return carry


@dataclass
class SlidingState:
    ring: SlidingRing
    snapshots: Snapshots | None = None  # the engine's page-boundary saves (None: none this step)


@dataclass
class HCAState:
    ring: SlidingRing
    carry: CompressorCarry
    pool: CompressedPool | PagedPool
    snapshots: Snapshots | None = None


@dataclass
class CSAState:
    ring: SlidingRing
    carry: CompressorCarry
    pool: CompressedPool | PagedPool
    index_carry: CompressorCarry
    index_pool: CompressedPool | PagedPool
    snapshots: Snapshots | None = None


LayerState = SlidingState | HCAState | CSAState


class SequenceState:
    """Every layer's state for one sequence, and how many of its tokens the model has seen."""

    def __init__(self, cfg: DeepseekV4Config, max_tokens: int, dtype: torch.dtype, device="cpu") -> None:
        self.max_tokens = max_tokens
        self.length = 0
        d, w = cfg.attention.head_dim, cfg.attention.sliding_window
        c = cfg.compression.index_head_dim
        self.layers: list[LayerState] = []
        for i, kind in enumerate(cfg.layer_kinds):
            ring = SlidingRing(w, d, dtype, device)
            if kind == "sliding":
                self.layers.append(SlidingState(ring))
                continue
            m = cfg.ratio(i)
            pool = CompressedPool(max_tokens // m, d, dtype, device)
            if kind == "hca":
                self.layers.append(HCAState(ring, CompressorCarry(m, d, None, dtype, device), pool))
            else:
                self.layers.append(
                    CSAState(
                        ring,
                        CompressorCarry(m, 2 * d, d, dtype, device),
                        pool,
                        CompressorCarry(m, 2 * c, c, dtype, device),
                        CompressedPool(max_tokens // m, c, dtype, device),
                    )
                )

    def clone(self) -> SequenceState:
        """A snapshot: everything a preempted or prefix-cached sequence needs to continue exactly (the
        tests fork one prefill into many continuations with it)."""
        return copy.deepcopy(self)

"""One step's input, flattened: the scheduled chunks of every request, decodes first.

Notation
  T        tokens in the step, ordered [decode tokens | prefill tokens]
  B        requests in the step
  slot     page * page_size + offset: a row of the paged latent cache
  state slot  a request's slot of the "request"-addressed states (cache/slot_pool.py); None on models
           without request states, and then the batch carries no state-slot tensors at all
A request is a *decode* when its query length <= decode_threshold (1 by default, so a one-token
prompt is a decode, as in vLLM and DeepSeek's reference). The batch only orders tokens by that
rule; `attention.router.route` names the paths.

Page-boundary snapshots of request states (config/layer_kinds.py; built with snapshots=True, when the cache
keeps them): a chunk whose tokens reach page boundaries (context_len < b <= seq_len, b a multiple of
page_size) lists them in snapshot_at as (k, page): the state after its first k tokens is the snapshot row of
`page` = block_table[b / page_size - 1]. A chunk with restore_page starts at a prefix hit: the runner
restores its slot from that page's snapshot row before the step (ForwardBatch.restores).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class SeqChunk:
    """One request's work this step: asked for by the scheduler, placed in the flat batch by build()."""

    request_id: str
    token_ids: tuple[int, ...]  # the new tokens (query)
    context_len: int  # tokens of this request already in the cache
    block_table: tuple[int, ...]  # pages holding positions [0, context_len + len(token_ids))
    needs_logits: bool = True  # False for a prefill chunk that does not end the prompt
    all_logits: bool = False  # logits at every query position (prompt_logits)
    num_cached: int = 0  # leading context tokens served from the prefix cache (reported in the ledger)
    query_start: int = 0  # first row of these tokens in the flat batch (set by ForwardBatch.build)
    state_slot: int | None = None  # the request's slot of the request-addressed states (None: the model has none)
    reset_state: bool = False  # the runner zeroes the slot before this step: the chunk starts the sequence
    # the chunk starts at a prefix hit: the runner restores the slot from this page's snapshot row (the hit's
    # last page) before the step, instead of zeroing it
    restore_page: int | None = None
    snapshot_at: tuple[tuple[int, int], ...] = ()  # (k, page): save the state after k tokens (set by build)
    # speculative verification: the chunk's last num_draft tokens are drafts, which the verdict may reject (a
    # model with request states keeps what it needs to roll them back; models/deepseek_v4/rollback.py)
    num_draft: int = 0

    @property
    def query_len(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: cache row each new token is written to
    seqs: tuple[SeqChunk, ...]  # decodes first, query_start set
    num_decode_seqs: int
    logits_indices: torch.Tensor  # [n] rows of the flat batch whose logits are needed
    logits_owner: tuple[tuple[str, int], ...]  # per logits row: (request_id, query offset)
    page_size: int
    pad_slot: int = 0  # the cache row that key positions past a request's sequence read (ModelCache.pad_slot)
    # Request-addressed states (None when no sequence has a state slot: today's models):
    state_slots: torch.Tensor | None = None  # [B] int64: each sequence's state slot, in batch order
    token_state_slots: torch.Tensor | None = None  # [T] int64: the state slot of each token's sequence
    reset_slots: tuple[int, ...] = ()  # slots the runner zeroes before the step (chunks with reset_state)
    restores: tuple[tuple[int, int], ...] = ()  # (slot, page): restored from the page's snapshot before the step

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.query_len for s in self.seqs[: self.num_decode_seqs])

    @staticmethod
    def build(
        chunks: list[SeqChunk],
        page_size: int,
        decode_threshold: int,
        device: str | torch.device = "cpu",
        pad_slot: int = 0,
        snapshots: bool = False,
    ) -> ForwardBatch:
        """pad_slot: the engine's caches have a zero row there (ModelCache.pad_slot); a bare batch (tests of
        the metadata alone) may leave it 0. snapshots: the cache keeps page-boundary snapshots of request
        states, so each chunk lists the boundaries it reaches (SeqChunk.snapshot_at)."""
        decodes = [c for c in chunks if c.query_len <= decode_threshold]
        prefills = [c for c in chunks if c.query_len > decode_threshold]
        ordered = decodes + prefills
        state_slots = [c.state_slot for c in ordered]
        stateful = state_slots.count(None) < len(state_slots)  # a model with request states (one C-speed pass)
        if stateful:
            _check_state_slots(ordered)
        ids, pos, slots, seqs, lidx, owner = [], [], [], [], [], []
        for c in ordered:
            start = len(ids)
            ids.extend(c.token_ids)
            positions = range(c.context_len, c.seq_len)
            pos.extend(positions)
            slots.extend(c.block_table[p // page_size] * page_size + p % page_size for p in positions)
            at = _boundaries(c, page_size) if snapshots and c.state_slot is not None else ()
            seqs.append(replace(c, query_start=start, snapshot_at=at))
            wanted = range(c.query_len) if c.all_logits else ([c.query_len - 1] if c.needs_logits else [])
            lidx.extend(start + i for i in wanted)
            owner.extend((c.request_id, i) for i in wanted)
        return ForwardBatch(
            input_ids=_longs(ids, device),
            positions=_longs(pos, device),
            slot_mapping=_longs(slots, device),
            seqs=tuple(seqs),
            num_decode_seqs=len(decodes),
            logits_indices=_longs(lidx, device),
            logits_owner=tuple(owner),
            page_size=page_size,
            pad_slot=pad_slot,
            state_slots=_longs(state_slots, device) if stateful else None,
            token_state_slots=_longs([c.state_slot for c in ordered for _ in c.token_ids], device)
            if stateful
            else None,
            reset_slots=tuple(c.state_slot for c in ordered if c.reset_state) if stateful else (),
            restores=tuple((c.state_slot, c.restore_page) for c in ordered if c.restore_page is not None)
            if stateful
            else (),
        )


def _boundaries(c: SeqChunk, page_size: int) -> tuple[tuple[int, int], ...]:
    """(k, page) for each page boundary b in (context_len, seq_len]: k = b - context_len tokens of the chunk."""
    first = c.context_len // page_size + 1
    return tuple(
        (b - c.context_len, c.block_table[b // page_size - 1])
        for b in range(first * page_size, c.seq_len + 1, page_size)
    )


def _check_state_slots(chunks: list[SeqChunk]) -> None:
    """In a step where some sequence has a state slot, every one has (a model with request states), and no
    slot is shared: two sequences writing one slot would mix their states. (A step without any slot has no
    state to reset: reset_slots stays empty, and a model with request states refuses it in the runner.)"""
    seen: dict[int, str] = {}
    for c in chunks:
        if c.state_slot is None:
            raise ValueError(f"request {c.request_id}: no state slot in a step whose other requests have one")
        if c.reset_state and c.restore_page is not None:
            raise ValueError(f"request {c.request_id}: a chunk either resets its state or restores it, not both")
        if c.state_slot in seen:
            raise ValueError(f"requests {seen[c.state_slot]} and {c.request_id} share state slot {c.state_slot}")
        seen[c.state_slot] = c.request_id


def _longs(values: list[int], device) -> torch.Tensor:
    # Built on the host and copied once: a list -> device tensor directly is one transfer per call anyway.
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

"""Rolling DeepSeek-V4's request states back after a speculative verification rejects drafts.

A verify step runs each verifying sequence's [last token, d_1 .. d_k] at positions c .. c+k through every layer,
and the batched state update (step_update.py) advances the sequence's states by all k + 1 of them: ring rows of
rejected positions overwrite rows of positions p - W that later queries still read, a window closing inside the
drafts pools rejected tokens into a compressed row and the CSA overlap half, and the carry keeps the wrong open
window. The step must run that way (a draft's query reads the rows of the drafts before it), so the states are
repaired after the verdict. The mechanism is save-restore-replay:

  before the step  `RollbackTape.build`: per layer the verifying slots' request states (window ring, kv / index
                   carries, overlap halves: the slot's whole fixed-size state) copied out
  during the step  the layer's projections of the verifying rows (K=V rows, the compressors' kv / gate, the
                   indexer compressor's kv / gate) kept on the tape (`LayerTape`, the same tensors the step's
                   update read: index_select of its rows)
  after the verdict `rollback`: for each sequence that kept a < k + 1 tokens, its slot's states are put back
                   as they were before the step and the batched state update is run again over its kept rows
                   only (ring_plan / window_plan over spans cut at a, the page-boundary snapshots at k <= a):
                   the same values through the same ops, so the states equal those of a plain step over the
                   kept tokens bit for bit. The pool rows of windows that closed inside the rejected tokens are
                   zeroed at their paged slots, and so are the page snapshot rows of boundaries past a (those
                   pages are the request's own and not yet in the prefix cache: only committed tokens register).

Why not snapshot-and-recompute (restore, then re-run the kept tokens through the model): a second forward of
every layer per verification, where the replay is a few gathers and one pooling per layer. Why not save only the
ring rows the step overwrites: the carries and overlap halves need the replay anyway, and the slot's whole state
is one index_select per tensor (V4-Flash: 11.5 MB per verifying request, the bytes per request `inspect` prints).

Notation
  R verifying sequences j, each (rows a_j .. a_j+n_j-1 of the step, positions c_j .., slot s_j, n_j = k_j + 1)
  tape rows: the verifying rows in sequence order, [sum_j n_j, ...]; kept_j tokens kept (1 + accepted)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlaserve.cache.model_cache import take
from mlaserve.models.deepseek_v4.step_update import apply_ring, ring_plan, window_plan

# the request states a verify step advances (config/layer_kinds.py _v4_layer); pools and snapshots are paged
STATE_NAMES = ("window", "kv_carry", "kv_overlap", "index_carry", "index_overlap")


@dataclass
class LayerTape:
    """One layer's projections of the tape rows (None where the layer has no such projection)."""

    kv: torch.Tensor
    ckv: torch.Tensor | None
    cgate: torch.Tensor | None
    ikv: torch.Tensor | None
    igate: torch.Tensor | None


@dataclass
class RollbackTape:
    """What a verify step keeps for its verifying sequences (plain data + the saved tensors)."""

    request_ids: tuple[str, ...]  # per j
    rows: torch.Tensor  # [sum n_j] the verifying rows of the step, in sequence order
    spans: tuple[tuple[int, int, int, int], ...]  # per j: (first tape row, n_j, c_j, slot s_j)
    snapshots: tuple[tuple[tuple[int, int], ...], ...]  # per j: the (k, page) boundaries its chunk reached
    tables: tuple[tuple[int, ...], ...]  # per j: its block table
    saved: list[dict[str, torch.Tensor]]  # per layer: state name -> [R, ...] the slots' states before the step
    layers: list[LayerTape | None] = field(default_factory=list)  # per layer, filled during the step

    @staticmethod
    def build(step, cache, drafts: tuple[int, ...], request_ids: tuple[str, ...]) -> RollbackTape | None:
        """step: the StepContext; drafts, request_ids: per sequence of the step its draft tokens (0: not
        verifying) and its request.
        None when no sequence verifies drafts. Run before the forward (after the slots' reset / restore)."""
        verifying = [b for b, d in enumerate(drafts) if d]
        if not verifying:
            return None
        device = step.positions.device
        spans, rows, at = [], [], 0
        for b in verifying:
            a, n, c, slot = step.seq_spans[b]
            spans.append((at, n, c, slot))
            rows.extend(range(a, a + n))
            at += n
        slots = torch.tensor([s for *_, s in spans], dtype=torch.long, device=device)
        saved = [
            {name: take(layer.tensors[name], slots) for name in STATE_NAMES if name in layer.tensors}
            for layer in cache.layers
        ]
        return RollbackTape(
            tuple(request_ids[b] for b in verifying),
            torch.tensor(rows, dtype=torch.long, device=device),
            tuple(spans),
            tuple(step.snapshots[b] for b in verifying),
            tuple(step.block_tables[b] for b in verifying),
            saved,
            [None] * len(cache.layers),
        )

    def keep(self, layer: int, projected: tuple) -> None:
        """The layer's step projections (kv, ckv, cgate, ikv, igate over all T rows) -> their tape rows."""
        self.layers[layer] = LayerTape(*(None if x is None else x.index_select(0, self.rows) for x in projected))


def rollback(tape: RollbackTape, kept: list[int], cache, layers, tables, page_size: int, pool_slots) -> None:
    """kept[j]: tokens of sequence j's chunk that stay (1 + accepted drafts). For every j with kept[j] < n_j:
    restore its slot's states, replay the state update over its kept rows, zero its rejected pool rows and
    snapshot rows. layers: the model's attention modules (their compressors pool the replayed windows);
    pool_slots: serving.pool_slots (the block tables' row slots)."""
    cut = [j for j, (_, n, _, _) in enumerate(tape.spans) if kept[j] < n]
    if not cut:
        return
    device = tape.rows.device
    sel = torch.tensor(cut, dtype=torch.long, device=device)
    slots = torch.tensor([tape.spans[j][3] for j in cut], dtype=torch.long, device=device)
    spans = tuple((tape.spans[j][0], kept[j], tape.spans[j][2], tape.spans[j][3]) for j in cut)
    full = tuple(tape.spans[j] for j in cut)
    snaps = tuple(tuple((k, p) for k, p in tape.snapshots[j] if k <= kept[j]) for j in cut)
    dropped = [p for j in cut for k, p in tape.snapshots[j] if k > kept[j]]
    blocks = tuple(tape.tables[j] for j in cut)
    for i, (layer, attn) in enumerate(zip(cache.layers, layers)):
        t, taped = layer.tensors, tape.layers[i]
        for name, before in tape.saved[i].items():  # the slots as they were before the step
            t[name].index_copy_(0, slots, take(before, sel))
        if dropped:
            pages = torch.tensor(dropped, dtype=torch.long, device=device)
            for name in STATE_NAMES:
                if name + "_snapshot" in t:
                    t[name + "_snapshot"].index_fill_(0, pages, 0)
        window = t["window"].shape[1]
        apply_ring(ring_plan(spans, snaps, window, device), taped.kv, t["window"], t.get("window_snapshot"))
        if attn.compressor is None:
            continue
        m = attn.ratio
        _, _, keep_slots = pool_slots(blocks, spans, m, page_size, device)
        _, _, all_slots = pool_slots(blocks, full, m, page_size, device)
        gone = torch.cat([s[len(k) :] for s, k in zip(all_slots, keep_slots)])
        plan = window_plan(spans, snaps, m, torch.cat(keep_slots))
        rows = attn.compressor.close_step(
            taped.ckv, taped.cgate, plan, t["kv_carry"], t.get("kv_overlap"), t.get("kv_overlap_snapshot"), tables
        )
        t["kv_pool"].index_copy_(0, plan.pool_slots, rows.to(t["kv_pool"].dtype))
        t["kv_pool"].index_fill_(0, gone, 0)
        if "index_pool" in t:
            irows = attn.compressor.indexer.close_step(
                taped.ikv,
                taped.igate,
                plan,
                t["index_carry"],
                t["index_overlap"],
                t.get("index_overlap_snapshot"),
                tables,
            )
            t["index_pool"].index_copy_(0, plan.pool_slots, irows.to(t["index_pool"].dtype))
            t["index_pool"].index_fill_(0, gone, 0)

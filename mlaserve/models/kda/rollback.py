"""Rolling KDA layers' request states back after a speculative verification rejects drafts (GLM-5.3-Flash).

A verify step runs each verifying sequence's [last token, d_1 .. d_k] (n = k + 1 tokens) through every KDA layer as
one chunk: the recurrent state S and the conv window advance by all n tokens. After the verdict only the first
`kept` of them stay. The mechanism is save-restore-replay, the rollback protocol of models/rollback.py:

  before the step  `KDATape.build`: per KDA layer the verifying slots' `recurrent` [H, d, d] and `conv` [K-1, C]
                   copied out (one index_select per state)
  during the step  each KDA layer keeps its per-token inputs of the verifying rows on the tape (`keep`): the conv's
                   input `mixed` [n, C] (q|k|v before the conv), the forget gate g [n, H, d] and beta [n, H]
  after the verdict `rollback`: for the sequences with kept < n, the slots' states go back to the saved ones and the
                   kept tokens are replayed with the decode path's ops (conv.step over each kept token's window of
                   K inputs, recurrence.step token index by token index), batched over the cut sequences: a state
                   equals what plain decoding of the kept tokens from the same inputs computes. Page snapshot rows
                   of boundaries past `kept` are zeroed (those pages are the request's own, not in the prefix cache:
                   only committed tokens register, and the step that commits that boundary writes the row again).

Why this tape and not the others:
  - per-token states (keep S after every token of the chunk, restore the one at `kept`): k copies of [H, d, d] per
    verifying request and layer (GLM-5.3-Flash: 4 MiB each, 34 layers) where save-restore needs one; it would also
    need the chunked form split at every token.
  - recompute the kept prefix through the model (restore, re-run the kept tokens): a second forward of every layer
    (the MoE dominates) per rejection, where the replay is the recurrence alone (~H d^2 per token and layer).
  The replay costs nothing when every draft is accepted (no sequence is cut); a rejection replays at most k tokens.

Size (`tape_bytes`, printed by `mlaserve inspect` with speculative decoding): per verifying request of n rows and per
KDA layer, its two saved states (their StateSpecs' bytes: recurrent fp32, conv in the cache dtype) plus n rows of
inputs: mixed [C] and beta [H] in the compute dtype, g [H, d] fp32 (the forget gate is computed in fp32).

Notation
  R verifying sequences j (batch order), each: step rows a_j .. a_j + n_j - 1, state slot s_j
  tape rows: the verifying rows in sequence order, [sum_j n_j, ...]; kept_j tokens kept (1 + accepted drafts)
  K conv width, C = 3 H d conv channels
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from mlaserve.models.kda import conv, recurrence

if TYPE_CHECKING:
    from mlaserve.cache.model_cache import ModelCache
    from mlaserve.config.layer_kinds import LayerKind
    from mlaserve.executor.step_context import StepContext


class KDAWeights(Protocol):
    """What the replay reads of a KDA layer (models/kda/layer.py KimiDeltaAttention), stated here so the layer can
    name this module's tape without an import circle."""

    def taps(self) -> torch.Tensor: ...

    def split_heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


STATE_NAMES = ("recurrent", "conv")  # the request states a KDA layer keeps (config/layer_kinds.py kda_states)
GATE_BYTES = 4  # g is fp32 whatever the model dtype (KimiDeltaAttention.forget_gate)


def tape_bytes(layers: tuple[LayerKind, ...], num_tokens: int, compute_bytes: int) -> int:
    """The bytes a verify step's tape holds per verifying request of num_tokens rows (1 + drafts), from the config
    alone: per KDA layer its saved states (StateSpec.request_bytes, what the cache allocates per slot) and
    num_tokens rows of the inputs `keep` takes (mixed [C], beta [H]: compute dtype; g [H, d]: fp32)."""
    total = 0
    for k in layers:
        if k.attention != "kda":
            continue
        rec, conv_state = k.state("recurrent"), k.state("conv")
        heads, head_dim = rec.per_request[0], rec.width
        row = conv_state.width * compute_bytes + heads * head_dim * GATE_BYTES + heads * compute_bytes
        total += rec.request_bytes(compute_bytes) + conv_state.request_bytes(compute_bytes) + num_tokens * row
    return total


@dataclass
class KDATape:
    """What a verify step keeps for its verifying sequences (plain data + the saved tensors)."""

    request_ids: tuple[str, ...]  # per j
    rows: torch.Tensor  # [sum n_j] the verifying rows of the step, in sequence order
    spans: tuple[tuple[int, int, int], ...]  # per j: (first tape row, n_j, slot s_j)
    snapshots: tuple[tuple[tuple[int, int], ...], ...]  # per j: the (k, page) boundaries its chunk reached
    saved: dict[int, dict[str, torch.Tensor]]  # per KDA layer index: state name -> [R, ...] before the step
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # filled by keep

    @staticmethod
    def build(
        step: StepContext, cache: ModelCache, layers: tuple[int, ...], request_ids: tuple[str, ...]
    ) -> KDATape | None:
        """layers: the KDA layers' indices; request_ids: per sequence of the step. None when no sequence verifies
        drafts (step.drafts, plain data of the step). Run before the forward (after the slots' reset / restore)."""
        verifying = [b for b, d in enumerate(step.drafts) if d]
        if not verifying:
            return None
        device = step.positions.device
        spans, rows, at = [], [], 0
        for b in verifying:
            a, n, _, slot = step.seq_spans[b]
            spans.append((at, n, slot))
            rows.extend(range(a, a + n))
            at += n
        slots = torch.tensor([s for *_, s in spans], dtype=torch.long, device=device)
        saved = {
            i: {name: cache.layers[i].tensors[name].index_select(0, slots) for name in STATE_NAMES} for i in layers
        }
        return KDATape(
            tuple(request_ids[b] for b in verifying),
            torch.tensor(rows, dtype=torch.long, device=device),
            tuple(spans),
            tuple(step.snapshots[b] for b in verifying),
            saved,
        )

    def keep(self, layer: int, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        """A KDA layer's per-token inputs over all T rows of the step -> their tape rows."""
        self.inputs[layer] = tuple(x.index_select(0, self.rows) for x in (mixed, g, beta))


def rollback(tape: KDATape, kept: list[int], cache: ModelCache, layers: dict[int, KDAWeights]) -> None:
    """kept[j]: tokens of sequence j's chunk that stay. For every j with kept[j] < n_j, in every KDA layer: the slot's
    states as they were before the step, then the kept tokens replayed; its snapshot rows past kept[j] zeroed."""
    cut = [j for j, (_, n, _) in enumerate(tape.spans) if kept[j] < n]
    if not cut:
        return
    device = tape.rows.device
    sel = torch.tensor(cut, dtype=torch.long, device=device)
    slots = torch.tensor([tape.spans[j][2] for j in cut], dtype=torch.long, device=device)
    dropped = [p for j in cut for k, p in tape.snapshots[j] if k > kept[j]]
    plan = _replay_plan(tape, cut, kept, device)
    for i, attn in layers.items():
        t = cache.layers[i].tensors
        rec0 = tape.saved[i]["recurrent"].index_select(0, sel)  # [R', H, d, d]
        conv0 = tape.saved[i]["conv"].index_select(0, sel)  # [R', K-1, C]
        rec, conv_state = replay(attn, plan, conv0, rec0, *tape.inputs[i])
        t["recurrent"].index_copy_(0, slots, rec)
        t["conv"].index_copy_(0, slots, conv_state.to(t["conv"].dtype))
        if dropped:
            pages = torch.tensor(dropped, dtype=torch.long, device=device)
            for name in STATE_NAMES:
                if name + "_snapshot" in t:
                    t[name + "_snapshot"].index_fill_(0, pages, 0)


@dataclass(frozen=True)
class ReplayPlan:
    """The replay's index tensors, from the tape's spans and the verdict alone (plain data, once per rollback).

    Sources: a conv window row is read from [conv0 flattened (R' (K-1) rows) ; the tape's input rows]."""

    windows: torch.Tensor  # [N, K] per kept token (N = sum kept_j over the cut j): its K conv inputs, as source rows
    final: torch.Tensor  # [R', K-1] per cut sequence: the conv state after its kept tokens, as source rows
    tokens: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per token index t: (sequences j' with kept > t, rows in N)
    tape_rows: torch.Tensor  # [N] per kept token: its row among the tape's input rows


def _replay_plan(tape: KDATape, cut: list[int], kept: list[int], device) -> ReplayPlan:
    k1 = next(iter(tape.saved.values()))["conv"].shape[1]  # K - 1
    base = len(cut) * k1  # the tape's rows follow the saved conv rows in the source
    windows, final, firsts, tape_rows = [], [], [], []
    for jj, j in enumerate(cut):  # plain ints: each sequence's list of source rows, oldest first
        history = [jj * k1 + r for r in range(k1)] + [base + tape.spans[j][0] + t for t in range(kept[j])]
        firsts.append(len(windows))
        windows.extend(history[t : t + k1 + 1] for t in range(kept[j]))
        tape_rows.extend(tape.spans[j][0] + t for t in range(kept[j]))
        final.append(history[-k1:])
    tokens = []
    for t in range(max(kept[j] for j in cut)):
        live = [jj for jj, j in enumerate(cut) if kept[j] > t]
        tokens.append(
            (
                torch.tensor(live, dtype=torch.long, device=device),
                torch.tensor([firsts[jj] + t for jj in live], dtype=torch.long, device=device),
            )
        )
    return ReplayPlan(
        torch.tensor(windows, dtype=torch.long, device=device).view(-1, k1 + 1),
        torch.tensor(final, dtype=torch.long, device=device).view(-1, k1),
        tuple(tokens),
        torch.tensor(tape_rows, dtype=torch.long, device=device),
    )


def replay(
    attn: KDAWeights,
    plan: ReplayPlan,
    conv0: torch.Tensor,
    rec0: torch.Tensor,
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept tokens of the cut sequences from their saved states, with the decode path's ops.
    conv0 [R', K-1, C], rec0 [R', H, d, d]; mixed, g, beta: the tape's rows -> (recurrent [R', H, d, d], conv
    [R', K-1, C]). Every kept token's conv output at once (it reads inputs only), then the recurrence one token
    index at a time over the sequences that keep it (at most k + 1 batched steps: no per-sequence loop)."""
    source = torch.cat([conv0.flatten(0, 1).to(mixed.dtype), mixed])  # [R'(K-1) + rows, C]
    window = source[plan.windows]  # [N, K, C]
    y, _ = conv.step(window[:, -1], window[:, :-1], attn.taps())  # [N, C]: each kept token's conv output
    q, k, v = attn.split_heads(y)
    q, k = recurrence.prepare(q, k)
    g, beta = g[plan.tape_rows], beta[plan.tape_rows]  # [N, ...] in the kept tokens' order
    s = rec0.clone()
    for live, rows in plan.tokens:
        _, s[live] = recurrence.step(q[rows], k[rows], v[rows], g[rows], beta[rows], s[live])
    return s, source[plan.final]

"""KimiDeltaAttention: one KDA layer of Kimi-Linear over its request states, with the checkpoint's names.

Notation
  T tokens of the step (decodes first), D hidden, H heads, d head width (dk = dv), K conv width
  x [T, D]; q, k, v [T, H d] each (q_proj, k_proj, v_proj), then the short conv + SiLU (q_conv1d, k_conv1d,
  v_conv1d: [H d, 1, K] each)
  g [T, H, d]   forget gate, log space, f = f_b_proj(f_a_proj(x)) + dt_bias:
                  Kimi-Linear: -exp(A_log_h) softplus(f)                 (no lower bound)
                  GLM-5.3-Flash: b sigmoid(exp(A_log_h) f), b = linear_lower_bound < 0 (the "safe gate", in (b, 0))
  beta [T, H]   sigmoid(b_proj(x))
  out = o_proj(o_norm(o, sigmoid(g_b_proj(g_a_proj(x)))))  o_norm: RMSNorm over d in fp32, times the gate
Cache (config/layer_kinds.py, "request" addressing, one slot per running request, zeroed when a sequence starts):
  recurrent [slots + 1, H, d, d] fp32   the delta rule's state S
  conv      [slots + 1, K - 1, 3 H d]   the last K-1 conv inputs, columns [q | k | v]
  recurrent_snapshot, conv_snapshot [pages + 1, ...]  (prefix caching on) both states after each page's last token
The step's "kda" plan (attention/router.py route_kda) names the route as data: a "recurrent" segment of
sequences with one new token each (one batched step over [B, H, d, d], gathered from and written back to their
slots) and a "chunked" segment (each sequence's chunk through the chunked form, chunk 64). The chunked segment
loops over its sequences: each has its own length and its own starting state, so one batched call would pad
every sequence to the longest and run the padded chunks for nothing; the projections, the gates and the output
run over all T tokens at once. Page-boundary snapshots (StepContext.snapshots, (k, page) per sequence): a chunk
is split at each boundary it reaches and the states after exactly k tokens go to the page's rows; the batched
step copies the slots whose token ends a page. recurrence.recurrent_reference is the plain reference both are
tested against. Speculative verification (GLM-5.3-Flash): a verify step's tape keeps the layer's per-token inputs of
the verifying rows, and a rollback replays the kept tokens from the states before the step (models/kda/rollback.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mlaserve.config.model import ModelConfig
from mlaserve.models.kda import conv, recurrence

if TYPE_CHECKING:
    from mlaserve.cache.model_cache import LayerState
    from mlaserve.executor.step_context import StepContext
    from mlaserve.models.indexer import Selection
    from mlaserve.models.kda.rollback import KDATape
    from mlaserve.models.layers import RotaryEmbedding


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's d values in fp32 (the weight too), times sigmoid(gate), cast back: transformers'
    KimiLinearRMSNormGated."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = self.weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))
        return (h * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    kind = "kda"  # the attention kind whose plan this layer executes (config/layer_kinds.py)

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        kda = cfg.kda
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim, self.width = kda.num_heads, kda.head_dim, kda.width
        d, w, hd = cfg.hidden_size, kda.width, kda.head_dim
        self.q_proj = nn.Linear(d, w, bias=False)
        self.k_proj = nn.Linear(d, w, bias=False)
        self.v_proj = nn.Linear(d, w, bias=False)
        self.q_conv1d = nn.Conv1d(w, w, kda.conv_kernel, groups=w, bias=False)
        self.k_conv1d = nn.Conv1d(w, w, kda.conv_kernel, groups=w, bias=False)
        self.v_conv1d = nn.Conv1d(w, w, kda.conv_kernel, groups=w, bias=False)
        self.f_a_proj = nn.Linear(d, hd, bias=False)
        self.f_b_proj = nn.Linear(hd, w, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(w, dtype=torch.float32))
        self.lower_bound = kda.lower_bound  # config: which gate formula (KDAConfig), chosen at construction
        self.gate_of = self._bounded_gate if kda.lower_bound is not None else self._softplus_gate
        self.A_log = nn.Parameter(torch.empty(1, 1, kda.num_heads, 1))
        self.b_proj = nn.Linear(d, kda.num_heads, bias=False)
        self.g_a_proj = nn.Linear(d, hd, bias=False)
        self.g_b_proj = nn.Linear(hd, w, bias=False)
        self.o_norm = GatedRMSNorm(hd, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(w, d, bias=False)

    def keep_fp32(self) -> None:
        """dt_bias stays fp32 in a bf16 model, as transformers keeps it (_keep_in_fp32_modules_strict)."""
        self.dt_bias.data = self.dt_bias.data.float()

    def taps(self) -> torch.Tensor:
        """The three depthwise convs' taps side by side: [3 H d, K] (q, k, v), as the conv state's columns."""
        return torch.cat([c.weight[:, 0] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> g [T, H, d] fp32, log space (<= 0). softplus written as transformers writes it."""
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).unflatten(-1, (self.num_heads, -1))
        return self.gate_of(g, self.A_log.float().view(self.num_heads, 1).exp())

    @staticmethod
    def _softplus_gate(g: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
        """Kimi-Linear: -rate softplus(g), softplus as transformers writes it (g itself above 20)."""
        return -rate * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))

    def _bounded_gate(self, g: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
        """GLM-5.3-Flash: lower_bound sigmoid(rate g), in [lower_bound, 0] (fp32's sigmoid reaches 1): each token
        keeps at least exp(lower_bound) of the state per channel."""
        return self.lower_bound * torch.sigmoid(rate * g)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [T, H, d] (model dtype) -> o_proj(gated RMSNorm of each head's d values)."""
        gate = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, (self.num_heads, -1))
        return self.o_proj(self.o_norm(o, gate).flatten(1))

    def forward(
        self,
        x: torch.Tensor,
        step: StepContext,
        rope: RotaryEmbedding,
        state: LayerState,
        prev: tuple[Selection, ...] | None,
        tape: KDATape | None = None,
    ) -> tuple[torch.Tensor, tuple[Selection, ...] | None]:
        """x [T, D] -> (out [T, D], prev unchanged). The decoder layer's attention interface (MLAAttention's): a KDA
        layer has no position encoding (rope unused) and passes a previous layer's DSA selection on untouched.
        tape: a verify step's KDATape (models/kda/rollback.py), which keeps this layer's inputs of the verifying rows."""
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3 H d]
        g, beta = self.forget_gate(x), torch.sigmoid(self.b_proj(x))
        if tape is not None:  # what a rollback replays: the recurrence's inputs of the verifying rows
            tape.keep(self.layer_idx, mixed, g, beta)
        t = state.tensors
        rec, conv_state = t["recurrent"], t["conv"]
        # page-boundary snapshot rows (prefix caching on; absent otherwise): [P + 1, ...] per state
        rec_snap, conv_snap = t.get("recurrent_snapshot"), t.get("conv_snapshot")
        taps, o = self.taps(), x.new_empty(x.shape[0], self.num_heads, self.head_dim)
        plan = step.route.plan_of(self.kind)
        for seg in plan.segments:
            lo, hi = seg.token_start, seg.token_end
            if seg.path == "recurrent":  # one new token per sequence: one batched step for all of them
                slots = step.state_slots[seg.seq_start : seg.seq_end]
                y, conv_new = conv.step(mixed[lo:hi], conv_state.index_select(0, slots), taps)
                conv_state.index_copy_(0, slots, conv_new.to(conv_state.dtype))
                q, k, v = self.split_heads(y)
                q, k = recurrence.prepare(q, k)
                out, s = recurrence.step(q, k, v, g[lo:hi], beta[lo:hi], rec.index_select(0, slots))
                rec.index_copy_(0, slots, s)
                o[lo:hi] = out.to(o.dtype)
                if rec_snap is not None:  # a token that ends a page: its slot's state is that page's row
                    self._save_ended_pages(step, seg.seq_start, seg.seq_end, rec, conv_state, rec_snap, conv_snap)
                continue
            for b in range(seg.seq_start, seg.seq_end):  # why a loop: see the module doc
                a, n, _, slot = step.seq_spans[b]
                at = step.snapshots[b] if rec_snap is not None else ()
                conv_before = conv_state[slot].clone() if at else None
                y, conv_state[slot] = conv.prefill(mixed[a : a + n], conv_state[slot], taps)
                q, k, v = self.split_heads(y)
                q, k = recurrence.prepare(q, k)
                # the chunk is split at each page boundary it reaches: the state after exactly k tokens is the
                # page's snapshot row (the chunked form's chunks restart there, the result is the same recurrence)
                s, done = rec[slot], 0
                for cut, page in (*at, (n, None)):
                    if cut > done:
                        piece = slice(a + done, a + cut)
                        out, s = recurrence.chunked(
                            q[done:cut], k[done:cut], v[done:cut], g[piece], beta[piece], s, plan.chunk
                        )
                        o[piece] = out.to(o.dtype)
                        done = cut
                    if page is not None:
                        rec_snap[page] = s
                        conv_snap[page] = conv.state_after(mixed[a : a + cut], conv_before)
                rec[slot] = s
        return self.output(o, x), prev

    @staticmethod
    def _save_ended_pages(step, first: int, end: int, rec, conv_state, rec_snap, conv_snap) -> None:
        """Sequences first .. end-1 each ran one token; those whose token ends a page (snapshot_at ((1, page),))
        copy their slot's states to that page's rows, one batched copy per state. The index lists are the step's
        plain data (StepContext.snapshots), read here, not computed from a tensor."""
        ended = [(step.seq_spans[b][3], step.snapshots[b][0][1]) for b in range(first, end) if step.snapshots[b]]
        if not ended:
            return
        slots = torch.tensor([e[0] for e in ended], dtype=torch.long, device=rec.device)
        pages = torch.tensor([e[1] for e in ended], dtype=torch.long, device=rec.device)
        rec_snap.index_copy_(0, pages, rec.index_select(0, slots))
        conv_snap.index_copy_(0, pages, conv_state.index_select(0, slots))

    def split_heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(t.unflatten(-1, (self.num_heads, self.head_dim)) for t in y.split(self.width, dim=-1))

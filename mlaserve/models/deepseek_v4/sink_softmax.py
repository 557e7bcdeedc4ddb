"""DeepSeek-V4's softmax with sinks over a step's keys, in each form the attention layer binds (attention.py: the
KernelPlan's op sink_attention). A mixin of V4Attention: it reads the layer's `sinks` [H] and `scale`.

Notation (attention.py's)
  q [T, H, D] the step's query rows; per sequence b its keys [K_b, D] (one shared K=V head) and mask [n_b, K_b]
  padded: Qp [B, S, H, D], keys [B, K, D] (or native_v4.KeyParts: the same rows named where they lie), mask [B, S, K]
  p = softmax over [q . keys * scale | sink_h] with the sink column dropped; out = p @ keys
Forms: _attend, one sequence (the plain reference); _attend_padded, the loop's per-sequence keys padded into one
call; _attend_step_*, every sequence's keys read at once by the step's plan; _sink_softmax_*, the padded call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlaserve.kernels import native_v4
from mlaserve.models.deepseek_v4.step_keys import StepQueries


class SinkSoftmax:
    def _attend_padded(self, q: torch.Tensor, keyed: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """q [T, H, D]; per sequence b (rows a_b .. a_b+n_b-1 of q) its keys [K_b, D] and mask [n_b, K_b]
        -> [T, H, D]. Padded to Q [B, S, H, D] (S = max n_b), keys [B, K, D] (K = max K_b, pad rows zero) and
        mask [B, S, K] (pad rows and columns False), then sink_softmax. Equal to _attend per sequence up to fp32
        summation order (a softmax over K >= K_b columns; tests/identities/test_deepseek_v4_batched.py)."""
        b_n, s_n, k_n = len(keyed), max(n for _, n, _, _ in keyed), max(k.shape[0] for _, _, k, _ in keyed)
        # which (sequence, slot) each of the T query rows occupies: plain ints from the spans
        seq_of = torch.tensor([i for i, (_, n, _, _) in enumerate(keyed) for _ in range(n)], device=q.device)
        slot_of = torch.tensor([j for _, n, _, _ in keyed for j in range(n)], device=q.device)
        rows = torch.tensor([r for a, n, _, _ in keyed for r in range(a, a + n)], device=q.device)
        keys = q.new_zeros(b_n, k_n, q.shape[-1])
        mask = torch.zeros(b_n, s_n, k_n, dtype=torch.bool, device=q.device)
        for i, (_, n, k, visible) in enumerate(keyed):  # copies only: each sequence's key count differs
            keys[i, : k.shape[0]] = k
            mask[i, :n, : k.shape[0]] = visible
        qp = q.new_zeros(b_n, s_n, *q.shape[1:])
        qp[seq_of, slot_of] = q[rows]
        outp = self.sink_softmax(qp, keys, mask)
        out = torch.empty_like(q)
        out[rows] = outp[seq_of, slot_of]
        return out

    def _attend_step_torch(
        self, q: torch.Tensor, keys: torch.Tensor | native_v4.KeyParts, mask: torch.Tensor, queries: StepQueries
    ) -> torch.Tensor:
        """q [T, H, D], every sequence's keys [B, K, D] and mask [B, S, K] (_step_keys) -> [T, H, D]: the
        queries padded by the step's plan, one _sink_softmax_torch, the rows taken back out."""
        outp = self._sink_softmax_torch(pad_rows(q, queries), _key_tensor(keys), mask)
        out = torch.empty_like(q)
        out[queries.rows] = outp[queries.seq, queries.slot]
        return out

    def _attend_step_native(
        self, q: torch.Tensor, keys: torch.Tensor | native_v4.KeyParts, mask: torch.Tensor, queries: StepQueries
    ) -> torch.Tensor:
        """_attend_step_torch in one C call (csrc/attention.c mls_sink_mqa): each query reads its row of q and
        writes its row of the result where they lie (queries.index; no padded copy in or out), and its scores,
        softmax and weighted sum run over its allowed keys only, tiles of keys in L2, register-blocked over heads.
        The torch form computes every (query, key) pair of the padded [B, S, H, K] logits and masks them: at a
        1024-token prefill of a CSA layer ~1400 keys of which ~640 are visible, two fp32 GEMMs plus where / cat /
        softmax over 90 MB of logits, then the pad and gather copies (2.4 -> 1.2 s for the prompt on a 4-layer
        model: a 2-core AMX Xeon, 2 threads, 2026-12-07). Equal up to fp32 summation order. Keys given as
        KeyParts (the native gather's) are read where they lie (mls_sink_mqa_parts: the same rows, the same bits,
        no copy). Its contract on the step's input: fp32 CPU tensors (else the reference)."""
        if q.dtype != torch.float32 or q.device.type != "cpu":
            return self._attend_step_torch(q, keys, mask, queries)
        if isinstance(keys, native_v4.KeyParts):  # the native gather's (fp32 rows by its contract)
            return native_v4.sink_mqa_parts(
                q.contiguous(), queries.index, keys, mask.contiguous(), self.sinks, self.scale
            )
        if keys.dtype != torch.float32:
            return self._attend_step_torch(q, keys, mask, queries)
        return native_v4.sink_mqa(
            q.contiguous(), queries.index, keys.contiguous(), mask.contiguous(), self.sinks, self.scale
        )

    def _sink_softmax_native(self, qp: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """_sink_softmax_torch in one C call (as _attend_step_native, the padded queries their own rows). Its
        contract on the step's input: fp32 CPU tensors (else the reference)."""
        if qp.dtype != torch.float32 or keys.dtype != torch.float32 or qp.device.type != "cpu":
            return self._sink_softmax_torch(qp, keys, mask)
        b, s, h, d = qp.shape
        index = torch.arange(b * s, dtype=torch.int64).view(b, s)
        out = native_v4.sink_mqa(qp.reshape(b * s, h, d).contiguous(), index, keys.contiguous(),
                                     mask.contiguous(), self.sinks, self.scale)  # fmt: skip
        return out.view(b, s, h, d)

    def _sink_softmax_torch(self, qp: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """qp [B, S, H, D], keys [B, K, D], mask [B, S, K] -> [B, S, H, D]. Masked logits are selected to -inf
        (torch.where), never multiplied by zero: a masked logit times 0 would still carry a NaN or inf. A pad
        query row sees only its sink, so its probabilities are 0 and its output 0 (dropped)."""
        b_n, s_n = qp.shape[0], qp.shape[1]
        logits = torch.matmul(qp, keys.transpose(1, 2).unsqueeze(1)) * self.scale  # [B, S, H, K]
        logits = torch.where(mask[:, :, None, :], logits.float(), float("-inf"))
        sinks = self.sinks.float().view(1, 1, -1, 1).expand(b_n, s_n, -1, 1)
        combined = torch.cat([logits, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        return torch.matmul(probs.to(keys.dtype), keys.unsqueeze(1))  # [B, S, H, D]

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [S, H, D], kv [K, D], visible [S, K] -> [S, H, D]; the per-head sink joins the softmax only."""
        logits = torch.matmul(q, kv.t()) * self.scale  # [S, H, K]
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        # the fp32 sink column promotes the row to fp32 (as the reference's cat does in bf16 runs)
        sinks = self.sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        combined = torch.cat([logits.float(), sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        return torch.matmul(probs.to(kv.dtype), kv)


def pad_rows(x: torch.Tensor, queries: StepQueries) -> torch.Tensor:
    """x [T, ...] the step's rows -> [B, S, ...] by the step's query layout, zeros on pad slots."""
    out = x.new_zeros(*queries.pos.shape, *x.shape[1:])
    out[queries.seq, queries.slot] = x[queries.rows]
    return out


def _key_tensor(keys: torch.Tensor | native_v4.KeyParts) -> torch.Tensor:
    """The step's keys [B, K, D] as a tensor: the native gather's KeyParts copied out (one C call)."""
    return keys.gather() if isinstance(keys, native_v4.KeyParts) else keys


def keyed_of(
    keys: torch.Tensor | native_v4.KeyParts, mask: torch.Tensor, queries: StepQueries
) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """A batched call's keys [B, K, D] and mask [B, S, K] (_attend_step's) as the per-sequence loop's list of
    (first row, tokens, keys [K, D], mask [n_b, K]) per sequence, the pad columns kept (zero rows no query sees):
    for checks that observe each sequence's attention (verify, tests), off the serving path."""
    keys = _key_tensor(keys)
    out = []
    for b in range(keys.shape[0]):
        rows = queries.rows[queries.seq == b]  # a_b .. a_b + n_b - 1
        out.append((int(rows[0]), rows.shape[0], keys[b], mask[b, : rows.shape[0]]))
    return out

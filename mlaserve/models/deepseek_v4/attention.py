"""DeepSeek-V4 attention: shared-K=V multi-query attention over [sliding window | compressed rows], with sinks.

Notation
  S   tokens of the chunk (positions t), H heads, D head width, d rope width (trailing dims)
  r   q_lora_rank, G o_groups, o o_lora_rank
  K   keys visible to the chunk: min(start, W-1) ring rows + S new rows, then T compressed rows
  q_latent [S, r]    q_a_norm(q_a_proj(x))           (also the indexer's query input)
  q        [S, H, D] rope(unweighted_rms(q_b_proj(q_latent)))   per head, no weight
  kv       [S, D]    rope(kv_norm(kv_proj(x)))        one head, used as key and as value (with the official
                     FP8 rounding of its non-rope part when the run asks for it: official.py)
  logits   [S, H, K] q . kv * D^-1/2, masked: ring rows t-W < p <= t; compressed rows by the layer kind
                     (HCA: s < (t+1)//m; CSA: the indexer's top-k of those)
  p        softmax over [logits | sink_h] with the sink column dropped (a per-head extra logit)
  out      [S, H, D] p @ kv, rope slice de-rotated at t (-sin), since the values carry rope
  y        [S, hidden] o_b_proj(concat_g o_a_proj_g(out[:, heads of group g]))   grouped low-rank output
A step holds the chunks of one or more sequences (spans): the projections, norms and rope run over all of its
tokens at once. The state updates (ring, compressors' windows, indexer keys) run in one of two forms, fixed by
the caller before the step: `step` None, the plain reference, a Python loop over the spans (each updates its own
state, with its own row counts; in the engine with prefix caching on, in pieces ending at the page boundaries
its chunk reaches, saving the ring and overlap halves after each); or a step_update.LayerStep, every
sequence's update at once through index tensors computed once per step (the engine's path: one pooling of all
closed windows, one scatter per cache tensor, boundary snapshots computed from the same data). The chunk's keys
(ring rows before the chunk, the chunk's rows, pool rows) and the indexer's top-k are then read in one of two forms:
with `step` and `batched` (the engine's path, `_step_keys`) for every sequence at once from the cache tensors
through the step's plan (step_keys.py: one read of the sequences' rings, one gather of the keys, masks by tensor
ops, the indexer's scoring and top-k batched over sequences: Indexer.choose_step), one softmax for the step over
the padded keys (`attend_step`: the KernelPlan's op sink_attention binds one C call over each query's allowed keys,
or the torch form over the padded logits); otherwise a Python loop over the spans reads each sequence's keys from its
state objects (`_attend_spans`), then one softmax per sequence (`batched` False: the plain reference) or one
padded softmax (`_attend_padded`). Padded, both forms alike (each sequence's keys packed in the reference's order):
  Qp [B, S, H, D]  keys [B, K, D]  mask [B, S, K]  (S = longest chunk, K = most keys of one sequence)
Layer kinds pick the table (sliding: main; CSA/HCA: compress) and the compressor: plain data from the config,
fixed at construction.
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.config.deepseek_v4 import DeepseekV4Config
from mlaserve.config.v4_numerics import TRANSFORMERS, V4Numerics, check_v4_numerics
from mlaserve.kernels import native_v4, registry, row_product
from mlaserve.kernels.registry import KernelSwitch
from mlaserve.models.deepseek_v4.compressor import Compressor
from mlaserve.models.deepseek_v4.indexer import Indexer, visible_rows
from mlaserve.models.deepseek_v4.norm import RMSNorm, unweighted_rms_norm
from mlaserve.models.deepseek_v4.official import index_rounding, kv_rounding
from mlaserve.models.deepseek_v4.rope import V4RopeTables, rotate_trailing
from mlaserve.models.deepseek_v4.sink_softmax import SinkSoftmax, pad_rows
from mlaserve.models.deepseek_v4.state import CSAState, HCAState, LayerState
from mlaserve.models.deepseek_v4.step_keys import LayerKeys
from mlaserve.models.deepseek_v4.step_update import LayerStep, apply_ring

# one sequence's part of a step: (first row in x, tokens, position of its first token, its layer state)
Span = tuple[int, int, int, LayerState]


class GroupedLinear(nn.Module):
    """o_a_proj: G independent [o, H/G*D] blocks stacked in one weight [G*o, H/G*D] (the checkpoint's)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.zeros(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, G, H/G*D] -> [S, G*o]."""
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)  # [G, in, o]
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).flatten(1)


class V4Attention(SinkSoftmax, KernelSwitch, nn.Module):
    KERNEL_OP = "sink_attention"  # kernels/registry.py chooses `kernel` at load (the KernelPlan)
    KERNELS = ("native", "torch")  # native: the softmax with sinks in one C call over the allowed keys only
    KERNEL_CALLS = {
        "attend_step": {"native": "_attend_step_native", "torch": "_attend_step_torch"},
        "sink_softmax": {"native": "_sink_softmax_native", "torch": "_sink_softmax_torch"},
        "rotate": {"native": "_rotate_native", "torch": "_rotate_torch"},
        "norm_rotate": {"native": "_norm_rotate_native", "torch": "_norm_rotate_torch"},
        "project": {"native": "_project_native", "torch": "_project_torch"},
        "gather_keys": {"native": "_gather_keys_native", "torch": "_gather_keys_torch"},
    }

    def __init__(self, cfg: DeepseekV4Config, layer: int, numerics: V4Numerics = TRANSFORMERS) -> None:
        super().__init__()
        self.cfg = cfg
        a, c, eps = cfg.attention, cfg.compression, cfg.rms_norm_eps
        self.kind = cfg.layer_kinds[layer]
        self.table = "main" if self.kind == "sliding" else "compress"
        self.ratio = cfg.ratio(layer)
        self.heads, self.head_dim, self.eps = a.num_heads, a.head_dim, eps
        self.window = a.sliding_window
        self.scale = a.head_dim**-0.5
        # the step's softmax: False the per-sequence reference (_attend), True one padded softmax for all of
        # the step's sequences (_attend_padded); plain data set before any forward (V4Serving sets True)
        self.batched = False
        hidden = cfg.hidden_size
        self.q_a_proj = nn.Linear(hidden, a.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(a.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(a.q_lora_rank, a.num_heads * a.head_dim, bias=False)
        self.kv_proj = nn.Linear(hidden, a.head_dim, bias=False)
        self.kv_norm = RMSNorm(a.head_dim, eps)
        self.o_a_proj = GroupedLinear(a.num_heads * a.head_dim // a.o_groups, a.o_groups * a.o_lora_rank, a.o_groups)
        self.o_b_proj = nn.Linear(a.o_groups * a.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(a.num_heads, dtype=torch.float32))
        self.compressor: Compressor | None = None
        if self.kind != "sliding":
            self.compressor = Compressor(hidden, a.head_dim, self.ratio, overlap=self.kind == "csa", eps=eps)
        if self.kind == "csa":
            self.compressor.indexer = Indexer(
                hidden, a.q_lora_rank, c.index_n_heads, c.index_head_dim, c.index_topk, self.ratio, eps
            )
        self.set_numerics(numerics)
        self.kernel = "torch"  # the reference; the loader's plan sets the engine's (binds the KERNEL_CALLS)

    def native_unfit(self) -> str | None:
        """The native softmax's load-time check: fp32 sinks on the CPU (the step's queries and keys are checked
        per call: fp32 there, else the reference)."""
        s = self.sinks
        return None if s.dtype == torch.float32 and s.device.type == "cpu" else "sinks not fp32 on the CPU"

    def set_numerics(self, numerics: V4Numerics) -> None:
        """The official-code roundings (config/v4_numerics.py), fixed before any forward: every K=V row this
        layer attends (its window rows and its compressor's rows) through `kv_round`, the indexer's queries and
        keys through its `round_rows` (models/deepseek_v4/official.py; the identity by default)."""
        a = self.cfg.attention
        check_v4_numerics(self.cfg, numerics)
        self.numerics = numerics
        self.kv_round = kv_rounding(numerics.kv_rounding, a.nope_dim, a.rope_dim)
        if self.compressor is not None:  # its own instance: the same map, a module of its own (tests spy on each)
            self.compressor.round_rows = kv_rounding(numerics.kv_rounding, a.nope_dim, a.rope_dim)
        if self.kind == "csa":
            self.compressor.indexer.round_rows = index_rounding(numerics.indexer)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        spans: list[Span],
        tables: V4RopeTables,
        csa_dense: bool = False,
        step: LayerStep | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] at `positions`: the tokens of one or more sequences, each a Span (its tokens' rows
        a .. a+n-1 of x, at sequence positions start .. start+n-1, continuing its layer state). csa_dense (the
        step's route): a CSA layer attends every causally visible compressed row, its indexer's pool still
        filled (so later sparse steps continue exactly) but its top-k not applied. step: the batched state
        update's plan and cache tensors (None: the per-sequence reference updates each span's state)."""
        s = x.shape[0]
        cos, sin = tables.cos_sin(self.table, positions, x.dtype)
        # projections, norms and rope over every token of the step at once
        # x's projections: q_a, kv, and the compressor's kv, gate and the indexer's kv, gate in the layers that have
        # them (the indexer's keys always: its pool fills)
        xq, xkv, *rest = self.project(x)
        q_latent = self.q_a_norm(xq)
        q = self.norm_rotate(self.q_b_proj(q_latent).view(s, self.heads, self.head_dim), None, cos, sin)
        kv = self.kv_round(self.norm_rotate(xkv, self.kv_norm, cos, sin))
        ckv, cgate, ikv, igate = (*rest, None, None, None, None)[:4]
        iq = iw = None
        if self.kind == "csa" and self._scores(step, csa_dense):  # the indexer's queries where a top-k chooses
            iq, iw = self.compressor.indexer.queries(x, q_latent, positions, tables)
        projected = (kv, ckv, cgate, ikv, igate)
        if step is not None and step.tape is not None:  # a verify step: what a rollback replays
            step.tape.keep(step.layer, projected)
        closed = None
        if step is not None:  # batched: every sequence's windows close at once; its pools see the new rows
            closed = self._close_step(step, spans, projected, tables, per_sequence_reads=not self.batched)
        if step is not None and self.batched:  # the engine's path: every sequence's keys read at once
            keys, mask = self._step_keys(step, kv, closed, iq, iw, csa_dense)
            out = self.attend_step(q, keys, mask, step.keys.queries)
            # after the attention: the native keys (KeyParts) read the rings' old rows where they lie
            apply_ring(step.ring, kv, step.tensors["window"], step.tensors.get("window_snapshot"))
        else:
            out = self._attend_spans(q, kv, positions, spans, projected, tables, csa_dense, step, iq, iw)

        out = self.rotate(out, cos, sin, -1.0)  # the values carried rope: undo it at the query position
        grouped = out.reshape(s, self.o_a_proj.groups, -1)
        return self.o_b_proj(self.o_a_proj(grouped))

    def _scores(self, step: LayerStep | None, csa_dense: bool) -> bool:
        """Whether this CSA layer's step needs the indexer's queries: the per-sequence forms always compute them;
        the batched one only on a sparse route whose top-k chooses among some sequence's rows (LayerKeys.scored:
        below index_topk rows every visible row is chosen, so a context under index_topk x ratio tokens skips the
        query projection, its rope and the head weights)."""
        if step is None or not self.batched:
            return True
        return not csa_dense and step.keys.layers[self.ratio].scored(self.compressor.indexer.topk)

    @staticmethod
    def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
        """The rope of the layer's queries, K=V rows and output (sign -1: the de-rotation): rope.rotate_trailing."""
        return rotate_trailing(x, cos, sin if sign > 0 else -sin)

    @staticmethod
    def _rotate_native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
        """_rotate_torch in one C call, in place on x (the layer's own fresh q, K=V rows and output; csrc/glue.c
        mls_rope_pairs: the same bits), where torch composed ~10 ops (3 calls a layer at every step). Its contract
        on the step's input: fp32 CPU contiguous tensors (else the reference)."""
        if not all(v.dtype == torch.float32 and v.device.type == "cpu" and v.is_contiguous() for v in (x, cos, sin)):
            return V4Attention._rotate_torch(x, cos, sin, sign)
        return native_v4.rope_pairs(x, cos, sin, sign)

    def _projections(self) -> tuple[nn.Module, ...]:
        """The projections of the layer's input, in forward's order: q_a, kv, then the compressor's kv and gate,
        then the indexer's kv and gate (in the layers that have them)."""
        mods = [self.q_a_proj, self.kv_proj]
        if self.compressor is not None:
            mods += [self.compressor.kv_proj, self.compressor.gate_proj]
        if self.kind == "csa":
            mods += [self.compressor.indexer.kv_proj, self.compressor.indexer.gate_proj]
        return tuple(mods)

    def _project_torch(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [T, hidden] -> each projection's output (_projections' order), each module called in turn."""
        return [m(x) for m in self._projections()]

    def _project_native(self, x: torch.Tensor) -> list[torch.Tensor]:
        """_project_torch in one C call where the projections can share it (GGUF holders of one type on the native
        int16 decode products, no bias: kernels/row_product.bind_shared_input, bit for bit their own calls): one
        call's start and one quantization of x instead of one per projection (2-6 a layer; ~0.1 ms of a CSA
        layer's decode step on the 4-layer benchmark model, a 2-core AMX Xeon). Its contract on the step's input:
        at most row_product.SHARED_ROWS fp32 CPU rows (else each module's own call)."""
        product = self._shared_product()
        rows = x.reshape(-1, x.shape[-1])
        if (
            product is None
            or rows.shape[0] > row_product.SHARED_ROWS
            or x.dtype != torch.float32
            or x.device.type != "cpu"
        ):
            return self._project_torch(x)
        return [y.view(*x.shape[:-1], y.shape[-1]) for y in product(rows.contiguous())]

    def _shared_product(self) -> row_product.SharedProduct | None:
        """The projections' shared call, bound for their weights and settings (bound again when either changed:
        the loader fills the weights after the plan); None where they cannot share one."""
        mods = self._projections()
        key = tuple((id(m), m.weight.data_ptr(), getattr(m, "int8", None), getattr(m, "kernel", None)) for m in mods)
        if self.__dict__.get("_shared_key") != key:
            self.__dict__["_shared"] = _shared_input(mods)
            self.__dict__["_shared_key"] = key
        return self.__dict__["_shared"]

    def _norm_rotate_torch(
        self, x: torch.Tensor, norm: RMSNorm | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The step's query heads [T, H, D] (norm None: the per-head RMSNorm without a weight) or K=V rows [T, D]
        (norm: kv_norm) normalised, then their rope (rotate)."""
        return self.rotate(unweighted_rms_norm(x, self.eps) if norm is None else norm(x), cos, sin)

    def _norm_rotate_native(
        self, x: torch.Tensor, norm: RMSNorm | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """_norm_rotate_torch in one C call, in place on x (the layer's own fresh projection; csrc/glue.c
        mls_norm_rope_pairs), where torch composed ~8 ops for the query heads' norm and each form then made a
        rope call (and the K=V row a norm call): ~0.6 ms of a decode step on the 4-layer benchmark model (a 2-core
        AMX Xeon, 2 threads). Equal up to the rounding of the sum of squares (fp32), as the native RMSNorm. Its
        contract on the step's input: fp32 CPU contiguous rows and an fp32 norm weight (else the reference)."""
        w = None if norm is None else norm.weight
        fits = all(v.dtype == torch.float32 and v.device.type == "cpu" and v.is_contiguous() for v in (x, cos, sin))
        if not fits or (w is not None and (w.dtype != torch.float32 or w.device.type != "cpu")):
            return self._norm_rotate_torch(x, norm, cos, sin)
        return native_v4.norm_rope_pairs(x, w, self.eps if norm is None else norm.eps, cos, sin)

    def _attend_spans(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        spans: list[Span],
        projected: tuple,
        tables: V4RopeTables,
        csa_dense: bool,
        step: LayerStep | None,
        iq: torch.Tensor | None,
        iw: torch.Tensor | None,
    ) -> torch.Tensor:
        """The per-sequence form (the plain reference with `step` None): a Python loop over the step's
        sequences (their key counts differ) reads each one's keys and mask and the indexer's choice; with `step`
        None it also runs each sequence's state update (ring, windows, indexer keys). Then one softmax per
        sequence (`batched` False) or one padded softmax for the step."""
        ix = self.compressor.indexer if self.kind == "csa" else None
        keyed: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        for a, n, start, state in spans:
            b, pos = a + n, positions[a : a + n]
            keys, key_pos = state.ring.keys(kv[a:b], start)  # read before the chunk's rows enter the ring
            visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - self.window)
            # the reference's state updates, in pieces that end at the page boundaries the engine keeps
            # snapshots of (plain data of the step, state.Snapshots): the state after the piece is that page's
            # snapshot row. Pieces equal one pass, as chunked prefill does (the ring keeps the last W rows;
            # windows close alike).
            done = 0
            for k, page in state.snapshots.at if step is None and state.snapshots is not None else ():
                self._advance(state, a + done, a + k, start + done, projected, tables)
                state.snapshots.save(page)
                done = k
            if step is None and done < n:
                self._advance(state, a + done, b, start + done, projected, tables)
            if isinstance(state, (HCAState, CSAState)):
                rows = state.pool.view()
                if isinstance(state, CSAState):
                    chosen = ix.choose(iq[a:b], iw[a:b], pos, state.index_pool)
                    if csa_dense:
                        chosen = visible_rows(pos, rows.shape[0], self.ratio)
                else:
                    chosen = visible_rows(pos, rows.shape[0], self.ratio)
                keys = torch.cat([keys, rows.to(keys.dtype)], dim=0)
                visible = torch.cat([visible, chosen], dim=1)
            keyed.append((a, n, keys, visible))
        if step is not None:  # after every read of the rings' old rows
            apply_ring(step.ring, kv, step.tensors["window"], step.tensors.get("window_snapshot"))
        if self.batched:  # one padded key set and one softmax for the whole step
            return self._attend_padded(q, keyed)
        out = torch.empty_like(q)  # the plain reference: one softmax per sequence
        for a, n, keys, visible in keyed:
            out[a : a + n] = self._attend(q[a : a + n], keys, visible)
        return out

    def _step_keys(
        self,
        step: LayerStep,
        kv: torch.Tensor,
        closed: tuple[torch.Tensor, torch.Tensor | None] | None,
        iq: torch.Tensor | None,
        iw: torch.Tensor | None,
        csa_dense: bool,
    ) -> tuple[torch.Tensor | native_v4.KeyParts, torch.Tensor]:
        """Every sequence's keys [B, K, D] (native: KeyParts, named where they lie; read before the step's ring
        writes) and mask [B, S, K] at once, from the step's plan (step_keys.py): one read of the sequences' rings,
        then one gather of [rings | the step's rows | pool rows before the step | rows the step closed | a zero
        row], packed per sequence in the reference's order (ring rows by position, the chunk's rows, pool rows) and
        padded with the zero row; the masks from positions (window rule, causal rule) and, in a CSA layer's sparse
        route, the indexer's batched top-k."""
        ratio = self.ratio if self.compressor is not None else 0
        queries, plan = step.keys.queries, step.keys.layers[ratio]
        rows, irows = closed if closed is not None else (None, None)
        keys = self.gather_keys(step, plan, kv, rows)  # [B, K, D] (or KeyParts)
        masks = step.keys.visible(ratio, self.window)  # [B, S, K]: (window columns[, pool columns, both])
        if self.kind != "csa" or not self._scores(step, csa_dense):  # no top-k chooses: every visible row
            return keys, masks[-1]
        ix, index_rows = self.compressor.indexer, step.index_rows
        ikeys = torch.cat([index_rows.before(), irows.to(index_rows.pool.dtype)])
        ikeys = ikeys.index_select(0, plan.pool_source.flatten()).view(*plan.pool_source.shape, ikeys.shape[-1])
        chosen = ix.choose_step(pad_rows(iq, queries), pad_rows(iw, queries), queries.pos, ikeys, plan.sizes)
        window, visible, _ = masks
        if chosen.shape[-1]:  # [B, S, Kp] by pool row -> the pool columns
            at = plan.pool_row.clamp(max=chosen.shape[-1] - 1)[:, None, :].expand(-1, chosen.shape[1], -1)
            visible = visible & torch.gather(chosen, 2, at)
        return keys, window | visible

    def _gather_keys_torch(
        self, step: LayerStep, plan: LayerKeys, kv: torch.Tensor, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """Every sequence's keys [B, K, D] (_step_keys): the rings' read, the parts concatenated, one gather."""
        rings = step.tensors["window"].index_select(0, plan.ring_slots)  # [B, W, D] (8-bit rows: dequantized)
        parts = [rings.reshape(-1, kv.shape[-1]).to(kv.dtype), kv]
        if self.compressor is not None:  # the pool's dtype first, as the reference's PagedPool keeps the rows
            parts += [step.kv_rows.before().to(kv.dtype), rows.to(step.kv_rows.pool.dtype).to(kv.dtype)]
        parts.append(kv.new_zeros(1, kv.shape[-1]))
        # by index_select of the flat plan (CPU's advanced indexing is several times slower for rows)
        return torch.cat(parts).index_select(0, plan.source.flatten()).view(*plan.source.shape, kv.shape[-1])

    def _gather_keys_native(
        self, step: LayerStep, plan: LayerKeys, kv: torch.Tensor, rows: torch.Tensor | None
    ) -> torch.Tensor | native_v4.KeyParts:
        """_gather_keys_torch's keys not copied: native_v4.KeyParts, each key row named where it lies (the ring
        cache, the step's rows, the paged pool, the closed rows; plan.direct), which the native softmax reads in
        place (_attend_step_native) and any other consumer gathers in one C call (KeyParts.gather: csrc/glue.c
        mls_gather_rows, each row copied once, where the torch form copies a ring row three times). The gather
        was ~10% of a step at 16 decodes and ~0.1 ms a layer at a 1K-token decode (the 4-layer benchmark model, a
        2-core AMX Xeon). The same values. Its contract on the step's input: fp32 rows throughout (the ring and
        the pool plain tensors, not 8-bit rows) and the CPU plan's `direct` (else the reference's tensor)."""
        window, zero = step.tensors["window"], kv.new_zeros(1, kv.shape[-1])
        pool = step.kv_rows.pool if self.compressor is not None else zero
        rows = rows if rows is not None else zero
        parts = [window, kv, pool, rows]
        plain = all(isinstance(p, torch.Tensor) and p.dtype == torch.float32 and p.is_contiguous() for p in parts[::2])
        if plan.direct is None or not plain or kv.dtype != torch.float32 or rows.dtype != torch.float32:
            return self._gather_keys_torch(step, plan, kv, rows)
        parts = (window.reshape(-1, kv.shape[-1]), kv.contiguous(), pool, rows.contiguous(), zero)
        return native_v4.KeyParts(parts, plan.direct)

    def _advance(self, state: LayerState, lo: int, hi: int, start: int, projected: tuple, tables: V4RopeTables) -> None:
        """Rows lo .. hi-1 of the step (positions start ..) enter one sequence's state: the ring, then the
        compressors' windows (kv, and the indexer's keys in a CSA layer), closed rows appended to the pools."""
        kv, ckv, cgate, ikv, igate = projected
        state.ring.append(kv[lo:hi], start)
        if isinstance(state, (HCAState, CSAState)):
            self.compressor.close(ckv[lo:hi], cgate[lo:hi], state.carry, state.pool, tables)
        if isinstance(state, CSAState):
            self.compressor.indexer.close(ikv[lo:hi], igate[lo:hi], state.index_carry, state.index_pool, tables)

    def _close_step(
        self, step: LayerStep, spans: list[Span], projected: tuple, tables: V4RopeTables, per_sequence_reads: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The batched form of the compressors' part of _advance for every span at once: close the step's windows
        (kv, and the indexer's keys in a CSA layer), queue their rows for the paged pools in one write each
        -> the closed rows (kv [N, D], index keys [N, c] or None; None in a sliding layer). per_sequence_reads:
        also hand each span's PagedPool its slice (a loop over Python objects only: each sequence then reads its
        own rows; the batched reads take the returned rows instead)."""
        if self.compressor is None:
            return None
        _, ckv, cgate, ikv, igate = projected
        t, plan = step.tensors, step.plan
        rows = self.compressor.close_step(
            ckv, cgate, plan, t["kv_carry"], t.get("kv_overlap"), t.get("kv_overlap_snapshot"), tables
        )
        step.kv_rows.write(plan.pool_slots, rows.to(step.kv_rows.pool.dtype))
        irows = None
        if self.kind == "csa":
            irows = self.compressor.indexer.close_step(
                ikv, igate, plan, t["index_carry"], t["index_overlap"], t.get("index_overlap_snapshot"), tables
            )
            step.index_rows.write(plan.pool_slots, irows.to(step.index_rows.pool.dtype))
        for b, (*_, state) in enumerate(spans if per_sequence_reads else ()):
            lo, hi = plan.starts[b], plan.starts[b + 1]
            state.pool.extend(rows[lo:hi])
            if irows is not None:
                state.index_pool.extend(irows[lo:hi])
        return rows, irows


def _shared_input(mods: tuple[nn.Module, ...]) -> row_product.SharedProduct | None:
    """One native call for projections of the same input: GGUF holders (ggml_type) the plan runs native, of one
    type, row width and activation setting, without a bias; else None."""
    types = {(getattr(m, "ggml_type", None), m.in_features, getattr(m, "int8", None)) for m in mods}
    if len(types) != 1 or not all(registry.runs_native(m) and m.bias is None for m in mods):
        return None
    ((t, k, int8),) = types
    if t is None:
        return None
    return row_product.bind_shared_input([m.weight for m in mods], t, k, int8)

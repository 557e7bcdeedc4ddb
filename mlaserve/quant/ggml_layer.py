"""A decoder layer of ggml-block holders run as one native call per decode step (kernels/csrc/decode_layer.c mls_decode_layer).

Notation: T tokens of a pure-decode step (T requests, one query each), D hidden, H heads, r kv_lora_rank,
dn / dr / dv the nope / rope / v head dims, S the rows of a layer's latent cache, Di the DSA index_head_dim,
L the step's key positions per request, K = min(index_topk, L) the rows a selecting step keeps.
  x           [T, D]       the residual stream entering the layer, fp32
  cache       [S, r + dr]  the layer's paged latent rows, fp32, or 8-bit (kv_cache_dtype: codes [S, r], scales
                           [S, r / block], k_pe [S, dr] fp32; cache/quantized_rows.py)
  index_keys  [S, Di]      a full DSA indexer layer's key cache (sparse routes), fp32, or FP8 codes [S, Di] with a
                           scale per key when the latent rows are 8-bit
  selection   [T, 1, K]    positions on the key axis and their validity (models.indexer.Selection), written by a
                           full layer's call, read by the shared layers after it: one buffer per step (FusedStep)
What runs is the layer's per-op native path (input norm, q_a / norm / q_b or q_proj, kv_a, the latent row with
its rope, on sparse routes the indexer's query, key and weights with the key written to its cache and, when the
step selects, the scores and the top-k, W_UK per head, the latent MQA over the paged rows or over the selected
rows, W_UV per head, o_proj, residual, post norm, the MoE block or a dense SwiGLU, residual) with the same
per-row operations, in C, instead of ~20 native calls and ~60 tensor ops (and ~35 more for the indexer); that
path is the reference (tests/kernels/test_decode_layer.py, tests/kernels/test_decode_layer_sparse.py). With
activations (int8 for weights of <= 6 bits by default) the products take int8 activations where the per-op path's do.
Where it applies is decided before anything runs: at load, per layer (GGUFDecodeLayer.unfit: every weight a
native ggml holder or F32 rows, one activation choice for the layer; under tensor parallelism the call hands
o_proj's and the MLP's partial sums to the layer's all_reduce through mls_layer_t.reduce), and per step from the plan
(decode_step: a single absorbed segment on the native backend, dense or sparse, one query per request in
request order, at most BLOCK_TOKENS requests, fp32 or 8-bit caches on the CPU: 8-bit rows are written through
the cache's quantizer in C (csrc/rows8.c, bit-identical to QuantizedRows.index_copy_) and read as codes); a layer under forward hooks
(observability.capture) takes its per-op path (GGUFDecodeLayer.hooked, checked per step), and a selection
passes between the two paths through the step's buffer (FusedStep.carry).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from mlaserve.config.layer_kinds import layer_ranges
from mlaserve.kernels import native, native_layers, registry
from mlaserve.models.deepseek import DecoderLayer, MLAAttention, MLAForCausalLM, single_process
from mlaserve.models.indexer import Indexer, Selection
from mlaserve.models.layers import RMSNorm, SwiGLU
from mlaserve.models.moe import MoE
from mlaserve.models.mtp import MTPLayer
from mlaserve.quant.ggml_heads import GGUFHeads
from mlaserve.quant.ggml_linear import BLOCK_TOKENS, native_rows, rows_args

if TYPE_CHECKING:
    from mlaserve.attention.metadata import SegmentTensors
    from mlaserve.cache.model_cache import ModelCache
    from mlaserve.executor.step_context import StepContext


@dataclass(frozen=True)
class Part:
    """One weight-holding module the one call reads: its mls_layer_t field (kernels/csrc/mls.h), its name under
    the decoder layer, what it is (rows: an mls_lin_t of a native_rows layer; norm: an fp32 RMSNorm's weight
    pointer, with its eps field; layernorm: an fp32 LayerNorm's weight and bias) and when the layer has it."""

    field: str
    module: str
    kind: str  # "rows" | "norm" | "layernorm"
    when: str = "always"  # "always" | "q_lora" | "no_q_lora" | "dense_mlp" | "full_indexer"
    eps: str | None = None  # the struct field of a norm's eps


# The one call's description of a decoder layer: GGUFDecodeLayer fills mls_layer_t from it and unfit checks
# each part from it, so a part is added, filled and checked in one place. Besides these, the call reads the
# MoE block (mlp, its native block), W_UK / W_UV (self_attn.kept_heads) and the dimensions from the config.
PARTS = (
    Part("norm_in", "input_layernorm", "norm", eps="eps_in"),
    Part("norm_post", "post_attention_layernorm", "norm", eps="eps_post"),
    Part("norm_q", "self_attn.q_a_layernorm", "norm", "q_lora", "eps_q"),
    Part("norm_kv", "self_attn.kv_a_layernorm", "norm", eps="eps_kv"),
    Part("q_a", "self_attn.q_a_proj", "rows", "q_lora"),
    Part("q_b", "self_attn.q_b_proj", "rows", "q_lora"),
    Part("q_b", "self_attn.q_proj", "rows", "no_q_lora"),
    Part("kv_a", "self_attn.kv_a_proj_with_mqa", "rows"),
    Part("o_proj", "self_attn.o_proj", "rows"),
    Part("mlp_gate", "mlp.gate_proj", "rows", "dense_mlp"),
    Part("mlp_up", "mlp.up_proj", "rows", "dense_mlp"),
    Part("mlp_down", "mlp.down_proj", "rows", "dense_mlp"),
    Part("idx_q_b", "self_attn.indexer.wq_b", "rows", "full_indexer"),
    Part("idx_k", "self_attn.indexer.wk", "rows", "full_indexer"),
    Part("idx_w", "self_attn.indexer.weights_proj", "rows", "full_indexer"),
    Part("idx_norm_w", "self_attn.indexer.k_norm", "layernorm", "full_indexer", "idx_eps"),
)
# every module whose weights a layer may hold: the parts, the MoE block, W_UK / W_UV, and kv_b_proj (the same
# matrices as kept_heads, for the decompressed prefill path; decode reads kept_heads). A weight outside them (a
# module the model's structure gained) or a step the call does not repeat (a subclass overriding it) would be
# skipped by the C code, so such a layer is refused at load, naming it (GGUFDecodeLayer.unfit), and runs per op.
ONE_CALL_MODULES = (*dict.fromkeys(p.module for p in PARTS), "mlp", "self_attn.kept_heads", "self_attn.kv_b_proj")
ONE_CALL_FORWARDS = (
    (DecoderLayer, "forward"),
    *(
        (MLAAttention, name)
        for name in (
            "forward",
            "project_q",
            "_write_latent_torch",
            "_write_latent_native",
            "_write_latent_triton",
            "select",
            "attend",
        )
    ),
    *((Indexer, name) for name in ("project", "select")),
)


def _parts(layer: DecoderLayer) -> list[tuple[Part, nn.Module]]:
    """The parts this layer has, with their modules."""
    cfg = layer.self_attn.cfg
    has = {
        "always": True,
        "q_lora": bool(cfg.q_lora_rank),
        "no_q_lora": not cfg.q_lora_rank,
        "dense_mlp": not isinstance(layer.mlp, MoE),
        "full_indexer": _indexer_role(layer) == "full",
    }
    return [(p, _module(layer, p.module)) for p in PARTS if has[p.when]]


def _module(layer: DecoderLayer, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def _part_unfit(part: Part, m: nn.Module | None, int8: bool) -> str | None:
    if m is None:
        return f"no {part.module}, which the one call reads"
    if part.kind == "rows" and not native_rows(m, int8):
        return f"{part.module} neither a native ggml holder (with the layer's activations) nor fp32, or with a bias"
    if part.kind == "norm" and not _fp32_norm(m):
        return f"{part.module} not an fp32 RMSNorm with the native kernels"
    if part.kind == "layernorm" and not _fp32_layer_norm(m):
        return f"{part.module} not an fp32 LayerNorm with weight and bias"
    return None


def _fill(a: native_layers.LayerArgs, part: Part, m: nn.Module) -> list[torch.Tensor]:
    """Sets the part's fields of mls_layer_t -> the tensors they point into."""
    if part.kind == "rows":
        setattr(a, part.field, rows_args(m))
        return [m.weight]
    setattr(a, part.field, m.weight.data_ptr())
    setattr(a, part.eps, m.eps)
    if part.kind == "layernorm":
        a.idx_norm_b = m.bias.data_ptr()
        return [m.weight, m.bias]
    return [m.weight]


def _structure_unfit(layer: DecoderLayer) -> str | None:
    """Why the layer is not the structure the one call repeats (ONE_CALL_MODULES, ONE_CALL_FORWARDS), or None."""
    extra = [
        n
        for n, _ in [*layer.named_parameters(), *layer.named_buffers()]
        if not any(n.startswith(m + ".") for m in ONE_CALL_MODULES)
    ]
    if extra:
        return f"weights the one call does not read: {', '.join(extra)}"
    parts = {DecoderLayer: layer, MLAAttention: layer.self_attn, Indexer: layer.self_attn.indexer}
    for cls, name in ONE_CALL_FORWARDS:
        part = parts[cls]
        if part is not None and getattr(type(part), name) is not getattr(cls, name):
            return f"{type(part).__name__}.{name} is not {cls.__name__}.{name}, which the one call repeats"
    return None


def _fp32_layer_norm(m: nn.Module) -> bool:
    return (
        isinstance(m, nn.LayerNorm)
        and m.weight is not None
        and m.bias is not None
        and all(p.dtype == torch.float32 and p.is_contiguous() and p.device.type == "cpu" for p in m.parameters())
    )


def _fp32_norm(m: nn.Module) -> bool:
    return (
        isinstance(m, RMSNorm)
        and registry.runs_native(m)
        and m.weight.dtype == torch.float32
        and m.weight.is_contiguous()
    )


class GGUFDecodeLayer:
    """One decoder layer's decode step as one native call; built once at load (by the KernelPlan)."""

    def __init__(self, layer: DecoderLayer, interleaved: bool) -> None:
        attn, cfg = layer.self_attn, layer.self_attn.cfg
        heads: GGUFHeads = attn.kept_heads
        a = native_layers.LayerArgs()
        a.d, a.h, a.dn, a.dr, a.dv, a.r = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        a.q_lora = cfg.q_lora_rank or 0
        a.scale, a.interleaved = cfg.softmax_scale, int(interleaved)
        keep: list = [t for part, m in _parts(layer) for t in _fill(a, part, m)]
        a.type_k, a.type_v, a.k_b, a.v_b = heads.type_k, heads.type_v, heads.k_b.data_ptr(), heads.v_b.data_ptr()
        a.k_head_stride, a.k_row_bytes = heads.k_b.stride(0), heads.k_b.shape[2]
        a.v_head_stride, a.v_row_bytes = heads.v_b.stride(0), heads.v_b.shape[2]
        keep += [heads.k_b, heads.v_b]
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            a.moe = ctypes.pointer(mlp.native_block.args)
            keep.append(mlp.native_block)
        else:
            a.mlp_inter = mlp.gate_proj.out_features
        a.int8 = native.act_setting(heads.int8)
        self.role = _indexer_role(layer)
        a.idx_role = native_layers.INDEXER_ROLES[self.role]
        if self.role == "full":
            ix = attn.indexer
            a.idx_h, a.idx_d, a.idx_interleaved = ix.cfg.n_heads, ix.cfg.head_dim, int(ix.cfg.rope_interleaved)
            # the per-op path's scalars: w * Hi^-0.5 (Indexer.project), then * Di^-0.5 (Indexer.select), in fp32
            a.idx_w_scale, a.idx_d_scale = ix.cfg.n_heads**-0.5, ix.cfg.head_dim**-0.5
        self.args, self._tensors = a, tuple(keep)  # what the C struct points into stays alive with it
        # tensor parallel: the C call hands o_proj's and the MLP's partial sums to the layer's all_reduce (the
        # per-op path's two collectives, at the same points); an exception there is kept and re-raised after it
        self._reduce, self._failed = None, []
        if layer.all_reduce is not single_process:
            self._reduce = native_layers.REDUCE_FN(self._make_reduce(layer.all_reduce))
            a.reduce = ctypes.cast(self._reduce, ctypes.c_void_p).value
        # forward hooks (observability.capture) must see the sub-blocks run: such a layer takes its per-op path
        self._hookable = (layer, attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
        self._hookable += (attn.indexer,) if attn.indexer is not None else ()

    @staticmethod
    def unfit(layer: DecoderLayer) -> str | None:
        """Why this layer cannot run its decode steps as one native call, or None."""
        if not isinstance(layer.self_attn, MLAAttention):  # Kimi-Linear's KDA layers (a GGUF's too)
            return f"{type(layer.self_attn).__name__} layer: the one call repeats an MLA layer"
        attn, cfg = layer.self_attn, layer.self_attn.cfg
        if (why := _structure_unfit(layer)) is not None:
            return why
        if not registry.runs_native(attn) or not isinstance(attn.kept_heads, GGUFHeads):
            return "attention without the native kernels or without attn_k_b / attn_v_b blocks"
        heads = attn.kept_heads
        int8 = heads.int8  # one activation choice for the whole layer (the loader sets every holder alike)
        if not registry.runs_native(heads) or not (heads.k_b.is_contiguous() and heads.v_b.is_contiguous()):
            return "W_UK / W_UV not native blocks"
        if _indexer_role(layer) == "full" and not cfg.q_lora_rank:
            return "a DSA indexer without a query latent (q_lora_rank 0)"
        mlp = layer.mlp
        if not isinstance(mlp, (MoE, SwiGLU)):
            return f"an MLP of type {type(mlp).__name__} (the one call runs a MoE block or a SwiGLU)"
        if isinstance(mlp, MoE) and (
            mlp.native_block is None or mlp.native_block.args.int8 != native.act_setting(int8)
        ):
            return "MoE layer without its native block (or with other activations)"
        for part, m in _parts(layer):
            if (why := _part_unfit(part, m, int8)) is not None:
                return why
        return None

    def hooked(self) -> bool:
        return any(m._forward_hooks or m._forward_pre_hooks for m in self._hookable)

    def _make_reduce(self, all_reduce):
        failed = self._failed

        def reduce(a, n: int) -> int:
            try:  # a [n] fp32: the C call's buffer, summed over the ranks in place
                buf = torch.frombuffer(
                    (ctypes.c_float * n).from_address(ctypes.addressof(a.contents)), dtype=torch.float32
                )
                out = all_reduce(buf)
                if out.data_ptr() != buf.data_ptr():
                    buf.copy_(out)
                return 0
            except BaseException as e:  # noqa: BLE001 -- an exception cannot cross the C call: kept, re-raised
                failed.append(e)
                return 1

        return reduce

    def __call__(
        self, x: torch.Tensor, step: native_layers.DecodeStepArgs, cache: torch.Tensor, index_keys: torch.Tensor | None
    ) -> torch.Tensor:
        try:
            return native_layers.decode_layer(self.args, step, x, cache, index_keys)
        except RuntimeError:
            if self._failed:  # the all-reduce's own error (a rank that failed, died or hung), not the C code
                raise self._failed.pop() from None
            raise


def _indexer_role(layer: DecoderLayer) -> str | None:
    """The layer's DSA indexer (config/layer_kinds.py indexer_role): "full", "shared" or None (plain MLA)."""
    attn = layer.self_attn
    if attn.kind != "mla_dsa":
        return None
    return "full" if attn.indexer is not None else "shared"


@dataclass(frozen=True)
class FusedStep:
    """A step the native layers take: the C struct of its shared arguments, the tensors it points into, and on a
    selecting sparse step the selection buffer (one Selection over [T, 1, K]: the per-op path's own type, so a
    selection passes between fused and per-op layers)."""

    args: native_layers.DecodeStepArgs
    keep: tuple
    carry: tuple[Selection] | None = None
    # every trunk layer's call in one (GGUFDecodeStack), decided with the step (MLAForCausalLM.fused_decode), or
    # None: layer by layer
    stack: GGUFDecodeStack | None = None


def decode_step(step: StepContext, cache: ModelCache) -> FusedStep | None:
    """The step's shared arguments when it is a pure decode step the native layers take, else None (then every
    layer runs its per-op path): one absorbed segment (dense, or sparse with fp32 or FP8 index keys, scored in fp32
    or from bf16-rounded values: the route's index_scoring, the step's index_bf16) on the native backend, one query
    per request in request order, at most BLOCK_TOKENS of them, fp32 rope and caches (fp32 rows, or 8-bit rows with
    fp32 kept values) on the CPU."""
    if len(step.kinds) != 1:
        return None  # the C layers run one MLA route for the whole stack
    (mine,) = step.kinds.values()
    plan = mine.plan
    if len(mine.segments) != 1 or mine.backends[0].name != "native":
        return None
    seg = mine.segments[0]
    t = step.slot_mapping.shape[0]
    if (
        seg.segment.path != "absorbed"
        or seg.segment.token_start != 0
        or seg.q_index.shape != (t, 1)
        or t > BLOCK_TOKENS
    ):
        return None
    latent = [t for t in cache.state("latent") if t is not None]  # None: a layer without latent rows (KDA)
    first = latent[0]
    if step.cos.dtype != torch.float32 or first.device.type != "cpu":
        return None
    if not all(_fp32_rows(c) and c.shape == first.shape for c in latent):
        return None
    if plan.sparse:  # the full layers' key caches: fp32 (or 8-bit) rows of the latent cache's slots
        keys = [k for k in cache.state("index_keys") if k is not None]
        if not all(_fp32_rows(k) and k.shape[0] == first.shape[0] for k in keys):
            return None  # a bf16 key cache scores bf16_then_fp32 (attention/backends/torch_index.py): per op
    if not _in_token_order(step, seg):
        return None  # the C layer writes request b's output at token b
    kv_slots, mask, q_index = seg.kv_slots.contiguous(), seg.mask.contiguous(), seg.q_index.contiguous()
    cos, sin, slots = step.cos.contiguous(), step.sin.contiguous(), step.slot_mapping.contiguous()
    topk, carry, sel = 0, None, (None, None)
    if plan.needs_selection:  # the per-op path's k: min(index_topk, the segment's key positions)
        topk = min(plan.index_topk, kv_slots.shape[1])
        sel = (torch.zeros(t, 1, topk, dtype=torch.int64), torch.zeros(t, 1, topk, dtype=torch.bool))
        carry = (Selection(*sel),)
    args = native_layers.DecodeStepArgs(
        t, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), first.shape[0], q_index.data_ptr(), kv_slots.data_ptr(),
        mask.data_ptr(), kv_slots.shape[1], int(plan.sparse), topk, *(x.data_ptr() if x is not None else None for x in sel),
        int(seg.segment.index_scoring == "bf16"),
    )  # fmt: skip
    return FusedStep(args, (kv_slots, mask, q_index, cos, sin, slots, *sel), carry)


def _in_token_order(step: StepContext, seg: SegmentTensors) -> bool:
    """Whether request b's query is token b (q_index[:, 0] == 0 .. T-1): from the step's plain spans where it has
    them (every step the runner builds), else from the tensor (a padded step's)."""
    spans = step.seq_spans[seg.segment.seq_start : seg.segment.seq_end]
    if spans:
        return all(span[0] == b for b, span in enumerate(spans))
    t = seg.q_index.shape[0]
    return torch.equal(seg.q_index[:, 0], torch.arange(t, device=seg.q_index.device))


def _fp32_rows(state) -> bool:
    """A state the C layer reads in place: contiguous fp32 rows, or 8-bit rows (kv_cache_dtype: codes and scales
    as the cache allocates them, contiguous) whose kept values are fp32 (an fp32 compute dtype)."""
    if isinstance(state, torch.Tensor):
        return state.dtype == torch.float32 and state.is_contiguous()
    return state.dtype == torch.float32 and all(t.is_contiguous() and t.device.type == "cpu" for t in state.tensors())


def _decode_layer_fits(layer: DecoderLayer, ctx: registry.KernelContext) -> str | None:
    if isinstance(layer, MTPLayer):
        return "the MTP layer (the one-call path covers the trunk's decoder layers)"
    return registry.needs_native(ctx) or GGUFDecodeLayer.unfit(layer)


def _attach_layer(layer: DecoderLayer, ctx: registry.KernelContext) -> None:
    layer.native_layer = GGUFDecodeLayer(layer, layer.self_attn.cfg.rope.interleaved)


def _per_op_layer(layer: DecoderLayer, ctx: registry.KernelContext) -> None:
    layer.native_layer = None


def _indexer_note(layer: DecoderLayer) -> str | None:
    role = _indexer_role(layer)
    if role == "full":
        return "mla_dsa, full indexer: dense and sparse decode steps (index keys, scores, top-k in the call)"
    if role == "shared":
        return "mla_dsa, shared indexer: dense and sparse decode steps (the previous full layer's top-k)"
    return None


registry.register("decode_layer", "native", _decode_layer_fits, _attach_layer, _indexer_note)
registry.register("decode_layer", "per_op", registry.always, _per_op_layer)


class GGUFDecodeStack:
    """Every trunk layer's native call of a step in one (native_layers.decode_layers, csrc mls_decode_layers): the
    same C code as the layers' own calls, bit for bit, without the caller's glue between them. Built for the
    model's current GGUFDecodeLayers (stacks_of: rebuilt when one is replaced); a step where some layer is under a
    forward hook takes the layers one by one (MLAForCausalLM.forward)."""

    def __init__(self, layers: list[GGUFDecodeLayer]) -> None:
        self.layers = layers
        self.c = native_layers.LayerStack([layer.args for layer in layers])

    def hooked(self) -> bool:
        return any(layer.hooked() for layer in self.layers)

    def __call__(self, x: torch.Tensor, step: native_layers.DecodeStepArgs, states: list) -> torch.Tensor:
        try:
            return native_layers.decode_layers(self.c, step, x, states)
        except RuntimeError:
            for layer in self.layers:  # the all-reduce's own error (a rank that failed, died or hung), not the C code
                if layer._failed:
                    raise layer._failed.pop() from None
            raise


class DecodeStacks:
    """model.native_stack: the GGUFDecodeStack of the trunk's current native layers (the one built last, while the
    same layers are passed), or None where some trunk layer runs per op or a shared-indexer layer comes before any
    full one (the per-layer path refuses that step by name)."""

    def __init__(self) -> None:
        self._last: GGUFDecodeStack | None = None

    def __call__(self, fasts: list) -> GGUFDecodeStack | None:
        last = self._last
        if last is not None and len(fasts) == len(last.layers) and all(a is b for a, b in zip(fasts, last.layers)):
            return last
        if not fasts or any(f is None for f in fasts):
            return None
        roles = [f.role for f in fasts if f.role is not None]
        if roles and roles[0] != "full":
            return None
        self._last = GGUFDecodeStack(fasts)
        return self._last


def enable_decode_step(model: MLAForCausalLM) -> int:
    """After the KernelPlan: the model asks decode_step once per step where some trunk layer runs natively, and
    where every one does, runs them in one call (DecodeStacks). -> how many trunk layers do."""
    n = sum(layer.native_layer is not None for layer in model.model.layers)
    model.native_decode = decode_step if n else None
    model.native_stack = DecodeStacks() if n else None
    return n


def decode_layer_misses(plan: registry.KernelPlan) -> list[str]:
    """For the load report: which trunk layers run decode steps per op instead of as one call, and why (one line
    per reason, with the layers), so that a GGUF whose layers do not qualify (F16 attn_k_b, say) says so."""
    why: dict[str, list[int]] = {}
    for c in plan.choices:
        if c.op == "decode_layer" and c.impl == "per_op" and c.layer.isdigit():
            why.setdefault(c.reason.removeprefix("not native: "), []).append(int(c.layer))
    return [f"decoder layer(s) {layer_ranges(ids)} decode per op: {reason}" for reason, ids in why.items()]

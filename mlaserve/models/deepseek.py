"""MLA causal LM for DeepSeek-V2/V3/V3.2, Kimi-K2, GLM-4.7-Flash, GLM-5 and Kimi-Linear, one class selected by config
(Kimi-Linear: its KDA layers are models/kda's KimiDeltaAttention, its MLA layers NoPE through an identity rope).

Notation
  T tokens (flat), D hidden, H heads, r = kv_lora_rank, dn/dr/dv = nope/rope/v head dims
  x      [T, D]             hidden states
  c_q    [T, q_lora_rank]   query latent (q_a_layernorm(q_a_proj(x))), also the DSA indexer's input
  q_nope [T, H, dn], q_pe [T, H, dr]
  c_kv   [T, r]             kv_a_layernorm of the compressed kv; k_pe [T, dr] rotated, shared by heads
  cache  [S, r + dr]        this layer's paged latent rows [c_kv | k_pe]
Parameter names follow the Hugging Face checkpoints (in-memory layout: experts stacked).
The forward pass executes the step's route: each layer runs the plan of its attention kind
(config/layer_kinds.py; `step.of(self.kind)`); no layer looks at a shape to pick its path.
Tensor parallel: cfg is this rank's config (its H/N heads, I/N intermediate, V/N vocabulary rows);
`all_reduce` sums the ranks' partial outputs of o_proj, of the MLP / MoE and of the embedding
(identity on one process). See mlaserve/distributed/sharding.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from mlaserve.config.layer_kinds import attention_kind
from mlaserve.config.model import ModelConfig
from mlaserve.kernels import native_layers
from mlaserve.kernels.registry import KernelSwitch
from mlaserve.models.indexer import Indexer, Selection
from mlaserve.models.kda.layer import KimiDeltaAttention
from mlaserve.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, embedding
from mlaserve.models.moe import MoE
from mlaserve.models.pooled_indexer import PooledIndexer

if TYPE_CHECKING:
    from mlaserve.attention.backends import AttentionBackend
    from mlaserve.attention.metadata import SegmentTensors
    from mlaserve.cache.model_cache import LayerState, ModelCache
    from mlaserve.executor.step_context import KindStep, StepContext

Selections = tuple[Selection, ...] | None  # one per segment on sparse steps
AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _native_fits(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, step: StepContext) -> bool:
    """The native latent write's contract on a step's input: fp32 CPU tensors, q contiguous, kv rows of unit
    stride (the cache's dtype is the engine's, not the module's). The norm weight (fp32 on the CPU) was checked
    at load (MLAAttention.native_unfit); the rest holds by construction, once per step rather than checked per
    layer: cos / sin are fresh [T, dr/2] tensors in the compute dtype (RotaryEmbedding.cos_sin), slot_mapping a
    fresh int64 [T] (ForwardBatch); the C code refuses slots outside the cache."""
    fp32 = q.dtype == kv.dtype == cache.dtype == step.cos.dtype == torch.float32
    return fp32 and cache.device.type == "cpu" and q.is_contiguous() and kv.stride(-1) == 1


def _triton_fits(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, step: StepContext) -> bool:
    """The Triton latent write's contract on a step's input: fp32 (the norm weight's device and Triton's mode
    were checked at load, MLAAttention.triton_unfit). A quantized cache takes the kernel's fp32 rows."""
    cache_fp32 = not isinstance(cache, torch.Tensor) or cache.dtype == torch.float32
    return q.dtype == kv.dtype == step.cos.dtype == torch.float32 and cache_fp32


def single_process(x: torch.Tensor) -> torch.Tensor:
    """The all-reduce of a group of one."""
    return x


def vocab_parallel_embed(table: nn.Module, input_ids: torch.Tensor, vocab_start: int, all_reduce: AllReduce):
    """table holds vocabulary rows [vocab_start, vocab_start + rows) (all of them on one process): this rank's
    rows, zeros for ids another rank holds, summed over ranks by all_reduce -> the full embedding [T, D]."""
    if all_reduce is single_process:
        return table(input_ids)
    rows = table.num_embeddings
    local = input_ids - vocab_start
    mine = (local >= 0) & (local < rows)
    return all_reduce(table(local.clamp(0, rows - 1)).masked_fill(~mine[:, None], 0.0))


class MLAAttention(KernelSwitch, nn.Module):
    KERNEL_OP = "latent_write"  # kernels/registry.py chooses `kernel` at load (the KernelPlan)
    # native: the latent row and the query rope in one C call; triton: the same in one Triton kernel (a GPU)
    KERNELS = ("triton", "native", "torch")
    # forward calls self.write_latent: _write_latent_torch (the reference), _write_latent_native or
    # _write_latent_triton, bound by `kernel`
    KERNEL_CALLS = {
        "write_latent": {
            "triton": "_write_latent_triton",
            "native": "_write_latent_native",
            "torch": "_write_latent_torch",
        }
    }

    def __init__(self, cfg: ModelConfig, layer_idx: int, cache_state: str = "latent") -> None:
        """cache_state: the layer's latent state this attention reads and writes (LongCat-Flash's second
        sublayer: "latent_1"; config/layer_kinds.py)."""
        super().__init__()
        self.cfg = cfg
        self.kind = attention_kind(cfg, layer_idx)  # which plan of the step's route this layer executes
        self.cache_state = cache_state
        self.kernel = "torch"  # the reference; the loader sets the engine's kernels (binds self.write_latent)
        h, d = cfg.num_heads, cfg.hidden_size
        bias = cfg.attention_bias
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=bias)
        # DSA: a "full" layer owns an indexer; a "shared" layer reuses the previous full layer's top-k.
        full = cfg.indexer is not None and cfg.indexer.layer_types[layer_idx] == "full"
        if full and cfg.indexer.kpool:  # GLM-5.3-Flash's pooled indexer (its route: docs/GLM5_NEXT.md)
            self.indexer = PooledIndexer(d, cfg.q_lora_rank, cfg.indexer)
        else:
            self.indexer = Indexer(d, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.indexer) if full else None
        # W_UK / W_UV also kept as a GGUF's attn_k_b / attn_v_b blocks (quant.ggml_heads.GGUFHeads, set by
        # the loader after the fill); the absorbed path's backend multiplies those instead of kv_b_proj's views
        self.kept_heads = None

    def native_unfit(self) -> str | None:
        """The native latent write's load-time check: kv_a_layernorm's weight fp32 on the CPU."""
        w = self.kv_a_layernorm.weight
        return None if w.dtype == torch.float32 and w.device.type == "cpu" else "kv_a_layernorm not fp32 on the CPU"

    def triton_unfit(self) -> str | None:
        """The Triton latent write's load-time check: kv_a_layernorm's weight fp32 (the kernel's dtype)."""
        w = self.kv_a_layernorm.weight
        return None if w.dtype == torch.float32 else f"kv_a_layernorm weight {w.dtype}, the Triton kernel takes fp32"

    def triton_device(self) -> str:
        """Where the Triton kernel would run: the device of the weights."""
        return self.kv_a_layernorm.weight.device.type

    def kv_b_weight(self, bf16: bool = False) -> torch.Tensor:
        """kv_b_proj's weight [H * (dn + dv), r]: the held one, or, where the loader keeps none (a
        quant.transient_kv_b.TransientKvB beside GGUFHeads), decoded now from attn_k_b / attn_v_b (a new tensor;
        bf16: rounded to bf16, what a decompressed expansion the plan runs in bf16 multiplies)."""
        decode = getattr(self.kv_b_proj, "decode", None)
        return decode(self.kept_heads, bf16) if decode is not None else self.kv_b_proj.weight

    def expansion_bf16(self, backends) -> bool:
        """The decompressed segments' K / V expansion in bf16: where the KernelPlan runs both kept halves' prefill
        products in plain bf16 (GGUFHeads.expansion_bf16) and no backend of the step reads the dense W_UK / W_UV
        (the reference's absorbed path, which verify runs on the same model: it reads them exact)."""
        heads = self.kept_heads
        return heads is not None and heads.expansion_bf16() and not any(b.reads_dense_heads for b in backends)

    def attention_bf16(self, backends) -> bool:
        """The decompressed segments' scores and P V as bf16 products (AMX-BF16 tiles or AVX512-BF16 dot products,
        kernels/bf16_attention.py):
        where the kept heads' plan takes them (GGUFHeads.attention_tiles: the K / V expansion in bf16, or the latent
        rows from a weight in bf16 prefill) and no backend of the step reads the dense W_UK / W_UV (the reference's,
        which never has the tiles)."""
        heads = self.kept_heads
        return heads is not None and heads.attention_tiles() and not any(b.reads_dense_heads for b in backends)

    def w_uk_uv(self, kv_b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b [H * (dn + dv), r] (default kv_b_weight()) per head: W_UK [H, dn, r] and W_UV [H, dv, r]."""
        cfg = self.cfg
        w = (self.kv_b_weight() if kv_b is None else kv_b).view(
            cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
        )
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def project_q(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (q [T, H, dn + dr], c_q [T, q_lora_rank] or None)."""
        if self.cfg.q_lora_rank:
            c_q = self.q_a_layernorm(self.q_a_proj(x))
            return self.q_b_proj(c_q).unflatten(-1, (self.cfg.num_heads, -1)), c_q
        return self.q_proj(x).unflatten(-1, (self.cfg.num_heads, -1)), None

    def forward(
        self,
        x: torch.Tensor,
        step: StepContext,
        rope: RotaryEmbedding,
        state: LayerState,
        prev: Selections,
    ) -> tuple[torch.Tensor, Selections]:
        cfg, mine = self.cfg, step.of(self.kind)
        cache = state.tensors[self.cache_state]
        q, c_q = self.project_q(x)
        # Write first: each segment then reads its context *and* this step's rows from the cache.
        q_nope, q_pe = self.write_latent(q, self.kv_a_proj_with_mqa(x), step, rope, cache)
        selections = None
        if mine.plan.sparse:
            selections = self.select(x, c_q, step, mine, state, prev)
        out = x.new_empty(x.shape[0], cfg.num_heads, cfg.v_head_dim)
        # the held kv_b_proj (a TransientKvB's: a meta tensor, shapes only); a decompressed segment in the
        # route, or a backend that reads the dense W_UK / W_UV (the reference: verify runs it on the same model),
        # reads values: decoded once for the layer's step, dropped when this call returns
        kv_b = self.kv_b_proj.weight
        if kv_b.is_meta and any(
            seg.segment.path != "absorbed" or backend.reads_dense_heads
            for seg, backend in zip(mine.segments, mine.backends)
        ):
            kv_b = self.kv_b_weight(self.expansion_bf16(mine.backends))
        tiles = any(seg.segment.path != "absorbed" for seg in mine.segments) and self.attention_bf16(mine.backends)
        for i, (seg, backend) in enumerate(zip(mine.segments, mine.backends)):
            sel = selections[i] if selections is not None else None
            per_query = self.attend(backend, q_nope, q_pe, cache, seg, sel, kv_b, tiles).flatten(0, 1)  # [B*Q, H, dv]
            out.index_copy_(0, seg.out_index, per_query.index_select(0, seg.valid_flat).to(out.dtype))
        return self.o_proj(out.flatten(1)), selections

    def _write_latent_native(
        self, q: torch.Tensor, kv: torch.Tensor, step: StepContext, rope: RotaryEmbedding, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """_write_latent_torch in one C call instead of ~20 ops per layer (norm, split, cat, rope, cast, index_copy_);
        the rope is bit-identical, the norm equal up to its sum's rounding (kernels/csrc/glue.c). A step
        outside its contract (_native_fits) takes the reference."""
        if not _native_fits(q, kv, cache, step):
            return self._write_latent_torch(q, kv, step, rope, cache)
        cfg, norm = self.cfg, self.kv_a_layernorm
        # 8-bit rows (kv_cache_dtype; cache/quantized_rows.py): the C call writes this step's fp32 rows to a
        # buffer of T rows, then the cache quantizes them (its one write)
        quantized = not isinstance(cache, torch.Tensor)
        target = kv.new_empty(kv.shape) if quantized else cache
        slots = torch.arange(kv.shape[0]) if quantized else step.slot_mapping
        native_layers.latent_rope_write(
            kv, q, cfg.qk_nope_head_dim, norm.weight, norm.eps, step.cos, step.sin, rope.interleaved, target, slots
        )
        if quantized:
            cache.index_copy_(0, step.slot_mapping, target)
        return q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)

    def _write_latent_triton(
        self, q: torch.Tensor, kv: torch.Tensor, step: StepContext, rope: RotaryEmbedding, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """_write_latent_torch as one Triton kernel per step (kernels/triton/latent_write.py): the rope bit for
        bit, the norm equal up to its sum's order. Its contract: fp32 tensors (_triton_fits); another step
        takes the reference (the plan says so)."""
        if not _triton_fits(q, kv, cache, step):
            return self._write_latent_torch(q, kv, step, rope, cache)
        from mlaserve.kernels.triton import latent_write  # defined after triton_runtime said how it runs

        cfg, norm = self.cfg, self.kv_a_layernorm
        # 8-bit rows (cache/quantized_rows.py): the kernel writes T fp32 rows to a buffer, the cache quantizes them
        quantized = not isinstance(cache, torch.Tensor)
        target = kv.new_empty(kv.shape) if quantized else cache
        slots = torch.arange(kv.shape[0], device=kv.device) if quantized else step.slot_mapping
        q_pe = latent_write.latent_write(
            kv, q, cfg.qk_nope_head_dim, norm.weight, norm.eps, step.cos, step.sin, rope.interleaved, target, slots
        )
        if quantized:
            cache.index_copy_(0, step.slot_mapping, target)
        return q[..., : cfg.qk_nope_head_dim], q_pe

    def _write_latent_torch(
        self, q: torch.Tensor, kv: torch.Tensor, step: StepContext, rope: RotaryEmbedding, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference: writes this step's cache rows [kv_a_layernorm(c_kv) | rope(k_pe)] and returns
        (q_nope, rope(q_pe)). q [T, H, dn + dr], kv [T, r + dr] (kv_a_proj_with_mqa's output)."""
        cfg = self.cfg
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        # One rotation for the query heads and the shared key: [T, H + 1, dr] (rope is elementwise per row)
        pe = rope(torch.cat([q_pe, k_pe[:, None]], dim=1), step.cos, step.sin)
        q_pe, k_pe = pe[:, : cfg.num_heads], pe[:, cfg.num_heads]
        cache.index_copy_(0, step.slot_mapping, torch.cat([c_kv, k_pe], dim=-1).to(cache.dtype))
        return q_nope, q_pe

    def select(
        self,
        x: torch.Tensor,
        c_q: torch.Tensor,
        step: StepContext,
        mine: KindStep,
        state: LayerState,
        prev: Selections,
    ) -> Selections:
        if self.indexer is None:
            if prev is None and mine.plan.needs_selection:
                raise RuntimeError("a shared-indexer layer needs the top-k of a previous full indexer layer")
            return prev
        if mine.pooled is not None:  # the plan's pooled route (GLM-5.3-Flash): models/pooled_indexer.py
            t = state.tensors
            return self.indexer.step(
                x, c_q, step.slot_mapping, mine.pooled, mine.segments, t["index_rows"], t["index_pools"]
            )
        index_keys = state.index_keys
        q_idx, k_idx, w = self.indexer.project(x, c_q, step.cos, step.sin)
        index_keys.index_copy_(0, step.slot_mapping, k_idx.to(index_keys.dtype))
        if not mine.plan.needs_selection:
            return None  # keys written for later steps; this step keeps every row anyway
        topk = mine.plan.index_topk
        return tuple(
            self.indexer.select(q_idx, w, index_keys, seg, topk, backend)
            for seg, backend in zip(mine.segments, mine.backends)
        )

    def attend(
        self,
        backend: AttentionBackend,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        seg: SegmentTensors,
        sel: Selection | None,
        kv_b: torch.Tensor,
        tiles: bool = False,
    ) -> torch.Tensor:
        """The segment's route (path, and its top-k when sparse) executed by the backend it names.
        kv_b: kv_b_proj's weight for this step (forward's); tiles: the step's attention_bf16."""
        cfg, scale = self.cfg, self.cfg.softmax_scale
        if seg.segment.path == "absorbed":
            w_uk, w_uv = self.w_uk_uv(kv_b)
            heads = self.kept_heads
            if sel is not None:
                return backend.sparse_absorbed(
                    q_nope, q_pe, cache, w_uk, w_uv, seg, scale, sel.index, sel.valid, heads=heads
                )
            return backend.absorbed(q_nope, q_pe, cache, w_uk, w_uv, seg, scale, heads=heads)
        allowed = sel.as_mask(seg.mask.shape[-1]) if sel is not None else None
        tiles = tiles and backend.decompressed_tiles
        return backend.decompressed(q_nope, q_pe, cache, kv_b, seg, scale, cfg.qk_nope_head_dim, allowed, tiles)


class DecoderLayer(nn.Module):
    KERNEL_OP = "decode_layer"  # native: the whole pure-decode step in one C call (quant/ggml_layer.py)

    def __init__(self, cfg: ModelConfig, layer_idx: int, all_reduce: AllReduce = single_process) -> None:
        super().__init__()
        self.all_reduce = all_reduce
        kda = attention_kind(cfg, layer_idx) == "kda"  # Kimi-Linear's linear-attention layers (models/kda)
        self.self_attn = KimiDeltaAttention(cfg, layer_idx) if kda else MLAAttention(cfg, layer_idx)
        # swiglu_limit: GLM-5.3-Flash's clamps (its MTP block is this layer); None for every other family
        if cfg.mlp_layer_types[layer_idx] == "moe":
            self.mlp = MoE(cfg.hidden_size, cfg.moe, cfg.swiglu_limit)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the whole layer as one native call for pure decode steps (quant.ggml_layer.GGUFDecodeLayer), set by the
        # KernelPlan where every weight is a native ggml holder; forward() below is its reference
        self.native_layer = None

    def forward(
        self,
        x: torch.Tensor,
        step: StepContext,
        rope: RotaryEmbedding,
        state: LayerState,
        prev: Selections,
    ) -> tuple[torch.Tensor, Selections]:
        h, selections = self.self_attn(self.input_layernorm(x), step, rope, state, prev)
        x = x + self.all_reduce(h)
        del h  # not read again: freed before the MLP makes its temporaries (a [T, D] tensor beside a step's peak)
        return x + self.all_reduce(self.mlp(self.post_attention_layernorm(x))), selections


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, all_reduce: AllReduce = single_process, layer_cls=None) -> None:
        """layer_cls: the decoder layer (DecoderLayer; LongCat-Flash's of two sublayers, models/longcat.py)."""
        super().__init__()
        layer_cls = layer_cls or DecoderLayer
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i, all_reduce) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MLAForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, vocab_start: int = 0, all_reduce: AllReduce = single_process, layer_cls=None
    ) -> None:
        """vocab_start: first vocabulary row this rank holds (tensor parallel; 0 on one process). layer_cls: the
        decoder layer class (None: DecoderLayer)."""
        super().__init__()
        self.cfg, self.vocab_start, self.all_reduce = cfg, vocab_start, all_reduce
        self.model = DeepseekModel(cfg, all_reduce, layer_cls)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.rope)
        # step -> the native layers' shared step arguments, or None when the step is not theirs
        # (quant.ggml_layer.decode_step, set by the loader with the native layers)
        self.native_decode: Callable | None = None
        # trunk's native layers -> their calls in one (quant.ggml_layer.DecodeStacks), or None: layer by layer
        self.native_stack: Callable | None = None
        self.kernel_plan = None  # the load's KernelPlan (kernels/registry.py), which the ledger names by digest

    def fused_decode(self, step: StepContext, cache: ModelCache):
        """The native decode layers' step arguments when this step is theirs, else None; with every trunk layer's
        call in one (FusedStep.stack) where each is native and none is under a forward hook. Decided from the
        route and the layers before the forward pass, so the ledger can say so."""
        native = self.native_decode(step, cache) if self.native_decode is not None else None
        if native is None or self.native_stack is None:
            return native
        stack = self.native_stack([layer.native_layer for layer in self.model.layers])
        return native if stack is None or stack.hooked() else replace(native, stack=stack)

    def forward(self, input_ids: torch.Tensor, step: StepContext, cache: ModelCache, native=None) -> torch.Tensor:
        """-> final hidden states [T, D] (normed). native: fused_decode(step, cache) of this step (a
        quant.ggml_layer.FusedStep), or None (every layer per op)."""
        x = self.embed(input_ids)
        if native is not None and native.stack is not None:
            # the layers' calls in one; on a selecting sparse step the selection stays in the step's buffer
            x = native.stack(x, native.args, [(s.latent, s.index_keys) for s in cache.layers])
            return self.model.norm(x)
        selections: Selections = None
        for i, layer in enumerate(self.model.layers):
            fast = layer.native_layer
            if native is not None and fast is not None and not fast.hooked():
                x, selections = self._fused(fast, x, native, cache.layers[i], selections)
                continue
            x, selections = layer(x, step, self.rope, cache.layers[i], selections)
        return self.model.norm(x)

    @staticmethod
    def _fused(fast, x: torch.Tensor, native, state: LayerState, selections: Selections) -> tuple:
        """One layer's native call (quant.ggml_layer.GGUFDecodeLayer) on a step `native` (quant.ggml_layer.FusedStep).
        On a selecting sparse step the selection lives in the step's buffer (native.carry): a full layer's call
        writes it, a shared layer's reads it; one made by a per-op layer (a hooked one) is copied in first."""
        if native.carry is None:  # dense, or sparse within index_topk: nothing selected to pass on
            return fast(x, native.args, state.latent, state.index_keys), selections
        if fast.role == "shared" and selections is None:
            raise RuntimeError("a shared-indexer layer needs the top-k of a previous full indexer layer")
        if selections is not None and selections is not native.carry:
            (buf,), (sel,) = native.carry, selections
            buf.index.copy_(sel.index)
            buf.valid.copy_(sel.valid)
        return fast(x, native.args, state.latent, state.index_keys), native.carry

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: this rank's rows, zeros for ids another rank holds; the sum
        over ranks is the full embedding."""
        return vocab_parallel_embed(self.model.embed_tokens, input_ids, self.vocab_start, self.all_reduce)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, V] (tensor parallel: this rank's vocabulary columns, gathered by the runner)."""
        return self.lm_head(hidden).float()

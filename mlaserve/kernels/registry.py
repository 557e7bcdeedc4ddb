"""The kernel registry: every op, its implementations in order of preference, and why one is taken.

An op is a piece of the model that has more than one implementation (the reference in torch, a native C
call, a fused block). A module that performs an op names it (`KERNEL_OP = "norm"`); each implementation
registers a `supports(module, ctx) -> reason | None` check (None: it can run this module) and an `apply`
that puts it in place. At load, `plan_kernels` walks the model once, takes for every module the first
implementation whose check passes (the reference always does) and returns a KernelPlan: per layer and op,
which implementation and why. The plan is data: `mlaserve inspect` prints it, every ledger record names it
by its digest, and a check that fails only moves that module to the reference, with the reason recorded.
Models call the op, not a name: applying the plan binds, on a KernelSwitch module, the chosen implementation's
method to the attribute its forward calls (RMSNorm.norm, MLAAttention.write_latent, Gate.route, the holders'
matmul / routed / per_head); a native method hands a step past its row limit (NATIVE_ROWS, one constant per op)
to its declared fallback, and the plan's reason says so.

Ops, in the order they are planned (a fused op's check reads the choices of the ops it fuses):
  embedding        a token table kept as GGUF blocks: native decode of the rows looked up | torch
  linear           a matrix kept in a stored format (GGUF blocks, FP8 blocks): triton (FP8, GGUF Q8_0 / Q4_K on
                   a GPU, triton_linear.py) | native decode-and-dot | torch
  grouped_experts  a routed-expert stack kept in a stored format: native | torch
  heads            W_UK / W_UV kept as a GGUF's attn_k_b / attn_v_b blocks: native grouped GEMV | torch
  norm             RMSNorm: native (one C call, fp32 CPU) | torch
  router           the MoE gate's scoring and group-limited top-k: native | torch
  latent_write     kv_a norm, rope of k_pe and q_pe, the cache row write: triton (one kernel per step, fp32, on a
                   GPU; kernels/triton/latent_write.py) | native | torch
  sink_attention   DeepSeek-V4's padded softmax with sinks over a step's gathered keys: native (one C call over
                   the allowed keys only, fp32 CPU) | torch
  hyper_connection an mHC hyper-connection's mixing weights and sublayer input (DeepSeek-V4, GLM-5.3-Flash): native
                   (one C call, fp32 CPU) | torch
  moe_block        a MoE layer's decode step as one call: native | per_op
  v4_ffn           a DeepSeek-V4 layer's FFN sublayer (hyper-connections, norm, MoE block) as one call: native |
                   per_op
  decode_layer     a decoder layer's pure decode step as one call: native | per_op
Attention over the cache (latent MQA, decompressed MHA, index scoring) is chosen per step by the router
(the segment's backend and implementation, in the ledger), not here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mlaserve.config.layer_kinds import layer_ranges
from mlaserve.kernels import triton_linear
from mlaserve.platform.triton_runtime import triton_mode

OPS = (
    "embedding",
    "linear",
    "mlp_rows",  # after linear: its check reads the settings linear's apply gave the projections
    "grouped_experts",
    "heads",
    "norm",
    "router",
    "latent_write",
    "sink_attention",
    "hyper_connection",
    "moe_block",
    "v4_ffn",  # after hyper_connection, norm and moe_block: its check reads their choices
    "decode_layer",
)


@dataclass(frozen=True)
class KernelContext:
    """The engine's switches an implementation's check may read (config/machine.py resolved them)."""

    kernels: str  # "native" | "triton" | "torch"
    int8: int  # activations: 0 float; else the widest weight (bits per value) whose products take int8 (native.takes_int8)
    bf16: int = 0  # prefill_matmul: 0 fp32; else the widest weight whose many-rows products run in bf16 (bf16_prefill)
    tiles: bool = False  # prefill_matmul "int8": int8 prefill products on the AMX-INT8 tiles up to ggml.tile_rows rows


Supports = Callable[[nn.Module, KernelContext], "str | None"]
Apply = Callable[[nn.Module, KernelContext], None]
Note = Callable[[nn.Module], "str | None"]


@dataclass(frozen=True)
class Impl:
    op: str
    name: str
    supports: Supports
    apply: Apply
    note: Note | None = None  # what the plan should say about a module this implementation takes


_IMPLS: dict[str, list[Impl]] = {op: [] for op in OPS}


def register(op: str, name: str, supports: Supports, apply: Apply, note: Note | None = None) -> None:
    """Add an implementation of `op`, preferred over those registered after it (the reference goes last)."""
    if op not in _IMPLS:
        raise ValueError(f"unknown kernel op {op!r}; ops: {OPS}")
    if any(i.name == name for i in _IMPLS[op]):
        raise ValueError(f"{op}: implementation {name!r} registered twice")
    _IMPLS[op].append(Impl(op, name, supports, apply, note))


def implementations(op: str) -> tuple[Impl, ...]:
    return tuple(_IMPLS[op])


def set_kernel(name: str) -> Apply:
    """apply() of the ops whose module reads its own `kernel` switch."""

    def apply(module: nn.Module, ctx: KernelContext) -> None:
        module.kernel = name

    return apply


def always(module: nn.Module, ctx: KernelContext) -> str | None:
    """The reference's check: it runs everything."""
    return None


def needs_native(ctx: KernelContext) -> str | None:
    return None if ctx.kernels == "native" else f"engine kernels={ctx.kernels}"


@dataclass(frozen=True)
class KernelChoice:
    module: str  # the module's name in the model ("model.layers.3.mlp.gate")
    layer: str  # "3", "mtp.0" or "model" (outside the decoder layers)
    op: str
    impl: str
    reason: str  # why this one: the engine's choice, or why each preferred one did not fit


@dataclass(frozen=True)
class KernelPlan:
    choices: tuple[KernelChoice, ...]

    @property
    def digest(self) -> str:
        """A short name of the plan's content, which every ledger record carries."""
        raw = json.dumps([[c.module, c.op, c.impl] for c in self.choices]).encode()
        return hashlib.sha256(raw).hexdigest()[:12]

    def of(self, module: str, op: str) -> KernelChoice | None:
        return next((c for c in self.choices if c.module == module and c.op == op), None)

    def summary(self) -> list[tuple[str, str, str, str]]:
        """(op, implementation, layers, reason) rows, modules with the same choice and reason grouped."""
        groups: dict[tuple[str, str, str], list[str]] = {}
        for c in self.choices:
            groups.setdefault((c.op, c.impl, c.reason), [])
            if c.layer not in groups[(c.op, c.impl, c.reason)]:
                groups[(c.op, c.impl, c.reason)].append(c.layer)
        rows = [(op, impl, _layers(ids), reason) for (op, impl, reason), ids in groups.items()]
        return sorted(rows, key=lambda r: OPS.index(r[0]))

    def format(self) -> str:
        rows = self.summary()
        if not rows:
            return "  (no op with more than one implementation in this model)"
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join(f"  {op:<{w[0]}}  {impl:<{w[1]}}  layers {lay:<{w[2]}}  {why}" for op, impl, lay, why in rows)


def plan_kernels(model: nn.Module, ctx: KernelContext) -> KernelPlan:
    """Choose and apply every module's implementation, op by op in OPS order. -> the plan."""
    choices = []
    for op in OPS:
        for name, module in model.named_modules():
            if getattr(module, "KERNEL_OP", None) != op:
                continue
            impl, passed = _first(op, module, ctx)
            impl.apply(module, ctx)  # before the note: it may say what apply set (a holder's activations)
            reason = _reason(impl, module, passed, ctx)
            choices.append(KernelChoice(name, _layer_of(name), op, impl.name, reason))
    return KernelPlan(tuple(choices))


def _choose(op: str, module: nn.Module, ctx: KernelContext) -> tuple[Impl, str]:
    """The implementation the plan would take for this module, and why (without applying it)."""
    impl, passed = _first(op, module, ctx)
    return impl, _reason(impl, module, passed, ctx)


def _reason(impl: Impl, module: nn.Module, passed: list[str], ctx: KernelContext) -> str:
    said = impl.note(module) if impl.note is not None else None
    return "; ".join([*passed, *([said] if said else [])]) or f"first choice, kernels={ctx.kernels}"


def _first(op: str, module: nn.Module, ctx: KernelContext) -> tuple[Impl, list[str]]:
    """The first implementation whose check passes, and why each preferred one did not."""
    impls = _IMPLS[op]
    if not impls:
        raise RuntimeError(f"kernel op {op!r} has no implementation registered (its module was not imported)")
    passed = []
    for impl in impls:
        why_not = impl.supports(module, ctx)
        if why_not is None:
            return impl, passed
        passed.append(f"not {impl.name}: {why_not}")
    raise RuntimeError(f"{op}: no implementation supports {type(module).__name__} ({'; '.join(passed)})")


def _layer_of(name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 2:
        return parts[2]
    if parts[0] == "mtp" and len(parts) > 1:
        return f"mtp.{parts[1]}"
    return "model"


def _layers(ids: list[str]) -> str:
    nums = [int(i) for i in ids if i.isdigit()]
    return ", ".join(([layer_ranges(nums)] if nums else []) + [i for i in ids if not i.isdigit()])


class KernelSwitch:
    """A module whose op has its implementations as methods. Setting `kernel` (the plan's choice, applied at
    load) binds, for each attribute the model calls, the chosen implementation's method (KERNEL_CALLS:
    attribute -> {implementation: method}), so no forward compares an implementation's name. A native method's
    contract on the step's input (at most NATIVE_ROWS rows; a dtype or stride only the step shows) is kept in
    that method, which hands a step outside it to its declared fallback (NATIVE_FALLBACK); the plan says so."""

    KERNEL_CALLS: dict[str, dict[str, str]]
    NATIVE_ROWS: int | None = None  # rows of a step up to which the native method runs (None: no row limit)
    NATIVE_UNIT = "rows"  # what NATIVE_ROWS counts
    NATIVE_FALLBACK = "torch"  # what takes a step past NATIVE_ROWS

    @property
    def kernel(self) -> str:
        return self.__dict__["_kernel"]

    @kernel.setter
    def kernel(self, name: str) -> None:
        for call, methods in type(self).KERNEL_CALLS.items():
            if name not in methods:
                raise ValueError(f"{type(self).__name__}: no kernel {name!r} (it has {', '.join(methods)})")
            self.__dict__[call] = getattr(self, methods[name])
        self.__dict__["_kernel"] = name


class BlockSwitch:
    """A layer whose whole step the plan may hand to a native block (op moe_block): setting `native_block` (the
    block, or None for the per-op path) binds `step`, which the layer's forward calls; the block hands a step
    outside its contract to `per_op`, the layer's reference."""

    @property
    def native_block(self):
        return self.__dict__["_native_block"]

    @native_block.setter
    def native_block(self, block) -> None:
        self.__dict__["_native_block"] = block
        self.__dict__["step"] = block if block is not None else self.per_op


def runs_native(module: nn.Module) -> bool:
    """Whether the plan gave this module its native implementation: what a fused op's check reads of the ops it
    fuses (at load; no forward asks)."""
    return isinstance(module, KernelSwitch) and module.kernel == "native"


def native_contract(module: nn.Module) -> str | None:
    """What the plan says about a module the native implementation takes: its row limit and fallback."""
    rows = getattr(module, "NATIVE_ROWS", None)
    if rows is None:
        return None
    detail = getattr(module, "native_detail", None)  # a module may name the kernel build it runs (its ISA)
    said = detail() if detail is not None else None  # or the activations it takes (GGUF holders with int8)
    said = f" ({said})" if said else ""
    return f"native{said} up to {rows} {module.NATIVE_UNIT} per step, else {module.NATIVE_FALLBACK}"


# The ops whose module holds its own `kernel` switch (a KernelSwitch: setting it binds what the model calls):
# the native one where the engine runs the native kernels, the module has one (KERNELS) and the module's own
# check (native_unfit: limits of the C code, dtype / device / layout known at load) passes; else the torch
# reference. Every op but the four whose implementations bind a whole step, a sublayer or a block's row parts
# (registered by models/layers.py, quant/ggml_moe_block.py, models/deepseek_v4/model.py and quant/ggml_layer.py).
MODULE_OPS = tuple(op for op in OPS if op not in ("mlp_rows", "moe_block", "v4_ffn", "decode_layer"))


def _native_module(module: nn.Module, ctx: KernelContext) -> str | None:
    why = needs_native(ctx)
    if why is not None:
        return why
    if "native" not in getattr(module, "KERNELS", ()):
        return f"{type(module).__name__} has no native kernel"
    unfit = getattr(module, "native_unfit", None)
    return unfit() if unfit is not None else None


def _apply_native(module: nn.Module, ctx: KernelContext) -> None:
    module.kernel = "native"
    if ctx.int8 and hasattr(module, "int8"):  # GGUF block holders: llama.cpp's integer dots (not exact)
        module.int8 = ctx.int8
    if ctx.bf16 and hasattr(module, "set_prefill_bf16"):  # GGUF block holders: bf16 GEMMs on prefill (not exact)
        module.set_prefill_bf16(ctx.bf16)
    if ctx.tiles and hasattr(module, "set_prefill_tiles"):  # after int8: the tiles take the int8 products' weights
        module.set_prefill_tiles()


def _triton_module(module: nn.Module, ctx: KernelContext) -> str | None:
    return triton_linear.supports(module, ctx.kernels)


def _triton_latent(module: nn.Module, ctx: KernelContext) -> str | None:
    """The Triton latent write's check: the module's kernel list and load-time check (an fp32 norm weight),
    Triton can run on its device (compiled on CUDA, the interpreter under TRITON_INTERPRET=1), kernels=triton."""
    if "triton" not in getattr(module, "KERNELS", ()):
        return f"{type(module).__name__} has no Triton kernel"
    unfit = module.triton_unfit()
    if unfit is not None:
        return unfit
    mode = triton_mode(module.triton_device())
    if mode.mode is None:
        return mode.reason
    if ctx.kernels != "triton":
        return f"engine kernels={ctx.kernels} ({mode.mode} Triton not asked for)"
    return None


def _triton_latent_note(module: nn.Module) -> str:
    mode = triton_mode(module.triton_device()).mode
    return f"triton norm + rope + cache write in one kernel per step ({mode}), fp32 steps, else torch"


# The holders whose format has a Triton kernel (FP8Linear, GGUFLinear of Q8_0 / Q4_K) take it first where the
# engine's kernels are "triton" (a GPU); the plan names why each other one did not (no GPU, format not covered).
register("linear", "triton", _triton_module, set_kernel("triton"), triton_linear.detail)
# MLAAttention's latent write: one Triton kernel where the engine's kernels are "triton" (a GPU; tests: the
# interpreter), its fp32 norm weight checked at load
register("latent_write", "triton", _triton_latent, set_kernel("triton"), _triton_latent_note)
for _op in MODULE_OPS:
    register(_op, "native", _native_module, _apply_native, native_contract)
    register(_op, "torch", always, set_kernel("torch"))

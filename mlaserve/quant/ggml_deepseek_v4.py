"""DeepSeek-V4's modules kept in a GGUF file's ggml blocks (Q8_0, Q4_K, MXFP4, ...), as quant/deepseek_v4.py
keeps the release's FP8 / FP4 ones: the stored bytes are copied at load, never converted.

Notation: R = ggml.row_bytes(type, K), the bytes of one stored row of K values (a whole number of blocks).
  nn.Linear       -> GGUFLinear (quant/ggml_linear.py) weight [N, R_K]: q/kv/o projections, compressors,
                     indexer, shared expert, lm_head
  nn.Embedding    -> GGUFEmbedding                         weight [V, R_D]
  GroupedLinear   -> GGUFGroupedLinear  o_a_proj           weight [G*o, R_(H/G*Dh)]
  Experts         -> GGUFV4Experts      gate_up_proj [E, 2I, R_D] (gate rows first, gate and up of one type),
                                        down_proj [E, D, R_I]; V4's clamped SwiGLU (models/deepseek_v4/moe.py)
A tensor stored F32 / F16 / BF16 stays a float module (dequantized at load); the router (ffn_gate_inp) is a
float parameter, and tid2eid, norms, sinks, position biases and the hc_* tensors load as floats (fp32).
Plan (`plan_v4_gguf`, from the file's tensor types) -> swap (`swap_in_v4_gguf`, on the meta model) -> fill.
Kernels (the KernelPlan, loading/deepseek_v4.plan_v4_kernels: each holder's `kernel` bound at load from the
engine's `kernels`): GGUFLinear has the native decode-and-dot kernels of the other GGUF models; GGUFGroupedLinear
runs its G groups as one native grouped decode-and-dot at few rows (else the weight decoded natively, then the
block products); GGUFV4Experts is GGUFExperts (one native call pair by pair at decode, the pairs sorted by expert
and grouped native products beyond, int8 or int16 activations where the engine's `activations` gives them to both
projections' types, the pair-by-pair call included) with the clamped SwiGLU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mlaserve.config.provenance import Setting
from mlaserve.gguf.quants import GGML_TYPES
from mlaserve.kernels import bf16_prefill, ggml, native, registry
from mlaserve.loading.deepseek_v4_names import target
from mlaserve.models.deepseek_v4.moe import clamped_swiglu, experts_loop
from mlaserve.quant.ggml_linear import GGUFEmbedding, GGUFExperts, GGUFLinear, _raw, bf16_detail, int8_detail
from mlaserve.quant.ggml_plan import BLOCK_TYPES
from mlaserve.quant.plan import _group


class GGUFGroupedLinear(registry.KernelSwitch, nn.Module):
    """o_a_proj in ggml blocks: y[:, g] = x[:, g] @ W_g^T for the G row blocks W_g of the [G*o, K] weight.
    Kernels (the KernelPlan's op "linear"): native up to NATIVE_ROWS rows the C grouped decode-and-dot (the groups
    as the "experts" of one call: a group's rows are whole ggml rows) with the plan's activations as GGUFLinear's
    (`int8`: int16 codes for Q8_0 under int8_6bit_int16, int8 for weights of 6 bits or fewer; ggml.expert_linear_native
    decides as it does for routed experts), more rows the weight decoded by the C
    decoder (the reference's values bit for bit), then the G block products, or, where the plan's prefill setting
    gives the type a product of its own (set_prefill_bf16: Q8_0's bf16 pairs on AMX-BF16, int16 on AVX512-VNNI,
    bf16 for weights of 6 bits or fewer), each group's product on its row block as a GGUFLinear's many-rows product
    (ggml.linear_native); torch: decoded by torch, then the block products."""

    KERNEL_OP = "linear"
    KERNELS = ggml.KERNELS
    KERNEL_CALLS = {"matmul": {"native": "_matmul_native", "torch": "_matmul_torch"}}
    NATIVE_ROWS, NATIVE_FALLBACK = ggml.GEMV_ROWS, "native decode, then the G block products"

    def __init__(self, in_per_group: int, out_features: int, groups: int, ggml_type: int, device) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.groups, self.ggml_type = in_per_group, out_features, groups, ggml_type
        self.kernel = "torch"  # the reference until the KernelPlan binds the engine's kernels
        self.int8 = False  # the decode products' activations: False, or the plan's setting (native.takes_int8)
        self.bf16 = bf16_prefill.FP32  # the plan's prefill setting for this type (set_prefill_bf16)
        self.weight = _raw((out_features, ggml.row_bytes(ggml_type, in_per_group)), device)

    def set_prefill_bf16(self, cap: int) -> None:
        """The KernelPlan's prefill setting (the widest weight taking bf16, bits per value), decided once here."""
        self.bf16 = bf16_prefill.takes_bf16(self.ggml_type, cap)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ggml.dense(self.weight, self.ggml_type, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, G, K] -> [S, G*o], in fp32, rounded to x's dtype."""
        return self.matmul(x)

    def _products(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [S, G, K], the dense weight w [G*o, K] fp32 -> [S, G*o] in x's dtype."""
        w = w.view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        return torch.bmm(x.float().transpose(0, 1), w).transpose(0, 1).flatten(1).to(x.dtype)

    def _matmul_torch(self, x: torch.Tensor) -> torch.Tensor:
        return self._products(x, ggml.dense(self.weight, self.ggml_type, self.in_features))

    def _matmul_native(self, x: torch.Tensor) -> torch.Tensor:
        s, g = x.shape[0], self.groups
        if s > self.NATIVE_ROWS and self.bf16 != bf16_prefill.FP32:  # each group's row block, a GGUF product of its own
            w = self.weight.view(g, -1, self.weight.shape[-1])
            ys = [ggml.linear_native(x[:, a], w[a], self.ggml_type, self.in_features, bf16=self.bf16) for a in range(g)]
            return torch.cat(ys, dim=1).to(x.dtype)
        if s > self.NATIVE_ROWS:
            return self._products(x, native.dequantize(self.ggml_type, self.weight, self.in_features))
        xs = x.float().transpose(0, 1).reshape(g * s, -1).contiguous()  # group a's rows: a*S .. (a+1)*S - 1
        experts = torch.arange(g, dtype=torch.int64)
        ends = torch.arange(s, g * s + 1, s, dtype=torch.int64)
        w = self.weight.view(g, -1, self.weight.shape[-1])
        y = ggml.expert_linear_native(xs, w, self.ggml_type, self.in_features, experts, ends, int8=self.int8)
        return y.view(g, s, -1).transpose(0, 1).reshape(s, -1).to(x.dtype)

    def native_detail(self) -> str:
        said = bf16_detail((self.ggml_type,), (self.bf16,))  # the groups' prefill products, where the setting gives any
        prefill = f"; per group, {said}" if said else ""
        acts = int8_detail((self.ggml_type,), self.int8)  # the decode products' activations, where not fp32
        return (
            f"{native.product_detail(self.ggml_type, GGML_TYPES[self.ggml_type].name)}, {self.groups} groups"
            f"{f'; {acts}' if acts else ''}{prefill}"
        )

    def describe(self) -> tuple[str, tuple[int, int]]:
        t = GGML_TYPES[self.ggml_type]
        return f"gguf {t.name}", (1, t.block_size)


class GGUFV4Experts(GGUFExperts):
    """V4's routed experts in ggml blocks: GGUFExperts (pairs sorted by expert, grouped products, one index_add;
    up to NATIVE_ROWS pairs one native call pair by pair) with V4's clamped SwiGLU between the products.
    `reference` is the plain loop over experts (models/deepseek_v4/moe.experts_loop over `expert(e)`, torch's
    dequantizer) the fast paths are tested against."""

    def __init__(self, hidden: int, n_experts: int, inter: int, limit: float, t_gate_up: int, t_down: int, device):
        super().__init__(hidden, n_experts, inter, t_gate_up, t_down, device)
        self.limit = self.swiglu_limit = limit
        # V4's reader fills one fused stack per layer (gate rows first, loading/deepseek_v4.py's gate_up_proj), so
        # gate_proj / up_proj are its two halves: views with the same shape and expert stride, which the kernels
        # take as two stacks wherever they lie (GGUFExperts keeps the file's two tensors in place instead)
        del self.gate_proj, self.up_proj
        self.gate_up_proj = _raw((n_experts, 2 * inter, ggml.row_bytes(t_gate_up, hidden)), device)

    @property
    def gate_proj(self) -> torch.Tensor:
        return self.gate_up_proj[:, : self.inter]

    @property
    def up_proj(self) -> torch.Tensor:
        return self.gate_up_proj[:, self.inter :]

    def _swiglu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(g, u, self.limit)

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's dense (gate_up [2I, D], down [D, I]) in fp32, by torch's dequantizer (the reference's)."""
        return (
            ggml.dense(self.gate_up_proj[e], self.type_gate_up, self.hidden),
            ggml.dense(self.down_proj[e], self.type_down, self.inter),
        )

    def reference(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return experts_loop(x, weights, idx, self.expert, self.limit)

    def extra_repr(self) -> str:
        gu, d = GGML_TYPES[self.type_gate_up].name, GGML_TYPES[self.type_down].name
        return f"experts={self.gate_up_proj.shape[0]}, gate_up={gu}, down={d}"


@dataclass(frozen=True)
class V4GGUFPlan:
    """Which modules keep their blocks (module name, ggml type name(s)) and which load as floats, and why."""

    kept: tuple[tuple[str, str, tuple[tuple[str, int], ...]], ...]  # (module, type name(s), (part, type) pairs)
    floats: tuple[tuple[str, str, str], ...]  # (module, stored type(s), why)
    blocks: frozenset[str]  # checkpoint (release) names read as stored bytes

    def settings(self) -> tuple[Setting, ...]:
        """`mlaserve inspect`'s rows: per stored type and module kind, the layers kept in blocks; then the
        modules loaded as floats, with why."""
        kept: dict[str, list[str]] = {}
        for module, tname, _ in self.kept:
            kept.setdefault(tname, []).append(module)
        rows = []
        for tname, mods in sorted(kept.items()):
            for kind, layers in _group(tuple(mods)):
                rows.append(Setting(f"gguf {tname} {kind}", layers, f"stored {tname}; kept in its blocks"))
        floats: dict[tuple[str, str], list[str]] = {}
        for module, tname, why in self.floats:
            floats.setdefault((tname, why), []).append(module)
        for (tname, why), mods in floats.items():
            for kind, layers in _group(tuple(mods)):
                rows.append(Setting(f"gguf {tname} {kind}", layers, f"stored {tname}; {why}"))
        return tuple(rows)

    def summary(self) -> str:
        types: dict[str, int] = {}
        for _, t, _ in self.kept:
            types[t] = types.get(t, 0) + 1
        kinds = ", ".join(f"{n} {t}" for t, n in sorted(types.items()))
        return f"GGUF blocks kept: {len(self.kept)} module(s) ({kinds}); {len(self.floats)} stored float or dense"


def plan_v4_gguf(source, model: nn.Module) -> V4GGUFPlan:
    """From the file's tensor types (source: V4GGUFTensors) and the model's module tree: a module whose stored
    type is a block format keeps its blocks; a routed-expert stack keeps them when gate and up share a type."""
    from mlaserve.models.deepseek_v4.attention import GroupedLinear
    from mlaserve.models.deepseek_v4.moe import Experts

    module_names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    types: dict[str, dict] = {}  # module -> {part: ggml type}
    names: dict[str, list[str]] = {}
    for name in source.names():
        t = target(name, module_names)
        if t is None:
            continue
        module = t.name.rpartition(".")[0]
        types.setdefault(module, {})[t.part or "weight"] = source.ggml_type(name)
        names.setdefault(module, []).append(name)
    kept, floats, blocks = [], [], set()
    for module, parts in sorted(types.items()):
        try:
            m = model.get_submodule(module)
        except AttributeError:
            m = None
        tnames = "/".join(sorted({GGML_TYPES[t].name for t in parts.values()}))
        if not isinstance(m, (nn.Linear, nn.Embedding, GroupedLinear, Experts)):
            continue  # norms, router, sinks, hc_*, biases, tid2eid: floats by the reference's rule
        if not all(t in BLOCK_TYPES for t in parts.values()):
            floats.append((module, tnames, "not a block format: loaded as floats"))
            continue
        if isinstance(m, Experts) and parts.get("w1") != parts.get("w3"):
            floats.append((module, tnames, "gate and up stored in different types: dequantized at load"))
            continue
        kept.append((module, tnames, tuple(sorted(parts.items()))))
        blocks.update(names[module])
    return V4GGUFPlan(tuple(kept), tuple(floats), frozenset(blocks))


def swap_in_v4_gguf(model: nn.Module, plan: V4GGUFPlan, dtype: torch.dtype) -> None:
    """Replace the planned modules (on the model's device, the meta device at load) with their holders."""
    from mlaserve.models.deepseek_v4.attention import GroupedLinear
    from mlaserve.models.deepseek_v4.moe import Experts

    for module, _, pairs in plan.kept:
        old, parts = model.get_submodule(module), dict(pairs)
        if isinstance(old, Experts):
            e, two_i, d = old.gate_up_proj.shape
            new = GGUFV4Experts(d, e, two_i // 2, old.limit, parts["w1"], parts["w2"], old.gate_up_proj.device)
        elif isinstance(old, GroupedLinear):
            o, k = old.weight.shape
            new = GGUFGroupedLinear(k, o, old.groups, parts["weight"], old.weight.device)
        elif isinstance(old, nn.Embedding):
            new = GGUFEmbedding(old.num_embeddings, old.embedding_dim, parts["weight"], dtype, old.weight.device)
        else:
            new = GGUFLinear(old.in_features, old.out_features, parts["weight"], False, dtype, old.weight.device)
        model.set_submodule(module, new)

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
Kernels (`kernel`, set at load from the engine's `kernels`): GGUFLinear has the native decode-and-dot kernels
of the other GGUF models; GGUFGroupedLinear and GGUFV4Experts decode their blocks per call (the routed experts
one per routed expert and step) by the native decoder (bit for bit the torch reference's values) or in torch,
then multiply in fp32 torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mlaserve.config.provenance import Setting
from mlaserve.gguf.quants import GGML_TYPES
from mlaserve.kernels import ggml, native, registry
from mlaserve.loading.deepseek_v4_names import target
from mlaserve.models.deepseek_v4.moe import experts_loop
from mlaserve.quant.ggml_linear import GGUFEmbedding, GGUFLinear, _raw
from mlaserve.quant.ggml_plan import BLOCK_TYPES
from mlaserve.quant.plan import _group


class _Decoder(registry.KernelSwitch):
    """`decode(w [N, R] uint8, type, K) -> [N, K] fp32`: the native decoder or torch's (the same values)."""

    KERNELS = ggml.KERNELS
    KERNEL_CALLS = {"decode": {"native": "_decode_native", "torch": "_decode_torch"}}
    NATIVE_FALLBACK = "none (every call decodes natively)"

    @staticmethod
    def _decode_native(w: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
        return native.dequantize(ggml_type, w.contiguous(), k)

    @staticmethod
    def _decode_torch(w: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
        return ggml.dense(w, ggml_type, k)


class GGUFGroupedLinear(_Decoder, nn.Module):
    """o_a_proj in ggml blocks: y[:, g] = x[:, g] @ W_g^T for the G row blocks W_g of the [G*o, K] weight."""

    KERNEL_OP = "grouped_linear"

    def __init__(self, in_per_group: int, out_features: int, groups: int, ggml_type: int, device) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.groups, self.ggml_type = in_per_group, out_features, groups, ggml_type
        self.kernel = "torch"  # the reference until the loader sets the engine's kernels
        self.weight = _raw((out_features, ggml.row_bytes(ggml_type, in_per_group)), device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ggml.dense(self.weight, self.ggml_type, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, G, K] -> [S, G*o], in fp32 (the dequantized weight's dtype), rounded to x's dtype."""
        w = self.decode(self.weight, self.ggml_type, self.in_features)
        w = w.view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        return torch.bmm(x.float().transpose(0, 1), w).transpose(0, 1).flatten(1).to(x.dtype)


class GGUFV4Experts(_Decoder, nn.Module):
    """V4's routed experts in ggml blocks; forward = models/deepseek_v4/moe.experts_loop over expert(e), each
    routed expert decoded once per step."""

    KERNEL_OP = "v4_experts"

    def __init__(self, hidden: int, n_experts: int, inter: int, limit: float, t_gate_up: int, t_down: int, device):
        nn.Module.__init__(self)
        self.hidden, self.inter, self.limit = hidden, inter, limit
        self.kernel = "torch"  # the reference until the loader sets the engine's kernels
        self.type_gate_up, self.type_down = t_gate_up, t_down
        self.gate_up_proj = _raw((n_experts, 2 * inter, ggml.row_bytes(t_gate_up, hidden)), device)
        self.down_proj = _raw((n_experts, hidden, ggml.row_bytes(t_down, inter)), device)

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's dense (gate_up [2I, D], down [D, I]) in fp32, by the chosen decoder."""
        return (
            self.decode(self.gate_up_proj[e], self.type_gate_up, self.hidden),
            self.decode(self.down_proj[e], self.type_down, self.inter),
        )

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference's values of every expert."""
        pairs = [
            (
                ggml.dense(self.gate_up_proj[e], self.type_gate_up, self.hidden),
                ggml.dense(self.down_proj[e], self.type_down, self.inter),
            )
            for e in range(self.gate_up_proj.shape[0])
        ]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
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


def set_v4_kernels(model: nn.Module, kernel: str, int8: int) -> str:
    """The engine's kernels on every GGUF holder of a V4 model (at load, before any forward); int8: GGUFLinear's
    int8 activations (engine option activations: the cap of native.takes_int8, 0 none). Returns the load report's line."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, registry.KernelSwitch):
            m.kernel = kernel
            if isinstance(m, GGUFLinear):
                m.int8 = int8
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    held = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
    how = {
        "native": "GGUFLinear native decode-and-dot; grouped o_a_proj and routed experts decoded natively, "
        "multiplied in fp32 torch",
        "torch": "torch (each call decodes its blocks)",
    }[kernel]
    return f"DeepSeek-V4 GGUF holders ({held}): {how}" + (", int8 activations" if int8 else "")

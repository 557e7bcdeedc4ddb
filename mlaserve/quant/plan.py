"""Which modules of a model hold quantized weights, decided from the checkpoint before loading.

A module is quantized exactly when the checkpoint has its scale tensor (`<module>.<scale_name>`);
routed experts are quantized per layer (all experts of the layer, or none). Steps:
  plan_quantization  names + scheme -> QuantPlan (validated: ignore patterns, scale placement)
  swap_in            nn.Linear / Experts -> FP8Linear / FP8Experts for the planned modules
                     (after build_model, before the strict loader fills them)
  densify            after loading: modules the engine reads as dense matrices get their
                     dequantized weight (kv_b_proj: the absorbed path takes per-head views
                     W_UK / W_UV of it; the indexer's weights_proj stays a float projection)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.config.provenance import Setting
from mlaserve.loading.safetensors_source import WeightError
from mlaserve.models.moe import Gate
from mlaserve.quant.config import QuantScheme, ignore_match
from mlaserve.quant.int4_experts import INT4Experts
from mlaserve.quant.linear import FP4Experts, FP8Experts, FP8Linear

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.\d+\.(gate_proj|up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
DENSE_AT_LOAD = {
    "kv_b_proj": "dequantized at load: absorbed attention takes per-head views W_UK/W_UV of it",
    "weights_proj": "dequantized at load: the DSA indexer's head weights stay a float projection",
}


@dataclass(frozen=True)
class QuantPlan:
    scheme: QuantScheme
    linears: tuple[str, ...]  # modules swapped for FP8Linear
    experts: tuple[str, ...]  # experts modules swapped for FP8Experts
    kept: tuple[str, ...] = ()  # linear, embedding and router modules left unquantized (after swap_in)

    def settings(self) -> tuple[Setting, ...]:
        """The scheme's settings, then one row per module kind: quantized or kept, and why."""
        rows = list(self.scheme.settings)
        s = self.scheme.scale_name
        for kind, layers in _group(self.linears):
            how = DENSE_AT_LOAD.get(kind.rsplit(".", 1)[-1], f"kept {self.scheme.fmt}, dequantized per call")
            rows.append(Setting(f"quantized {kind}", layers, f"checkpoint: *.{s} present; {how}"))
        for kind, layers in _group(self.experts):
            how = f"{self.scheme.expert_dtype}: only the experts a step routes to are dequantized"
            rows.append(Setting(f"quantized {kind}", layers, f"checkpoint: *.{s} present; {how}"))
        for kind, layers in _group(self.kept):
            rows.append(Setting(f"kept {kind}", layers, "checkpoint: no scale tensor (stored unquantized)"))
        return tuple(rows)


def _group(modules: tuple[str, ...]) -> list[tuple[str, str]]:
    """model.layers.3.self_attn.q_a_proj, ... -> [("model.layers.*.self_attn.q_a_proj", "layers 1-3")]."""
    kinds: dict[str, list[int]] = {}
    for m in modules:
        layer = _LAYER.match(m)
        kind = _LAYER.sub("model.layers.*.", m) if layer else m
        kinds.setdefault(kind, []).append(int(layer.group(1)) if layer else -1)
    out = []
    for kind, ids in kinds.items():
        ids = sorted(i for i in ids if i >= 0)
        out.append((kind, f"layers {_ranges(ids)}" if ids else "yes"))
    return out


def _ranges(ids: list[int]) -> str:
    parts, start = [], None
    for i, v in enumerate(ids):
        start = v if start is None else start
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(parts)


def plan_quantization(
    scheme: QuantScheme, names: list[str], cfg: ModelConfig, model_modules: set[str] = frozenset()
) -> QuantPlan:
    """model_modules: the built model's module names; an ignore pattern may name one the
    checkpoint stores no tensor for (lm_head of a model with tied embeddings)."""
    suffix = "." + scheme.scale_name
    scaled = [n[: -len(suffix)] for n in names if n.endswith(suffix)]
    have = set(names)
    modules = {n.rsplit(".", 1)[0] for n in names} | set(model_modules)
    _check_ignore(scheme, modules, scaled)
    linears, experts = set(), set()
    for module in scaled:
        layer = _LAYER.match(module)
        if layer and int(layer.group(1)) >= cfg.num_layers:
            continue  # MTP / nextn: skipped by the loader
        if f"{module}.weight" not in have and f"{module}.weight_packed" not in have:
            raise WeightError(f"scale tensor {module}{suffix!s} has no weight {module}.weight in the checkpoint")
        m = _EXPERT.match(module)
        if m:
            experts.add(m.group(1))
        elif f"{module}.weight_packed" in have or scheme.strategy == "none":
            raise WeightError(
                f"tensor {module}{suffix}: {module!r} is not a routed expert; FP4 (weight_packed) and "
                "scales without an 8-bit config group are read for routed experts only"
            )
        else:
            linears.add(module)
    return QuantPlan(scheme, tuple(sorted(linears, key=_natural)), tuple(sorted(experts, key=_natural)))


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _check_ignore(scheme: QuantScheme, modules: set[str], scaled: list[str]) -> None:
    for pattern in scheme.ignore:
        if not any(ignore_match(pattern, m) for m in modules):
            raise ConfigError(
                f"quantization_config ignore pattern {pattern!r} matches no module of the checkpoint "
                "(a typo, or a config written for another model)"
            )
    for module in scaled:
        if scheme.ignores(module):
            raise WeightError(
                f"tensor {module}.{scheme.scale_name!s}: module {module!r} is in the ignore list "
                "but is stored quantized"
            )


def swap_in(model: nn.Module, plan: QuantPlan, dtype: torch.dtype) -> QuantPlan:
    """Replace the planned modules in place; -> the plan with the unquantized linears listed."""
    for name in plan.linears:
        old = _get(model, name)
        if not isinstance(old, nn.Linear):
            raise WeightError(f"tensor {name}.{plan.scheme.scale_name}: {name!r} is not a linear layer")
        new = FP8Linear(old.in_features, old.out_features, plan.scheme, old.bias is not None, dtype, old.weight.device)
        model.set_submodule(name, new)
    for name in plan.experts:
        old = _get(model, name)
        e, two_i, d = old.gate_up_proj.shape
        cls = {"fp8": FP8Experts, "int4": INT4Experts}.get(plan.scheme.expert_dtype, FP4Experts)
        new = cls(d, e, two_i // 2, plan.scheme, old.gate_up_proj.device)
        new.impl = old.impl
        model.set_submodule(name, new)
    kept = tuple(n for n, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding, Gate))
    return QuantPlan(plan.scheme, plan.linears, plan.experts, kept)


def _get(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise WeightError(
            f"tensor {name}.weight: the checkpoint quantizes {name!r}, which this model does not have"
        ) from None


def densify(model: nn.Module, plan: QuantPlan, dtype: torch.dtype) -> None:
    for name in plan.experts:  # stored metadata checked against the config (INT4: weight_shape)
        check = getattr(model.get_submodule(name), "check_loaded", None)
        if check is not None:
            check(name)
    for name in plan.linears:
        if name.rsplit(".", 1)[-1] not in DENSE_AT_LOAD:
            continue
        q = model.get_submodule(name)
        dense = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None, device=q.weight.device, dtype=dtype)
        with torch.no_grad():
            dense.weight.copy_(q.dequantize(dtype))
            if q.bias is not None:
                dense.bias.copy_(q.bias)
        model.set_submodule(name, dense.requires_grad_(False))

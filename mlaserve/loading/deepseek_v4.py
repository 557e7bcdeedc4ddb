"""DeepSeek-V4 checkpoints -> models/deepseek_v4's module tree (the names: loading/deepseek_v4_names.py), and a
strict folder loader: every tensor used once, every parameter filled, every shape checked; errors name the
tensor and its file.

Accepted layouts (the optional leading `model.` is dropped first):
  released   embed.weight, head.weight, norm.weight, hc_head_{fn,base,scale},
             layers.N.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink},
             layers.N.attn.compressor.{wkv,wgate,ape,norm}, layers.N.attn.indexer.{wq_b,weights_proj},
             layers.N.attn.indexer.compressor.*, layers.N.ffn.gate.{weight,bias,tid2eid},
             layers.N.ffn.experts.E.{w1,w2,w3}, layers.N.ffn.shared_experts.{w1,w2,w3},
             layers.N.{attn_norm,ffn_norm}, layers.N.hc_{attn,ffn}_{fn,base,scale}, mtp.*
  save_pretrained (transformers 5.24 writes the released names back, with `model.` on most, `attn.norm` for
             attn.kv_norm, `hc_head.hc_*` and `embed_tokens`)
  module     the module names themselves (model.layers.N.self_attn.q_a_proj.weight, stacked experts)
Experts E: w1 (gate) and w3 (up) stack into mlp.experts.gate_up_proj[E] = [w1; w3], w2 into down_proj[E].
DeepSeek FP8 (quantization_config quant_method fp8, 128x128 e4m3 blocks, ue8m0 or fp32 scales): every module
with a `<module>.weight_scale_inv` is swapped for its quantized holder (quant/deepseek_v4.py, FP8Linear) before
the fill, and its stored bytes are copied as they are.
Expert parallelism (`experts=(e0, e1)`, distributed/expert_parallel.py): every MoE layer's routed experts are cut
to [e0, e1) on the meta device (before the FP8 / FP4 holders are made), the rank's expert tensors fill local ids
0 .. e1 - e0 - 1, and the other ranks' per-expert tensors are never read (counted in the report); a stacked
module-layout tensor is read whole and sliced.
mtp.j.* (num_nextn_predict_layers): with `mtp` (speculative="mtp") they fill the MTP layers
(models/deepseek_v4/mtp.py: released names mtp.j.{e_proj,h_proj,enorm,hnorm,norm,hc_head_*} and the block's
layer names, or the module names mtp.j.self_attn.* ...), strictly like the trunk; without it they are skipped
and reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mlaserve.config.deepseek_v4 import DeepseekV4Config
from mlaserve.config.model import ConfigError
from mlaserve.distributed.expert_parallel import cut_range
from mlaserve.kernels.registry import KernelContext, KernelPlan, plan_kernels
from mlaserve.loading.allocate import allocate
from mlaserve.loading.deepseek_v4_names import SCALE, Target, target
from mlaserve.loading.files import path_problem, read_json
from mlaserve.loading.safetensors_source import SafetensorsSource, WeightError
from mlaserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
from mlaserve.models.deepseek_v4.mtp import V4MTPLayer
from mlaserve.quant.config import parse_quantization
from mlaserve.quant.deepseek_v4 import swap_in_fp8
from mlaserve.quant.ggml_moe_block import attach_moe_blocks  # noqa: F401 -- registers the plan's "moe_block" op
from mlaserve.quant.plan import QuantPlan

_STORED = (torch.float8_e4m3fn, torch.int8)  # quantized codes: copied as stored (FP8 e4m3, packed FP4 e2m1)


@dataclass
class V4LoadReport:
    loaded: int = 0
    skipped: list[str] = field(default_factory=list)
    quant: QuantPlan | None = None  # an FP8 / FP4 folder: which modules hold stored blocks, which stayed float
    gguf: object = None  # a GGUF file: its V4GGUFPlan (quant/ggml_deepseek_v4.py), None when not kept
    bytes_read: int = 0  # tensor bytes read from the checkpoint (an expert-parallel rank: its experts only)
    hidden: int = 0  # expert tensors of other expert-parallel ranks, never read


_STACKS = ("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_scale", "experts.down_scale")


def load_into(model: DeepseekV4ForCausalLM, source, experts: tuple[int, int] | None = None) -> V4LoadReport:
    """Fill every parameter and buffer of `model` from `source` (names(), get(name), where(name)). experts: this
    expert-parallel rank's range [e0, e1) (the model's stacks already cut to it), None: every expert."""
    report = V4LoadReport()
    e0, e1 = experts or (0, model.config.moe.n_routed_experts)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    filled: dict[str, set] = {}
    for name in source.names():
        t = target(name, set(tensors))
        if t is None:
            report.skipped.append(name)
            continue
        where = f"{source.where(name)}: tensor {name!r}"
        if t.name not in tensors:
            raise WeightError(f"{where} -> {t.name}: the model built from config.json has no such tensor")
        dest = tensors[t.name]
        if t.expert is not None and experts is not None:
            if not e0 <= t.expert < e1 and t.expert < model.config.moe.n_routed_experts:
                report.hidden += 1  # another rank's expert: not read
                continue
            t = replace(t, expert=t.expert - e0)  # the rank's local id (one past its range: named below)
        value = source.get(name)
        if experts is not None and t.expert is None and t.name.endswith(_STACKS):
            value = value[e0:e1]  # a stacked tensor of every expert (module layout): the rank's rows
        if t.expert is None:
            view, key = dest, None
        else:
            if t.expert >= dest.shape[0]:
                raise WeightError(f"{where}: expert {t.expert + e0} >= n_routed_experts={e0 + dest.shape[0]}")
            view, key = _expert_view(dest, t), (t.expert, t.part)
        if tuple(value.shape) != tuple(view.shape):
            raise WeightError(f"{where}: shape {tuple(value.shape)} but {t.name} needs {tuple(view.shape)}")
        if not value.dtype.is_floating_point and dest.dtype.is_floating_point:
            raise WeightError(f"{where}: an integer tensor ({value.dtype}) where {t.name} holds floats")
        if (dest.dtype in _STORED or value.dtype in _STORED) and dest.dtype != value.dtype:
            # stored bytes are copied, never converted: a float weight is not quantized here, nor the reverse
            raise WeightError(f"{where}: stored as {value.dtype} but {t.name} holds {dest.dtype}")
        seen = filled.setdefault(t.name, set())
        if key in seen:
            raise WeightError(f"{where}: {t.name} is filled twice (two layouts of one tensor in the folder?)")
        seen.add(key)
        with torch.no_grad():
            view.copy_(value.to(view.dtype))
        report.loaded += 1
    held = e1 - e0
    for name in tensors:
        need = None
        if name.endswith(("experts.gate_up_proj", "experts.gate_up_scale")):
            need = {(e, p) for e in range(held) for p in ("w1", "w3")}
        elif name.endswith(("experts.down_proj", "experts.down_scale")):
            need = {(e, "w2") for e in range(held)}
        have = filled.get(name, set())
        if (need is None and not have) or (need is not None and have != need and have != {None}):
            gone = sorted((e + e0, part) for e, part in need - have) if need is not None else []
            missing = "" if need is None else f" (experts/parts missing: {gone[:4]}...)"
            raise WeightError(f"checkpoint has no tensor for {name}{missing}")
    return report


def _expert_view(dest: torch.Tensor, t: Target) -> torch.Tensor:
    """Expert t.expert's slice of a stacked tensor: w1 / w3 the gate / up rows of gate_up_proj (their scales
    the [e, 0] / [e, 1] grids of gate_up_scale), w2 down_proj[e] (down_scale[e])."""
    if t.name.endswith("gate_up_scale"):
        return dest[t.expert, 0 if t.part == "w1" else 1]
    if t.part == "w2":
        return dest[t.expert]
    inter = dest.shape[1] // 2
    return dest[t.expert, :inter] if t.part == "w1" else dest[t.expert, inter:]


def fp8_modules(names: list[str], module_names: set[str]) -> tuple[set[str], set[str]]:
    """The modules a DeepSeek FP8 checkpoint stores quantized (those with a scale tensor): linear modules, and
    the expert stacks of the layers whose routed experts are (all or none of a layer's)."""
    linears, experts = set(), set()
    for name in names:
        if not name.endswith(SCALE):
            continue
        t = target(name.removesuffix(SCALE) + ".weight", module_names)
        if t is None:
            continue
        if t.expert is None:
            linears.add(t.name.removesuffix(".weight"))
        else:
            experts.add(t.name.rpartition(".")[0])
    return linears, experts


def check_scheme(scheme, folder: Path) -> None:
    """The quantized forms V4 has holders for: DeepSeek FP8 blocks (`weight_scale_inv`), experts FP8 or FP4."""
    if scheme.method != "fp8" or scheme.strategy != "block" or scheme.scale_name != SCALE[1:]:
        raise ConfigError(
            f"{folder.name}/config.json: quantization_config: DeepSeek-V4 reads DeepSeek FP8 block checkpoints "
            f"only (e4m3 blocks with weight_scale_inv, experts fp8 or fp4), got {scheme.method} {scheme.strategy}"
        )


def load_folder(
    folder: str | Path, dtype: torch.dtype = torch.float32, mtp: bool = False, experts: tuple[int, int] | None = None
) -> tuple[DeepseekV4ForCausalLM, V4LoadReport]:
    """A Hugging Face folder (config.json + safetensors; float, or DeepSeek FP8 blocks kept in their stored
    form by the quantized holders) -> the model in `dtype`, eval mode. mtp: build and fill the MTP layer
    (`model.mtp[0]`; an error naming the folder when it has none). experts: an expert-parallel rank's range
    [e0, e1) of every MoE layer's routed experts (the MTP layer's too), the only ones it holds and reads."""
    folder = Path(folder)
    if path_problem(folder / "config.json") == "does not exist":
        raise ConfigError(f"{folder}: no config.json")
    raw = read_json(folder / "config.json", ConfigError)
    cfg = DeepseekV4Config.from_hf(raw, source=f"{folder.name}/config.json")
    scheme = parse_quantization(raw, f"{folder.name}/config.json")
    source = SafetensorsSource(folder)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
        if mtp:
            attach_mtp(model, source.names(), folder)
        if experts is not None:  # before the holders are made: they are made for the rank's experts only
            cut_range(model, *experts)
    holders: set[str] = set()
    plan = None
    if scheme is not None:
        check_scheme(scheme, folder)
        names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
        linears, stacks = fp8_modules(source.names(), names)
        swap_in_fp8(model, linears, stacks, scheme)
        holders = linears | stacks
        float_linears = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n not in holders}
        plan = QuantPlan(scheme, tuple(sorted(linears)), tuple(sorted(stacks)), tuple(sorted(float_linears)))
    model = allocate(model, "cpu")
    for name, p in model.named_parameters():
        # the reference keeps norms, sinks, position biases, mHC and the router bias in fp32 in any dtype;
        # a quantized holder keeps its stored form
        if not _kept_fp32(name) and name.rpartition(".")[0] not in holders:
            p.data = p.data.to(dtype)
    report = load_into(model, source, experts)
    report.quant, report.bytes_read = plan, source.bytes_read
    return model.eval(), report


# V4's own ops in the KernelPlan (not stored-weight holders): how the load report's kernels line names them
_OWN_OPS = {
    "sink_attention": ("attention softmax", "layers"),
    "hyper_connection": ("mHC mixing", "hyper-connections"),
    "norm": ("RMSNorm", "norms"),
    "moe_block": ("MoE decode step", "layers"),
    "v4_ffn": ("FFN sublayer", "layers"),
}


def plan_v4_kernels(
    model: torch.nn.Module, kernels: str, int8: int, bf16: int = 0, tiles: bool = False
) -> tuple[KernelPlan, str]:
    """The KernelPlan of a V4 model (kernels/registry.py; made at load, after any expert-parallel cut): its
    quantized holders (FP8 / FP4 folder: FP8Linear, FP8GroupedLinear, FP8V4Experts / FP4V4Experts; GGUF:
    GGUFLinear, GGUFGroupedLinear, GGUFV4Experts) take the engine's kernels, native where they have it, with the
    engine's prefill products (bf16: config/machine.BF16_BITS, tiles: PREFILL_TILES; GGUFLinear and the routed
    experts take them, as in the other GGUF models), and so does the attention's padded softmax with sinks (op
    sink_attention), the hyper-connections' mixing (hyper_connection) and the weighted RMSNorms (norm: the MLA models'
    native norm); the router has one implementation. -> the plan and the load report's line: the holders per class and implementation, V4's
    own ops' implementations, and the float routed experts' form (decided from the shapes)."""
    from mlaserve.models.deepseek_v4.moe import Experts

    plan = plan_kernels(model, KernelContext(kernels, int8, bf16, tiles))
    held: dict[str, int] = {}
    own: dict[str, dict[str, int]] = {op: {} for op in _OWN_OPS}  # V4's own ops: per op, implementation -> count
    for c in plan.choices:
        if c.op in own:
            own[c.op][c.impl] = own[c.op].get(c.impl, 0) + 1
            continue
        key = f"{type(model.get_submodule(c.module)).__name__} {c.impl}"
        held[key] = held.get(key, 0) + 1
    forms: dict[str, int] = {}
    for m in model.modules():
        if type(m) is Experts:  # float stacks: grouped_mm where rows are 16-byte aligned, else the loop
            forms[m.impl] = forms.get(m.impl, 0) + 1
    parts = [", ".join(f"{n} {k}" for k, n in sorted(held.items())) if held else "no quantized holders"]
    parts += [
        f"{what} {', '.join(f'{k} in {n} {unit}' for k, n in sorted(own[op].items()))}"
        for op, (what, unit) in _OWN_OPS.items()
        if own[op]
    ]
    parts += [f"float routed experts {', '.join(f'{n} {k}' for k, n in sorted(forms.items()))}"] if forms else []
    line = f"DeepSeek-V4 kernels (plan {plan.digest}): " + "; ".join(parts)
    return plan, line + (", int8 activations where the plan says" if int8 and held else "")


def attach_mtp(model: DeepseekV4ForCausalLM, names: list[str], where) -> None:
    """Build the checkpoint's first MTP layer as `model.mtp[0]` (drafts reuse it for every depth, as vLLM
    does); the strict fill then needs every one of its tensors. No mtp.0.* tensor: an error naming `where`."""
    if not any(n.removeprefix("model.").startswith("mtp.0.") for n in names):
        raise ConfigError(
            f"{where}: speculative='mtp' needs the checkpoint's MTP layer (mtp.0.e_proj, mtp.0.h_proj, ... of "
            f"num_nextn_predict_layers={model.config.num_nextn_predict_layers}); this checkpoint has none"
        )
    kinds = model.config.mtp_layer_kinds
    if kinds and kinds[0] != "sliding":
        raise ConfigError(
            f"{where}: config.json's compress_ratios gives the MTP layer the kind {kinds[0]!r}; the release's MTP "
            "block is a sliding-window layer (no compressor tensors), and a compressed MTP block is not built"
        )
    model.mtp = torch.nn.ModuleList([V4MTPLayer(model.config)])


_FP32 = ("norm", "sinks", "position_bias", "_hc.", "hc_head", "e_score_correction_bias", "layernorm")


def _kept_fp32(name: str) -> bool:
    return any(k in name for k in _FP32)


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    keep_blocks: bool = True,
    experts: tuple[int, int] | None = None,
):
    """A deepseek4 GGUF file (gguf/read/deepseek_v4.py: every key, name and shape checked) -> (the model in
    `dtype`, eval mode; its report; the opened file). keep_blocks: modules stored in a ggml block format keep
    their blocks in quant/ggml_deepseek_v4.py's holders (the report's `gguf` plan says which); else every
    tensor is dequantized to floats at load. experts: an expert-parallel rank's range [e0, e1): the model's
    expert stacks are cut to it on the meta device (so GGUFV4Experts holders are made for those experts only),
    and only their byte ranges of the stacked ffn_*_exps are read (V4GGUFTensors serves each expert as its
    slice of the stack; the report's bytes_read counts what the file handed out)."""
    from mlaserve.gguf.read.deepseek_v4 import load_v4_gguf
    from mlaserve.quant.ggml_deepseek_v4 import plan_v4_gguf, swap_in_v4_gguf
    from mlaserve.quant.ggml_plan import BlockSource

    ck = load_v4_gguf(path)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(ck.config)
        if experts is not None:  # before the holders are made: they are made for the rank's experts only
            cut_range(model, *experts)
    plan = plan_v4_gguf(ck.tensors, model) if keep_blocks else None
    holders: set[str] = set()
    if plan is not None:
        swap_in_v4_gguf(model, plan, dtype)
        holders = {module for module, _, _ in plan.kept}
    model = allocate(model, "cpu")
    for name, p in model.named_parameters():
        if not _kept_fp32(name) and name.rpartition(".")[0] not in holders:
            p.data = p.data.to(dtype)
    read_before = ck.file.bytes_read
    report = load_into(model, BlockSource(ck.tensors, plan.blocks) if plan is not None else ck.tensors, experts)
    report.skipped, report.bytes_read = list(ck.skipped), ck.file.bytes_read - read_before
    report.gguf = plan
    return model.eval(), report, ck

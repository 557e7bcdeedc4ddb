"""Fill a model from a tensor source, strictly: every checkpoint tensor used exactly once,
every parameter filled, every shape checked -- errors name the tensor and its file.

Named steps between the checkpoint layout and the model:
  stack_experts   mlp.experts.E.{gate,up,down}_proj.weight -> experts.gate_up_proj [E, 2I, D]
                  (gate rows first) and experts.down_proj [E, D, I]
  skip_mtp        model.layers.N for num_hidden_layers <= N < num_hidden_layers + num_nextn_predict_layers
                  (MTP / nextn heads) are skipped, reported; a layer beyond those is an error (the config
                  would otherwise load as a shallower model);
                  with speculative="mtp" they fill the model's mtp.{N - n}.* instead
  tie_embeddings  lm_head.weight shares embed_tokens.weight when the config ties them
  skip_prefixes   tensors under the family's skipped_tensor_prefixes (LongCat-Flash's model.mtp.*) are
                  skipped and reported; expert tensors a module declares unused (`unused_checkpoint_tensor`:
                  the identity experts' gate/up rows transformers saves) likewise
  optional        a module's OPTIONAL_TENSORS (LongCat's router correction bias) are zeros when the
                  checkpoint lacks them (as transformers initialises them), reported by name
  renames         the family's checkpoint names read as the model's (Family.checkpoint_renames: Kimi-Linear's
                  block_sparse_moe.experts.E.w1/w3/w2 -> mlp.experts.E.gate/up/down_proj); errors name the
                  checkpoint's tensor
  in_place        a source that maps its file (a GGUF with gguf_mmap) says which tensors are kept as they
                  come (`in_place(name)`): the parameter then becomes that view of the mapped file instead of
                  receiving a copy, and a routed-expert stack the file stores as one tensor (`stacked_blocks`)
                  becomes the module's stacked parameter where its slot is a whole parameter (GGUFExperts'
                  gate_proj / up_proj / down_proj; a float model's fused gate_up_proj interleaves two stored
                  tensors per expert, so it is filled by copies)
A source is anything with names(), get(name) and where(name) (safetensors folder or GGUF file).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from mlaserve.config.model import ModelConfig
from mlaserve.loading.safetensors_source import WeightError
from mlaserve.models.mtp import mtp_param_name

_EXPERT = re.compile(r"^((?:model\.layers|mtp)\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_PROJS = ("gate_proj", "up_proj", "down_proj")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class TensorSource(Protocol):
    """Also optional: release(name), called once a tensor is copied (a memory-mapped source drops the
    pages it read), get_slice(name, dim, start, stop) for tensor-parallel ranks, in_place(name) and
    stacked_blocks(names) (tensors kept as views of a mapped file, see the module docstring)."""

    def names(self) -> list[str]: ...
    def get(self, name: str) -> torch.Tensor: ...
    def where(self, name: str) -> str: ...


@dataclass
class LoadReport:
    loaded: int = 0
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unused_experts: int = 0  # of `skipped`: expert tensors their module declares unused
    bytes_read: int | None = None  # tensor bytes read from the checkpoint while filling (None: not counted)


def load_weights(model: nn.Module, source: TensorSource, cfg: ModelConfig, progress=None) -> LoadReport:
    """progress: optional callable(done, total) called as tensors are read (the CLI draws a bar)."""
    report = LoadReport()
    total, tick = len(source.names()), progress or (lambda done, total: None)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    if cfg.tie_word_embeddings:
        targets.pop("lm_head.weight", None)
    filled: set[str] = set()
    experts: dict[str, dict[tuple[str, int], str]] = {}
    _check_extra_layers(source, cfg)
    with_mtp = hasattr(model, "mtp")
    prefixes = cfg.family.skipped_tensor_prefixes if cfg.family is not None else {}
    skipped_by_prefix: dict[str, int] = {}
    renames = [(re.compile(p), r) for p, r in cfg.family.checkpoint_renames] if cfg.family is not None else []
    for name in source.names():
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is not None:  # a part of the checkpoint the engine does not build (LongCat's MTP layer)
            report.skipped.append(name)
            skipped_by_prefix[prefix] = skipped_by_prefix.get(prefix, 0) + 1
            continue
        layer = _LAYER.match(name)
        target = name
        for pattern, replacement in renames:
            target = pattern.sub(replacement, target)
        if layer and int(layer.group(1)) >= cfg.num_layers:
            if not with_mtp:
                report.skipped.append(name)  # MTP / nextn layers are run only for speculative decoding
                continue
            target = mtp_param_name(name, cfg)
        m = _EXPERT.match(target)
        if m:
            experts.setdefault(m.group(1), {})[(m.group(3), int(m.group(2)), m.group(4))] = name
            continue
        _copy(name, source, targets, filled, target)
        report.loaded += 1
        tick(report.loaded, total)
    for prefix, parts in experts.items():
        report.loaded += _stack_experts(prefix, parts, source, model, filled, report)
        tick(report.loaded, total)
    optional = {
        f"{mod}.{attr}" if mod else attr
        for mod, module in model.named_modules()
        for attr in getattr(module, "OPTIONAL_TENSORS", ())
    }
    absent = sorted(optional & (set(targets) - filled))
    if absent:  # the model was allocated without initialising (meta, then to_empty): zero them here
        with torch.no_grad():
            for name in absent:
                targets[name].zero_()
        filled.update(absent)
        report.notes.append(
            f"{len(absent)} optional tensor(s) absent, zeros used (as transformers initialises them): "
            + ", ".join(absent[:4])
            + (" ..." if len(absent) > 4 else "")
        )
    missing = sorted(set(targets) - filled)
    if missing:
        raise WeightError(
            f"checkpoint is missing {len(missing)} tensor(s) the model needs: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        report.notes.append("lm_head.weight tied to model.embed_tokens.weight (tie_word_embeddings)")
    for prefix, n in skipped_by_prefix.items():
        report.notes.append(f"skipped {n} tensor(s) under {prefix}: {prefixes[prefix]}")
    layer_skips = len(report.skipped) - sum(skipped_by_prefix.values()) - report.unused_experts
    if layer_skips:
        report.notes.append(f"skipped {layer_skips} MTP/nextn tensor(s) of layers >= {cfg.num_layers}")
    return report


def _check_extra_layers(source: TensorSource, cfg: ModelConfig) -> None:
    """Layers past num_hidden_layers are MTP heads only when num_nextn_predict_layers says so."""
    end = cfg.num_layers + cfg.num_nextn_predict_layers
    extra = [n for n in source.names() if (m := _LAYER.match(n)) and int(m.group(1)) >= end]
    if extra:
        raise WeightError(
            f"{source.where(extra[0])}: {len(extra)} tensor(s) of layers >= {end} (num_hidden_layers="
            f"{cfg.num_layers} + num_nextn_predict_layers={cfg.num_nextn_predict_layers}), e.g. "
            f"{', '.join(repr(n) for n in extra[:3])}: num_hidden_layers is smaller than the checkpoint's layers"
        )


def _copy(name: str, source: TensorSource, targets: dict, filled: set[str], target: str | None = None) -> None:
    target = target or name  # the parameter's name in the model (MTP layers are renamed to mtp.{j}.*)
    if target not in targets:
        raise WeightError(f"{source.where(name)}: unexpected tensor {name!r} (no such parameter in the model)")
    if target in filled:
        raise WeightError(f"{source.where(name)}: tensor {name!r} appears twice")
    tensor = source.get(name)
    _check_stored_dtype(name, tensor.dtype, targets[target].dtype, source)
    _check_shape(name, tuple(tensor.shape), tuple(targets[target].shape), source)
    with torch.no_grad():
        kept = _keeps(source, name, tensor, targets[target])
        if kept:
            targets[target].data = tensor  # the mapped file's bytes are the weight: no copy
        else:
            targets[target].copy_(tensor)
    filled.add(target)
    if not kept:  # a kept view's pages are the weight's: they stay
        _release(source, name)


def _keeps(source: TensorSource, name: str, tensor: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether the parameter becomes `tensor` itself: the source offers it in place, and it has the
    parameter's dtype, device and a contiguous layout (a column slice of a rank is copied instead)."""
    in_place = getattr(source, "in_place", None)
    return (
        in_place is not None
        and in_place(name)
        and tensor.dtype == target.dtype
        and tensor.device == target.device
        and tensor.is_contiguous()
    )


def _release(source: TensorSource, name: str) -> None:
    """A memory-mapped source (GGUF) drops the file pages of a tensor once it is copied, so that the
    peak memory of a load is the model's, not the model's plus the file's."""
    release = getattr(source, "release", None)
    if release is not None:
        release(name)


def _stack_experts(
    prefix: str,
    parts: dict[tuple[str, int, str], str],
    source: TensorSource,
    model: nn.Module,
    filled: set[str],
    report: LoadReport,
) -> int:
    """parts: (proj, expert, suffix) -> name. The experts module says where each suffix goes
    (`checkpoint_slots`: "weight", and a quantized holder's scales / packed values), and which tensors it does
    not use (`unused_checkpoint_tensor`: skipped, reported)."""
    any_name = next(iter(parts.values()))
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        module = None
    if not hasattr(module, "checkpoint_slots"):
        raise WeightError(
            f"{source.where(any_name)}: unexpected expert tensor {any_name!r} (layer has no routed experts)"
        )
    dst = module.checkpoint_slots()
    n_exp = next(iter(dst.values()))[0].shape[0]
    unused = getattr(module, "unused_checkpoint_tensor", lambda proj, e: None)
    dropped = [k for k in parts if unused(k[0], k[1]) is not None]
    if dropped:
        names = sorted(parts.pop(k) for k in dropped)
        report.skipped.extend(names)
        report.unused_experts += len(names)
        report.notes.append(f"skipped {len(names)} unused expert tensor(s) of {prefix}: {unused(*dropped[0][:2])}")
    for e, proj, suffix in itertools.product(range(n_exp), _PROJS, dst):
        if (proj, e, suffix) not in parts:
            # an expert-parallel rank lists its experts from 0 (distributed/expert_source.py): name the checkpoint's
            name = getattr(source, "checkpoint_name", lambda n: n)(f"{prefix}.{e}.{proj}.{suffix}")
            raise WeightError(f"checkpoint is missing {name}")
    extra = [parts[k] for k in parts if k[1] >= n_exp or k[2] not in dst]
    if extra:
        raise WeightError(
            f"{source.where(extra[0])}: unexpected tensor {extra[0]!r} (the layer has {n_exp} experts "
            f"holding {sorted(dst)})"
        )
    kept = _keep_stacks(prefix, parts, source, dst, n_exp)
    with torch.no_grad():
        for (proj, e, suffix), name in parts.items():
            if (proj, suffix) in kept:
                continue
            target = dst[suffix][_PROJS.index(proj)][e]
            tensor = source.get(name)
            _check_stored_dtype(name, tensor.dtype, target.dtype, source)
            _check_shape(name, tuple(tensor.shape), tuple(target.shape), source)
            target.copy_(tensor)
            _release(source, name)
    filled.update(f"{prefix}.{n}" for n, _ in list(module.named_parameters()) + list(module.named_buffers()))
    return len(parts)


def _keep_stacks(
    prefix: str, parts: dict[tuple[str, int, str], str], source: TensorSource, dst: dict, n_exp: int
) -> set[tuple[str, str]]:
    """(proj, suffix) stacks kept as views of the mapped file: the module's slot is a whole parameter and
    the source stores experts 0..E-1 as one tensor of its shape. The others are copied expert by expert."""
    stacked = getattr(source, "stacked_blocks", None)
    kept: set[tuple[str, str]] = set()
    if stacked is None:
        return kept
    for proj, suffix in itertools.product(_PROJS, dst):
        slot = dst[suffix][_PROJS.index(proj)]
        if not isinstance(slot, nn.Parameter):  # a slice of a fused parameter (gate_up_proj's halves)
            continue
        names = [parts[(proj, e, suffix)] for e in range(n_exp)]
        whole = stacked(names)
        if whole is None or whole.dtype != slot.dtype or whole.device != slot.device:
            continue
        _check_shape(names[0], tuple(whole.shape), tuple(slot.shape), source)
        with torch.no_grad():
            slot.data = whole  # kept: its pages are the weight's, not released
        kept.add((proj, suffix))
    return kept


def _check_stored_dtype(name: str, got: torch.dtype, want: torch.dtype, source: TensorSource) -> None:
    """Quantized bytes are copied as stored, never converted: a float8 (or int8-packed fp4) tensor
    needs a target of its dtype (its module planned as quantized because its scale tensor exists),
    and a float tensor a float target."""
    if _storage_kind(got) == _storage_kind(want):
        return
    got_s, want_s = str(got).removeprefix("torch."), str(want).removeprefix("torch.")
    if want == torch.uint8 and _storage_kind(got) == "float":  # a GGUF holder (quant/ggml_linear.py)
        raise WeightError(
            f"{source.where(name)}: tensor {name!r} came as {got_s}, but its module keeps GGUF blocks (uint8 bytes)"
        )
    if "float" not in (_storage_kind(got), _storage_kind(want)):
        raise WeightError(
            f"{source.where(name)}: tensor {name!r} is stored as {got_s}, the quantization_config implies "
            f"{want_s} (int8 = packed fp4: expert_dtype 'fp4')"
        )
    if _storage_kind(got) != "float":
        raise WeightError(
            f"{source.where(name)}: tensor {name!r} is stored as {got_s} but the "
            "checkpoint has no scale tensor for it (weight_scale_inv / weight_scale), or no quantization_config"
            + (" (or no expert_dtype 'fp4')" if got == torch.int8 else "")
        )
    raise WeightError(
        f"{source.where(name)}: tensor {name!r} is stored as {got_s} but has a scale tensor, so it should be {want_s}"
    )


def _storage_kind(dtype: torch.dtype) -> str:
    if dtype == torch.float8_e4m3fn:
        return "fp8"
    return "float" if dtype.is_floating_point else str(dtype)


def _check_shape(name: str, got: tuple, want: tuple, source: TensorSource) -> None:
    if got != want:
        raise WeightError(
            f"{source.where(name)}: tensor {name!r} has shape {list(got)}, the config implies {list(want)}"
        )

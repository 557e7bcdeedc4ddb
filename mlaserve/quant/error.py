"""What an FP8 / FP4 safetensors checkpoint's storage costs, per block of the model, read from the
files alone: the safetensors counterpart of observability/weight_error.py (same model, same use:
`mlaserve verify FP8_FOLDER --against ORIGINAL` allows each block its weights' rounding error).

Notation
  W = value(Q) * S       a quantized weight, dequantized (fp8_block.py, fp4_group.py, int4_group.py)
  step(x)                the grid spacing of Q's format around the stored value x, times its scale:
                           e4m3: 2^(E - 10) for exponent field E >= 1, 2^-9 for subnormals (E = 0)
                           e2m1: 0.5 for |v| < 2, 1 for 2 <= |v| < 4, 2 for |v| >= 4
                           int4 (pack-quantized): 1, a uniform grid
  err^2(W) = sum step^2 / 12          rounding to the nearest level: uniform in +-step/2
  e(W)     = sqrt(err^2(W) / ||W||^2) relative RMS error; float tensors kept as bf16 / f16:
             u / sqrt(3) (u = 2^-8 / 2^-11), f32: 0 -- weight_error.py's rule
  e(block) = sum of e(W) over the block's tensors ("embed", "layer.i.attn", "layer.i.mlp", "logits")
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mlaserve.config import families
from mlaserve.loading.files import read_json
from mlaserve.loading.safetensors_source import SafetensorsSource
from mlaserve.loading.text_part import TextPartSource
from mlaserve.quant import fp4_group, fp8_block, int4_group
from mlaserve.quant.config import QuantScheme

_FLOAT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.")
_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_global_scale", ".input_global_scale", ".weight_shape")


def block_of(name: str, num_layers: int) -> str | None:
    if name.startswith("model.embed_tokens."):
        return "embed"
    if name.startswith(("lm_head.", "model.norm.")):
        return "logits"
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) >= num_layers:
        return None
    return f"layer.{m.group(1)}.{'attn' if m.group(2) == 'self_attn' else 'mlp'}"


def e4m3_step(q: torch.Tensor) -> torch.Tensor:
    """Grid spacing of each e4m3 value, unscaled (fp32, Q's shape)."""
    exponent = (q.view(torch.uint8).to(torch.int32) >> 3) & 0xF
    return torch.exp2((exponent.clamp(min=1) - 10).float())


def e2m1_step(codes: torch.Tensor) -> torch.Tensor:
    exponent = ((codes & 0x7) >> 1).to(torch.int32)
    return torch.exp2((exponent.clamp(min=1) - 2).float())


def relative_error(w: torch.Tensor, step: torch.Tensor) -> float:
    norm2 = float(w.double().pow(2).sum())
    return 0.0 if norm2 == 0 else (float(step.double().pow(2).sum()) / 12.0 / norm2) ** 0.5


def tensor_error(source: SafetensorsSource, name: str, scheme: QuantScheme) -> tuple[str, float]:
    """-> (storage type, e(W)) of one weight tensor of the folder."""
    module = name.rsplit(".", 1)[0]
    names = set(source.names())
    if name.endswith(".weight_packed") and scheme.expert_dtype == "int4":
        packed, s = source.get(name), source.get(f"{module}.weight_scale").float()
        w = int4_group.dequantize_reference(packed, s, scheme.group_size)
        return "INT4", relative_error(w, s.repeat_interleave(scheme.group_size, -1))
    if name.endswith(".weight_packed") or source.get(name).dtype == torch.int8:
        return "FP4", _fp4_error(source, module, names)
    t = source.get(name)
    if t.dtype == fp8_block.FP8:
        s = source.get(f"{module}.{scheme.scale_name}").float()
        block = scheme.block_of(*t.shape)
        s = s.view(fp8_block.scale_blocks(*t.shape, block))
        full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: t.shape[0], : t.shape[1]]
        return "F8_E4M3", relative_error(t.float() * full, e4m3_step(t) * full)
    kind = str(t.dtype).removeprefix("torch.").upper()
    return kind, _FLOAT_ROUNDOFF.get(t.dtype, 0.0) / 3**0.5 if float(t.double().pow(2).sum()) > 0 else 0.0


def _fp4_error(source: SafetensorsSource, module: str, names: set[str]) -> float:
    packed_name = f"{module}.weight_packed" if f"{module}.weight_packed" in names else f"{module}.weight"
    packed = source.get(packed_name)
    if f"{module}.weight_scale_inv" in names:
        s, group = source.get(f"{module}.weight_scale_inv").float(), fp4_group.GROUP
    else:
        s = source.get(f"{module}.weight_scale")
        glob = source.get(f"{module}.weight_global_scale") if f"{module}.weight_global_scale" in names else None
        s, group = (torch.exp2(s.float() - 127), 32) if glob is None else (s.float() / glob.float(), 16)
    full = s.repeat_interleave(group, -1)[..., : packed.shape[-1] * 2]
    w = fp4_group.dequantize_reference(packed, s, group)
    return relative_error(w, e2m1_step(fp4_group.unpack_codes(packed)) * full)


def folder_errors(
    folder: str | Path, scheme: QuantScheme, num_layers: int
) -> tuple[dict[str, float], dict[str, dict[str, int]]]:
    """-> (e(block), storage type counts per block) over the folder's weight tensors."""
    source = SafetensorsSource(folder)
    wrapper = families.by_model_type((read_json(Path(folder) / "config.json", ValueError) or {}).get("model_type"))
    if wrapper is not None and wrapper.text_config:  # the text model's tensors, under their own names
        source = TextPartSource(source, wrapper)
    errors: dict[str, float] = {}
    types: dict[str, dict[str, int]] = {}
    for name in source.names():
        block = block_of(name, num_layers)
        if block is None or name.endswith(_SUFFIXES):
            continue
        kind, e = tensor_error(source, name, scheme)
        errors[block] = errors.get(block, 0.0) + e
        types.setdefault(block, {}).setdefault(kind, 0)
        types[block][kind] += 1
    return errors, {b: dict(sorted(c.items())) for b, c in types.items()}

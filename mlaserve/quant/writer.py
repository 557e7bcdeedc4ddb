"""Write a Hugging Face folder as an FP8 checkpoint in a release's layout (DeepSeek FP8 block
format or compressed-tensors), quantizing as the releases do (fp8_block.quantize: block amax / 448).

Quantized: every 2-D `*.weight` of a linear layer (experts one by one, in the checkpoint's per-expert
layout) except the modules the releases keep: embeddings, lm_head, the MoE router (`mlp.gate`)
and the DSA indexer's `weights_proj`. Everything else is stored as `keep_dtype` (bf16 in releases).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from mlaserve.loading.safetensors_source import SafetensorsSource
from mlaserve.quant import fp4_group, fp8_block

ROUTED_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
KEPT = ("model.embed_tokens", "lm_head", "re:.*mlp\\.gate$", "re:.*weights_proj$")
FORMATS = ("fp8", "compressed-tensors")


def quantization_config(
    fmt: str, block: tuple[int, int] | None, ignore: list[str] = (), experts: str = "fp8", scale_fmt: str = "float"
) -> dict:
    """The config.json entry of each format (block None: compressed-tensors channel strategy);
    ignore: the kept modules' patterns (compressed-tensors lists them)."""
    if fmt == "fp8":
        out = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "activation_scheme": "dynamic"}
        out |= {"scale_fmt": scale_fmt} if scale_fmt != "float" else {}
        return out | ({"expert_dtype": "fp4"} if experts == "fp4" else {})
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    weights |= {"strategy": "block", "block_structure": list(block)} if block else {"strategy": "channel"}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": list(ignore),
    }


def _kept_by(module: str) -> list[str]:
    return [p for p in KEPT if (re.match(p[3:], module) if p.startswith("re:") else p == module)]


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    return name.endswith(".weight") and len(shape) == 2 and not _kept_by(name.removesuffix(".weight"))


def write_fp8_folder(
    src: str | Path,
    dst: str | Path,
    fmt: str = "fp8",
    block: tuple[int, int] | None = (128, 128),
    keep_dtype: torch.dtype = torch.bfloat16,
    experts: str = "fp8",
    scale_fmt: str = "float",
) -> dict[str, int]:
    """src HF folder -> dst FP8 folder (config.json with quantization_config, one model.safetensors,
    the other files copied). experts "fp4": routed experts as packed e2m1 with group-32 scales
    (DeepSeek-V4 style, fmt "fp8" only); scale_fmt "ue8m0": power-of-two scales stored as
    float8_e8m0fnu. -> {"quantized": n, "kept": m} tensor counts."""
    if fmt not in FORMATS or (experts == "fp4" and fmt != "fp8"):
        raise ValueError(f"format must be one of {FORMATS} (fp4 experts: 'fp8' only), got {fmt!r}")
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    source = SafetensorsSource(src)
    out, counts = _quantized_tensors(source, fmt, block, keep_dtype, experts, scale_fmt)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    ignore = {p for n in source.names() for p in _kept_by(n.rsplit(".", 1)[0])}
    kept = [p for p in KEPT if p in ignore]
    config["quantization_config"] = quantization_config(fmt, block, kept, experts, scale_fmt)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    return counts


def _quantized_tensors(source, fmt, block, keep_dtype, experts, scale_fmt) -> tuple[dict, dict[str, int]]:
    out, counts = {}, {"quantized": 0, "kept": 0}
    scale_name = "weight_scale_inv" if fmt == "fp8" else "weight_scale"
    pow2 = scale_fmt == "ue8m0"
    for name in source.names():
        t = source.get(name)
        if not is_quantized(name, tuple(t.shape)):
            out[name] = t.to(keep_dtype) if t.is_floating_point() else t
            counts["kept"] += 1
            continue
        if experts == "fp4" and ROUTED_EXPERT.match(name):
            q, s = fp4_group.quantize(t, pow2=pow2)
        else:
            q, s = fp8_block.quantize(t, block or (1, t.shape[1]), pow2=pow2)
        out[name], out[name.removesuffix("weight") + scale_name] = q, s.to(torch.float8_e8m0fnu) if pow2 else s
        counts["quantized"] += 1
    return out, counts

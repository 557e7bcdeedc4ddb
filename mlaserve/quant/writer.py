"""Write a Hugging Face folder as an FP8 checkpoint in a release's layout (DeepSeek FP8 block
format or compressed-tensors), quantizing as the releases do (fp8_block.quantize: block amax / 448).

Quantized: every 2-D `*.weight` of a linear layer (experts one by one, in the checkpoint's per-expert
layout) except the modules the releases keep: embeddings, lm_head, the MoE router (`mlp.gate`)
and the DSA indexer's `weights_proj` (DeepSeek-V4 names: `head`, `ffn.gate`, the compressors' wkv / wgate). Everything else is stored as `keep_dtype` (bf16 in releases).
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

# routed experts, in the MLA families' layout and in DeepSeek-V4's released one (ffn.experts.E.w1|w2|w3)
ROUTED_EXPERT = re.compile(
    r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"
    r"|^(model\.)?layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$"
)
KEPT = ("model.embed_tokens", "lm_head", "re:.*mlp\\.gate$", "re:.*weights_proj$")
# DeepSeek-V4's released layout keeps these too: its output head, router (ffn.gate) and the compressors'
# projections (bf16 in the release: transformers' _keep_in_fp32_modules); the patterns match no MLA name.
KEPT += ("head", "re:.*ffn\\.gate$", "re:.*compressor\\.(wkv|wgate)$")
FORMATS = ("fp8", "compressed-tensors")
CT_FP4 = {"nvfp4": ("tensor_group", 16), "mxfp4": ("group", 32)}  # compressed-tensors 4-bit expert groups


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
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    if experts in CT_FP4:
        strategy, size = CT_FP4[experts]
        fp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": strategy, "group_size": size}
        groups["group_1"] = {
            "targets": ["re:.*mlp\\.experts\\..*"],
            "weights": fp4,
            "format": f"{experts}-pack-quantized",
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision" if experts in CT_FP4 else "float-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
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
    if fmt not in FORMATS or (experts == "fp4" and fmt != "fp8") or (experts in CT_FP4 and fmt == "fp8"):
        raise ValueError(
            f"format must be one of {FORMATS} (experts 'fp4': 'fp8' only; 'nvfp4'/'mxfp4': compressed-tensors), "
            f"got {fmt!r} with experts {experts!r}"
        )
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
        if experts in CT_FP4 and ROUTED_EXPERT.match(name):
            out |= _ct_fp4_tensors(name.removesuffix(".weight"), t, experts)
            counts["quantized"] += 1
            continue
        if experts == "fp4" and ROUTED_EXPERT.match(name):
            q, s = fp4_group.quantize(t, pow2=pow2)
        else:
            q, s = fp8_block.quantize(t, block or (1, t.shape[1]), pow2=pow2)
        out[name], out[name.removesuffix("weight") + scale_name] = q, s.to(torch.float8_e8m0fnu) if pow2 else s
        counts["quantized"] += 1
    return out, counts


def _ct_fp4_tensors(module: str, w: torch.Tensor, variant: str) -> dict[str, torch.Tensor]:
    """compressed-tensors' 4-bit layout: NVFP4 global = 448 * 6 / amax(W), group scale
    e4m3(amax_g / 6 * global), W ~= value * scale / global (group 16); MXFP4 scale
    2^ceil(log2(amax_g / 6)) stored as its e8m0 byte (group 32)."""
    if variant == "nvfp4":
        amax = w.float().abs().amax()
        glob = (fp8_block.E4M3_MAX * fp4_group.E2M1_MAX / amax if amax > 0 else torch.tensor(1.0)).reshape(1)
        scale = (fp4_group.group_amax(w, 16) / fp4_group.E2M1_MAX * glob).to(fp8_block.FP8)
        codes = fp4_group.encode(w, scale.float() / glob, 16)
        extra = {"weight_global_scale": glob.float()}
    else:
        s = fp4_group.group_amax(w, 32) / fp4_group.E2M1_MAX
        exp = torch.ceil(torch.log2(torch.where(s > 0, s, torch.ones_like(s))))
        codes, scale, extra = fp4_group.encode(w, torch.exp2(exp), 32), (exp + 127).to(torch.uint8), {}
    tensors = {"weight_packed": codes.view(torch.uint8), "weight_scale": scale} | extra
    return {f"{module}.{k}": v for k, v in tensors.items()}

"""Scan weights for NaN/Inf (like llama.cpp's --check-tensors): every model tensor, and for a GGUF
file every block scale of its quantized tensors, so a bad file is named before it serves NaN logits.

Notation: a quantized ggml tensor is n_blocks blocks of `type_size` bytes; each block holds one or
two fp16 scales (d, and dmin / m for the "_1" and K types) at fixed byte offsets, then the quants.
A non-finite scale poisons its whole block of values; the scan reports the block index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mlaserve.gguf.quants import GGML_TYPES

# ggml type name -> byte offsets of the fp16 scales inside one block (ggml-common.h block layouts)
SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),  # scales[16] qs[64] d dmin
    "Q3_K": (108,),  # hmask[32] qs[64] scales[12] d
    "Q4_K": (0, 2),  # d dmin scales[12] qs[128]
    "Q5_K": (0, 2),
    "Q6_K": (208,),  # ql[128] qh[64] scales[16] d
    "MXFP4": (),  # e qs[16]: an e8m0 byte, every value finite (ggml reads 255 as 2^127); an Inf value is found
    "IQ2_XXS": (0,),  # d, then codes and sub-block scales (the i-quants of ggml-common.h)
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ3_XXS": (0,),
    "IQ3_S": (0,),
    "IQ1_S": (0,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "IQ1_M": (),  # qs[32] qh[16] scales[8]: its fp16 d is spread over the top nibbles of the scales; the value scan
    "TQ1_0": (52,),  # qs[48] qh[4] d
    "TQ2_0": (64,),  # qs[64] d
}  # by scan_gguf's value scan (MXFP4, IQ1_M)
MAX_LISTED = 8  # block indices listed per tensor; the count is always given


@dataclass(frozen=True)
class BadTensor:
    name: str
    detail: str  # "3 NaN, 0 Inf of 4096 values" or "block scale NaN/Inf in blocks 0, 7 (2 of 64)"

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


def scan_model(model: nn.Module) -> list[BadTensor]:
    """Every parameter and buffer with a NaN or Inf, by its HF name."""
    bad = []
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        with torch.no_grad():
            if t.dtype == torch.float8_e4m3fn:  # no isinf kernel; e4m3fn has no Inf, NaN is s.1111.111
                n_nan, n_inf = int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum()), 0
            else:
                n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if n_nan or n_inf:
            bad.append(BadTensor(name, f"{n_nan} NaN, {n_inf} Inf of {t.numel()} values"))
    return bad


def scan_gguf_scales(gf) -> list[BadTensor]:
    """Every quantized tensor of a GGUFFile whose block scales hold NaN/Inf, with the block indices."""
    bad = []
    for name, info in gf.tensors.items():
        offsets = SCALE_OFFSETS.get(info.type_name)
        if offsets is None:
            continue
        size = GGML_TYPES[info.ggml_type].type_size
        blocks = gf.raw(name).reshape(-1, size)
        finite = torch.ones(blocks.shape[0], dtype=torch.bool)
        for off in offsets:
            scale = blocks[:, off : off + 2].contiguous().view(torch.float16).reshape(-1)
            finite &= torch.isfinite(scale)
        idx = (~finite).nonzero().reshape(-1).tolist()
        if idx:
            shown = ", ".join(map(str, idx[:MAX_LISTED])) + (", ..." if len(idx) > MAX_LISTED else "")
            bad.append(
                BadTensor(
                    f"{gf.path.name}:{name}", f"block scale NaN/Inf in blocks {shown} ({len(idx)} of {len(finite)})"
                )
            )
    return bad


def scan_gguf(gf) -> list[BadTensor]:
    """A GGUF file, independent of loading it: each block scale, then each tensor's values
    (dequantized), by GGUF tensor name."""
    bad = scan_gguf_scales(gf)
    scaled = {b.name for b in bad}
    for name in gf.tensors:
        key = f"{gf.path.name}:{name}"
        if key in scaled:
            continue  # its values are NaN because of the scales already named
        t = gf.tensor(name)
        if t.is_floating_point():
            n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            if n_nan or n_inf:
                bad.append(BadTensor(key, f"{n_nan} NaN, {n_inf} Inf of {t.numel()} values"))
    return bad


def format_bad(bad: list[BadTensor]) -> str:
    return f"{len(bad)} tensor(s) hold NaN/Inf:\n  " + "\n  ".join(map(str, bad))

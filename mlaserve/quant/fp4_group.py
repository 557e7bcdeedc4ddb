"""FP4 (e2m1) weights with per-row group scales, two values per byte: the routed experts of
DeepSeek-V4-style releases (quantization_config quant_method "fp8", expert_dtype "fp4").

Notation
  W  [..., N, K]        a weight (experts: [E, N, K]); K even
  P  [..., N, K/2]      int8 bytes: element 2j in the low nibble, 2j+1 in the high nibble
  c  4-bit code s.ee.m  e2m1 value (-1)^s * (e == 0 ? m/2 : 2^(e-1) * (1 + m/2)):
                        0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
  S  [..., N, ceil(K/g)] fp32 scale per row and group of g = 32 columns (the last group partial)
  W ~= value(c) * S[n, k // g]             (dequantize)
  S = amax(|W| over the group) / 6,  c = the nearest e2m1 value of W / S (ties to the even code)
A zero group gets S = 1.

Fast dequantizer: the code's bits placed as s.0ee.m000000000 of an fp16 give exactly value * 2^-14
(exponent biases 1 and 15; the e == 0 codes land on fp16 subnormals with the same mantissa); the
fp16 -> fp32 conversion is exact, then * (S * 2^14) rounds once, like value * S.
"""

from __future__ import annotations

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
_POW14 = 2.0**14


def scale_groups(k: int, group: int = GROUP) -> int:
    return -(-k // group)


def _expand(s: torch.Tensor, k: int, group: int) -> torch.Tensor:
    return s.float().repeat_interleave(group, dim=-1)[..., :k]


def quantize(w: torch.Tensor, group: int = GROUP, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., N, K] float -> (P [..., N, K/2] int8, S [..., N, ceil(K/g)] fp32); pow2 (ue8m0
    scales, MXFP4): S rounded up to a power of two, so |W / S| stays <= 6."""
    amax = group_amax(w, group)
    s = amax / torch.full_like(amax, E2M1_MAX)  # a tensor divisor: exact on CUDA too (see fp8_block.quantize)
    s = torch.where(s > 0, s, torch.ones_like(s))
    if pow2:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    return encode(w, s, group), s


def group_amax(w: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """[..., N, K] -> [..., N, ceil(K/g)]: amax(|W|) per row and group of g columns."""
    return torch.stack([c.abs().amax(dim=-1) for c in w.float().split(group, dim=-1)], dim=-1)


def encode(w: torch.Tensor, s: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The nearest e2m1 codes of W / S (a zero scale encodes zeros), packed -> int8 [..., N, K/2]."""
    k = w.shape[-1]
    if k % 2:
        raise ValueError(f"FP4 packs two values per byte: the last dim must be even, got {k}")
    s = _expand(s, k, group)
    scaled = w.float() / torch.where(s > 0, s, torch.ones_like(s))
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=w.device)
    # nearest magnitude (|W / S| > 6 clamps to 6); on a tie the lower code, whose mantissa bit is 0
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    code = code | ((scaled < 0) & (code > 0)).to(code.dtype) << 3
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8).view(torch.int8).contiguous()


def unpack_codes(p: torch.Tensor) -> torch.Tensor:
    """P int8 or uint8 [..., N, K/2] -> codes uint8 [..., N, K] (low nibble first)."""
    u = p.view(torch.uint8)
    return torch.stack([u & 0xF, u >> 4], dim=-1).flatten(-2)


def dequantize_reference(p: torch.Tensor, s: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The oracle: a 16-entry table lookup times the expanded scale -> fp32 [..., N, K]."""
    codes = unpack_codes(p)
    values = torch.tensor(E2M1_VALUES, device=codes.device)[codes.long()]
    return values * _expand(s, codes.shape[-1], group)


def dequantize(p: torch.Tensor, s: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """Fast: fp32 [..., N, K], equal to dequantize_reference bit for bit."""
    c = unpack_codes(p).to(torch.int16)
    h = ((c & 0x8) << 12) | ((c & 0x7) << 9)
    w = h.view(torch.float16).float()
    k = w.shape[-1]
    if k % group == 0:
        w.unflatten(-1, (k // group, group)).mul_(s.float()[..., None] * _POW14)
    else:
        w.mul_(_expand(s, k, group) * _POW14)
    return w

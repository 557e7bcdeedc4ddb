"""FP8 (e4m3) block-scaled weights: the quantizer, the reference dequantizer and the fast one.

Notation
  W  [..., N, K]   a weight (or a stack of them: experts [E, N, K]), N out, K in features
  (bn, bk)         block size; channel strategy = (1, K), tensor strategy = (N, K)
  Q  [..., N, K]   float8_e4m3fn values
  S  [..., ceil(N/bn), ceil(K/bk)] fp32 per-block scale; edge blocks are partial
  W ~= Q * S[n // bn, k // bk]             (dequantize)
  S = amax(|W| over the block) / 448,  Q = e4m3(W / S)   (quantize; 448 = e4m3's largest finite)
A zero block gets S = 1 (any S dequantizes its zeros exactly, and W / 0 would be NaN).

The fast dequantizer avoids torch's float8 -> float cast (measured ~5x slower on CPU) with integer
bit moves: e4m3 bits s.eeee.mmm placed as s.0eeee.mmm0000000 of an fp16 give exactly Q * 2^-8 (the
exponent biases are 7 and 15; e4m3 subnormals land on fp16 subnormals with the same mantissa); the
hardware fp16 -> fp32 conversion is exact and yields normal fp32 numbers, so W = fp32 * (S * 2^8)
multiplies no subnormal operand (placing the bits straight into fp32/bf16 would: 6x slower on x86).
The product rounds once, like Q.float() * S: both dequantizers agree bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn
_POW8 = 2.0**8
_FP16_MASK = -16512  # int16 0xBF80: the sign bit and the 7 bits eeeemmm shifted to bits 7..13


def scale_blocks(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-n // block[0]), -(-k // block[1])


def quantize(w: torch.Tensor, block: tuple[int, int], pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., N, K] float -> (Q [..., N, K] e4m3, S [..., nb, kb] fp32), as the releases do;
    pow2 (scale_fmt ue8m0): S rounded up to a power of two, so |W / S| stays <= 448."""
    n, k = w.shape[-2:]
    nb, kb = scale_blocks(n, k, block)
    bn, bk = block
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    blocks = padded.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))  # [..., nb, bn, kb, bk]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal (not exact)
    s = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    if pow2:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (blocks / s[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    q = q.flatten(-2).flatten(-3, -2)[..., :n, :k]
    return q.contiguous(), s


def dequantize_reference(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The oracle: torch's cast, the scale expanded to every element -> fp32 [..., N, K]."""
    n, k = q.shape[-2:]
    full = s.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return q.float() * full[..., :n, :k]


def e4m3_as_fp16_scaled(q: torch.Tensor) -> torch.Tensor:
    """Q e4m3 -> fp16 Q * 2^-8, exactly (see the module note); NaN codes are not expected in weights."""
    x = q.view(torch.int8).to(torch.int16)  # sign-extended: bits 15..7 copy the sign
    x <<= 7
    x &= _FP16_MASK
    return x.view(torch.float16)


def dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype=torch.float32) -> torch.Tensor:
    """Fast: W [..., N, K] in dtype, equal to dequantize_reference(...).to(dtype) bit for bit."""
    n, k = q.shape[-2:]
    bn, bk = block
    s = s.float() * _POW8
    if bn > 1:
        s = s.repeat_interleave(bn, dim=-2)[..., :n, :]  # [..., N, kb]: K/bk times smaller than W
    w = e4m3_as_fp16_scaled(q).float()
    if k % bk == 0:
        w.unflatten(-1, (k // bk, bk)).mul_(s[..., None])
    else:  # a partial edge block of columns: expand the scale to every column
        w.mul_(s.repeat_interleave(bk, dim=-1)[..., :k])
    return w if dtype == torch.float32 else w.to(dtype)

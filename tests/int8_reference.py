"""The int8-activation tests' shared reference pieces: llama.cpp's activation quantizers in numpy, and the kernel
builds every int8 test holds to the reference (the machine's own, AVX2 where it has AVX-512, scalar)."""

from __future__ import annotations

import numpy as np
import torch

from mlaserve.config.cpu import cpu_flags
from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import native

F32 = np.float32
U = 2.0**-24


def q8_0_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32 values: d = max|x| / 127, codes nearest(x * (1 / d)) (round half to even, as the SIMD quantizers of
    ggml do), 0 where d is 0. -> codes [M, K] int8, d [M, K / 32] fp32."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32).astype(F32)
    d = (np.abs(xb).max(-1) / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, F32(1) / np.where(d > 0, d, F32(1)), F32(0)).astype(F32)
    q = np.clip(np.rint((xb * inv[..., None]).astype(F32)), -127, 127).astype(np.int8)
    return q.reshape(m, k), d


def q8k_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_K_ref: per 256 values iscale = -127 / max (max the value of largest magnitude,
    the first of ties), codes nearest(iscale x) capped at 127, d = 1 / iscale."""
    m, k = x.shape
    xb = x.reshape(m, k // 256, 256).astype(F32)
    mx = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, F32(-127.0) / np.where(mx != 0, mx, F32(1)), F32(0)).astype(F32)
        d = np.where(iscale != 0, F32(1) / np.where(iscale != 0, iscale, F32(1)), F32(0)).astype(F32)
    q = np.minimum(F32(127), np.rint(iscale[..., None] * xb)).astype(np.int8)
    return q.reshape(m, k), d


def with_build(monkeypatch, flags: tuple[str, ...]) -> str:
    lib, detail = native._build(flags)
    assert lib is not None, detail
    monkeypatch.setitem(native._state, "lib", lib)
    return native.int8_isa()


def builds() -> list[tuple[str, ...]]:
    builds = [()]
    if "avx512f" in cpu_flags():
        builds.append(("-mno-avx512f",))  # AVX2: vpmaddubsw + vpmaddwd instead of vpdpbusd
    builds.append(("-mno-avx512f", "-mno-avx2", "-mno-f16c"))  # no SIMD: ref/int8.c
    return builds


def grid_blocks(name: str, rows: int, k: int, seed: int) -> torch.Tensor:
    """A grid i-quant's blocks [rows, R]: random bits everywhere, a finite fp16 d in (0.001, 0.021) (IQ1_M: in the top nibbles of its 4 scale words)."""
    g = torch.Generator().manual_seed(seed)
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    nb = k // 256
    raw = torch.randint(0, 256, (rows, nb, t.type_size), dtype=torch.uint8, generator=g)
    d = (torch.rand(rows, nb, generator=g) * 0.02 + 0.001).half().view(torch.int16).to(torch.int32) & 0xFFFF
    if name == "IQ1_M":
        for w in range(4):  # byte 49 + 2 w holds the high byte of scale word w: its top nibble is d's nibble w
            nibble = (d >> (4 * w)) & 0xF
            raw[..., 49 + 2 * w] = ((raw[..., 49 + 2 * w].to(torch.int32) & 0x0F) | (nibble << 4)).to(torch.uint8)
    else:
        raw[..., 0] = (d & 0xFF).to(torch.uint8)
        raw[..., 1] = (d >> 8).to(torch.uint8)
    return raw.flatten(-2).contiguous()

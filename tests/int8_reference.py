"""The int8-activation tests' shared reference pieces: llama.cpp's activation quantizers in numpy, and the kernel
builds every int8 test holds to the reference (the machine's own, AVX2 where it has AVX-512, scalar)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlaserve.config.cpu import cpu_flags
from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import ggml, native, native_build

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
    lib, detail = native_build._build(flags)
    assert lib is not None, detail
    monkeypatch.setitem(native_build._state, "lib", lib)
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


# The AMX-INT8 tile tests' shared pieces (tests/kernels/test_int8_tiles*.py): every tile type is held to the same
# float steps after its exact integer sums, at the same row counts, in the same grouped call.
TILE_ROW_COUNTS = (1, 15, 16, 17, 31, 32, 33, 48, 63, 64)  # below 16 the VNNI rows, from 16 the tiles; odd tails


def tiles_here() -> str:
    """The kernel plan's words on the tiles in this process ("" without the native kernels)."""
    return native.int8_tiles() if native.status().available else ""


def needs_tiles(f):
    """Skip where this process has no AMX-INT8 tiles (the build or the kernel)."""
    tiles = tiles_here()
    return pytest.mark.skipif(not tiles.startswith("amx-int8 tiles"), reason=f"no AMX-INT8 tiles here: {tiles}")(f)


def super_block_sums(s, d, dx, mins=None, dmin=None) -> np.ndarray:
    """The VNNI row kernels' float steps over exact integer sums, as numpy float32 array operations (each an IEEE fp32
    operation per element, as the scalar loop's): per super-block blk in order, y += (d_w d_x) S (with mins also
    y -= (dmin_w d_x) M). s, mins [M, N, nb] integers; d, dmin [N, nb]; dx [M, nb]. -> y [M, N] fp32."""
    m, n = s.shape[:2]
    y = np.zeros((m, n), dtype=F32)
    for blk in range(d.shape[1]):
        scale = (d[None, :, blk].astype(F32) * dx[:, None, blk].astype(F32)).astype(F32)
        y = (y + (scale * s[:, :, blk].astype(F32)).astype(F32)).astype(F32)
        if mins is not None:
            scale_min = (dmin[None, :, blk].astype(F32) * dx[:, None, blk].astype(F32)).astype(F32)
            y = (y - (scale_min * mins[:, :, blk].astype(F32)).astype(F32)).astype(F32)
    return y


def assert_tile_rows(name: str, raw: torch.Tensor, x: torch.Tensor, want: torch.Tensor) -> None:
    """native.gemm at every TILE_ROW_COUNTS (x has 64 rows) equal to want's bits, and rows 5..25 inside another batch
    the same (a row's result does not depend on its batch)."""
    t, k = GGML_TYPE_IDS[name], x.shape[1]
    for rows in TILE_ROW_COUNTS:
        got = native.gemm(t, x[:rows].contiguous(), raw, k, int8=True)
        assert torch.equal(got, want[:rows]), (name, rows, (got - want[:rows]).abs().max().item())
    assert torch.equal(native.gemm(t, x[5:26].contiguous(), raw, k, int8=True), want[5:26]), name


def assert_grouped_tiles(name: str, blocks, reference, x: torch.Tensor) -> None:
    """The grouped gemm of x (50 rows) with groups above and below 16 rows (tiles and VNNI rows in one call), experts
    out of order: each group equal to reference(weight, name, its rows). blocks(name, rows, k, seed) makes a weight."""
    t, k, n = GGML_TYPE_IDS[name], x.shape[1], 21
    stacked = torch.stack([blocks(name, n, k, seed=s) for s in (5, 6, 7)])
    experts, starts = torch.tensor([2, 0, 1]), torch.tensor([0, 19, 24, 50])
    ys = native.grouped_gemm(t, x, stacked, k, experts, starts, int8=True)
    for a in range(3):
        s0, s1 = starts[a].item(), starts[a + 1].item()
        assert torch.equal(ys[s0:s1], reference(stacked[experts[a]], name, x[s0:s1])), (name, a)


def chunked_int8(t: int, x: torch.Tensor, w: torch.Tensor, k: int, size: int) -> torch.Tensor:
    """The int8 product of x with one weight in chunks of `size` activation rows (each row quantized on its own, so the
    chunks give every row's bits whatever path takes the whole)."""
    return torch.cat([native.gemm(t, x[i : i + size].contiguous(), w, k, int8=True) for i in range(0, len(x), size)])


def assert_groups_int8(ys: torch.Tensor, xs: torch.Tensor, t: int, k: int, parts, experts, counts, size: int) -> None:
    """ys [P, sum of parts' rows]: each group's rows (counts, in order, of experts[a]) bit for bit that expert's
    chunked int8 product with every part (parts: stacks [E, N, R], side by side)."""
    s0 = 0
    for a, c in enumerate(counts):
        e = int(experts[a])
        want = torch.cat([chunked_int8(t, xs[s0 : s0 + c], p[e], k, size) for p in parts], dim=1)
        assert torch.equal(ys[s0 : s0 + c], want), (t, a, (ys[s0 : s0 + c] - want).abs().max().item())
        s0 += c


def assert_grouped_route(
    name: str, blocks, counts: list[int], seed: int, size: int, above: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 prefill route of routed experts (kernels/ggml.expert_linear_native with tiles, int8_6bit, bf16 on):
    gate and up as two stacks of 5 experts (blocks(name, rows, k, generator, lead): random weight blocks), groups of
    `counts` rows for experts 0, 2, 3, 4, each group's rows bit for bit its expert's int8 product in chunks of `size`
    rows; a mean of `above` rows per expert takes the decoded bf16 GEMMs (the products without the int8 setting).
    Returns the groups' products and theirs without the int8 setting."""
    t, k, inter = GGML_TYPE_IDS[name], 512, 24
    g = torch.Generator().manual_seed(seed)
    stacks = (blocks(name, inter, k, g, (5,)), blocks(name, inter, k, g, (5,)))
    experts = torch.tensor([0, 2, 3, 4])
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    xs = torch.randn(sum(counts), k, generator=g) * 2
    ys = ggml.expert_linear_native(xs, stacks, t, k, experts, offs, int8=6, bf16=True, tiles=True)
    assert_groups_int8(ys, xs, t, k, stacks, experts, counts, size=size)
    many = torch.tensor([above] * 4)
    offs_many = torch.cumsum(many, 0).to(torch.int32)
    xm = torch.randn(int(many.sum()), k, generator=g)
    ym = ggml.expert_linear_native(xm, stacks, t, k, experts, offs_many, int8=6, bf16=True, tiles=True)
    assert torch.equal(ym, ggml.expert_linear_native(xm, stacks, t, k, experts, offs_many, int8=6, bf16=True))
    return ys, ggml.expert_linear_native(xs, stacks, t, k, experts, offs, int8=6, bf16=True)


def assert_linear_keeps_int8_prefill(type_id: int) -> None:
    """A dense GGUFLinear of this type takes the int8 prefill unit (AMX tiles or VNNI panels) from its plan's
    set_prefill_tiles under int8_6bit activations, and not under float activations."""
    from mlaserve.quant.ggml_linear import GGUFLinear

    lin = GGUFLinear(256, 32, type_id, False, torch.float32, "cpu")
    for int8, want in ((6, True), (0, False)):
        lin.int8 = int8
        lin.set_prefill_tiles()
        assert lin.tiles is want, (type_id, int8)

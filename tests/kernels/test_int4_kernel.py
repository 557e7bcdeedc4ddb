"""The native INT4 kernel (compressed-tensors pack-quantized, kernels/csrc: MLS_INT4_PACKED) against
quant/int4_group.py's reference.

Decoding is bit-identical with dequantize_reference (q * S, one fp32 rounding each way). The decode-and-dot
applies each group's scale to the 32-column partial sum of the codes (y += S * sum_j q_j x_j) where the
reference multiplies dequantized values (sum_j (q_j S) x_j) in BLAS order: two summation orders of the same K
products. For a K-term fp32 dot product the rounding error of any order is at most K u sum_j |w_j x_j|
(u = 2^-24), so the two differ by at most 2 K u (|x| @ |W|^T) (with bf16 scales q * S is exact, so the
factored scale adds nothing): that is the bound held here, with the measured worst ratio to it printed.
Every ISA path is tested wherever the suite runs: the library for this CPU, and where it has AVX-512 an
AVX2-only build; a build without SIMD (the scalar fallback) everywhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlaserve.config.cpu import cpu_flags
from mlaserve.kernels import native, native_build
from mlaserve.quant import int4_group

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
U = 2.0**-24
SHAPES = [(37, 96), (5, 160), (16, 416), (8, 1024), (3, 32)]  # (N, K): K not a multiple of 256 but the last


def packed(n: int, k: int, seed: int, lead: tuple[int, ...] = (), scale_dtype=torch.bfloat16):
    """Random weights quantized by the writer's rule -> (P int32 [*lead, n, k/8], S fp32 [*lead, n, k/32])."""
    g = torch.Generator().manual_seed(seed)
    p, s = int4_group.quantize(torch.randn(*lead, n, k, generator=g), scale_dtype=scale_dtype)
    return p, s.float().contiguous()


def grid(s: torch.Tensor, part_rows: int, group: int = int4_group.GROUP) -> native.ScaleGrid:
    return native.ScaleGrid(s, 1, s.shape[-1], group, part_rows)


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return 2 * x.shape[-1] * U * (x.abs() @ w.abs().T)


def ratio(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """max |y - ref| / bound (<= 1 passes)."""
    return ((y - ref).abs() / bound(x, w).clamp_min(1e-30)).max().item()


def check_gemm(n: int, k: int, rows: int, seed: int, scale_dtype=torch.bfloat16) -> float:
    p, s = packed(n, k, seed, scale_dtype=scale_dtype)
    w = int4_group.dequantize_reference(p, s)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + rows))
    y = native.gemm(native.INT4_PACKED, x, p.view(torch.uint8), k, grid(s, n))
    r = ratio(y, F.linear(x, w), x, w)
    assert r <= 1.0, f"N={n} K={k} rows={rows}: {r:.3g} x the fp32 bound"
    return r


@needs_native
@pytest.mark.parametrize("n,k", SHAPES)
def test_decode_is_bit_identical_with_the_reference(n, k):
    p, s = packed(n, k, n + k)
    got = native.dequantize(native.INT4_PACKED, p.view(torch.uint8), k, grid(s, n))
    assert torch.equal(got.view(torch.int32), int4_group.dequantize_reference(p, s).view(torch.int32))


@needs_native
def test_every_code_decodes_and_the_byte_order_is_the_word_order():
    """All 16 codes in every nibble position of a word (the words' bytes read in memory order: little-endian)."""
    q = torch.arange(-8, 8).repeat(2, 8)[:, :128]  # [2, 128]
    q[1] = q[1].flip(0)
    p = int4_group.pack(q)
    s = torch.tensor([[0.5, -3.0, 1.0, 2.0**-20], [7.0, 1.0, 0.25, 3.0]])
    got = native.dequantize(native.INT4_PACKED, p.view(torch.uint8), 128, grid(s, 2))
    assert torch.equal(got, q.float() * s.repeat_interleave(32, -1))


@needs_native
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_gemm_within_the_summation_bound(n, k, rows):
    check_gemm(n, k, rows, seed=n * k)


@needs_native
def test_fp32_scales_and_wider_groups():
    """fp32 scales (q * S rounds: the factored scale's product differs from the reference's by <= u |w x| per
    term, inside the bound), and a group of 64 (two 32-column chunks under one scale)."""
    check_gemm(19, 320, 5, seed=3, scale_dtype=torch.float32)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(11, 256, generator=g)
    p, s = int4_group.quantize(w, group=64)
    s = s.float().contiguous()
    ref = int4_group.dequantize_reference(p, s, 64)
    x = torch.randn(4, 256, generator=g)
    y = native.gemm(native.INT4_PACKED, x, p.view(torch.uint8), 256, grid(s, 11, 64))
    assert ratio(y, F.linear(x, ref), x, ref) <= 1.0
    assert torch.equal(native.dequantize(native.INT4_PACKED, p.view(torch.uint8), 256, grid(s, 11, 64)), ref)


@needs_native
def test_a_group_the_kernel_cannot_take_is_refused():
    p, s = packed(4, 64, 1)
    s16 = s.repeat_interleave(2, -1).contiguous()  # groups of 16: not whole 32-column chunks
    with pytest.raises(RuntimeError, match="refused type 1002"):
        native.gemm(native.INT4_PACKED, torch.randn(1, 64), p.view(torch.uint8), 64, grid(s16, 4, 16))


@needs_native
@pytest.mark.parametrize("per_expert", [1, 3, 16])
def test_grouped_gemm_of_experts_within_the_bound(per_expert):
    """A stack of experts, gate and up with their own scale grids (parts of I rows), the routed ones only."""
    e, i, d = 5, 24, 96
    p, s = packed(2 * i, d, 11, lead=(e,))
    s = s.unflatten(1, (2, i)).contiguous()  # [E, 2, I, D/g] as INT4Experts keeps gate_up's
    w = int4_group.dequantize_reference(p, s.flatten(1, 2))
    experts = torch.tensor([0, 3, 4])
    counts = torch.tensor([per_expert, 1, per_expert + 1])
    starts = F.pad(torch.cumsum(counts, 0), (1, 0))
    xs = torch.randn(int(counts.sum()), d, generator=torch.Generator().manual_seed(per_expert))
    y = native.grouped_gemm(native.INT4_PACKED, xs, p.view(torch.uint8), d, experts, starts, grid(s, i))
    for a, ex in enumerate(experts.tolist()):
        lo, hi = starts[a].item(), starts[a + 1].item()
        assert ratio(y[lo:hi], F.linear(xs[lo:hi], w[ex]), xs[lo:hi], w[ex]) <= 1.0


def _with_build(monkeypatch, flags: tuple[str, ...], want_isa: str) -> None:
    lib, detail = native_build._build(flags)
    assert lib is not None, detail
    monkeypatch.setitem(native_build._state, "lib", lib)
    assert native.isa() == want_isa


@needs_native
def test_every_isa_path(monkeypatch, capsys):
    """The machine's build, then the narrower ones this CPU can run: AVX2-only (on an AVX-512 machine) and the
    scalar fallback (no SIMD), each held to the same bound and bit-identical decoding."""
    builds = [((), native.isa())]
    if "avx512f" in cpu_flags():
        builds.append((("-mno-avx512f",), "avx2"))
    builds.append((("-mno-avx512f", "-mno-avx2", "-mno-f16c"), "scalar"))
    worst = {}
    for flags, want in builds:
        _with_build(monkeypatch, flags, want)
        worst[want] = max(check_gemm(n, k, rows, seed=n + rows) for n, k in SHAPES for rows in (1, 3, 8, 9, 16))
        test_decode_is_bit_identical_with_the_reference(37, 96)
    with capsys.disabled():
        print(f"\nINT4 gemm: worst |y - ref| / bound per build {worst}")


@needs_native
def test_extra_build_flags_from_the_environment(monkeypatch):
    """MLASERVE_KERNEL_CFLAGS appends flags to the library's build: -mno-avx512f gives the AVX2 kernels on an AVX-512
    CPU, and isa() (the kernel plan's words) names them."""
    if "avx512f" not in cpu_flags():
        pytest.skip("this CPU has no AVX-512: its own build is already the AVX2 one")
    assert native.isa() == "avx512"
    monkeypatch.setenv(native_build.EXTRA_FLAGS, "-mno-avx512f")
    monkeypatch.setattr(native_build, "_state", {})  # the process's library is built once: this one built anew
    assert native.library() is not None and native.isa() == "avx2"

"""GGML_TYPE_MXFP4 (39): the dequantizer (gguf/quants.py) and the native kernels (decoder, fused decode-and-dot).

The block, as ggml-common.h's block_mxfp4 and gguf-py's MXFP4 class lay it out: one e8m0 byte e, then 16 bytes
holding 32 e2m1 codes, value j in the low nibble of byte j and value j + 16 in its high nibble. ggml keeps the
e2m1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives: exact integers) and halves the scale:
w = KVALUES[code] * 2^(e - 128). The decoder is held bit for bit to gguf-py's and to a plain decoder written
here from that description (every e byte, every code). The decode-and-dot applies d to each block's partial sum
of the integer codes times x, where "dequantize, then GEMM" multiplies d * code first: two summation orders of
the same K products, each within K u sum|w x| of the exact sum (u = 2^-24), so the bound is 2 K u (|x| @ |W|^T)
(tests/kernels/test_kernels.py's); every ISA build is held to it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mlaserve.config.cpu import cpu_flags
from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES, dequantize
from mlaserve.kernels import ggml, native, native_build

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
MXFP4 = 39
U = 2.0**-24
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the OCP e2m1 magnitudes; bit 3 of a code is its sign


def spec_decode(raw: np.ndarray) -> np.ndarray:
    """The plain decoder: [n, 17] bytes -> [n, 32] float64, e2m1(code) * 2^(e - 127), one value at a time."""
    out = np.empty((raw.shape[0], 32))
    for i, block in enumerate(raw):
        scale = 2.0 ** (int(block[0]) - 127)
        for j in range(16):
            for pos, code in ((j, block[1 + j] & 15), (j + 16, block[1 + j] >> 4)):
                out[i, pos] = (-1.0 if code & 8 else 1.0) * E2M1[code & 7] * scale
    return out


def every_code_blocks() -> np.ndarray:
    """256 blocks, e = 0..255, each with all 16 codes in both nibble positions."""
    codes = np.arange(16, dtype=np.uint8)
    qs = np.concatenate([codes | (codes[::-1] << 4)])  # low nibble j, high nibble 15 - j
    return np.concatenate([np.arange(256, dtype=np.uint8)[:, None], np.tile(qs, (256, 1))], axis=1)


def sane_blocks(rows: int, k: int, seed: int, lead: tuple[int, ...] = ()) -> torch.Tensor:
    """Random codes with e8m0 scales 2^-10..2^-6: [*lead, rows, k / 32 * 17] uint8."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*lead, rows, k // 32, 17), dtype=torch.uint8, generator=g)
    raw[..., 0] = torch.randint(118, 123, raw.shape[:-1], dtype=torch.uint8, generator=g)
    return raw.flatten(-2).contiguous()


def ratio(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    bound = 2 * x.shape[-1] * U * (x.abs() @ w.abs().T)
    return ((y - ref).abs() / bound.clamp_min(1e-30)).max().item()


def test_the_type_is_known_and_sized():
    t = GGML_TYPES[MXFP4]
    assert (t.name, t.block_size, t.type_size, GGML_TYPE_IDS["MXFP4"]) == ("MXFP4", 32, 17, 39)


def test_every_scale_and_code_decodes_as_the_spec_and_gguf_py():
    raw = every_code_blocks()
    mine = dequantize(torch.from_numpy(raw.copy()), MXFP4, (256, 32)).numpy()
    spec = spec_decode(raw)
    finite = np.abs(spec) < 2.0**128  # e = 255: 6 * 2^128 overflows fp32, as in ggml
    assert np.array_equal(mine[finite], spec[finite].astype(np.float32))
    assert np.array_equal(np.isinf(mine), ~finite) and np.array_equal(np.signbit(mine[~finite]), spec[~finite] < 0)
    assert not np.signbit(mine[:, [0, 24]]).any(), "code 8 is ggml's +0 (kvalues[8] = 0), not -0"
    gguf = pytest.importorskip("gguf")
    with np.errstate(over="ignore"):  # the same overflow at e = 255
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(mine.view(np.uint32), ref.astype(np.float32).view(np.uint32))


def test_values_quantized_by_gguf_py_come_back():
    gguf = pytest.importorskip("gguf")
    x = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.MXFP4)
    mine = dequantize(torch.from_numpy(np.ascontiguousarray(q)), MXFP4, (4, 256)).numpy()
    assert np.array_equal(mine, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4))
    # e2m1 spacing at the top of a block is 2 of 12 steps of d: the error is at most 1/6 of the block's max
    amax = np.abs(x.reshape(4, 8, 32)).max(-1, keepdims=True)
    assert (np.abs(mine - x).reshape(4, 8, 32) <= amax / 3 + 1e-6).all()


@needs_native
def test_native_decode_is_bit_identical_for_every_scale_and_code():
    raw = torch.from_numpy(every_code_blocks().reshape(8, -1).copy())  # 8 rows of 32 blocks (K 1024)
    got = native.dequantize(MXFP4, raw, 1024)
    assert torch.equal(got.view(torch.int32), ggml.dense(raw, MXFP4, 1024).view(torch.int32))


@needs_native
@pytest.mark.parametrize("k", [32, 96, 416, 1024])
@pytest.mark.parametrize("rows", [1, 3, 16, 17])
def test_native_linear_within_the_summation_bound(k, rows):
    """1-16 rows: the fused decode-and-dot; 17: the native decoder, then BLAS."""
    raw = sane_blocks(29, k, k)
    w = ggml.dense(raw, MXFP4, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    ref = F.linear(x, w)
    assert torch.equal(ggml.linear(x, raw, MXFP4, k, kernel="torch"), ref)
    assert ratio(ggml.linear(x, raw, MXFP4, k, kernel="native"), ref, x, w) <= 1.0


@needs_native
@pytest.mark.parametrize("per_expert", [1, 3, 40])
def test_native_expert_products_within_the_bound(per_expert):
    e, n, k = 6, 20, 160
    raw = sane_blocks(n, k, 4, lead=(e,))
    experts = torch.tensor([1, 2, 5])
    counts = torch.tensor([per_expert, 1, per_expert + 2])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = torch.randn(int(counts.sum()), k, generator=torch.Generator().manual_seed(per_expert))
    ref = ggml.expert_linear(xs, raw, MXFP4, k, experts, offs, kernel="torch")
    got = ggml.expert_linear(xs, raw, MXFP4, k, experts, offs, kernel="native")
    ends = [0, *offs.tolist()]
    for a, ex in enumerate(experts.tolist()):
        lo, hi = ends[a], ends[a + 1]
        w = ggml.dense(raw[ex], MXFP4, k)
        assert ratio(got[lo:hi], ref[lo:hi], xs[lo:hi], w) <= 1.0


@needs_native
def test_every_isa_path(monkeypatch, capsys):
    """The machine's build, AVX2-only where the CPU has AVX-512, and the build without SIMD (decode, then dot)."""
    builds = [((), native.isa())]
    if "avx512f" in cpu_flags():
        builds.append((("-mno-avx512f",), "avx2"))
    builds.append((("-mno-avx512f", "-mno-avx2", "-mno-f16c"), "scalar"))
    raw_all = torch.from_numpy(every_code_blocks().reshape(8, -1).copy())
    worst = {}
    for flags, want in builds:
        lib, detail = native_build._build(flags)
        assert lib is not None, detail
        monkeypatch.setitem(native_build._state, "lib", lib)
        assert native.isa() == want
        assert torch.equal(
            native.dequantize(MXFP4, raw_all, 1024).view(torch.int32),
            ggml.dense(raw_all, MXFP4, 1024).view(torch.int32),
        )
        r = 0.0
        for k in (96, 416):
            raw = sane_blocks(29, k, k)
            w = ggml.dense(raw, MXFP4, k)
            for rows in (1, 3, 8, 9, 16):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                r = max(r, ratio(native.gemm(MXFP4, x, raw, k), F.linear(x, w), x, w))
        assert r <= 1.0, (want, r)
        worst[want] = r
    with capsys.disabled():
        print(f"\nMXFP4 gemm: worst |y - ref| / bound per build {worst}")

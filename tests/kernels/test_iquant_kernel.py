"""The native decoders of the i-quants and TQ1_0 / TQ2_0 (kernels/csrc/ref/iquants.c): bit-identical to the torch
dequantizers (themselves bit-identical to gguf-py's: tests/gguf/test_gguf_iquants.py) on blocks that index every
grid entry and table code, in every ISA build; their grids the same data as gguf/iq_grids.py; and the products
("decode, then dot" for types without a fused kernel, the fused decode-and-dot where there is one) within the fp32
summation bound 2 K u (|x| @ |W|^T) of tests/kernels/test_kernels.py (two summation orders of the same K products,
each within K u sum|w x| of the exact sum, u = 2^-24)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mlaserve.config.cpu import cpu_flags
from mlaserve.gguf import iq_grids
from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import ggml, native, native_build

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
U = 2.0**-24
IQ_TYPES = ("IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")
HEADER = Path(native.__file__).parent / "csrc" / "ref" / "iq_grids.h"


def blocks(name: str, n_blocks: int, seed: int) -> torch.Tensor:
    from test_gguf_iquants import iq_blocks  # tests/gguf: valid blocks reaching every grid entry (asserted there)

    return torch.from_numpy(iq_blocks(name, n_blocks, seed))


def kernels(tid: int) -> int:
    """mls_type_info's kernel bits of a type: 1 decode, 2 fused decode-and-dot, 4 int8 activations."""
    v = (ctypes.c_int64 * 3)()
    assert native.library().mls_type_info(tid, ctypes.byref(v, 0), ctypes.byref(v, 8), ctypes.byref(v, 16)) == 0
    return v[2]


def ratio(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    bound = 2 * x.shape[-1] * U * (x.abs() @ w.abs().T)
    return ((y - ref).abs() / bound.clamp_min(1e-30)).max().item()


@pytest.fixture(autouse=True)
def _gguf_tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "gguf"))


def test_c_grids_are_the_python_grids():
    text = HEADER.read_text()
    for name in ("IQ2XXS", "IQ2XS", "IQ2S", "IQ3XXS", "IQ3S", "IQ1S"):
        n, w = getattr(iq_grids, f"{name}_GRID_SHAPE")
        body = re.search(rf"{name}_GRID\[{n}\] = \{{([^}}]*)\}}", text).group(1)
        values = [int(v, 16) for v in re.findall(r"0x([0-9a-f]+)", body)]
        raw = b"".join(v.to_bytes(w, "little") for v in values)
        assert raw.hex() == "".join(getattr(iq_grids, f"{name}_GRID_HEX")), name


@needs_native
@pytest.mark.parametrize("name", IQ_TYPES)
def test_native_decode_is_bit_identical(name):
    tid = GGML_TYPE_IDS[name]
    k = 1024 if GGML_TYPES[tid].block_size == 256 else 512
    raw = blocks(name, 4096, tid).reshape(-1, k // GGML_TYPES[tid].block_size * GGML_TYPES[tid].type_size)
    got = native.dequantize(tid, raw.contiguous(), k)
    assert torch.equal(got.view(torch.int32), ggml.dense(raw, tid, k).view(torch.int32))


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 16, 17])
@pytest.mark.parametrize("name", IQ_TYPES)
def test_native_linear_within_the_summation_bound(name, rows):
    """1-16 rows: decode-and-dot (fused where the type has it); 17: the native decoder, then BLAS."""
    tid = GGML_TYPE_IDS[name]
    t = GGML_TYPES[tid]
    n, k = 29, 512
    raw = blocks(name, n * k // t.block_size, rows).reshape(n, -1).contiguous()
    w = ggml.dense(raw, tid, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    ref = F.linear(x, w)
    assert ratio(ggml.linear(x, raw, tid, k, kernel="native"), ref, x, w) <= 1.0


@needs_native
def test_every_isa_path(monkeypatch, capsys):
    """The machine's build, AVX2-only where the CPU has AVX-512, and the build without SIMD (no F16C either)."""
    builds = [((), native.isa())]
    if "avx512f" in cpu_flags():
        builds.append((("-mno-avx512f",), "avx2"))
    builds.append((("-mno-avx512f", "-mno-avx2", "-mno-f16c"), "scalar"))
    worst = {}
    for flags, want in builds:
        lib, detail = native_build._build(flags)
        assert lib is not None, detail
        monkeypatch.setitem(native_build._state, "lib", lib)
        assert native.isa() == want
        fused = {n for n in IQ_TYPES if kernels(GGML_TYPE_IDS[n]) & 2}
        assert fused == (set() if want == "scalar" else set(IQ_TYPES)), (want, fused)
        r = 0.0
        for name in IQ_TYPES:
            tid = GGML_TYPE_IDS[name]
            t = GGML_TYPES[tid]
            k = 256 if t.block_size == 256 else 96
            raw = blocks(name, 2048 * k // t.block_size, tid).reshape(2048, -1).contiguous()  # all grid entries
            assert torch.equal(
                native.dequantize(tid, raw, k).view(torch.int32), ggml.dense(raw, tid, k).view(torch.int32)
            )
            w = ggml.dense(raw[:40], tid, k)
            for rows in (1, 5, 16):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                r_type = ratio(native.gemm(tid, x, raw[:40].contiguous(), k), F.linear(x, w), x, w)
                worst[f"{want} {name}"] = max(worst.get(f"{want} {name}", 0.0), r_type)
                r = max(r, r_type)
        assert r <= 1.0, (want, r)
    with capsys.disabled():
        print("\ni-quant gemm: worst |y - ref| / bound per build and type", {n: f"{r:.3f}" for n, r in worst.items()})

"""The fused decode-and-dot kernels of IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, TQ1_0 and TQ2_0 (kernels/csrc/x86/avx2.c, the
16-lane grid kernels in x86/avx512.c):
registered in the type table (mls_type_info's fused bit) in every SIMD build, and their products at every row count
1-16 within the fp32 summation bound 2 K u (|x| @ |W|^T) of "decode (bit-identical to gguf-py), then matmul": the
kernel sums s * sum_j(code_j x_j) where the reference sums (s * code_j) x_j, two roundings of one exact sum, each
within K u sum|w x| of it (u = 2^-24; tests/kernels/test_kernels.py derives it). The weight rows are 2048 random
valid super-blocks that index every grid entry (asserted), so a wrong entry, sign, scale nibble or delta anywhere
is an O(|w x|) error, hundreds of times the bound; the measured worst ratio is printed (~0.005)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mlaserve.config.cpu import cpu_flags
from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import ggml, native, native_build

STATUS = native.status()
pytestmark = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
U = 2.0**-24
NEW_FUSED = ("IQ2_XS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ2_S", "TQ1_0", "TQ2_0")
GRID_TYPES = ("IQ2_XS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ2_S")  # the ternary types have no grid


@pytest.fixture(autouse=True)
def _gguf_tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "gguf"))


def kernel_bits(tid: int) -> int:
    v = (ctypes.c_int64 * 3)()
    assert native.library().mls_type_info(tid, ctypes.byref(v, 0), ctypes.byref(v, 8), ctypes.byref(v, 16)) == 0
    return v[2]


def every_entry_blocks(name: str) -> torch.Tensor:
    """2048 rows of one super-block (k = 256) whose grid indices cover the whole grid."""
    from test_gguf_iquants import GRID_ENTRIES, _grid_indices, iq_blocks

    raw = iq_blocks(name, 2048, seed=GGML_TYPE_IDS[name])
    if name in GRID_TYPES:
        assert len(np.unique(_grid_indices(name, raw))) == GRID_ENTRIES[name], name
    return torch.from_numpy(raw).contiguous()


def worst_ratio(name: str) -> float:
    tid = GGML_TYPE_IDS[name]
    raw = every_entry_blocks(name)
    w = ggml.dense(raw, tid, 256)
    worst = 0.0
    for rows in range(1, 17):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        y = native.gemm(tid, x, raw, 256)
        bound = 2 * 256 * U * (x.abs() @ w.abs().T)
        worst = max(worst, ((y - F.linear(x, w)).abs() / bound.clamp_min(1e-30)).max().item())
    return worst


def test_fused_kernels_registered():
    for name in NEW_FUSED:
        assert kernel_bits(GGML_TYPE_IDS[name]) & 2, f"{name}: no fused kernel in the {native.isa()} build"


@pytest.mark.parametrize("name", NEW_FUSED)
def test_fused_within_the_summation_bound_every_entry_every_row_count(name, capsys):
    r = worst_ratio(name)
    with capsys.disabled():
        print(f"\n{native.isa()} {name}: worst |y - ref| / bound over rows 1-16 = {r:.4f}")
    assert r <= 1.0, (name, r)


def test_avx2_build_where_the_machine_has_avx512(monkeypatch):
    """The AVX2 build (8-lane kernels) here too, so that a machine without AVX-512 is covered."""
    if "avx512f" not in cpu_flags():
        pytest.skip("the machine's build is the AVX2 one (tested above)")
    lib, detail = native_build._build(("-mno-avx512f",))
    assert lib is not None, detail
    monkeypatch.setitem(native_build._state, "lib", lib)
    assert native.isa() == "avx2"
    for name in NEW_FUSED:
        assert kernel_bits(GGML_TYPE_IDS[name]) & 2, name
        assert worst_ratio(name) <= 1.0, name


def test_long_rows_and_expert_groups():
    """k = 7168 (DeepSeek-V3's hidden: 28 super-blocks per row) through the grouped product the MoE paths use."""
    k, n, e = 7168, 24, 3
    g = torch.Generator().manual_seed(3)
    for name in NEW_FUSED:
        from test_gguf_iquants import iq_blocks

        tid = GGML_TYPE_IDS[name]
        t = GGML_TYPES[tid]
        raw = torch.from_numpy(iq_blocks(name, e * n * k // 256, seed=tid + 1)).reshape(e, n, -1).contiguous()
        w = ggml.dense(raw, tid, k)
        x = torch.randn(5, k, generator=g)
        experts, starts = torch.tensor([0, 2]), torch.tensor([0, 2, 5])
        y = native.grouped_gemm(tid, x, raw, k, experts, starts)
        ref = torch.cat([F.linear(x[:2], w[0]), F.linear(x[2:], w[2])])
        wa = torch.cat([w[0].abs().expand(2, -1, -1), w[2].abs().expand(3, -1, -1)])
        bound = 2 * k * U * torch.einsum("pk,pnk->pn", x.abs(), wa)
        assert ((y - ref).abs() <= bound).all(), (name, t.name)


def test_the_kernel_plan_records_the_fused_kernel():
    """The plan's note for a holder of each type names the build and the kernel: decode-and-dot for the fused types,
    "decode, then dot" for a type without one (Q2_K), per projection where an expert stack mixes them."""
    from torch import nn

    from mlaserve.kernels.registry import KernelContext, plan_kernels
    from mlaserve.quant.ggml_linear import GGUFExperts, GGUFLinear

    model = nn.Module()
    for name in (*NEW_FUSED, "Q2_K"):
        model.add_module(name.lower(), GGUFLinear(256, 8, GGML_TYPE_IDS[name], False, torch.float32, "cpu"))
    model.experts = GGUFExperts(256, 2, 256, GGML_TYPE_IDS["IQ2_XS"], GGML_TYPE_IDS["Q2_K"], "cpu")
    plan = plan_kernels(model, KernelContext("native", False))
    isa = native.isa()
    for name in NEW_FUSED:
        c = plan.of(name.lower(), "linear")
        assert c.impl == "native" and f"({isa} {name} decode-and-dot" in c.reason, c
    assert f"({isa} Q2_K decode, then dot" in plan.of("q2_k", "linear").reason
    mixed = plan.of("experts", "grouped_experts").reason
    assert f"gate_up {isa} IQ2_XS decode-and-dot; down {isa} Q2_K decode, then dot" in mixed, mixed


def test_decode_then_dot_build_is_the_unfused_path(monkeypatch):
    """benchmarks/iquant_kernel.py's reference build (MLS_DECODE_THEN_DOT): the same products by decoding each row,
    then dotting it, also within the bound, and not the fused kernel's rounding (the switch took effect)."""
    fused_lib = native.library()
    lib, detail = native_build._build(("-DMLS_DECODE_THEN_DOT",))
    assert lib is not None, detail
    from test_gguf_iquants import iq_blocks

    tid = GGML_TYPE_IDS["IQ2_XS"]
    raw = torch.from_numpy(iq_blocks("IQ2_XS", 64 * 4, seed=9)).reshape(64, -1).contiguous()
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(9))
    fused = native.gemm(tid, x, raw, 1024)
    monkeypatch.setitem(native_build._state, "lib", lib)
    unfused = native.gemm(tid, x, raw, 1024)
    w = ggml.dense(raw, tid, 1024)
    bound = 2 * 1024 * U * (x.abs() @ w.abs().T)
    assert ((unfused - F.linear(x, w)).abs() <= bound).all()
    assert not torch.equal(fused, unfused) and fused_lib is not lib

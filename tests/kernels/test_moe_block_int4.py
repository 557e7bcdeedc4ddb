"""The MoE block at decode in one native call (quant.ggml_moe_block.GGUFMoEBlock, csrc/moe/block.c) with INT4
pack-quantized routed experts (quant/int4_experts.py: the scales beside the words, mls_moe_block_t gu_scale /
dn_scale) and an fp32 shared expert, as a Kimi-K2.5 folder loads: against MoE.forward's per-op path (the native
router, INT4Experts' grouped native products, the shared expert's BLAS products) and the torch reference
(unpacked experts, F.linear).

For the block's own routing the routed products are INT4Experts' native grouped ones row for row (the same
kernel over the same rows of each expert); silu (expf vs torch's), the order of the weighted sum and the gate's
logits round differently. The bound is tests/kernels/test_moe_block.py's (_block_bound: both sides' fp32
rounding through the SwiGLU, plus the routing weights' difference), with the shared expert's term from its fp32
weights.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_block import INTER, ROUTERS, D, U, _block_bound, _swiglu_bound, routing, set_kernel

from mlaserve.config.model import MoEConfig
from mlaserve.kernels import native, native_build, native_layers
from mlaserve.models.moe import MoE
from mlaserve.quant import int4_group
from mlaserve.quant.config import parse_quantization
from mlaserve.quant.ggml_linear import BLOCK_TOKENS
from mlaserve.quant.ggml_moe_block import GGUFMoEBlock, attach_moe_blocks
from mlaserve.quant.int4_experts import INT4Experts

STATUS = native.status()
pytestmark = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
SCHEME = parse_quantization(
    {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True},
                    "format": "pack-quantized",
                }
            },
        }
    }
)
assert U == 2.0**-24


def make_int4_moe(router: str, shared: bool, seed: int = 0) -> MoE:
    scoring, method, e, groups, topk_group, k, norm, scale = ROUTERS[router]
    cfg = MoEConfig(e, k, int(shared), INTER, scoring, method, groups, topk_group, norm, scale)
    g = torch.Generator().manual_seed(seed)
    moe = MoE(D, cfg)
    ex = INT4Experts(D, e, INTER, SCHEME, "cpu")
    p_gu, s_gu = int4_group.quantize(torch.randn(e, 2 * INTER, D, generator=g) * 0.05)
    p_dn, s_dn = int4_group.quantize(torch.randn(e, D, INTER, generator=g) * 0.05)
    with torch.no_grad():
        ex.gate_up_proj.copy_(p_gu)
        ex.gate_up_proj_scale.copy_(s_gu.float().view(e, 2, INTER, D // 32))
        ex.down_proj.copy_(p_dn)
        ex.down_proj_scale.copy_(s_dn.float())
        moe.gate.weight.copy_(torch.randn(e, D, generator=g) * 0.1)
        if moe.gate.e_score_correction_bias is not None:
            moe.gate.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.05)
        if shared:
            for lin in (moe.shared_experts.gate_proj, moe.shared_experts.up_proj, moe.shared_experts.down_proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.05)
    moe.experts = ex
    set_kernel(moe, "native")
    return moe


def bound(moe: MoE, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    sh, moe.shared_experts = moe.shared_experts, None
    try:
        b = _block_bound(moe, x, w, idx)  # the routed part (and the routing weights)
    finally:
        moe.shared_experts = sh
    if sh is not None:  # fp32 rows: the same SwiGLU bound on the stored weights
        wgu = torch.cat([sh.gate_proj.weight, sh.up_proj.weight]).double()
        b = b + 2 * _swiglu_bound(x, wgu, sh.down_proj.weight.double())[1]
    return b


@pytest.mark.parametrize("tokens", [1, 3, BLOCK_TOKENS])
@pytest.mark.parametrize("router", ["v3", "v2"])
@pytest.mark.parametrize("shared", [False, True])
def test_int4_block_equals_the_per_op_path_and_the_reference(router, shared, tokens):
    moe = make_int4_moe(router, shared)
    assert GGUFMoEBlock.unfit(moe) is None and attach_moe_blocks(moe) == 1
    block = moe.native_block
    assert block.args.type_gu == block.args.type_dn == native.INT4_PACKED and block.args.group == 32
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(tokens))
    calls, grouped = [], []
    real, real_grouped = native_layers.moe_block, native.grouped_gemm
    native_layers.moe_block = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    native.grouped_gemm = lambda t, *a, **kw: grouped.append(t) or real_grouped(t, *a, **kw)
    try:
        with torch.no_grad():
            got = moe(x)
            assert calls == [1] and grouped == []  # the block ran, once for the whole layer
            moe.native_block = None
            per_op = moe(x)
            assert set(grouped) == {native.INT4_PACKED}  # the per-op path: INT4Experts' native grouped products
            set_kernel(moe, "torch")
            ref = moe(x)
    finally:
        native_layers.moe_block, native.grouped_gemm = real, real_grouped
    moe.native_block = block
    _, w, idx = routing(block, x)
    b = bound(moe, x, w, idx)
    for other in (per_op, ref):
        excess = (got.double() - other.double()).abs() - b
        assert (excess <= 0).all(), f"max excess over the bound {excess.max().item():.3g}"
    assert not torch.equal(got, ref)  # two computations really ran


def test_routed_products_are_the_grouped_native_ones():
    """Without a shared expert, for the block's routing: the block's per-row products are INT4Experts' native
    grouped products (same kernel, same rows): |block - per-op| stays at the rounding of silu and of the weighted
    sum's order, far below the bound (measured < 1e-6 relative here, printed)."""
    moe = make_int4_moe("v3", shared=False)
    block = GGUFMoEBlock(moe)
    x = torch.randn(BLOCK_TOKENS, D, generator=torch.Generator().manual_seed(7))
    y, w, idx = routing(block, x)
    with torch.no_grad():
        want = moe.experts(x, w, idx)
    rel = ((y - want).abs().max() / want.abs().max()).item()
    print(f"INT4 block vs per-op experts, same routing: max relative difference {rel:.2e}")
    assert rel <= 1e-6


def test_where_the_int4_block_applies():
    """Not with the torch experts (the plan's choice), nor for steps past BLOCK_TOKENS (the per-op path runs)."""
    moe = make_int4_moe("v3", shared=True)
    moe.experts.kernel = "torch"
    assert "INT4 experts with the native kernels" in GGUFMoEBlock.unfit(moe)
    moe.experts.kernel = "native"
    block = GGUFMoEBlock(moe)
    x = torch.randn(BLOCK_TOKENS + 1, D)
    calls = []
    real = native_layers.moe_block
    native_layers.moe_block = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        with torch.no_grad():
            assert torch.equal(block(x), moe.per_op(x))
    finally:
        native_layers.moe_block = real
    assert calls == []


def test_every_isa_build_of_the_int4_block(monkeypatch):
    """The block's INT4 products on the narrower builds this CPU runs too (AVX2-only where it has AVX-512, and
    the scalar fallback), each held to the same bound against the torch reference."""
    from mlaserve.config.cpu import cpu_flags

    builds = [(("-mno-avx512f",), "avx2")] if "avx512f" in cpu_flags() else []
    builds.append((("-mno-avx512f", "-mno-avx2", "-mno-f16c"), "scalar"))
    moe = make_int4_moe("v3", shared=True, seed=2)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        set_kernel(moe, "torch")
        ref = moe.per_op(x)
    for flags, want in builds:
        lib, detail = native_build._build(flags)
        assert lib is not None, detail
        monkeypatch.setitem(native_build._state, "lib", lib)
        assert native.isa() == want
        set_kernel(moe, "native")
        block = GGUFMoEBlock(moe)
        y, w, idx = routing(block, x)
        excess = (y.double() - ref.double()).abs() - bound(moe, x, w, idx)
        assert (excess <= 0).all(), (want, excess.max().item())

"""The MoE block under activations="int8_6bit" (the default for GGUF files): the C block and GGUFExperts' per-op
path must agree on which projection takes int8 activations (the C side: types.c q8rows_in; the holders:
native.takes_int8). A Q4_K gate_up with a Q8_0 down: gate_up int8 (q8_K), down exact. The per-op path runs the
same gate_up codes and products (a row's int8 result does not depend on its batch), so the two differ by the
output's rounding only, as in test_moe_block.py's mixed pairs (measured 1-2 ulp of |y|max there; bound 4 ulp).
Were Q8_0 quantized on one side only, they would differ by the int8 error itself (~1% of |y|)."""

from __future__ import annotations

import pytest
import torch
from test_moe_block import BLOCK_TOKENS, INTER, ROUTERS, D, U, _random_blocks, make_moe, routing, set_kernel

from mlaserve.config.model import MoEConfig
from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import native
from mlaserve.models.moe import MoE
from mlaserve.quant.ggml_linear import GGUFExperts
from mlaserve.quant.ggml_moe_block import GGUFMoEBlock

pytestmark = pytest.mark.skipif(not native.status().available, reason="native kernels unavailable")


def _moe(gu: str, dn: str) -> MoE:
    scoring, method, e, groups, topk_group, k, norm, scale = ROUTERS["v3"]
    moe = MoE(D, MoEConfig(e, k, 0, INTER, scoring, method, groups, topk_group, norm, scale))
    g = torch.Generator().manual_seed(21)
    ex = GGUFExperts(D, e, INTER, GGML_TYPE_IDS[gu], GGML_TYPE_IDS[dn], "cpu")
    with torch.no_grad():
        gate_up = _random_blocks(gu, (e, 2 * INTER), D, g)
        ex.gate_proj.copy_(gate_up[:, :INTER])
        ex.up_proj.copy_(gate_up[:, INTER:])
        ex.down_proj.copy_(_random_blocks(dn, (e, D), INTER, g))
        moe.gate.weight.copy_(torch.randn(e, D, generator=g) * 0.1)
        moe.gate.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.05)
    moe.experts = ex
    set_kernel(moe, "native")
    return moe


@pytest.mark.parametrize("tokens", [1, 2, BLOCK_TOKENS])
@pytest.mark.parametrize("types", [("Q4_K", "Q8_0"), ("Q6_K", "Q4_K")])
def test_block_takes_int8_where_the_holders_do(types, tokens):
    moe = _moe(*types)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(tokens))
    y_float, w, idx = routing(GGUFMoEBlock(moe), x)
    moe.experts.int8 = 6
    block = GGUFMoEBlock(moe)
    assert block.args.int8 == 6
    y, w8, idx8 = routing(block, x)
    assert torch.equal(w8, w) and torch.equal(idx8, idx) and not torch.equal(y, y_float)
    with torch.no_grad():
        per_op = moe.experts(x, w, idx)
    diff, ulp = (y - per_op).abs().max().item(), 2 * U * per_op.abs().max().item()
    print(
        f"\n{types} {tokens}: fused vs per-op {diff:.2e} ({diff / ulp:.1f} ulp); int8 vs float "
        f"{(y - y_float).abs().max().item():.2e}"
    )
    assert diff <= 4 * ulp, (diff, ulp)


@pytest.mark.parametrize("types", ["q4_k-q5_k-q6_k", "q4_k-q5_0-q8_0"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("tokens", [5, 8, BLOCK_TOKENS])
def test_block_products_of_many_rows_take_the_tiles_bits(tokens, split, types):
    """Under int8 activations the block's shared expert (every token) and its routed groups of 8+ pairs run on the
    AMX-INT8 tiles where the process has them (x86/amx.c amx_item), the per-op holders on theirs (GGUFLinear, the
    grouped products): both the VNNI row kernels' bits, so the outputs differ by the final sums' rounding only
    (bound 4 ulp of |y|max, as above). Q4_K / Q6_K (digit planes) and Q5_K (scaled units) in one block: the
    thread's tile shapes change between projections. Without the tiles (or below 8 tokens) the same comparison
    holds on the row kernels. split: the router sends the tokens along +v to experts 0, 1, 4, 5 and those along -v
    to 2, 3, 6, 7, so at 16 tokens eight groups of 8 pairs, each with its own tokens, take their own packs. On an
    AVX2 CPU the shared expert's products of 8+ tokens take the AVX2 panels inside the block (a2_item): the second
    types mix gives it a Q6_K down (the panels' activation pair sums of the shared h), the first a Q6_K up."""
    moe = make_moe("v3", types)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, D, generator=g)
    if split:
        v = torch.randn(D, generator=g)
        v /= v.norm()
        sign = torch.tensor([1.0 if i % 2 else -1.0 for i in range(tokens)])
        x = 0.1 * x + 5.0 * sign[:, None] * v
        with torch.no_grad():
            moe.gate.weight.mul_(0.01)
            moe.gate.weight[[0, 1, 4, 5]] = 2.0 * v
            moe.gate.weight[[2, 3, 6, 7]] = -2.0 * v
            moe.gate.e_score_correction_bias.zero_()
    y_float, w, idx = routing(GGUFMoEBlock(moe), x)
    for m in (moe.experts, moe.shared_experts.gate_proj, moe.shared_experts.up_proj, moe.shared_experts.down_proj):
        m.int8 = 6
    y, w8, idx8 = routing(GGUFMoEBlock(moe), x)
    assert torch.equal(w8, w) and torch.equal(idx8, idx)
    with torch.no_grad():
        per_op = moe(x)
    counts = torch.bincount(idx.flatten(), minlength=16)
    if split:
        assert sorted(counts.tolist()) == [0] * 8 + [tokens // 2] * 4 + [(tokens + 1) // 2] * 4, counts
    tiles = native.library().mls_int8_tile_rows(GGML_TYPE_IDS["Q4_K"])
    diff, ulp = (y - per_op).abs().max().item(), 2 * U * per_op.abs().max().item()
    print(
        f"\n{tokens} tokens (groups {counts.tolist()}, tiles from {tiles} rows): block vs per-op {diff / ulp:.1f} ulp"
    )
    assert diff <= 4 * ulp, (diff, ulp)
    assert (y - y_float).abs().max().item() > 100 * ulp

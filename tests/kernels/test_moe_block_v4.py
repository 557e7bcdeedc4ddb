"""DeepSeek-V4's MoE layer at decode in one native call (quant/ggml_moe_block.py GGUFMoEBlock over a V4MoEBlock:
csrc/moe/block.c with the router's sqrt(softplus) scores or hash routing by token id, the SwiGLU clamped at
swiglu_limit) against the layer's per-op path (models/deepseek_v4/moe.py Router, GGUFV4Experts, SharedExpert), on
random ggml blocks.

What is exact and what rounds: for the same routing the block's routed sum equals the pair-by-pair experts call
(csrc/moe/experts.c, which clamps alike) bit for bit. The router's logits are dot products in another order than
torch's GEMM (|dl| <= D u sum|x w| a side, u = 2^-24), and its scores use expf / log1pf / sqrtf where torch has
its own: the weights are held to the bound propagated from those (_weights_bound), each side against float64. The
shared expert's silu uses expf (a few ulps of h), bounded with the down product's sums (_shared_bound).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_kernels import random_blocks

from mlaserve.config.deepseek_v4_parts import V4MoE
from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import native, native_layers
from mlaserve.models.deepseek_v4.moe import V4MoEBlock
from mlaserve.quant.ggml_deepseek_v4 import GGUFV4Experts
from mlaserve.quant.ggml_linear import BLOCK_TOKENS, GGUFLinear
from mlaserve.quant.ggml_moe_block import GGUFMoEBlock

STATUS = native.status()
pytestmark = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
U = 2.0**-24
D, INTER, E, K, VOCAB = 256, 256, 16, 4, 50
LIMIT = 0.5  # small enough that the random products cross it: the clamps act on both sides


def make_block(hashed: bool, types: tuple[str, str, str], seed: int = 0, shared: bool = True) -> V4MoEBlock:
    """A V4 MoE layer of GGUF holders: routed gate_up / down and the shared expert's three projections."""
    g = torch.Generator().manual_seed(seed)
    cfg = V4MoE(E, K, 1, INTER, 1.5, LIMIT)
    moe = V4MoEBlock(D, cfg, VOCAB, hashed)
    tgu, tdn, tsh = (GGML_TYPE_IDS[n] for n in types)
    ex = GGUFV4Experts(D, E, INTER, LIMIT, tgu, tdn, "cpu")
    with torch.no_grad():
        ex.gate_up_proj.copy_(random_blocks(types[0], 2 * INTER, D, g, lead=(E,)))
        ex.down_proj.copy_(random_blocks(types[1], D, INTER, g, lead=(E,)))
        moe.gate.weight.copy_(torch.randn(E, D, generator=g) * 0.1)
        if hashed:
            moe.gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(VOCAB)]))
        else:
            moe.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.05)
    moe.experts = ex
    for attr, (n, kk) in (("gate_proj", (INTER, D)), ("up_proj", (INTER, D)), ("down_proj", (D, INTER))):
        lin = GGUFLinear(kk, n, tsh, False, torch.float32, "cpu")
        with torch.no_grad():
            lin.weight.copy_(random_blocks(types[2], n, kk, g))
        setattr(moe.shared_experts, attr, lin)
    for m in moe.modules():
        if "native" in getattr(m, "KERNELS", ()):
            m.kernel = "native"
    if not shared:
        moe.shared_experts = None
    return moe


def run_block(block: GGUFMoEBlock, x: torch.Tensor, ids: torch.Tensor):
    w, idx = torch.empty(x.shape[0], K), torch.empty(x.shape[0], K, dtype=torch.int64)
    y = native_layers.moe_block(block.args, x, (w, idx), ids=ids if block.hashed else None)
    return y, w, idx


def _weights_bound(moe: V4MoEBlock, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, dw) [T, k] float64: the exact routing weights of experts idx and one fp32 side's bound: the logits'
    dot order D u sum|x w|, through sqrt(softplus) (derivative sigmoid(l) / (2 s)) plus 6 u s for exp, log1p and
    sqrt, then the normalisation and a few roundings."""
    wg, xd = moe.gate.weight.double(), x.double()
    logits = xd @ wg.T
    dl = D * U * (xd.abs() @ wg.abs().T)
    s = F.softplus(logits).sqrt()
    ds = dl * torch.sigmoid(logits) / (2 * s) + 6 * U * s
    s_j, ds_j = s.gather(1, idx), ds.gather(1, idx)
    tot = s_j.sum(-1, keepdim=True)
    w = s_j / tot
    dw = ds_j / tot + s_j * ds_j.sum(-1, keepdim=True) / tot**2 + 4 * U * w
    return 1.5 * w, 1.5 * dw


@pytest.mark.parametrize("tokens", [1, 2, 5, BLOCK_TOKENS])
@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("types", [("Q8_0", "Q8_0", "Q8_0"), ("Q4_K", "Q6_K", "Q4_K")])
def test_routing_and_routed_sum(types, hashed, tokens):
    """The block's routing is the Router's (the same experts; hash layers: tid2eid of the token), its weights
    within the derived bound of the exact ones (so are the per-op router's), and its routed sum for that routing
    is the clamped pair-by-pair experts call's, bit for bit."""
    moe = make_block(hashed, types, shared=False)
    block = GGUFMoEBlock(moe)
    g = torch.Generator().manual_seed(tokens)
    x, ids = torch.randn(tokens, D, generator=g), torch.randint(0, VOCAB, (tokens,), generator=g)
    y, w, idx = run_block(block, x, ids)
    ref_w, ref_idx = moe.gate(x, ids)
    order, ref_order = idx.argsort(-1), ref_idx.argsort(-1)
    assert torch.equal(idx.gather(1, order), ref_idx.gather(1, ref_order))
    if hashed:
        assert torch.equal(idx, moe.gate.tid2eid[ids])
    exact, bound = _weights_bound(moe, x, idx)
    assert ((w.double() - exact).abs() <= bound).all()
    assert ((ref_w.gather(1, ref_order).double() - exact.gather(1, order)).abs() <= bound.gather(1, order)).all()
    ex = moe.experts
    want = native.moe_experts(
        ex.type_gate_up, ex.type_down, x, ex.gate_proj, ex.up_proj, ex.down_proj, idx, w, limit=LIMIT
    )
    assert torch.equal(y, want)
    clamped = F.linear(x, ex.expert(int(idx[0, 0]))[0][:INTER]).abs().max().item()
    assert clamped > LIMIT  # the clamp acts in this test's data


def _shared_bound(moe: V4MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """|dy| [T, D] float64 between two fp32 shared experts with the same products: h's silu (expf against torch's
    exp: 8 u |h|) through the down weight, and the sum with the routed part (2 u of each side's magnitude)."""
    sh = moe.shared_experts
    xd = x.double()
    g, up = xd @ sh.gate_proj.dequantize().double().T, xd @ sh.up_proj.dequantize().double().T
    h = F.silu(g.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT)
    wd = sh.down_proj.dequantize().double()
    return (8 * U * h.abs()) @ wd.abs().T + INTER * 2 * U * (h.abs() @ wd.abs().T)


@pytest.mark.parametrize("hashed", [False, True])
def test_the_block_equals_the_per_op_path(hashed):
    """The whole layer: for the block's routing, the routed sum plus the per-op shared expert (GGUFLinear products,
    torch's clamped SwiGLU) within the shared expert's bound; the layer's forward takes the block at decode sizes
    and hands a prompt (more than BLOCK_TOKENS rows) to per_op."""
    moe = make_block(hashed, ("Q8_0", "Q8_0", "Q8_0"))
    moe.native_block = block = GGUFMoEBlock(moe)
    g = torch.Generator().manual_seed(5)
    x, ids = torch.randn(3, D, generator=g), torch.randint(0, VOCAB, (3,), generator=g)
    y, w, idx = run_block(block, x, ids)
    ex = moe.experts
    routed = native.moe_experts(
        ex.type_gate_up, ex.type_down, x, ex.gate_proj, ex.up_proj, ex.down_proj, idx, w, limit=LIMIT
    )
    want = routed + moe.shared_experts(x)
    bound = _shared_bound(moe, x) + 2 * U * (routed.abs() + want.abs()).double()
    assert ((y.double() - want.double()).abs() <= bound).all()
    assert torch.equal(moe(x, ids), y)  # forward: the block
    xp, idsp = torch.randn(BLOCK_TOKENS + 1, D, generator=g), torch.randint(0, VOCAB, (BLOCK_TOKENS + 1,), generator=g)
    assert torch.equal(moe(xp, idsp), moe.per_op(xp, idsp))  # a prompt: per_op


def test_nothing_silently_wrong():
    """A token id outside the hash table is an error naming it, never a routing; a NaN row stays NaN (the clamps
    keep it, as torch's clamp does) and leaves the other rows as they were alone."""
    moe = make_block(True, ("Q8_0", "Q8_0", "Q8_0"))
    block = GGUFMoEBlock(moe)
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(9))
    with pytest.raises(RuntimeError, match="token id outside the tid2eid table"):
        native_layers.moe_block(block.args, x, ids=torch.tensor([3, VOCAB]))
    with pytest.raises(ValueError, match="token ids"):
        native_layers.moe_block(block.args, x)
    alone = native_layers.moe_block(block.args, x[1:], ids=torch.tensor([7]))
    x[0, 5] = math.nan
    y = native_layers.moe_block(block.args, x, ids=torch.tensor([3, 7]))
    assert y[0].isnan().all() and torch.equal(y[1], alone[0])


def test_unfit_layers_keep_the_per_op_path():
    """A shared expert clamped at another limit than the routed experts, or an expert-parallel shard: per op."""
    moe = make_block(False, ("Q8_0", "Q8_0", "Q8_0"))
    assert GGUFMoEBlock.unfit(moe) is None
    moe.shared_experts.limit = 2 * LIMIT
    assert "swiglu_limit" in GGUFMoEBlock.unfit(moe)
    moe.shared_experts.limit = LIMIT
    moe.expert_shard = object()
    assert "expert parallel" in GGUFMoEBlock.unfit(moe)

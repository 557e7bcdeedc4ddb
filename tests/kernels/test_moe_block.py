"""The MoE block at decode in one native call (quant.ggml_moe_block.GGUFMoEBlock, blocks.c mls_moe_block) against
MoE.forward's per-op path (the native router + experts calls and three GGUFLinear products) and the torch
reference (dequantize, then F.linear), on random ggml blocks of several types.

What is exact and what rounds: for the same routing the block's routed sum equals the pair-by-pair experts
call bit for bit (the grouping by expert changes no row's operations, the weighted sum runs in the same
order). The gate's logits are dot products in another order than torch's GEMM (|dl| <= 2 D u sum|x w|, u =
2^-24 per side), which moves the routing weights by the propagated amount (_weights_bound); the shared
expert's silu uses expf where torch uses its own exp (a few ulps of h). Every other difference is fp32
summation order, bounded as in tests/gguf/test_gguf_quantized.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kernels import random_blocks

from mlaserve.config.model import MoEConfig
from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import ggml, native, native_build, native_layers
from mlaserve.models.moe import MoE
from mlaserve.quant.ggml_linear import BLOCK_TOKENS, GGUFExperts, GGUFLinear
from mlaserve.quant.ggml_moe_block import GGUFMoEBlock, attach_moe_blocks

STATUS = native.status()
pytestmark = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
U = 2.0**-24
D, INTER = 256, 256  # whole 256-value super-blocks for the K-quants
# (routed gate_up, routed down, shared gate, shared up, shared down): one type everywhere, and Q4_K_M-like mixes
TYPES = {
    "q8_0": ("Q8_0",) * 5,
    "q4_0-q6_k": ("Q4_0", "Q6_K", "Q4_0", "Q4_0", "Q6_K"),
    "q4_0": ("Q4_0",) * 5,  # every projection on the 2+-row pairs (int8) where groups have 2+ rows
    "q4_k-q5_0-q8_0": ("Q4_K", "Q5_0", "Q4_K", "Q8_0", "Q6_K"),
    # the AMX-INT8 tiles' two hooks (digit planes: Q4_K, Q6_K; scaled units: Q5_K) in one block
    "q4_k-q5_k-q6_k": ("Q4_K", "Q5_K", "Q4_K", "Q6_K", "Q5_K"),
}
ROUTERS = {  # (scoring, topk_method, experts, n_group, topk_group, k, norm, scale)
    "v3": ("sigmoid", "noaux_tc", 16, 4, 2, 4, True, 2.5),
    "v2": ("softmax", "group_limited_greedy", 16, 4, 2, 3, False, 16.0),
    "v2-lite": ("softmax", "greedy", 8, 1, 1, 2, False, 1.0),
}


def _random_blocks(name: str, shape: tuple[int, ...], k: int, g: torch.Generator) -> torch.Tensor:
    *lead, rows = shape
    return random_blocks(name, rows, k, g, lead=tuple(lead))


def make_moe(router: str, types: str, shared: bool = True, seed: int = 0) -> MoE:
    scoring, method, e, groups, topk_group, k, norm, scale = ROUTERS[router]
    cfg = MoEConfig(e, k, int(shared), INTER, scoring, method, groups, topk_group, norm, scale)
    tgu, tdn, tsg, tsu, tsd = (GGML_TYPE_IDS[n] for n in TYPES[types])
    g = torch.Generator().manual_seed(seed)
    moe = MoE(D, cfg)
    ex = GGUFExperts(D, e, INTER, tgu, tdn, "cpu")
    with torch.no_grad():
        gate_up = _random_blocks(TYPES[types][0], (e, 2 * INTER), D, g)
        ex.gate_proj.copy_(gate_up[:, :INTER])
        ex.up_proj.copy_(gate_up[:, INTER:])
        ex.down_proj.copy_(_random_blocks(TYPES[types][1], (e, D), INTER, g))
        moe.gate.weight.copy_(torch.randn(e, D, generator=g) * 0.1)
        if moe.gate.e_score_correction_bias is not None:
            moe.gate.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.05)
    moe.experts = ex
    if shared:
        for attr, t, (n, kk) in (
            ("gate_proj", tsg, (INTER, D)),
            ("up_proj", tsu, (INTER, D)),
            ("down_proj", tsd, (D, INTER)),
        ):
            lin = GGUFLinear(kk, n, t, False, torch.float32, "cpu")
            with torch.no_grad():
                lin.weight.copy_(
                    _random_blocks(TYPES[types][2 + ("gate_proj", "up_proj", "down_proj").index(attr)], (n,), kk, g)
                )
            setattr(moe.shared_experts, attr, lin)
    set_kernel(moe, "native")
    return moe


def set_kernel(moe: MoE, kernel: str) -> None:
    for m in moe.modules():
        if kernel in getattr(m, "KERNELS", ()):
            m.kernel = kernel


def routing(block: GGUFMoEBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = block.args.kk
    w, idx = torch.empty(x.shape[0], k), torch.empty(x.shape[0], k, dtype=torch.int64)
    y = native_layers.moe_block(block.args, x, (w, idx))
    return y, w, idx


def sorted_rows(w: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k order is unspecified: compare routings as sets (rows sorted by expert id)."""
    order = idx.argsort(dim=-1)
    return w.gather(1, order), idx.gather(1, order)


def _weights_bound(moe: MoE, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """|dw| [T, k] between two routings whose logits differ by at most 2 D u sum|x w| (each side's dot order),
    propagated through the scores (sigmoid: |ds| <= |dl| / 4; softmax: |dp| <= p (2 max|dl| + (E + 4) u)) and
    the normalisation, plus a few roundings of w."""
    cfg, wg = moe.gate.cfg, moe.gate.weight.double()
    xd = x.double()
    logits = xd @ wg.T
    dl = 2 * D * U * (xd.abs() @ wg.abs().T)
    if cfg.scoring_func == "sigmoid":
        s = logits.sigmoid()
        ds = dl / 4 + 2 * U * s
    else:
        s = logits.softmax(-1)
        ds = s * (2 * dl.amax(-1, keepdim=True) + (s.shape[-1] + 4) * U)
    s_j, ds_j = s.gather(1, idx), ds.gather(1, idx)
    if cfg.norm_topk_prob:
        tot = s_j.sum(-1, keepdim=True)
        w = s_j / tot
        dw = ds_j / tot + s_j * ds_j.sum(-1, keepdim=True) / tot**2
    else:
        w, dw = s_j, ds_j
    return cfg.routed_scaling_factor * (dw + 4 * U * w)


def _swiglu_bound(x: torch.Tensor, wgu: torch.Tensor, wdn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, dy) [T, D] float64 for one expert applied to each row of x: the exact down(silu(g) * u) and the bound of
    one fp32 side's error: dg, du <= D u' (|x| |W|) (u' = 2u: a side against the exact value); dh <= 1.1 |u| dg +
    (|g| + dg) du + 8 u |h| (silu's exp and the products); dy <= I u' (|W_down| |h|) + |W_down| dh."""
    xd = x.double()
    g, up = (xd @ wgu.T).chunk(2, -1)
    dg, du = (D * 2 * U * (xd.abs() @ wgu.abs().T)).chunk(2, -1)
    h = F.silu(g) * up
    dh = 1.1 * up.abs() * dg + (g.abs() + dg) * du + 8 * U * h.abs()
    return h @ wdn.T, INTER * 2 * U * (h.abs() @ wdn.abs().T) + dh @ wdn.abs().T


def _block_bound(moe: MoE, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """|y_a - y_b| [T, D] for two fp32 computations of the block with the same experts: both sides' rounding
    (2x one side's) plus the routing weights' difference times each expert's output."""
    gu, dn = (t.double() for t in moe.experts.dequantize())
    dw = _weights_bound(moe, x, idx)
    bound = torch.zeros(x.shape[0], D, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            y, dy = _swiglu_bound(x[t : t + 1], gu[e], dn[e])
            bound[t] += 2 * w[t, j].double().abs() * dy[0] + dw[t, j] * y[0].abs()
    sh = moe.shared_experts
    if sh is not None:
        wgu = torch.cat([sh.gate_proj.dequantize(), sh.up_proj.dequantize()]).double()
        _, dy = _swiglu_bound(x, wgu, sh.down_proj.dequantize().double())
        bound += 2 * dy
    return bound + 1e-30


@pytest.mark.parametrize("tokens", [1, 2, 5, BLOCK_TOKENS])  # 2: the pair-by-pair call's limit; 16: experts shared
@pytest.mark.parametrize("types", list(TYPES))
def test_routed_sum_equals_the_pairwise_experts_call(types, tokens):
    """Grouping the pairs by expert (each active expert's rows read once for all its pairs) changes nothing:
    bit for bit the pair-by-pair call's result for the block's own routing."""
    moe = make_moe("v3", types, shared=False)
    block = GGUFMoEBlock(moe)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(tokens))
    y, w, idx = routing(block, x)
    ex = moe.experts
    want = native.moe_experts(ex.type_gate_up, ex.type_down, x, ex.gate_proj, ex.up_proj, ex.down_proj, idx, w)
    assert torch.equal(y, want)
    if tokens == BLOCK_TOKENS:
        assert idx.unique().numel() < idx.numel()  # some expert serves several pairs: the grouped branch ran


@pytest.fixture(params=["machine", "avx2"])
def build(request, monkeypatch):
    """The machine's build of the native library, or its AVX2 build on an AVX-512 CPU (there the one-row Q4_K /
    Q5_K products take x86/rows16_q8k.c's 8-row kernel, which the block calls as the AVX-512 build's 16-row one)."""
    if request.param == "avx2":
        from mlaserve.config.cpu import cpu_flags

        if "avx512f" not in cpu_flags():
            pytest.skip("no AVX-512: the machine's build is the AVX2 one")
        lib, detail = native_build._build(("-mno-avx512f",))
        assert lib is not None, detail
        monkeypatch.setitem(native_build._state, "lib", lib)
    return request.param


@pytest.mark.parametrize("tokens", [1, 2, 5, BLOCK_TOKENS])
@pytest.mark.parametrize("types", list(TYPES))
def test_int8_routed_experts_follow_the_per_op_rule(types, tokens, build):
    """activations="int8": the block quantizes a projection's activations when its type has int8 kernels under the
    setting (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K; native.takes_int8), each projection on its own, as GGUFExperts' per-op
    path does. All-Q8_0: bit for bit the pairwise int8 call. A setting no type takes (3 bits): the float block, bit
    for bit. Mixed pairs (Q4_0 / Q6_K, Q4_K / Q5_0 without an int8 kernel): the per-op path's result to fp32
    rounding. In the machine's build and in the AVX2 one."""
    moe = make_moe("v3", types, shared=False)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(tokens))
    y_float, w, idx = routing(GGUFMoEBlock(moe), x)
    for m in moe.modules():
        if hasattr(m, "int8"):
            m.int8 = 3  # below every type's bits
    assert torch.equal(routing(GGUFMoEBlock(moe), x)[0], y_float)
    for m in moe.modules():
        if hasattr(m, "int8"):
            m.int8 = True
    block = GGUFMoEBlock(moe)
    assert block.args.int8 == native.INT8_ALL  # a holder's int8=True: every type with int8 kernels
    y, w8, idx8 = routing(block, x)
    assert torch.equal(w8, w) and torch.equal(idx8, idx)
    ex = moe.experts
    if types == "q8_0":
        g, u, dn = ex.gate_proj, ex.up_proj, ex.down_proj
        want = ggml.moe_experts(x, w, idx, g, u, ex.type_gate_up, dn, ex.type_down, int8=True)
        assert torch.equal(y, want) and not torch.equal(y, y_float)
    else:
        with torch.no_grad():
            per_op = ex(x, w, idx)
            ex.int8 = False
            exact = ex(x, w, idx)
        assert not torch.equal(y, y_float)
        # The same int8 codes and products, summed in another order: rounding of the output, not the int8 error
        # (|per_op - exact| 3.9-7.8 here). Measured 6.1e-5 for |y|max 470-740 (0.7-1.1 of its spacing 2^-23 |y|max,
        # one or two ulp); bound 4 of it.
        diff, ulp = (y - per_op).abs().max().item(), 2 * U * per_op.abs().max().item()
        print(
            f"{types} {tokens}: fused vs per-op int8 {diff:.2e} ({diff / ulp:.1f} ulp), int8 error "
            f"{(per_op - exact).abs().max().item():.2f}"
        )
        assert diff <= 4 * ulp, (diff, ulp)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("router", list(ROUTERS))
def test_routing_equals_the_gate(router, tokens):
    """The block's logits + router choose the experts Gate's torch ops choose, with weights within the bound
    of the logits' summation order."""
    moe = make_moe(router, "q8_0")
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(3))
    _, w, idx = routing(GGUFMoEBlock(moe), x)
    set_kernel(moe, "torch")
    want_w, want_idx = moe.gate(x)
    (w, idx), (want_w, want_idx) = sorted_rows(w, idx), sorted_rows(want_w, want_idx)
    assert torch.equal(idx, want_idx)
    assert ((w.double() - want_w.double()).abs() <= _weights_bound(moe, x, idx)).all()


@pytest.mark.parametrize("tokens", [1, 3, BLOCK_TOKENS])
@pytest.mark.parametrize("router", ["v3", "v2"])
@pytest.mark.parametrize("types", list(TYPES))
def test_block_equals_the_per_op_path_and_the_reference(types, router, tokens):
    """MoE.forward with the block against its per-op native path and against the torch reference
    (dequantized weights, F.linear), with the shared expert: the same experts, outputs within the bound."""
    moe = make_moe(router, types)
    assert attach_moe_blocks(moe) == 1 and moe.native_block is not None
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(5))
    calls = []
    real = native_layers.moe_block
    native_layers.moe_block = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        with torch.no_grad():
            got = moe(x)
    finally:
        native_layers.moe_block = real
    assert calls == [1]  # the block ran, once for the whole layer
    _, w, idx = routing(moe.native_block, x)
    block = moe.native_block
    moe.native_block = None
    with torch.no_grad():
        per_op = moe(x)
        set_kernel(moe, "torch")
        ref = moe(x)
    moe.native_block = block
    bound = _block_bound(moe, x, w, idx)
    for other in (per_op, ref):
        excess = (got.double() - other.double()).abs() - bound
        assert (excess <= 0).all(), f"max excess over the bound {excess.max().item():.3g}"
    assert not torch.equal(got, ref)  # two computations really ran


def test_where_the_block_applies():
    """Attached only where every expert weight is a native ggml holder, with one activation choice; used only
    for fp32 steps of up to BLOCK_TOKENS tokens (prefill and bf16 take the per-op path)."""
    moe = make_moe("v3", "q8_0")
    set_kernel(moe, "torch")
    assert GGUFMoEBlock.unfit(moe) is not None and attach_moe_blocks(moe) == 0
    set_kernel(moe, "native")
    moe.shared_experts.up_proj.int8 = True  # one activation choice per block (the loader sets every holder alike)
    assert "activations" in GGUFMoEBlock.unfit(moe)
    moe.shared_experts.up_proj.int8 = False
    assert attach_moe_blocks(moe) == 1 and moe.native_block.args.int8 == 0
    dense = MoE(D, moe.gate.cfg)  # float experts (a safetensors model): no block
    assert GGUFMoEBlock.unfit(dense) is not None
    calls = []
    real = native_layers.moe_block
    native_layers.moe_block = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        with torch.no_grad():
            moe(torch.randn(BLOCK_TOKENS + 1, D))  # a prefill chunk
            moe(torch.randn(2, D).bfloat16().float()[:, ::1])  # fp32 again: runs
            moe(torch.randn(2, 2 * D)[:, ::2])  # not contiguous: per-op path
    finally:
        native_layers.moe_block = real
    assert calls == [1]

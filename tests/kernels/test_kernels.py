"""The native block kernels (mlaserve/kernels/blocks.c) against the pure-torch reference.

Decoding: every ggml block type and float8 e4m3 (with partial edge blocks, channel and tensor
scales) decodes to exactly the reference dequantizer's values, bit for bit.
Products: the native GEMV (up to GEMV_ROWS rows), decode-then-BLAS (more rows) and the grouped
expert kernel agree with "dequantize, then fp32 GEMM" within the fp32 summation-order bound
|y - y_ref| <= 2 K u (|x| @ |W|^T), u = 2^-24: each side's rounding error is at most K u sum|x w|
(the standard bound for a K-term dot product), whatever order it sums in.
Skipped, with the reason, where no C compiler can build the library.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlaserve.config.cpu import cpu_flags
from mlaserve.config.engine import EngineOptions, resolve
from mlaserve.config.model import ConfigError
from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import ggml, native, native_build
from mlaserve.quant import fp8_block

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")

# where each type keeps its fp16 scales (d, and dmin / m): set to sane values in random blocks
SCALE_BYTES = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
U = 2.0**-24


def random_blocks(name: str, rows: int, k: int, g: torch.Generator, lead: tuple[int, ...] = ()) -> torch.Tensor:
    """Random bits in every quant field, finite fp16 scales in (0.001, 0.021): [*lead, rows, R] uint8."""
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    shape = (*lead, rows, k // t.block_size)
    raw = torch.randint(0, 256, (*shape, t.type_size), dtype=torch.uint8, generator=g)
    for off in SCALE_BYTES[name]:
        d = (torch.rand(shape, generator=g) * 0.02 + 0.001).half()
        raw[..., off : off + 2] = d.view(torch.uint8).view(*shape, 2)
    return raw.flatten(-2).contiguous()


def gguf_py_dense(raw: torch.Tensor, name: str) -> torch.Tensor:
    """Blocks dequantized by the gguf package (llama.cpp's gguf-py): the reference that is not our own code."""
    import gguf
    import numpy as np

    flat = raw.reshape(-1, raw.shape[-1]).numpy()
    dense = gguf.quants.dequantize(flat, gguf.GGMLQuantizationType[name]).astype(np.float32)
    return torch.from_numpy(dense).reshape(*raw.shape[:-1], -1)


def assert_within_sum_bound(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    bound = 2 * x.shape[-1] * U * (x.abs() @ w.abs().T)
    excess = (y - ref).abs() - bound
    assert (excess <= 0).all(), f"max excess over the fp32 bound {excess.max().item():.3g}"


@needs_native
@pytest.mark.parametrize("name", list(SCALE_BYTES))
def test_native_decode_is_bit_identical(name):
    g = torch.Generator().manual_seed(1)
    t, k = GGML_TYPE_IDS[name], 512
    raw = random_blocks(name, 24, k, g)
    ref = ggml.dense(raw, t, k)
    got = native.dequantize(t, raw, k)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@needs_native
@pytest.mark.parametrize("name", list(SCALE_BYTES))
def test_native_expert_decode_is_bit_identical(name):
    """A prefill's active experts decoded where they lie in the stack (no gathered copy)."""
    g = torch.Generator().manual_seed(5)
    t, k = GGML_TYPE_IDS[name], 512
    raw = random_blocks(name, 6, k, g, lead=(5,))
    experts = torch.tensor([4, 0, 2])  # any order, not all of them
    got = native.dequantize_experts(t, raw, experts, k)
    assert torch.equal(got.view(torch.int32), ggml.dense(raw[experts], t, k).view(torch.int32))


@needs_native
@pytest.mark.parametrize("chunk_experts", [1, 2, 3])
def test_native_prefill_experts_in_chunks_equal_one_call(monkeypatch, chunk_experts):
    """Many rows per expert decode the experts EXPERT_BYTES at a time: the same products as all at once."""
    g = torch.Generator().manual_seed(6)
    t, k, n = GGML_TYPE_IDS["Q8_0"], 256, 24
    raw = random_blocks("Q8_0", n, k, g, lead=(6,))
    experts = torch.tensor([0, 1, 3, 4, 5])
    offs = torch.cumsum(torch.tensor([40, 0, 33, 50, 20]), 0).to(torch.int32)  # an empty group too
    xs = torch.randn(int(offs[-1]), k, generator=g)
    whole = ggml.expert_linear(xs, raw, t, k, experts, offs, kernel="native")
    monkeypatch.setattr(ggml, "EXPERT_BYTES", chunk_experts * n * k * 4)
    assert torch.equal(ggml.expert_linear(xs, raw, t, k, experts, offs, kernel="native"), whole)
    ref = ggml.expert_linear(xs, raw, t, k, experts, offs, kernel="torch")
    assert torch.allclose(whole, ref, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("parts", [2, 3, 7])
def test_native_prefill_dense_in_parts_equals_the_parts_gemms(monkeypatch, parts):
    """Many rows of a dense weight decode it DENSE_BYTES of rows at a time into one buffer: each part's columns are
    that part's GEMM on its exactly decoded rows, bit for bit, and the whole within the fp32 summation bound of the
    one-call product (bit for bit only where the BLAS sums a column in the same order at every N: MKL's kernels on a
    2-core AMD EPYC did not, 1-ulp differences at 3 and 7 parts)."""
    g = torch.Generator().manual_seed(7)
    t, k, n = GGML_TYPE_IDS["Q4_K"], 256, 100  # 100 rows: parts of 16-row multiples and a shorter last one
    raw = random_blocks("Q4_K", n, k, g)
    w = gguf_py_dense(raw, "Q4_K")
    x = torch.randn(ggml.PANEL_ROWS + 9, k, generator=g)  # decode-then-BLAS (fewer rows: decoded panels, AVX-512)
    whole = ggml.linear(x, raw, t, k, kernel="native")
    monkeypatch.setattr(ggml, "DENSE_BYTES", -(-n // parts) * k * 4)
    per = ggml.chunk_rows(n, k * 4, ggml.DENSE_BYTES)
    assert len(range(0, n, per)) == parts
    by_part = torch.cat([F.linear(x, w[n0 : n0 + per]) for n0 in range(0, n, per)], dim=1)
    got = ggml.linear(x, raw, t, k, kernel="native")
    assert torch.equal(got, by_part)
    assert_within_sum_bound(got, whole, x, w)
    assert_within_sum_bound(whole, F.linear(x, w), x, w)


def test_dense_parts_and_decoder_buffers():
    assert ggml.chunk_rows(100, 1024, 1 << 20) == 112  # one part: the whole weight (rounded up to 16 rows)
    assert ggml.chunk_rows(1000, 1024, 256 << 10) == 256  # four parts of 250 rows, rounded up to 16
    assert ggml.chunk_rows(40, 1 << 20, 1) == 16  # never fewer than 16 rows
    raw = random_blocks("Q8_0", 4, 64, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"decoder buffer \(4, 32\)"):
        native.dequantize(GGML_TYPE_IDS["Q8_0"], raw, 64, out=torch.empty(4, 32))


@needs_native
@pytest.mark.parametrize("name", list(SCALE_BYTES))
@pytest.mark.parametrize("rows", [1, 2, 3, 6, ggml.GEMV_ROWS, ggml.GEMV_ROWS + 1, 40])
def test_native_linear_equals_dequantize_then_gemm(name, rows):
    g = torch.Generator().manual_seed(2)
    t, k = GGML_TYPE_IDS[name], 768
    raw = random_blocks(name, 37, k, g)
    w = gguf_py_dense(raw, name)
    assert torch.equal(ggml.dense(raw, t, k), w)
    x = torch.randn(rows, k, generator=g)
    ref = F.linear(x, w)
    assert torch.equal(ggml.linear(x, raw, t, k, kernel="torch"), ref)  # the torch path: dequantize, then GEMM
    assert_within_sum_bound(ggml.linear(x, raw, t, k, kernel="native"), ref, x, w)
    # bf16 activations: the product still runs in fp32
    xb = x.bfloat16()
    assert_within_sum_bound(ggml.linear(xb, raw, t, k, kernel="native"), F.linear(xb.float(), w), xb.float(), w)


@needs_native
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q5_0"])
@pytest.mark.parametrize("pairs_per_expert", [1, 2, 3, 40])
def test_native_expert_linear_equals_grouped_gemm(name, pairs_per_expert):
    g = torch.Generator().manual_seed(3)
    t, k, e, n = GGML_TYPE_IDS[name], 512, 6, 20
    raw = random_blocks(name, n, k, g, lead=(e,))
    experts = torch.tensor([0, 2, 5])
    counts = torch.tensor([pairs_per_expert, 1, pairs_per_expert + 2])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = torch.randn(int(counts.sum()), k, generator=g)
    ref = ggml.expert_linear(xs, raw, t, k, experts, offs, kernel="torch")
    got = ggml.expert_linear(xs, raw, t, k, experts, offs, kernel="native")
    dense = ggml.dense(raw, t, k)
    start = 0
    for a, c in zip(experts.tolist(), counts.tolist()):
        rows = slice(start, start + c)
        assert_within_sum_bound(got[rows], ref[rows], xs[rows], dense[a])
        assert torch.allclose(ref[rows], F.linear(xs[rows], dense[a]))
        start += c


@needs_native
@pytest.mark.parametrize(
    "shape, block", [((260, 300), (128, 128)), ((70, 50), (32, 24)), ((9, 7), (1, 7)), ((33, 65), (33, 65))]
)
def test_native_fp8_decode_and_gemv(shape, block):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(shape, generator=g)
    q, s = fp8_block.quantize(w, block)
    ref = fp8_block.dequantize_reference(q, s, block)
    grid = native.ScaleGrid(s.contiguous(), block[0], s.shape[1], block[1], shape[0])
    got = native.dequantize(native.FP8_E4M3, q.view(torch.uint8), shape[1], grid)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    x = torch.randn(5, shape[1], generator=g)
    y = native.gemm(native.FP8_E4M3, x, q.view(torch.uint8), shape[1], grid)
    assert_within_sum_bound(y, F.linear(x, ref), x, ref)


def _fp8_linear(n_in: int, n_out: int, bias: bool, g: torch.Generator):
    """(scheme, an FP8Linear [n_out, n_in]) with random e4m3 weights in 64 x 32 scale blocks (bias left zero)."""
    from mlaserve.quant.config import parse_quantization
    from mlaserve.quant.linear import FP8Linear

    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 32], "activation_scheme": "dynamic"}
    scheme = parse_quantization({"quantization_config": qc})
    lin = FP8Linear(n_in, n_out, scheme, bias, torch.float32, "cpu")
    q, s = fp8_block.quantize(torch.randn(n_out, n_in, generator=g), (64, 32))
    lin.weight.data.copy_(q)
    getattr(lin, lin.scale_name).data.copy_(s)
    return scheme, lin


@needs_native
def test_native_fp8_holders_equal_torch_holders():
    from mlaserve.quant.linear import FP8Experts

    g = torch.Generator().manual_seed(5)
    scheme, lin = _fp8_linear(100, 90, False, g)
    w = lin.dequantize()
    for rows in (1, 7, 30):
        x = torch.randn(rows, 100, generator=g)
        lin.kernel = "torch"
        ref = lin(x)
        lin.kernel = "native"
        assert_within_sum_bound(lin(x), ref, x, w)
    ex = FP8Experts(96, 5, 40, scheme, "cpu")
    qg, sg = fp8_block.quantize(torch.randn(5, 2, 40, 96, generator=g), (64, 32))
    qd, sd = fp8_block.quantize(torch.randn(5, 96, 40, generator=g), (64, 32))
    ex.gate_up_proj.data.copy_(qg.flatten(1, 2))
    ex.gate_up_proj_scale.data.copy_(sg)
    ex.down_proj.data.copy_(qd)
    ex.down_proj_scale.data.copy_(sd)
    some = torch.tensor([0, 2, 4])
    ex.kernel = "torch"
    ref_w = ex.expert_weights(some, torch.float32)
    ex.kernel = "native"  # the prefill path: routed experts decoded natively, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(ex.expert_weights(some, torch.float32), ref_w))
    for tokens in (1, 4, 60):
        x = torch.randn(tokens, 96, generator=g)
        idx = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(tokens)])
        wts = torch.rand(tokens, 2, generator=g)
        ex.kernel = "torch"
        ref = ex(x, wts, idx)
        ex.kernel = "native"
        got = ex(x, wts, idx)
        # two products deep (gate_up, then down): relative agreement at fp32 rounding scale
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), tokens


@needs_native
@pytest.mark.parametrize("bias", [False, True])
def test_native_fp8_prefill_in_parts_equals_the_parts_gemms(monkeypatch, bias):
    """An FP8Linear's many-rows product decodes DENSE_BYTES of rows at a time (made small: parts of whole 64-row
    scale blocks, 200 rows = 3 parts and a shorter last one): each part its own GEMM on its decoded rows, bias
    included, bit for bit; the whole within the fp32 summation bound of decoding it whole (as the dense test above)."""
    g = torch.Generator().manual_seed(8)
    _, lin = _fp8_linear(96, 200, bias, g)
    if bias:
        lin.bias.data.copy_(torch.randn(200, generator=g))
    lin.kernel = "native"
    x = torch.randn(ggml.GEMV_ROWS + 5, 96, generator=g)
    whole = lin(x)
    monkeypatch.setattr(ggml, "DENSE_BYTES", 50 * 96 * 4)  # 50 rows a part, rounded up to a 64-row block
    assert ggml.chunk_rows(200, 96 * 4, ggml.DENSE_BYTES, 64) == 64
    w, b = lin.dequantize(), lin.bias if bias else None
    by_part = torch.cat(
        [F.linear(x, w[n0 : n0 + 64], b[n0 : n0 + 64] if bias else None) for n0 in range(0, 200, 64)], 1
    )
    got = lin(x)
    assert torch.equal(got, by_part)  # each part its own GEMM (the whole: within the bound below, as one call)
    assert_within_sum_bound(got - (b if bias else 0), whole - (b if bias else 0), x, w)
    lin.kernel = "torch"
    assert_within_sum_bound(whole - (lin.bias if bias else 0), lin(x) - (lin.bias if bias else 0), x, lin.dequantize())


def test_kernels_option_resolution():
    from hf_models import make_config

    from mlaserve.config.model import ModelConfig

    cfg = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    ok = lambda: (True, "built")  # noqa: E731
    missing = lambda: (False, "no C compiler on PATH")  # noqa: E731
    assert resolve(cfg, EngineOptions(device="cpu"), False, native_kernels=ok).kernels.impl == "native"
    assert resolve(cfg, EngineOptions(device="cpu"), False, native_kernels=missing).kernels.impl == "torch"
    assert resolve(cfg, EngineOptions(device="cpu"), False).kernels.impl == "torch"  # nothing quantized
    assert resolve(cfg, EngineOptions(device="cpu", kernels="torch"), False, native_kernels=ok).kernels.impl == "torch"
    with pytest.raises(ConfigError, match="no C compiler"):
        resolve(cfg, EngineOptions(device="cpu", kernels="native"), False, native_kernels=missing)
    with pytest.raises(ConfigError, match="kernels must be one of"):
        resolve(cfg, EngineOptions(device="cpu", kernels="fast"), False)
    settings = {s.name: s for s in resolve(cfg, EngineOptions(device="cpu"), False, native_kernels=ok).provenance}
    assert "built" in settings["kernels"].source


def test_no_compiler_falls_back_with_a_reason(monkeypatch):
    monkeypatch.setattr(native_build, "_compiler", lambda: None)
    lib, detail = native_build._build()
    assert lib is None and "no C compiler" in detail


@needs_native
@pytest.mark.parametrize("rows, k, group", [(4, 128, 32), (9, 70, 32), (12, 64, 16)])
def test_native_e2m1_decode_is_bit_identical_for_every_code(rows, k, group):
    """Every byte (two e2m1 codes, -0.0 included), full and partial groups, 32- and 16-wide groups."""
    from mlaserve.quant import fp4_group

    g = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=g)
    codes.view(-1)[: min(256, codes.numel())] = torch.arange(min(256, codes.numel()), dtype=torch.uint8)
    s = torch.rand(rows, fp4_group.scale_groups(k, group), generator=g) + 0.25
    ref = fp4_group.dequantize_reference(codes.view(torch.int8), s, group)
    grid = native.ScaleGrid(s.contiguous(), 1, s.shape[1], group, rows)
    got = native.dequantize(native.FP4_E2M1, codes, k, grid)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    x = torch.randn(3, k, generator=g)
    assert_within_sum_bound(native.gemm(native.FP4_E2M1, x, codes, k, grid), F.linear(x, ref), x, ref)


ROUTERS = [  # (scoring, topk_method, experts, n_group, topk_group, k, norm, scale)
    ("softmax", "greedy", 16, 1, 1, 6, False, 1.0),  # DeepSeek-V2-Lite
    ("softmax", "group_limited_greedy", 32, 8, 3, 6, False, 16.0),  # DeepSeek-V2
    ("sigmoid", "noaux_tc", 32, 4, 2, 4, True, 2.5),  # DeepSeek-V3 / GLM-5
    ("sigmoid", "noaux_tc", 64, 1, 1, 8, True, 1.8),  # one group (GLM-4.7-Flash)
    ("sigmoid", "noaux_tc", 24, 8, 4, 3, False, 1.0),  # groups of 3, not normalised
]


@needs_native
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("router", ROUTERS, ids=[f"{r[0]}-{r[1]}-{r[2]}" for r in ROUTERS])
def test_native_router_equals_gate(router, tokens):
    """The one-call router (scores, group-limited top-k, weights) picks the same experts as Gate's torch
    ops with the same weights up to float rounding (expf vs torch's exp, summation order)."""
    from mlaserve.config.model import MoEConfig
    from mlaserve.models.moe import Gate

    scoring, method, e, groups, topk_group, k, norm, scale = router
    cfg = MoEConfig(e, k, 1, 64, scoring, method, groups, topk_group, norm, scale)
    g = torch.Generator().manual_seed(7)
    gate = Gate(96, cfg)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(e, 96, generator=g) * 0.3)
        if gate.e_score_correction_bias is not None:
            gate.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.1)
    x = torch.randn(tokens, 96, generator=g)
    want_w, want_idx = gate(x)
    gate.kernel = "native"
    got_w, got_idx = gate(x)
    assert got_idx.dtype == torch.int64 and got_w.dtype == torch.float32
    for row in range(tokens):  # the reference's top-k order is unspecified: compare as sets
        a, b = got_idx[row].argsort(), want_idx[row].argsort()
        assert torch.equal(got_idx[row][a], want_idx[row][b])
        assert torch.allclose(got_w[row][a], want_w[row][b], rtol=4e-7, atol=0)


def _int8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y - y_exact| for int8 activations: each value moves by at most d_x / 2 (d_x = its 32-block's
    max|x| / 127), so |dy| <= sum_j |w_j| d_x(j) / 2; plus the fp32 bound of the block sums."""
    d = x.abs().view(x.shape[0], -1, 32).amax(-1) / 127  # [M, K / 32]
    step = d.repeat_interleave(32, dim=1) / 2  # [M, K]
    return step @ w.abs().T + 2 * x.shape[-1] * U * (x.abs() @ w.abs().T) * 1.01 + 1e-30


@needs_native
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
def test_native_int8_activations_within_their_bound(name, rows):
    """activations="int8": products within the quantization bound of the activations, and not exact
    (the int8 path really ran); grouped kernel per group likewise."""
    g = torch.Generator().manual_seed(9)
    t, k = GGML_TYPE_IDS[name], 512
    raw = random_blocks(name, 40, k, g)
    w = ggml.dense(raw, t, k)
    x = torch.randn(rows, k, generator=g)
    ref = F.linear(x, w)
    got = ggml.linear(x, raw, t, k, kernel="native", int8=True)
    assert ((got - ref).abs() <= _int8_bound(x, w)).all()
    assert not torch.allclose(got, ref, rtol=1e-6, atol=0)
    assert torch.equal(ggml.linear(x, raw, t, k, kernel="native", int8=False), ggml.linear(x, raw, t, k, "native"))
    stacked = random_blocks(name, 24, k, g, lead=(3,))
    experts, offs = torch.tensor([0, 2]), torch.tensor([rows, rows + 2], dtype=torch.int32)
    xs = torch.randn(rows + 2, k, generator=g)
    ys = ggml.expert_linear(xs, stacked, t, k, experts, offs, kernel="native", int8=True)
    for a, sl in ((0, slice(0, rows)), (2, slice(rows, rows + 2))):
        dense = ggml.dense(stacked[a], t, k)
        assert ((ys[sl] - F.linear(xs[sl], dense)).abs() <= _int8_bound(xs[sl], dense)).all()
        assert not torch.allclose(ys[sl], F.linear(xs[sl], dense), rtol=1e-6, atol=0)


@needs_native
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("tokens", [1, 2])  # 4 and 8 (token, expert) pairs: the one-call experts kernel
def test_native_int8_moe_experts_within_their_bound(name, tokens):
    """The pair-by-pair experts call with int8 activations: x quantized before gate_up, h before down.
    Bound (float64, from the exact weights): gate/up move by |W| d_x / 2 each; through SwiGLU
    |dh| <= 1.1 |u| |dg| + (|g| + |dg|) |du| (|silu'| <= 1.1, |silu(g)| <= |g|); down adds
    |W_down| (d_h / 2 + |dh|), with d_h from h's own blocks; plus fp32 rounding at each product."""
    g = torch.Generator().manual_seed(11)
    t, d, inter, e, k = GGML_TYPE_IDS[name], 256, 128, 5, 4
    gate_up = random_blocks(name, 2 * inter, d, g, lead=(e,))
    down = random_blocks(name, d, inter, g, lead=(e,))
    x = torch.randn(tokens, d, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    wts = torch.rand(tokens, k, generator=g)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]  # two stacks at their own addresses (one expert stride)
    got = ggml.moe_experts(x, wts, idx, gate, up, t, down, t, int8=True)
    exact = ggml.moe_experts(x, wts, idx, gate, up, t, down, t, int8=False)
    assert not torch.allclose(got, exact, rtol=1e-6, atol=0)
    wgu, wdn = ggml.dense(gate_up, t, d).double(), ggml.dense(down, t, inter).double()
    step_x = (x.abs().view(tokens, -1, 32).amax(-1) / 127).repeat_interleave(32, 1).double() / 2
    bound = torch.zeros(tokens, d, dtype=torch.float64)
    for j in range(k):
        a, b = wgu[idx[:, j]], wdn[idx[:, j]]  # [T, 2I, D], [T, D, I]
        gu = (a @ x.double()[:, :, None])[..., 0]
        dgu = (a.abs() @ step_x[:, :, None])[..., 0] + 2 * d * U * (a.abs() @ x.double().abs()[:, :, None])[..., 0]
        (gg, uu), (dg, du) = gu.chunk(2, -1), dgu.chunk(2, -1)
        h = F.silu(gg) * uu
        dh = 1.1 * uu.abs() * dg + (gg.abs() + dg) * du
        h_hi = h.abs() + dh  # h's blocks' scale is at most this block max / 127
        step_h = (h_hi.view(tokens, -1, 32).amax(-1) / 127).repeat_interleave(32, 1) / 2
        dy = (b.abs() @ (step_h + dh)[:, :, None])[..., 0] + 2 * inter * U * (b.abs() @ h_hi[:, :, None])[..., 0]
        bound += wts[:, j, None].double() * dy
    assert ((got.double() - exact.double()).abs() <= 2 * bound + 1e-6).all()


def test_int8_activations_option():
    """Explicit only: recorded in provenance; refused where the native kernels do not run."""
    from hf_models import make_config

    from mlaserve.config.model import ModelConfig

    cfg = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    ok = lambda: (True, "built")  # noqa: E731
    eng = resolve(cfg, EngineOptions(device="cpu", activations="int8"), False, native_kernels=ok)
    assert eng.kernels.activations == "int8" and eng.kernels.impl == "native"
    assert "not exact" in {s.name: s for s in eng.provenance}["activations"].source
    assert resolve(cfg, EngineOptions(device="cpu"), False, native_kernels=ok).kernels.activations == "float"
    with pytest.raises(ConfigError, match="activations='int8' runs in the native kernels"):
        resolve(cfg, EngineOptions(device="cpu", activations="int8"), False)  # nothing quantized: torch kernels
    with pytest.raises(ConfigError, match="activations must be one of"):
        resolve(cfg, EngineOptions(device="cpu", activations="int4"), False, native_kernels=ok)


@needs_native
def test_native_int8_nan_stays_nan_and_router_refuses_bad_groups():
    """A NaN activation is not laundered into finite int8 codes: its block's products come out NaN (as
    in the float path); the router refuses group settings it cannot honour instead of reading past them."""
    g = torch.Generator().manual_seed(12)
    raw = random_blocks("Q8_0", 8, 64, g)
    x = torch.randn(2, 64, generator=g)
    x[1, 40] = float("nan")
    y = ggml.linear(x, raw, GGML_TYPE_IDS["Q8_0"], 64, kernel="native", int8=True)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
    logits = torch.randn(1, 12, generator=g)
    for groups, topk_group in ((5, 2), (4, 5), (0, 1)):  # 12 experts in 5 groups; more kept groups than groups
        with pytest.raises(RuntimeError, match="native moe_route refused"):
            native.moe_route(logits, None, "sigmoid", "noaux_tc", groups, topk_group, 2, True, 1.0)


def test_native_attention_backend_resolution():
    """auto picks the native attention backend with the native kernels and an fp32 cache, torch otherwise;
    asking for it where it cannot run is a named error."""
    from hf_models import make_config

    from mlaserve.config.model import ModelConfig

    cfg = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    ok = lambda: (True, "built")  # noqa: E731
    eng = resolve(cfg, EngineOptions(device="cpu"), False, native_kernels=ok)
    assert eng.attention.backend == "native"
    assert "latent MQA in one C call" in {s.name: s for s in eng.provenance}["attention_backend"].source
    assert (
        resolve(cfg, EngineOptions(device="cpu", dtype="bfloat16"), False, native_kernels=ok).attention.backend
        == "torch"
    )
    assert resolve(cfg, EngineOptions(device="cpu"), False).attention.backend == "torch"  # nothing quantized
    assert (
        resolve(cfg, EngineOptions(device="cpu", attention_backend="torch"), False, native_kernels=ok).attention.backend
        == "torch"
    )
    with pytest.raises(ConfigError, match="attention_backend='native' needs the native kernels"):
        resolve(cfg, EngineOptions(device="cpu", attention_backend="native"), False)


@needs_native
@pytest.mark.skipif(
    "avx512f" not in cpu_flags(),
    reason="no AVX-512 here: the default build is the AVX2 one, tested above",
)
def test_avx2_kernels_on_an_avx512_machine(monkeypatch):
    """The library is built for the CPU at hand (-march=native), so an AVX-512 machine runs the AVX-512 fused
    kernels and never the AVX2 ones that other machines run: this builds the AVX2 variant too (-mno-avx512f) and
    holds its products to the same bound, so both code paths are tested wherever the suite runs."""
    lib, detail = native_build._build(("-mno-avx512f",))
    assert lib is not None, detail
    k, results = 512, {}
    for variant in ("avx512", "avx2"):
        if variant == "avx2":
            monkeypatch.setitem(native_build._state, "lib", lib)
        for name in ("Q8_0", "Q4_0", "Q5_0", "Q6_K", "Q4_K"):
            t = GGML_TYPE_IDS[name]
            raw = random_blocks(name, 37, k, torch.Generator().manual_seed(GGML_TYPE_IDS[name]))
            w = ggml.dense(raw, t, k)
            for rows in (1, 3, 4, 5, 8, 9, 16):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                y = ggml.linear(x, raw, t, k, kernel="native")
                assert_within_sum_bound(y, F.linear(x, w), x, w)
                results[variant, name, rows] = y
    assert native.library() is lib
    # the two builds really differ (summation in 8 vs 16 lanes) where the fused kernels run
    assert not torch.equal(results["avx2", "Q8_0", 16], results["avx512", "Q8_0", 16])

"""GGUF block-quantized weights kept in their ggml blocks (gguf_weights="quantized", the default on
one process): the same logits as the weights dequantized at load, resident weights ~ the file's
tensor bytes, every holder equal to F.linear over its dequantize().

Bound: a holder's product is x @ dequantize(W)^T in fp32, the same values the dequantized model
multiplies, so the two differ at most by fp32 summation order: |dy| <= K * 2^-23 * sum_k |x_k w_k|
per output (K terms). ATOL below is that bound for the fixtures' logits (|logit| < 10, K <= 2816),
and the tests also hold the holders to it per call."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import fixture_dir
from hf_models import random_ids
from test_kernels import gguf_py_dense

from mlaserve import LLM
from mlaserve.config.model import ConfigError
from mlaserve.gguf.quants import GGML_TYPES, dequantize
from mlaserve.gguf.read.file import GGUFError, open_gguf
from mlaserve.kernels import native
from mlaserve.loading.tensor_check import SCALE_OFFSETS
from mlaserve.models.moe import Experts
from mlaserve.quant.ggml_heads import GGUFHeads
from mlaserve.quant.ggml_linear import GGUFEmbedding, GGUFExperts, GGUFLinear
from mlaserve.quant.ggml_plan import BLOCK_TYPES
from mlaserve.quant.transient_kv_b import TransientKvB
from mlaserve.sampling.params import SamplingParams

FILES = [(m, t) for m in ("ds3", "ds2lite", "ds32", "glm5") for t in ("f16", "q8_0", "q4_k_m", "q4_0")]
HOLDERS = (GGUFLinear, GGUFEmbedding, GGUFExperts)
NATIVE = native.status()
KERNELS = [
    "torch",
    pytest.param(
        "native", marks=pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")
    ),
]


def _fp32_bound(x: torch.Tensor, w: torch.Tensor) -> float:
    """K * 2^-23 * max over outputs of sum_k |x_k w_k|: the fp32 summation-order bound of x @ w^T."""
    return x.shape[-1] * 2.0**-23 * (x.abs() @ w.abs().T).max().item()


def _holders(llm: LLM) -> list[torch.nn.Module]:
    return [m for m in llm.runner.model.modules() if isinstance(m, HOLDERS)]


def _weight_bytes(llm: LLM) -> int:
    m = llm.runner.model
    return sum(t.nbytes for t in list(m.parameters()) + list(m.buffers()))


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name,gtype", FILES)
def test_kept_blocks_equal_dequantized(name, gtype, kernels):
    """Same route, same prompt: logits with blocks kept == with the file dequantized at load, through
    the reference kernels and the native ones."""
    from safetensors.torch import load_file

    folder = fixture_dir(name)
    path = folder / f"model-{gtype}.gguf"
    if not path.exists():
        pytest.skip(f"../shared/fixtures/{name} has no {gtype} file")
    ids = load_file(str(folder / "expected.safetensors"))["input_ids"].tolist()
    # activations="float": the exact products this identity pins (the default takes int8 activations for weights
    # of <= 6 bits: tests/gguf/test_gguf_int8_default.py)
    kept = LLM(str(path), max_num_batched_tokens=40, kernels=kernels, activations="float")
    dense = LLM(str(path), max_num_batched_tokens=40, gguf_weights="dequantized")
    assert kept.config.kernels.gguf_weights == "quantized" and dense.config.kernels.gguf_weights == "dequantized"
    assert all(m.kernel == kernels for m in _holders(kept) if hasattr(m, "kernel"))
    assert not _holders(dense)
    quantized = any(t in BLOCK_TYPES for t in (i.ggml_type for i in open_gguf(path).tensors.values()))
    assert bool(_holders(kept)) == quantized  # an f16 file has no blocks to keep
    a, b = kept.prompt_logits(ids), dense.prompt_logits(ids)
    diff = (a - b).abs().max().item()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"{name} {gtype} {kernels}: kept vs dequantized max |dlogit| {diff:.2e}, top-1 {top1:.3f}")
    assert diff <= 1e-5 and top1 == 1.0, (diff, top1)


@pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")
@pytest.mark.parametrize(
    "name,gtype", [("ds3", "q8_0"), ("ds3", "q4_0"), ("ds2lite", "q4_k_m"), ("ds32", "q8_0"), ("glm5", "q4_k_m")]
)
def test_native_decode_equals_dequantized(name, gtype):
    """Batch-1 decode (the native router and the pair-by-pair experts call, not exercised by prefill):
    the same greedy tokens and the same log-probabilities as the file dequantized at load."""
    path = fixture_dir(name) / f"model-{gtype}.gguf"
    if not path.exists():
        pytest.skip(f"../shared/fixtures/{name} has no {gtype} file")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    runs = []
    for opts in ({"kernels": "native", "activations": "float"}, {"gguf_weights": "dequantized"}):
        llm = LLM(str(path), **opts)
        kept = [layer.self_attn.kept_heads for layer in llm.runner.model.model.layers]
        # the trunk's W_UK / W_UV read attn_k_b / attn_v_b blocks with the native kernels (glm5's are F16)
        assert all(h is not None for h in kept) == (opts.get("kernels") == "native" and name != "glm5")
        out = llm.generate([[5, 9, 2, 7]], params)[0].outputs[0]
        runs.append((out.token_ids, [[v for _, v in sorted(step.items())] for step in out.logprobs]))
    (tok_a, lp_a), (tok_b, lp_b) = runs
    assert tok_a == tok_b
    diff = max(abs(a - b) for sa, sb in zip(lp_a, lp_b) for a, b in zip(sa, sb))
    print(f"{name} {gtype}: native decode vs dequantized max |dlogprob| {diff:.2e}")
    assert diff <= 1e-5, diff


@pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")
@pytest.mark.parametrize(
    "name,gtype,max_rel", [("ds3", "q8_0", 0.09), ("ds3", "q4_0", 0.13), ("ds2lite", "q8_0", 0.032)]
)
def test_int8_activations_error_measured(name, gtype, max_rel):
    """activations="int8" (llama.cpp's integer dot products) is not exact; prompted token by token, so that
    every product is a decode product, the logits stay near the exact ones. Measured relative error: ds3 q8_0
    0.071, ds3 q4_0 0.084-0.101 (by CPU), ds2lite q8_0 0.025; top-1 agreement 0.948-0.979 over 96 positions
    (5 to 2 positions differ). The limits are about 1.3x each file's error and at most 6 differing positions:
    rounding the activations' int8 codes toward zero instead of to nearest (1.4x the error) fails them (the
    kernels' own bound is tested per product in test_kernels.py)."""
    from safetensors.torch import load_file

    folder = fixture_dir(name)
    path = folder / f"model-{gtype}.gguf"
    ids = load_file(str(folder / "expected.safetensors"))["input_ids"].tolist()
    exact = LLM(str(path), max_num_batched_tokens=1, kernels="native", activations="float")
    fast = LLM(str(path), max_num_batched_tokens=1, activations="int8")
    assert fast.config.kernels.activations == "int8" and exact.config.kernels.activations == "float"
    holders = [m for m in fast.runner.model.modules() if hasattr(m, "int8")]
    assert holders and all(m.int8 for m in holders)
    a, b = exact.prompt_logits(ids), fast.prompt_logits(ids)
    rel = ((a - b).norm() / a.norm()).item()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"{name} {gtype}: int8 activations vs exact: relative logit error {rel:.3f}, top-1 {top1:.3f}")
    assert 0 < rel <= max_rel and top1 >= 1 - 6 / len(ids), (rel, top1)


@pytest.mark.parametrize("name", ["ds3", "ds2lite"])
def test_resident_weights_near_file_size(name):
    """Q8_0: resident parameter+buffer bytes <= 1.15x the file's tensor bytes (kv_b_proj, rebuilt
    from attn_k_b/attn_v_b, and the F32 norms are the only expanded tensors of these files)."""
    path = fixture_dir(name) / "model-q8_0.gguf"
    gf = open_gguf(path)
    file_bytes = sum(i.nbytes for i in gf.tensors.values())
    gf.close()
    kept = LLM(str(path))
    dense = LLM(str(path), gguf_weights="dequantized")
    ratio, before = _weight_bytes(kept) / file_bytes, _weight_bytes(dense) / file_bytes
    print(f"{name} q8_0: resident weights {ratio:.3f}x the file's tensor bytes (dequantized: {before:.2f}x)")
    assert ratio <= 1.15


def test_kept_modules_and_provenance():
    """lm_head, embeddings, projections and experts keep their blocks; kv_b_proj is dense (torch kernels) or
    not held (native: decoded per prefill step from the kept attn_k_b / attn_v_b) and the plan says why; the
    engine option's value and source are recorded."""
    llm = LLM(str(fixture_dir("ds3") / "model-q4_k_m.gguf"))
    model = llm.runner.model
    assert isinstance(model.lm_head, GGUFLinear) and GGML_TYPES[model.lm_head.ggml_type].name == "Q6_K"
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    assert isinstance(model.model.layers[1].mlp.experts, GGUFExperts)
    native = llm.config.kernels.impl == "native"
    kv_b = model.model.layers[0].self_attn.kv_b_proj
    assert type(kv_b) is (TransientKvB if native else torch.nn.Linear)
    assert kv_b.weight.dtype == torch.float32 and kv_b.weight.is_meta == native
    assert type(model.model.layers[1].mlp.gate.weight) is torch.nn.Parameter
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    rows = {s.name: s for s in llm.loaded.gguf.settings()}
    why = "decoded per prefill step from attn_k_b / attn_v_b" if native else "rebuilt from attn_k_b + attn_v_b"
    assert why in rows["gguf dense model.layers.*.self_attn.kv_b_proj"].source
    if native:  # the absorbed path's W_UK / W_UV read the blocks (Q5_0 in this file)
        assert "W_UK / W_UV" in rows["gguf Q5_0 model.layers.*.self_attn.kv_b_proj"].source
    assert rows["gguf Q6_K lm_head"].value == "yes"
    assert "not a block format" in rows["gguf dense model.layers.*.self_attn.q_b_proj"].source  # F16 in this file
    assert any(n.startswith("gguf Q4_K") and n.endswith("mlp.experts") for n in rows)
    prov = {s.name: s for s in llm.config.all_provenance()}
    assert prov["gguf_weights"].value == "quantized" and "auto" in prov["gguf_weights"].source
    assert any("kept in their ggml blocks" in n for n in llm.loaded.report.notes)


def test_gguf_weights_option_validated(hf_model_dir):
    path = str(fixture_dir("ds3") / "model-q8_0.gguf")
    with pytest.raises(ConfigError, match="gguf_weights must be one of"):
        LLM(path, gguf_weights="int8")
    from mlaserve.config.engine import make_options
    from mlaserve.loading.model_loader import open_checkpoint

    # Tensor parallel: each rank keeps its slice's blocks (tests/distributed/test_tp_quantized.py); auto says so
    ck = open_checkpoint(path, make_options(tensor_parallel_size=2))
    prov = {s.name: s for s in ck.engine_cfg.provenance}
    assert (
        ck.engine_cfg.kernels.gguf_weights == "quantized" and "2 ranks reads its slice" in prov["gguf_weights"].source
    )
    ck = open_checkpoint(path, make_options(tensor_parallel_size=2, gguf_weights="dequantized"))
    assert ck.engine_cfg.kernels.gguf_weights == "dequantized"
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder))
    assert llm.config.kernels.gguf_weights is None and llm.loaded.gguf is None


def test_loop_experts_and_bf16_follow_the_same_holders():
    path = str(fixture_dir("ds3") / "model-q8_0.gguf")
    ids = random_ids(20, seed=5)
    grouped = LLM(path).prompt_logits(ids)
    loop = LLM(path, experts_impl="loop").prompt_logits(ids)
    assert (grouped - loop).abs().max().item() <= 1e-5
    bf16 = LLM(path, dtype="bfloat16")  # activations rounded to bf16 after each fp32 product
    # bf16's 2^-9 relative step on logits of |max| 4 through 3 layers: measured max 0.055 (mean 0.0095); 0.1
    assert (bf16.prompt_logits(ids).float() - grouped).abs().max().item() <= 0.1


def _tiny_gguf(hf_model_dir, tmp_path, kind: str, outtype: str):
    from test_gguf_convert import _byte_tokenizer

    from mlaserve.gguf.convert.convert import convert_hf_to_gguf

    folder, _ = hf_model_dir(kind)
    copy = tmp_path / kind
    shutil.copytree(folder, copy)
    _byte_tokenizer(copy, 256)
    path = tmp_path / f"{kind}-{outtype}.gguf"
    convert_hf_to_gguf(copy, path, outtype)
    return path


def test_tied_embeddings_share_the_blocks(hf_model_dir, tmp_path):
    """tie_word_embeddings: the file has no output.weight; lm_head multiplies token_embd's blocks."""
    path = _tiny_gguf(hf_model_dir, tmp_path, "v3_tied", "q8_0")
    kept, dense = LLM(str(path)), LLM(str(path), gguf_weights="dequantized")
    model = kept.runner.model
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.weight is model.model.embed_tokens.weight
    ids = random_ids(24, seed=1)
    a, b = kept.prompt_logits(ids), dense.prompt_logits(ids)
    # ATOL (1e-5) is the summation-order bound for |logit| < 10; this model's logits reach ~21 and the bound
    # grows with sum|x w|, i.e. with the logits' scale (measured: 1.05e-5 at 21 = 4 ulps, AVX-512 kernels)
    tol = 1e-5 * max(1.0, b.abs().max().item() / 10)
    assert (a - b).abs().max().item() <= tol and torch.equal(a.argmax(-1), b.argmax(-1))
    assert any(s.name == "gguf Q8_0 lm_head" and "tied" in s.source for s in kept.loaded.gguf.settings())


def test_mtp_layer_keeps_blocks(tmp_path, tmp_path_factory):
    """speculative="mtp": the nextn block's projections, experts and own head keep their blocks and
    draft the same logits as the dequantized file."""
    from mtp_models import mtp_model_folder
    from test_gguf_convert import _byte_tokenizer
    from test_mtp import engine_mtp_logits

    from mlaserve.gguf.convert.convert import convert_hf_to_gguf

    folder, _ = mtp_model_folder("glm_dsa", tmp_path_factory)
    copy = tmp_path / "glm_dsa"
    shutil.copytree(folder, copy)
    _byte_tokenizer(copy, 256)
    path = tmp_path / "mtp-q8_0.gguf"
    convert_hf_to_gguf(copy, path, "q8_0")
    kept = LLM(str(path), speculative="mtp")
    dense = LLM(str(path), speculative="mtp", gguf_weights="dequantized")
    mtp = kept.runner.model.mtp[0]
    assert isinstance(mtp.eh_proj, GGUFLinear) and isinstance(mtp.mlp.experts, GGUFExperts)
    ids = random_ids(24, seed=4)  # 24 > index_topk 16: the DSA layers select
    a, b = engine_mtp_logits(kept, ids), engine_mtp_logits(dense, ids)
    assert (a - b).abs().max().item() <= 1e-5 and torch.equal(a.argmax(-1), b.argmax(-1))


def test_truncated_file_still_names_the_tensor(tmp_path):
    src = fixture_dir("ds3") / "model-q8_0.gguf"
    bad = tmp_path / "cut.gguf"
    data = src.read_bytes()
    bad.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"truncated file: tensor '[\w.]+'"):
        LLM(str(bad))


# ---- every holder against F.linear over its dequantize(), on every block type ----------------


def _blocks(ggml_type: int, rows: int, k: int, seed: int) -> torch.Tensor:
    """Random valid blocks: random bytes with every fp16 scale set to a finite value of a sane size."""
    t = GGML_TYPES[ggml_type]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows * (k // t.block_size), t.type_size), dtype=torch.uint8, generator=g)
    for off in SCALE_OFFSETS[t.name]:
        scale = (torch.rand(raw.shape[0], generator=g) * 0.02 + 0.001).half()
        raw[:, off : off + 2] = scale.view(torch.uint8).view(-1, 2)
    if t.name == "MXFP4":  # its e8m0 byte: 2^(e - 128) in [2^-10, 2^-6] (x the codes' |12|: up to 0.19)
        raw[:, 0] = torch.randint(118, 123, (raw.shape[0],), dtype=torch.uint8, generator=g)
    if t.name == "IQ1_M":  # its fp16 d is the top nibbles of the 4 scale words (bytes 48-55), lowest word first
        d = (torch.rand(raw.shape[0], generator=g) * 0.02 + 0.001).half().view(torch.int16).to(torch.int32)
        for w in range(4):
            hi = raw[:, 49 + 2 * w].to(torch.int32)
            raw[:, 49 + 2 * w] = ((hi & 0x0F) | (((d >> (4 * w)) & 0x0F) << 4)).to(torch.uint8)
    return raw.reshape(rows, -1)


TYPES = sorted(BLOCK_TYPES)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("ggml_type", TYPES, ids=[GGML_TYPES[t].name for t in TYPES])
def test_linear_holder_equals_dense(ggml_type, rows, kernel):
    n, k = 48, 512
    lin = GGUFLinear(k, n, ggml_type, False, torch.float32, "cpu")
    lin.kernel = kernel
    with torch.no_grad():
        lin.weight.copy_(_blocks(ggml_type, n, k, 0))
    w = lin.dequantize()
    assert torch.equal(w, gguf_py_dense(lin.weight.detach(), GGML_TYPES[ggml_type].name))
    x = torch.randn(rows, 3, k)  # 3 or 120 rows: the native GEMV and its decode-then-GEMM branch
    y, ref = lin(x), F.linear(x, w)
    assert y.shape == (rows, 3, n) and (y - ref).abs().max().item() <= _fp32_bound(x.reshape(-1, k), w)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tokens", [1, 3, 20])  # the per-head GEMV (<= GEMV_ROWS rows a head) and beyond
@pytest.mark.parametrize("ggml_type", TYPES, ids=[GGML_TYPES[t].name for t in TYPES])
def test_heads_holder_equals_dense(ggml_type, tokens, kernel):
    """W_UK / W_UV kept as attn_k_b / attn_v_b blocks: absorb and expand equal the dense per-head
    products of absorbed attention (the einsums of the torch backend) within the fp32 bound, per head."""
    h, r, dn, dv = 3, 256, 256, 32  # rows of whole 256-value blocks for the K-quants
    k_b = _blocks(ggml_type, h * r, dn, 5).reshape(h, r, -1)
    v_b = _blocks(ggml_type, h * dv, r, 6).reshape(h, dv, -1)
    heads = GGUFHeads(k_b, ggml_type, v_b, ggml_type, dn, r)
    heads.kernel = kernel
    w_uk = dequantize(k_b, ggml_type, (h, r, dn)).transpose(1, 2)  # [H, dn, r] as kv_b_proj's view
    w_uv = dequantize(v_b, ggml_type, (h, dv, r))  # [H, dv, r]
    g = torch.Generator().manual_seed(8)
    q = torch.randn(tokens, h, dn, generator=g)
    o = torch.randn(2, tokens, h, r, generator=g)
    got_q, got_o = heads.absorb(q), heads.expand(o)
    want_q, want_o = torch.einsum("nhd,hdr->nhr", q, w_uk), torch.einsum("bqhr,hvr->bqhv", o, w_uv)
    assert got_q.shape == want_q.shape and got_o.shape == want_o.shape
    for i in range(h):
        assert (got_q[:, i] - want_q[:, i]).abs().max().item() <= 2 * _fp32_bound(q[:, i], w_uk[i].T)
        o_i = o[:, :, i].reshape(-1, r)
        assert (got_o[:, :, i].reshape(-1, dv) - want_o[:, :, i].reshape(-1, dv)).abs().max().item() <= 2 * _fp32_bound(
            o_i, w_uv[i]
        )
    if kernel == "native" and ggml_type in native.Q8_ACTIVATION_TYPES and tokens <= 16:
        heads.int8 = True  # activations="int8": within the activations' quantization bound, per head
        q8 = heads.absorb(q)
        assert not torch.allclose(q8, want_q, rtol=1e-6, atol=0)
        for i in range(h):
            step = (q[:, i].abs().view(tokens, -1, 32).amax(-1) / 127).repeat_interleave(32, 1) / 2
            bound = step @ w_uk[i].abs() + 2 * _fp32_bound(q[:, i], w_uk[i].T)
            assert ((q8[:, i] - want_q[:, i]).abs() <= bound).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("ggml_type", TYPES, ids=[GGML_TYPES[t].name for t in TYPES])
def test_embedding_holder_equals_dense(ggml_type, kernel):
    """Either lookup (the native one decodes the rows in C) returns the reference table's rows bit for bit."""
    emb = GGUFEmbedding(40, 256, ggml_type, torch.float32, "cpu")
    with torch.no_grad():
        emb.weight.copy_(_blocks(ggml_type, 40, 256, 1))
    if kernel == "native":
        assert emb.native_unfit() is None
    emb.kernel = kernel
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    assert torch.equal(emb(ids), F.embedding(ids, emb.dequantize()))  # the same rows, bit for bit
    assert torch.equal(emb(ids[:1, 2]), emb.dequantize()[39:40])  # one row: a decode step's lookup


def _experts_bound(x, gu, down, idx, w) -> float:
    """fp32 summation-order bound of the routed-experts output, propagated through SwiGLU:
    dg, du <= D eps (|x| |W|); dh <= 1.1 |u| dg + |g| du (|silu'| <= 1.1, |silu(g)| <= |g|);
    dy <= sum_slots w (I eps (|h| |W_down|) + dh |W_down|)."""
    eps, inter = 2.0**-23, down.shape[-1]
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    for s in range(idx.shape[1]):
        a, b = gu[idx[:, s]].double(), down[idx[:, s]].double()  # [T, 2I, D], [T, D, I]
        xa = x.double().abs()[:, None, :]
        g, u = (a @ x.double()[:, :, None])[..., 0].chunk(2, -1)
        dgu = x.shape[1] * eps * (a.abs() * xa).sum(-1)
        dg, du = dgu.chunk(2, -1)
        h = F.silu(g) * u
        dh = 1.1 * u.abs() * dg + g.abs() * du
        dy = inter * eps * (b.abs() * h.abs()[:, None, :]).sum(-1) + (b.abs() * dh[:, None, :]).sum(-1)
        out += w[:, s, None].double() * dy
    return out.max().item()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("t", [1, 4, 7, 70])  # 2 and 8 pairs: the native pair-by-pair call; more: grouped
@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=[GGML_TYPES[t].name for t in TYPES])
def test_experts_holder_equals_dense(ggml_type, impl, t, kernel):
    """Against models/moe.py's per-expert loop over the dequantized weights."""
    e, d, inter, k = 6, 256, 256, 2
    down_type = 8 if ggml_type != 8 else 14  # down_proj of another type (Q4_K_M files mix them)
    ex = GGUFExperts(d, e, inter, ggml_type, down_type, "cpu")
    ex.impl, ex.kernel = impl, kernel
    with torch.no_grad():
        gate_up = _blocks(ggml_type, e * 2 * inter, d, 2).reshape(e, 2 * inter, -1)
        ex.gate_proj.copy_(gate_up[:, :inter])
        ex.up_proj.copy_(gate_up[:, inter:])
        ex.down_proj.copy_(_blocks(down_type, e * d, inter, 3).reshape(e, d, -1))
    gu, down = ex.dequantize()
    assert gu.shape == (e, 2 * inter, d) and down.shape == (e, d, inter)
    ref = Experts.__new__(Experts)
    torch.nn.Module.__init__(ref)
    ref.gate_up_proj, ref.down_proj, ref.impl = torch.nn.Parameter(gu), torch.nn.Parameter(down), "loop"
    g = torch.Generator().manual_seed(4)
    x = torch.randn(t, d, generator=g)
    idx = torch.stack([torch.randperm(e - 2, generator=g)[:k] for _ in range(t)])  # experts 4, 5 unused
    w = torch.rand(t, k, generator=g)
    with torch.no_grad():
        got, want = ex(x, w, idx), ref(x, w, idx)
    assert (got - want).abs().max().item() <= 2 * _experts_bound(x, gu, down, idx, w)  # both sides round


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
@pytest.mark.parametrize("ggml_type", TYPES, ids=[GGML_TYPES[t].name for t in TYPES])
def test_cuda_dequantize_is_bit_exact(ggml_type):
    """The torch dequantizers give the CPU's values on the GPU (every op rounds alike; no tables left on the CPU)."""
    raw = _blocks(ggml_type, 16, 512, 0)
    assert torch.equal(dequantize(raw.cuda(), ggml_type, (16, 512)).cpu(), dequantize(raw, ggml_type, (16, 512)))


@cuda
@pytest.mark.parametrize("name,gtype", [("ds3", "q4_k_m"), ("glm5", "q4_k_m"), ("ds32", "q8_0")])
def test_cuda_kept_blocks_equal_dequantized(name, gtype):
    from safetensors.torch import load_file

    folder = fixture_dir(name)
    ids = load_file(str(folder / "expected.safetensors"))["input_ids"].tolist()
    path = str(folder / f"model-{gtype}.gguf")
    kept = LLM(path, device="cuda", max_num_batched_tokens=40)
    dense = LLM(path, device="cuda", max_num_batched_tokens=40, gguf_weights="dequantized")
    from mlaserve.platform.triton_runtime import triton_mode

    compiled = triton_mode("cuda").mode == "compiled"  # auto on CUDA: the Triton kernels (Q8_0 / Q4_K) where they run
    assert kept.config.kernels.impl == ("triton" if compiled else "torch") and kept.runner.model.lm_head.weight.is_cuda
    a, b = kept.prompt_logits(ids), dense.prompt_logits(ids)
    assert (a - b).abs().max().item() <= 1e-5 and torch.equal(a.argmax(-1), b.argmax(-1))

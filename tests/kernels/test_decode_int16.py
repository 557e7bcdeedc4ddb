"""Decode products with int16 activations (activations="int8_6bit_int16", auto's choice where the CPU has
AVX512-VNNI or AVX2): the 32-value block types the int8 cap leaves in fp32 (Q8_0, Q5_0, MXFP4) take kernels/int16_prefill.py's
products at every row count, the 1-3 row products on the weight rows as they lie. Held to: the choice and the plan's
words; the one-call decode layers and MoE block equal to the per-op path (both take them: the same kernels); a
request's tokens and log-probabilities the same bits alone and in a batch; the logits of decode-sized steps within
the prefill test's bound of the file's own error. The kernels themselves: test_int16_prefill.py."""

from __future__ import annotations

import pytest
import torch
from test_decode_layer import NATIVE, PROMPTS, _llm, _max_diff, _run
from test_moe_block import BLOCK_TOKENS, D, U, make_moe, routing

from mlaserve.config.model import ConfigError
from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import int16_prefill, native
from mlaserve.quant.ggml_moe_block import GGUFMoEBlock

Q8_0 = GGML_TYPE_IDS["Q8_0"]
pytestmark = pytest.mark.skipif(
    not NATIVE.available or not int16_prefill.takes_rows(Q8_0),
    reason=f"no int16 products here: {int16_prefill.detail() if NATIVE.available else NATIVE.detail}",
)
SETTING = 6 | native.INT16_REST  # machine.INT8_BITS["int8_6bit_int16"]


def test_auto_takes_them_where_the_cpu_has_avx512_vnni(monkeypatch):
    """auto resolves to int8_6bit_int16 where the CPU has AVX512-VNNI or AVX2 (the override stands for it here) and the plan
    names the Q8_0 holders' int16 products; without it, int8_6bit, and asking for them by name is refused."""
    monkeypatch.setenv("MLASERVE_INT16_ROWS", "1")
    llm = _llm("ds3", "q8_0")
    assert llm.config.kernels.activations == "int8_6bit_int16"
    said = next(s.source for s in llm.config.provenance if s.name == "activations")
    assert said.startswith("engine default (auto") and "AVX512-VNNI" in said
    reasons = " ".join(c.reason for c in llm.loaded.kernel_plan.choices)
    assert f"int16 activations for Q8_0 at every decode row count ({int16_prefill.detail()}" in reasons
    monkeypatch.setenv("MLASERVE_INT16_ROWS", "0")
    assert _llm("ds3", "q8_0").config.kernels.activations == "int8_6bit"
    with pytest.raises(ConfigError, match="int8_6bit_int16.*AVX512-VNNI or AVX2"):
        _llm("ds3", "q8_0", activations="int8_6bit_int16")


@pytest.mark.parametrize("setting", [0, 4, 6, 8, True, 0x100, 4 | 0x100, 6 | 0x100, 8 | 0x100])
def test_the_c_layers_take_them_where_the_holders_do(setting):
    """The one-call layer and MoE block decide per weight type from the C struct's setting (int16_prefill.c qw_in);
    the per-op holders from theirs (int16_prefill.takes_rest): the same answer for every ggml type and setting, the
    int8 cap first (Q8_0 under a cap of 8 takes int8, not int16)."""
    lib = native.library()
    for t in GGML_TYPES:
        assert lib.mls_int16_in(t, native.act_setting(setting)) == int16_prefill.takes_rest(t, setting), (t, setting)
    assert int16_prefill.takes_rest(Q8_0, 6 | 0x100) and not int16_prefill.takes_rest(Q8_0, 8 | 0x100)


@pytest.mark.parametrize("tokens", [1, 2])
def test_few_pairs_take_one_pair_by_pair_call_with_the_grouped_arithmetic(tokens, monkeypatch):
    """A Q8_0 expert stack under the setting at few (token, expert) pairs (decode: DeepSeek-V4's routed experts, an
    MLA model's outside the one-call block): one native call pair by pair with int16 activations
    (csrc/moe/experts.c mls_moe_experts16: the grouped products' kernel at one activation row, each row's product the
    same bits) instead of the grouped path's sort, products and index_add; the outputs differ by the sums over a
    token's experts, taken in top-k order instead of expert order (measured <= 1.1 ulp of |y|max; bound 4, as the
    block's test above), and from fp32 by int16's own error, far more. A mixed pair of types stays grouped."""
    from mlaserve.kernels import ggml

    moe = make_moe("v3", "q8_0")
    experts = moe.experts
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(tokens))
    _, w, idx = routing(GGUFMoEBlock(moe), x)
    experts.kernel, experts.int8 = "native", SETTING
    assert idx.numel() <= experts.NATIVE_ROWS
    calls = []
    real = native.moe_experts

    def spy(*args):
        calls.append(args[-1])  # int16
        return real(*args)

    monkeypatch.setattr(native, "moe_experts", spy)
    with torch.no_grad():
        pairwise = experts(x, w, idx)
        grouped = experts._grouped(x, w, idx, ggml.expert_linear_native)
        experts.int8 = 0
        exact = experts(x, w, idx)
    assert calls == [True, False]  # int16 under the setting, fp32 without it: one call each, pair by pair
    diff, ulp = (pairwise - grouped).abs().max().item(), 2 * U * grouped.abs().max().item()
    print(f"\n{tokens} tokens: pair by pair vs grouped {diff / ulp:.1f} ulp")
    assert diff <= 4 * ulp, (diff, ulp)
    assert (pairwise - exact).abs().max().item() > 100 * ulp
    mixed = make_moe("v3", "q4_k-q5_0-q8_0").experts  # gate_up Q4_K on int8, down Q5_0 on int16
    mixed.kernel, mixed.int8 = "native", SETTING
    calls.clear()
    with torch.no_grad():
        mixed(x, w, idx)
    assert calls == []


@pytest.mark.parametrize("tokens", [1, 2, 5, BLOCK_TOKENS])
@pytest.mark.parametrize("types", ["q8_0", "q4_k-q5_0-q8_0"])
def test_moe_block_equals_the_per_op_experts(types, tokens):
    """On the same input the C block (routed experts in 16-row runs, 1-3 rows in place; the shared expert on panels
    above 3 tokens, a Q8_0 one on the AMX-INT8 tiles where the process has them) and the per-op holders (grouped products, GGUFLinear) take the same int16 products: the outputs
    differ by the final sums' rounding only, as test_moe_block_int8.py's (measured <= 1.6 ulp of |y|max; bound 4);
    the block in fp32 differs by int16's own error, far more."""
    moe = make_moe("v3", types)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(tokens))
    y_float, w, idx = routing(GGUFMoEBlock(moe), x)
    for m in (moe.experts, moe.shared_experts.gate_proj, moe.shared_experts.up_proj, moe.shared_experts.down_proj):
        m.int8 = SETTING
    block = GGUFMoEBlock(moe)
    assert block.args.int8 == SETTING
    y, w16, idx16 = routing(block, x)
    assert torch.equal(w16, w) and torch.equal(idx16, idx)
    with torch.no_grad():
        per_op = moe(x)
    diff, ulp = (y - per_op).abs().max().item(), 2 * U * per_op.abs().max().item()
    print(
        f"\n{types} {tokens}: block vs per-op {diff / ulp:.1f} ulp; vs fp32 {(y - y_float).abs().max().item() / ulp:.0f} ulp"
    )
    assert diff <= 4 * ulp, (diff, ulp)
    assert (y - y_float).abs().max().item() > 100 * ulp


@pytest.mark.parametrize("name,gtype", [("ds3", "q8_0"), ("ds2lite", "q8_0"), ("ds3", "q4_k_m")])
def test_native_layers_run_them_close_to_the_per_op_path(name, gtype, monkeypatch):
    """The one-call layers under int8_6bit_int16, end to end against the per-op path: the same tokens, and
    log-probabilities within twice int16's own effect (the per-op path's against its run under int8_6bit, the same
    products in fp32). Not the 1e-5 of
    test_decode_layer_int8.py: the two paths' fp32 roundings differ (torch's silu, the routing weights' order; 1e-6
    in fp32 here), and a code a rounding apart moves a product by a whole int16 step, ~2^-16 of its block, where an
    int8 code rarely moves at all (measured on ds3 q8_0: 2.1e-4 between the paths, int16's own 1.6e-4). Which
    products take them is held to the holders' by the tests above; here the C layers take some (they leave fp32)."""
    monkeypatch.setenv("MLASERVE_INT16_ROWS", "1")
    llm = _llm(name, gtype, activations="int8_6bit_int16")
    model = llm.runner.model
    assert model.native_decode is not None
    assert all(layer.native_layer.args.int8 == SETTING for layer in model.model.layers)
    tok_a, lp_a, calls = _run(llm, PROMPTS, monkeypatch)
    assert calls >= 9 * len(model.model.layers)
    native_decode, model.native_decode = model.native_decode, None
    tok_b, lp_b, calls_b = _run(llm, PROMPTS, monkeypatch)
    model.native_decode = native_decode
    tok_f, lp_f, _ = _run(_llm(name, gtype, activations="int8_6bit"), PROMPTS, monkeypatch)
    assert calls_b == 0 and tok_a == tok_b
    same = [i for i in range(len(PROMPTS)) if tok_b[i] == tok_f[i]]  # a near tie may pick another token (ds3 q4_k_m)
    assert len(same) >= 3, same
    diff, own = _max_diff(lp_a, lp_b), _max_diff([lp_b[i] for i in same], [lp_f[i] for i in same])
    print(f"\n{name} {gtype}: native layers vs per-op {diff:.2e}; int16 vs fp32 per-op {own:.2e}")
    assert diff <= 2 * own and _max_diff([lp_a[i] for i in same], [lp_f[i] for i in same]) > 10 * 1e-6, (diff, own)


def test_a_requests_decode_does_not_depend_on_its_batch(monkeypatch):
    """Six one-token prompts alone and together (every step decode-sized: 1 row per product alone, the rows read in
    place; 6 together, on 16-row panels): the same tokens and the same bits of every log-probability. (Longer
    prompts take the prefill path together and the decode one alone, in fp32 too.)"""
    monkeypatch.setenv("MLASERVE_INT16_ROWS", "1")
    llm = _llm("ds3", "q8_0", activations="int8_6bit_int16")
    prompts = [[5], [9], [2], [7], [3], [8]]
    tok, lp, _ = _run(llm, prompts, monkeypatch)
    for i, prompt in enumerate(prompts):
        tok_1, lp_1, _ = _run(llm, [prompt], monkeypatch)
        assert tok_1[0] == tok[i] and lp_1[0] == lp[i], i


@pytest.mark.parametrize("name", ["ds3", "ds2lite"])
def test_decode_sized_steps_far_inside_the_files_own_error(name, monkeypatch):
    """A fixture's Q8_0 file scored in steps of 3 tokens (decode-sized products: 1-3 rows per weight and expert, the
    rows read in place) with int16 activations, against the same steps exact: the logits move by what int16 adds,
    bounded as test_int16_prefill.py's prefill (0.57 / 32 of the file's own error, exact products vs transformers on
    the f32 weights: int16's step ~1/70 of bf16's by RMS, and plain bf16 adds 0.54-0.57x it), with the same top-1."""
    from conftest import fixture_dir
    from safetensors.torch import load_file

    monkeypatch.setenv("MLASERVE_INT16_ROWS", "1")
    exp = load_file(str(fixture_dir(name) / "expected.safetensors"))
    ids = exp["input_ids"].tolist()
    steps = dict(max_num_batched_tokens=3, prefill_matmul="float")
    fast, exact = _llm(name, "q8_0", activations="int8_6bit_int16", **steps), _llm(name, "q8_0", **steps)
    assert exact.config.kernels.activations == "int8_6bit_int16"  # auto here, as on such a CPU
    exact = _llm(name, "q8_0", activations="float", **steps)
    a, b = fast.prompt_logits(ids), exact.prompt_logits(ids)
    act = ((a - b).norm() / b.norm()).item()
    file = ((b - exp["hf_logits"]).norm() / exp["hf_logits"].norm()).item()
    print(
        f"\n{name} q8_0 in steps of 3: int16 activations add {act:.2e} to the logits; the file's own error {file:.4f}"
    )
    assert 0 < act <= 0.57 / 32 * file, (act, file)
    assert torch.equal(a.argmax(-1), b.argmax(-1))

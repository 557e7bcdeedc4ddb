"""DeepSeek-V4 GGUF files in llama.cpp's `deepseek4` layout (tests/v4_gguf.py writes them with the `gguf`
package, Q8_0 attention, MXFP4 routed experts, F32 norms / hc_* / ape): read, validated and kept in their
blocks; logits equal transformers' on the dequantized weights and our load of the same weights as a folder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
from v4_gguf import BLOCK_DIMS, default_type, write_dequantized_folder, write_v4_gguf  # noqa: E402
from v4_models import save_hf_v4  # noqa: E402

from mlaserve.gguf.read.file import GGUFError  # noqa: E402
from mlaserve.loading.deepseek_v4 import load_folder, load_gguf  # noqa: E402

# fp32, the same dequantized weights on both sides: the V4 suites measure 0 to 2e-6 between our model and
# transformers on these sizes (tests/models/test_deepseek_v4.py); the blocks change the weights, not the
# arithmetic's rounding (the holders dequantize exactly, then multiply in fp32). Measured here: see the report.
BOUND = 1e-5
IDS = [0, *range(5, 40)]  # 36 tokens: CSA (4) and HCA (8) windows close inside the prompt, past the window 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from transformers import DeepseekV4ForCausalLM

    root = tmp_path_factory.mktemp("v4_gguf")
    save_hf_v4("all_kinds", root / "float", seed=5, **BLOCK_DIMS)
    deq = write_v4_gguf(root / "float", root / "model.gguf")
    write_dequantized_folder(root / "float", deq, root / "deq")
    ref = DeepseekV4ForCausalLM.from_pretrained(root / "deq", experts_implementation="eager").float().eval()
    with torch.no_grad():
        logits = ref(torch.tensor([IDS]), use_cache=False).logits[0].float()
    return root, logits, ref


def _ours(model):
    with torch.no_grad():
        return model(torch.tensor(IDS), model.new_state(len(IDS)))


def test_gguf_matches_transformers_on_dequantized_weights(files):
    root, ref, _ = files
    model, report, ck = load_gguf(root / "model.gguf")
    err = (_ours(model) - ref).abs().max().item()
    assert err <= BOUND, err
    assert (_ours(model).argmax(-1) == ref.argmax(-1)).all()
    kept = {m: t for m, t, _ in report.gguf.kept}
    assert kept["model.layers.1.mlp.experts"] == "MXFP4"
    assert kept["model.layers.1.self_attn.q_a_proj"] == "Q8_0"
    assert kept["model.layers.2.self_attn.o_a_proj"] == "Q8_0"  # the grouped output projection
    assert kept["model.layers.1.self_attn.compressor.indexer.q_b_proj"] == "Q8_0"
    # the holders keep the file's bytes: no float copy of a kept matrix
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.uint8
    assert model.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.uint8
    # hc_* and norms stay fp32 floats; tid2eid are the hash layer's expert ids
    assert model.model.layers[0].attn_hc.fn.dtype == torch.float32
    ck.close()


def test_gguf_equals_the_folder_of_the_same_weights(files):
    root, *_ = files
    gguf_model, _, ck = load_gguf(root / "model.gguf")
    folder_model, _ = load_folder(root / "deq")
    err = (_ours(gguf_model) - _ours(folder_model)).abs().max().item()
    assert err <= BOUND, err
    dense, _, ck2 = load_gguf(root / "model.gguf", keep_blocks=False)
    assert (_ours(dense) - _ours(folder_model)).abs().max().item() <= BOUND
    ck.close(), ck2.close()


def test_layer_kinds_and_keys_are_read_with_their_source(files):
    from mlaserve.gguf.read.deepseek_v4 import load_v4_gguf

    root, *_ = files
    ck = load_v4_gguf(root / "model.gguf")
    cfg = ck.config
    assert cfg.layer_kinds == ("sliding", "csa", "hca", "csa")
    assert cfg.layer_kinds_source == "gguf:deepseek4.attention.compress_ratios"
    assert (cfg.compression.csa_ratio, cfg.compression.hca_ratio) == (4, 8)
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "moe", "moe")
    assert cfg.hc.hc_mult == 4 and cfg.moe.swiglu_limit == 0.5
    sources = {s.name: s.source for s in cfg.provenance}
    assert sources["hc_mult"] == "gguf:deepseek4.hyper_connection.count"
    assert sources["layer_kinds"].startswith("gguf:deepseek4.attention.compress_ratios")
    assert sources["mlp_layer_types"] == "gguf:deepseek4.hash_layer_count"
    ck.close()


def test_hc_mult_other_than_llama_cpps_is_read_and_recorded(tmp_path):
    from transformers import DeepseekV4ForCausalLM

    from mlaserve.gguf.read.deepseek_v4 import load_v4_gguf

    save_hf_v4("all_kinds", tmp_path / "float", seed=2, **BLOCK_DIMS, hc_mult=2)
    deq = write_v4_gguf(tmp_path / "float", tmp_path / "hc2.gguf")
    ck = load_v4_gguf(tmp_path / "hc2.gguf")
    assert ck.config.hc.hc_mult == 2
    source = {s.name: s.source for s in ck.config.provenance}["hc_mult"]
    assert "llama.cpp's deepseek4 graph requires 4" in source
    ck.close()
    write_dequantized_folder(tmp_path / "float", deq, tmp_path / "deq")
    ref = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "deq", experts_implementation="eager").float().eval()
    with torch.no_grad():
        want = ref(torch.tensor([IDS]), use_cache=False).logits[0].float()
    model, _, ck = load_gguf(tmp_path / "hc2.gguf")
    assert (_ours(model) - want).abs().max().item() <= BOUND
    ck.close()


@pytest.fixture(scope="module")
def float_folder(files):
    return files[0] / "float"


@pytest.mark.parametrize(
    "broken, message",
    [
        (dict(drop_tensors=("blk.2.attn_compressor_kv.weight",)), "missing tensor 'blk.2.attn_compressor_kv.weight'"),
        (dict(drop_tensors=("blk.3.ffn_up_exps.weight",)), "missing tensor 'blk.3.ffn_up_exps.weight'"),
        (dict(drop_tensors=("output_hc_fn.weight",)), "missing tensor 'output_hc_fn.weight'"),
        (dict(drop_keys=("deepseek4.attention.compress_ratios",)), "'deepseek4.attention.compress_ratios' is missing"),
        (dict(drop_keys=("deepseek4.hyper_connection.count",)), "'deepseek4.hyper_connection.count' is missing"),
        (dict(drop_keys=("deepseek4.hash_layer_count",)), "'deepseek4.hash_layer_count' is missing"),
        (dict(reshape={"blk.1.attn_kv.weight": (32, 64)}), "tensor 'blk.1.attn_kv.weight' has shape [32, 64]"),
        (dict(reshape={"blk.0.ffn_gate_exps.weight": (6, 64, 32)}), "tensor 'blk.0.ffn_gate_exps.weight' has shape"),
    ],
    ids=["compressor", "experts", "hc_head", "ratios_key", "hc_key", "hash_key", "kv_shape", "experts_shape"],
)
def test_broken_file_names_what_is_wrong(float_folder, tmp_path, broken, message):
    from mlaserve.gguf.read.deepseek_v4 import load_v4_gguf

    write_v4_gguf(float_folder, tmp_path / "bad.gguf", **broken)
    with pytest.raises(GGUFError) as e:
        load_v4_gguf(tmp_path / "bad.gguf")
    assert message in str(e.value) and str(tmp_path / "bad.gguf") in str(e.value)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("deepseek4.expert_gating_func", 2, "'deepseek4.expert_gating_func'=2: DeepSeek-V4 routes by sqrt-softplus"),
        ("deepseek4.embedding_length_out", 64 * 3, "'deepseek4.embedding_length_out'=192 is not embedding_length"),
    ],
    ids=["sigmoid_gating", "stream_width"],
)
def test_key_llama_cpp_checks_is_checked_here(float_folder, tmp_path, key, value, message):
    """llama.cpp's deepseek4 loader refuses a gating function other than sqrt-softplus (4); the streams' width is
    embedding_length x hyper_connection.count (its loader derives it): a file that says otherwise is refused."""
    import gguf

    from mlaserve.gguf.read.deepseek_v4 import load_v4_gguf

    write_v4_gguf(float_folder, tmp_path / "bad.gguf", set_keys={key: (value, gguf.GGUFValueType.UINT32)})
    with pytest.raises(GGUFError) as e:
        load_v4_gguf(tmp_path / "bad.gguf")
    assert message in str(e.value) and str(tmp_path / "bad.gguf") in str(e.value)


def test_wrongly_typed_key_is_an_error(float_folder, tmp_path):
    import gguf

    from mlaserve.gguf.read.deepseek_v4 import load_v4_gguf

    bad = {"deepseek4.hyper_connection.count": ("four", gguf.GGUFValueType.STRING)}
    write_v4_gguf(float_folder, tmp_path / "bad.gguf", set_keys=bad)
    with pytest.raises(GGUFError, match="'deepseek4.hyper_connection.count' must be an integer"):
        load_v4_gguf(tmp_path / "bad.gguf")


def test_inspect_shows_layer_kinds_with_their_source_and_block_types(files, capsys):
    from mlaserve.entrypoints.cli import main

    root, *_ = files
    assert main(["inspect", str(root / "model.gguf")]) == 0
    out = capsys.readouterr().out
    assert "layers 0: sliding (sliding window 6; from gguf:deepseek4.attention.compress_ratios)" in out
    assert "layers 1, 3: csa (CSA m=4" in out and "layers 2: hca (HCA m'=8" in out
    assert "gguf MXFP4 model.layers.*.mlp.experts" in out and "gguf Q8_0 model.layers.*.self_attn.q_a_proj" in out
    assert "gguf:deepseek4.hyper_connection.count" in out  # the keys' provenance
    assert "GGUF blocks kept" in out  # the load report


def test_engine_greedy_equals_transformers_full_recompute(files):
    """The engine (V4Serving, paged pools, the kept holders) on the file: greedy tokens of a batch of two
    prompts of different lengths == transformers' full-recompute greedy on the dequantized weights, each."""
    from mlaserve.entrypoints.llm import LLM
    from mlaserve.sampling.params import SamplingParams

    root, _, ref = files
    llm = LLM(str(root / "model.gguf"))
    prompts = [IDS[:13], IDS[3:30]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        for _ in out.outputs[0].token_ids:
            with torch.no_grad():
                seq.append(int(ref(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        assert list(out.outputs[0].token_ids) == seq[len(prompt) :]


def test_native_kernels_on_the_holders_match_transformers(files):
    """GGUFLinear's native decode-and-dot (fp32 sums in another order), the grouped o_a_proj's and the MXFP4
    experts' native products (the KernelPlan binds them): the same bound."""
    from mlaserve.kernels import native
    from mlaserve.loading.deepseek_v4 import plan_v4_kernels

    if not native.status().available:
        pytest.skip(f"native kernels unavailable: {native.status().detail}")
    root, ref, _ = files
    model, _, ck = load_gguf(root / "model.gguf")
    plan, note = plan_v4_kernels(model, "native", 0)
    assert "4 GGUFV4Experts native" in note and "GGUFLinear native" in note and "GGUFGroupedLinear native" in note
    assert {c.impl for c in plan.choices} == {"native"}
    for ids in (IDS, IDS[:5]):  # 36 rows: decoded weight + BLAS; 5 rows: the decode-and-dot GEMV
        with torch.no_grad():
            got = model(torch.tensor(ids), model.new_state(len(ids)))
        assert (got - ref[: len(ids)]).abs().max().item() <= BOUND
    ck.close()


def test_nextn_block_is_skipped_and_reported(float_folder, tmp_path):
    import gguf

    from mlaserve.gguf.read.deepseek_v4 import load_v4_gguf

    u32 = gguf.GGUFValueType.UINT32
    keys = {"deepseek4.block_count": (5, u32), "deepseek4.nextn_predict_layers": (1, u32)}
    extra = {"blk.4.attn_norm.weight": np.ones(32), "blk.4.nextn.enorm.weight": np.ones(32)}
    write_v4_gguf(float_folder, tmp_path / "mtp.gguf", set_keys=keys, extra_tensors=extra)
    ck = load_v4_gguf(tmp_path / "mtp.gguf")
    assert ck.config.num_layers == 4 and ck.config.num_nextn_predict_layers == 1
    assert sorted(ck.skipped) == sorted(extra)
    ck.close()


@pytest.mark.parametrize(
    "broken, message",
    [
        (dict(extra_tensors={"blk.1.attn_foo.weight": np.ones(4)}), "unknown tensor 'blk.1.attn_foo"),
        (dict(extra_tensors={"blk.2.indexer.proj.weight": np.ones((8, 32))}), "unexpected tensor"),
        (dict(extra_tensors={"blk.7.attn_norm.weight": np.ones(32)}), "belongs to no block"),
    ],
    ids=["unknown", "indexer_on_hca", "past_blocks"],
)
def test_tensor_not_in_the_layout_is_an_error(float_folder, tmp_path, broken, message):
    from mlaserve.gguf.read.deepseek_v4 import load_v4_gguf

    write_v4_gguf(float_folder, tmp_path / "bad.gguf", **broken)
    with pytest.raises(GGUFError, match=message):
        load_v4_gguf(tmp_path / "bad.gguf")


def test_two_hca_ratios_are_an_error(float_folder, tmp_path):
    import gguf

    from mlaserve.gguf.read.deepseek_v4 import load_v4_gguf

    ratios = {"deepseek4.attention.compress_ratios": ([0, 4, 8, 16], gguf.GGUFValueType.ARRAY)}
    write_v4_gguf(float_folder, tmp_path / "bad.gguf", set_keys=ratios)
    with pytest.raises(GGUFError, match="several HCA ratios"):
        load_v4_gguf(tmp_path / "bad.gguf")


def test_every_kept_type_and_float_types_mixed(tmp_path):
    """Q4_K (attn_q_a, random valid blocks), Q4_0 (attn_kv), Q8_0, MXFP4 gate/up with Q8_0 down in one expert
    stack, BF16 (attn_output_b) and F16 (ape, shared experts) stored floats: == transformers on the `gguf`
    package's dequantization; the plan keeps the block types and loads the float types as floats."""
    import gguf
    from transformers import DeepseekV4ForCausalLM

    T = gguf.GGMLQuantizationType

    def choose(name: str, ndim: int):
        for part, t in (
            ("attn_q_a.weight", T.Q4_K),
            ("attn_kv.weight", T.Q4_0),
            ("attn_output_b", T.BF16),
            ("ape", T.F16),
            ("shexp", T.F16),
            ("ffn_down_exps", T.Q8_0),
        ):
            if part in name:
                return t
        return default_type(name, ndim)

    save_hf_v4("all_kinds", tmp_path / "float", seed=7, **dict(BLOCK_DIMS, hidden_size=256))
    deq = write_v4_gguf(tmp_path / "float", tmp_path / "mixed.gguf", choose_type=choose)
    write_dequantized_folder(tmp_path / "float", deq, tmp_path / "deq")
    ref = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "deq", experts_implementation="eager").float().eval()
    with torch.no_grad():
        want = ref(torch.tensor([IDS]), use_cache=False).logits[0].float()
    model, report, ck = load_gguf(tmp_path / "mixed.gguf")
    kept = {m: t for m, t, _ in report.gguf.kept}
    floats = {m: t for m, t, _ in report.gguf.floats}
    assert kept["model.layers.0.self_attn.q_a_proj"] == "Q4_K" and kept["model.layers.0.self_attn.kv_proj"] == "Q4_0"
    assert kept["model.layers.2.mlp.experts"] == "MXFP4/Q8_0"
    assert (
        floats["model.layers.1.self_attn.o_b_proj"] == "BF16"
        and floats["model.layers.1.mlp.shared_experts.up_proj"] == "F16"
    )
    err = (_ours(model) - want).abs().max().item()
    assert err <= BOUND, err
    ck.close()


def test_every_key_is_read_or_listed_as_not_read(float_folder, tmp_path):
    import gguf

    from mlaserve.gguf.read.deepseek_v4 import load_v4_gguf

    extra = {"deepseek4.attention.new_knob": (7, gguf.GGUFValueType.UINT32)}
    write_v4_gguf(float_folder, tmp_path / "extra.gguf", set_keys=extra)
    ck = load_v4_gguf(tmp_path / "extra.gguf")
    sources = {k: src for k, (_, src) in ck.provenance.items()}
    # every key the converter writes is read; only the one it does not know is listed as not read
    assert [k for k, src in sources.items() if "not read" in src] == ["deepseek4.attention.new_knob"]
    ck.close()


def test_native_keys_are_read_where_they_lie_as_the_torch_gather_copies_them(files, monkeypatch):
    """The batched attention's keys named where they lie (V4Attention._gather_keys_native -> KeyParts: the ring
    cache, the step's rows, the paged pool, the rows the step closed), gathered in one C call, are the torch form's
    copy bit for bit; and the native softmax reading them in place (mls_sink_mqa_parts, at the attention, before
    the step's ring writes) equals the one over that copy made at the gather, bit for bit, on every step of a batch
    of prompts in chunks beside decodes (chunks longer than the window: their own rows overwrite ring rows their
    first queries still see). A plan without the CPU's (part, row) table takes the torch form. The checks record
    what they see (an exception inside a step would only fail its requests); broken on purpose (the ring written
    before the attention) the in-place read differs."""
    import dataclasses

    from mlaserve.entrypoints.llm import LLM
    from mlaserve.kernels import native_v4
    from mlaserve.models.deepseek_v4.attention import V4Attention
    from mlaserve.sampling.params import SamplingParams

    root, _, _ = files
    copies, seen = {}, []
    real_gather, real_attend = V4Attention._gather_keys_native, V4Attention._attend_step_native

    def gather(self, step, plan, kv, rows):
        got = real_gather(self, step, plan, kv, rows)
        want = self._gather_keys_torch(step, plan, kv, rows)
        by_torch = real_gather(self, step, dataclasses.replace(plan, direct=None), kv, rows)
        seen.append(("gather", isinstance(got, native_v4.KeyParts) and torch.equal(got.gather(), want)))
        seen.append(("no table", torch.equal(by_torch, want)))
        copies[id(got)] = want
        return got

    def attend(self, q, keys, mask, queries):
        out = real_attend(self, q, keys, mask, queries)
        seen.append((q.shape[0], torch.equal(out, real_attend(self, q, copies.pop(id(keys)), mask, queries))))
        return out

    monkeypatch.setattr(V4Attention, "_gather_keys_native", gather)
    monkeypatch.setattr(V4Attention, "_attend_step_native", attend)
    llm = LLM(str(root / "model.gguf"), max_num_batched_tokens=9)
    attention = llm.runner.model.inner.model.layers[1].self_attn
    assert attention.gather_keys.__func__ is gather and attention.window < 9
    outs = llm.generate([IDS[:13], IDS[3:30], IDS[:6]], SamplingParams(temperature=0.0, max_tokens=8))
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]
    assert [what for what, same in seen if not same] == []
    assert len(seen) > 60 and not copies and max(n for n, _ in seen if isinstance(n, int)) == 9


def test_the_ffn_sublayer_in_one_call_equals_its_parts_bit_for_bit(files, monkeypatch):
    """V4DecoderLayer's FFN sublayer as one C call (op v4_ffn: csrc/v4_ffn.c mls_v4_ffn, the attention's new
    streams, the FFN's mixing, norm, MoE block and output streams) against the same parts called in turn with
    their native kernels (_ffn_per_op), bit for bit, on every step of a batch of prompts in chunks beside decodes,
    hash-routed layers included; a step past the MoE block's max_tokens takes the parts. The checks are recorded,
    not asserted inside the step (where an exception fails the requests, not the test). Broken on purpose (the
    FFN norm's weight not applied in the C call) every step differs."""
    from mlaserve.entrypoints.llm import LLM
    from mlaserve.models.deepseek_v4.model import V4DecoderLayer
    from mlaserve.sampling.params import SamplingParams

    root, _, _ = files
    seen = []
    real = V4DecoderLayer._ffn_native

    def both(self, h, post, comb, y, ids):
        got = real(self, h, post, comb, y, ids)
        seen.append((h.shape[0], self.mlp.gate.hashed, torch.equal(got, self._ffn_per_op(h, post, comb, y, ids))))
        return got

    monkeypatch.setattr(V4DecoderLayer, "_ffn_native", both)
    llm = LLM(str(root / "model.gguf"), max_num_batched_tokens=9)
    layers = llm.runner.model.inner.model.layers
    assert all(layer.ffn.__func__ is both for layer in layers), llm.loaded.kernel_plan.format()
    outs = llm.generate([IDS[:13], IDS[3:30], IDS[:6]], SamplingParams(temperature=0.0, max_tokens=8))
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]
    assert [s for s in seen if not s[2]] == []
    assert len(seen) > 40 and {hashed for _, hashed, _ in seen} == {True, False} and {n for n, _, _ in seen} >= {1, 9}


def test_the_projections_of_one_input_in_one_call_equal_their_own_calls_bit_for_bit(files, monkeypatch):
    """V4Attention's projections of its input (q_a, kv; the compressor's kv, gate; the indexer's kv, gate) as one
    native call where they share it (kernels/row_product.bind_shared_input: csrc/int16.c mls_int16_gemm_multi,
    int16 activations on Q8_0) against each module's own call, bit for bit, on every step of a batch of prompts
    in chunks beside decodes (steps of up to SHARED_ROWS rows; longer ones take the modules' own calls); other
    settings (the fixture's default here: exact Q8_0 products) take each module's own call. Recorded, not asserted
    inside the step. Broken on purpose (a weight's panels read from the one before it) every step differs."""
    from mlaserve.entrypoints.llm import LLM
    from mlaserve.gguf.quants import GGML_TYPE_IDS
    from mlaserve.kernels import int16_prefill
    from mlaserve.models.deepseek_v4.attention import V4Attention
    from mlaserve.sampling.params import SamplingParams

    if not int16_prefill.takes_rows(GGML_TYPE_IDS["Q8_0"]):
        pytest.skip(f"no int16 products here: {int16_prefill.detail()}")
    monkeypatch.setenv("MLASERVE_INT16_ROWS", "1")  # the suite turns auto's int16 off; the CPU has them
    root, _, _ = files
    seen = []
    real = V4Attention._project_native

    def both(self, x):
        got = real(self, x)
        want = self._project_torch(x)
        same = len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
        seen.append((x.shape[0], len(got), self._shared_product() is not None, same))
        return got

    monkeypatch.setattr(V4Attention, "_project_native", both)
    llm = LLM(str(root / "model.gguf"), max_num_batched_tokens=9, activations="int8_6bit_int16")
    attention = llm.runner.model.inner.model.layers[1].self_attn
    assert attention.project.__func__ is both
    outs = llm.generate([IDS[:13], IDS[3:30], IDS[:6]], SamplingParams(temperature=0.0, max_tokens=8))
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]
    assert [s for s in seen if not s[3]] == []
    assert all(shared for _, _, shared, _ in seen)  # the file's projections share one type: the one call binds
    assert {n for n, _, _, _ in seen} >= {1, 2, 3, 9} and {k for _, k, _, _ in seen} == {2, 4, 6}  # sliding, HCA, CSA


@pytest.mark.parametrize("type_name, setting", [("Q8_0", 6 | 0x100), ("Q4_K", 6), ("Q8_0", 0)])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_o_a_proj_takes_the_plans_activations_as_a_linear_of_each_group(type_name, setting, rows):
    """GGUFGroupedLinear (o_a_proj) at decode sizes with the plan's activation setting: each group's columns are bit
    for bit a GGUFLinear product (ggml.linear_native) of that group's input slice and row block under the same
    setting -- int16 codes for Q8_0 under int8_6bit_int16, int8 for Q4_K under int8_6bit, fp32 without one -- where
    until 2026-12-07 the holder had no setting and ran fp32 at every row count (at 16 rows ~1.6 ms a layer of the
    4-layer benchmark model's step, a 2-core AMX Xeon). Broken on purpose (the setting not passed) the int8 and
    int16 cases fail."""
    from mlaserve.gguf.quants import GGML_TYPE_IDS
    from mlaserve.kernels import ggml, int16_prefill, native
    from mlaserve.quant.ggml_deepseek_v4 import GGUFGroupedLinear

    if not native.status().available:
        pytest.skip(f"native kernels unavailable: {native.status().detail}")
    t = GGML_TYPE_IDS[type_name]
    if setting & 0x100 and not int16_prefill.takes_rows(t):
        pytest.skip(f"no int16 products here: {int16_prefill.detail()}")
    g, o, k = 4, 32, 256
    lin = GGUFGroupedLinear(k, g * o, g, t, "cpu")
    gen = torch.Generator().manual_seed(rows + t)
    raw = torch.randint(0, 256, tuple(lin.weight.shape), generator=gen, dtype=torch.uint8)
    block = {"Q8_0": 34, "Q4_K": 144}[type_name]  # the fp16 scales at each block's start (Q4_K: d, dmin)
    blocks = raw.view(-1, block)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    for at in (0, 2) if type_name == "Q4_K" else (0,):
        blocks[:, at : at + 2] = scale
    lin.weight.copy_(raw)
    lin.kernel, lin.int8 = "native", setting
    x = torch.randn(rows, g, k, generator=gen)
    got = lin(x)
    w = lin.weight.view(g, o, -1)
    for a in range(g):
        want = ggml.linear_native(x[:, a].contiguous(), w[a].contiguous(), t, k, setting)
        assert torch.equal(got[:, a * o : (a + 1) * o], want), (type_name, setting, rows, a)
    assert native.takes_int8(t, setting) or int16_prefill.takes_rest(t, setting) or setting == 0


def test_every_block_holder_takes_the_plans_activation_setting(files):
    """The kind of the o_a_proj bug: the plan hands its activation setting only to holders that declare `int8`
    (registry._apply_native), so a holder without one silently stayed fp32. Every module of the V4 file whose
    products read ggml blocks (ops linear, grouped_experts, heads) carries the engine's setting after the plan."""
    from mlaserve.entrypoints.llm import LLM

    root, _, _ = files
    llm = LLM(str(root / "model.gguf"), activations="int8_6bit")
    holders = [
        (name, m)
        for name, m in llm.runner.model.inner.named_modules()
        if getattr(m, "KERNEL_OP", None) in ("linear", "grouped_experts", "heads")
        and type(m).__module__.startswith("mlaserve.quant.ggml")
    ]
    kinds = {type(m).__name__ for _, m in holders}
    assert {"GGUFLinear", "GGUFGroupedLinear", "GGUFV4Experts"} <= kinds, kinds
    assert [name for name, m in holders if getattr(m, "int8", None) != 6] == []

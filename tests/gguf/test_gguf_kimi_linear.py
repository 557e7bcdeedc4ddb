"""Kimi-Linear GGUF files in llama.cpp's `kimi-linear` layout (tests/kimi_gguf.py writes them with the `gguf`
package: Q8_0 projections, F32 norms / convs / ssm_a / dt_bias / router / embedding): read, validated, kept in their
blocks; logits equal transformers' on the weights the `gguf` package dequantizes from the file, and our load of the
same weights as a folder.

Bound: 1e-5 max abs against transformers run in float64 on the dequantized weights, 100% top-1 -- the bound of the
Kimi-Linear suite (tests/models/test_kimi_linear.py: fp32 rounding of these sizes is 1e-6 .. 7.5e-6 on both sides).
The blocks change the weights, not the arithmetic (the holders dequantize exactly and multiply in fp32). Measured
here: 1.3e-6 .. 2.9e-6 (logits of magnitude ~4, lengths 5 .. 130). A defect moves logits by 1e-2 .. 1: a conv read
with the wrong axis, ssm_a taken as A_log, k_b / v_b swapped, a KDA layer read as MLA.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
from hf_models import hf_greedy  # noqa: E402
from kimi_gguf import save_block_kimi, write_dequantized_folder, write_kimi_gguf  # noqa: E402
from kimi_linear_models import float64_copy, hf_logits, random_ids  # noqa: E402
from state_engine import assert_close  # noqa: E402

from mlaserve.gguf.read.file import GGUFError  # noqa: E402

BOUND = 1e-5
LENGTHS = (5, 64, 130)  # inside one 64-token KDA chunk, exactly one, past two


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(root, float64 transformers on the file's dequantized weights); root holds float/ (the model as saved),
    model.gguf (Q8_0 projections) and deq/ (the dequantized weights as a folder)."""
    from transformers import KimiLinearForCausalLM

    root = tmp_path_factory.mktemp("kimi_gguf")
    save_block_kimi(root / "float", seed=3)
    deq = write_kimi_gguf(root / "float", root / "model.gguf")
    write_dequantized_folder(root / "float", deq, root / "deq")
    ref = float64_copy(KimiLinearForCausalLM.from_pretrained(root / "deq").float().eval())
    return root, ref


@pytest.fixture(scope="module")
def llm(files):
    from mlaserve.entrypoints.llm import LLM

    return LLM(str(files[0] / "model.gguf"), max_num_batched_tokens=40)


def test_gguf_logits_equal_transformers_on_the_dequantized_weights(files, llm):
    _, ref = files
    for n in LENGTHS:  # prefill in chunks of 40 tokens: the KDA states carried across steps
        ids = random_ids(n, ref.config.vocab_size, n)
        assert_close(llm.prompt_logits(ids), hf_logits(ref, ids), BOUND, f"length {n}")


def test_projections_stay_in_their_blocks_and_the_rest_float(llm):
    from mlaserve.gguf.quants import GGML_TYPES

    plan = llm.loaded.gguf
    kept = {m: GGML_TYPES[t].name for m, t in plan.linears} | {m: GGML_TYPES[t].name for m, t, _ in plan.experts}
    for proj in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "b_proj", "o_proj"):
        assert kept[f"model.layers.0.self_attn.{proj}"] == "Q8_0", proj
    assert kept["model.layers.1.self_attn.q_proj"] == "Q8_0"  # the MLA layer's
    assert kept["model.layers.1.self_attn.kv_a_proj_with_mqa"] == "Q8_0"
    assert kept["model.layers.2.mlp.experts"] == "Q8_0"
    model = llm.loaded.model
    kda = model.model.layers[0].self_attn
    assert kda.q_proj.weight.dtype == torch.uint8  # the file's bytes, no float copy
    for p in (kda.q_conv1d.weight, kda.A_log, kda.dt_bias, kda.o_norm.weight):
        assert p.dtype == torch.float32


def test_gguf_equals_the_folder_of_the_same_weights(files, llm):
    """The file (blocks kept, multiplied by the ggml kernels) == the dequantized weights loaded as a folder."""
    from mlaserve.entrypoints.llm import LLM

    root, ref = files
    folder = LLM(str(root / "deq"), max_num_batched_tokens=40)
    ids = random_ids(130, ref.config.vocab_size, 11)
    assert_close(llm.prompt_logits(ids), folder.prompt_logits(ids), BOUND, "gguf vs folder")


def test_an_f32_file_reads_back_the_saved_weights(files):
    """All-F32 file: every tensor reads back as the folder saved it (A_log through ssm_a = -exp(A_log) to 1 ulp)."""
    import gguf
    from safetensors.torch import load_file

    from mlaserve.gguf.read.checkpoint import load_gguf

    root, _ = files
    path = root / "f32.gguf"
    write_kimi_gguf(root / "float", path, choose_type=lambda g, s: gguf.GGMLQuantizationType.F32)
    ck = load_gguf(path)
    saved = load_file(root / "float" / "model.safetensors")
    rename = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
    assert len(ck.tensors) == len(saved)
    for name, want in saved.items():
        ours = name
        for a, b in rename.items():
            ours = ours.replace(a, b)
        got = ck.tensors.get(ours)
        if name.endswith("A_log"):
            torch.testing.assert_close(got, want, rtol=0, atol=2e-7)  # log(-(-exp(x))) in fp32
        else:
            assert torch.equal(got, want), name
    assert ck.provenance["layer_types"][1] == "gguf:kimi-linear.attention.head_count_kv (0 = KDA layer)"
    assert ck.hf_config["layer_types"][:2] == ["linear_attention", "full_attention"]
    assert ck.provenance["linear_head_dim"][1] == "gguf:kimi-linear.kda.head_dim"
    assert ck.provenance["linear_conv_kernel_dim"][1] == "gguf:kimi-linear.ssm.conv_kernel"
    ck.close()


@pytest.mark.parametrize(
    "broken, message",
    [
        (dict(drop_tensors=("blk.0.ssm_f_b.weight",)), "missing tensor 'blk.0.ssm_f_b.weight'"),
        (
            dict(drop_tensors=("blk.3.ssm_a",)),
            "missing tensor 'blk.3.ssm_a' (needed for model.layers.3.self_attn.A_log)",
        ),
        (dict(drop_tensors=("blk.1.attn_k_b.weight",)), "'blk.1.attn_k_b.weight'"),
        (dict(reshape={"blk.2.ssm_beta.weight": (4, 64)}), "tensor 'blk.2.ssm_beta.weight' has shape [4, 64]"),
        (dict(reshape={"blk.0.ssm_conv1d_k.weight": (1, 160, 1, 3)}), "tensor 'blk.0.ssm_conv1d_k.weight' has shape"),
        (dict(drop_keys=("kimi-linear.kda.head_dim",)), "'kimi-linear.kda.head_dim' is missing"),
        (dict(drop_keys=("kimi-linear.ssm.conv_kernel",)), "'kimi-linear.ssm.conv_kernel' is missing"),
        (dict(drop_keys=("kimi-linear.attention.head_count_kv",)), "'kimi-linear.attention.head_count_kv' must be"),
    ],
    ids=["f_b", "ssm_a", "k_b", "beta_shape", "conv_shape", "head_dim_key", "conv_key", "pattern_key"],
)
def test_broken_file_names_what_is_wrong(files, tmp_path, broken, message):
    from mlaserve.gguf.read.checkpoint import load_gguf

    write_kimi_gguf(files[0] / "float", tmp_path / "bad.gguf", **broken)
    with pytest.raises(GGUFError) as e:
        load_gguf(tmp_path / "bad.gguf")
    assert message in str(e.value) and str(tmp_path / "bad.gguf") in str(e.value)


def test_inspect_shows_layer_kinds_with_their_source_and_block_types(files, capsys):
    from mlaserve.entrypoints.cli import main

    assert main(["inspect", str(files[0] / "model.gguf")]) == 0
    out = capsys.readouterr().out
    assert "gguf:kimi-linear.attention.head_count_kv (0 = KDA layer)" in out  # the layer kinds' source
    assert "layers 0, 2-3: kda; cache: recurrent [5 x 32 x 32]" in out and "layers 1: mla;" in out
    assert "gguf:kimi-linear.kda.head_dim" in out and "gguf:kimi-linear.ssm.conv_kernel" in out
    assert "gguf Q8_0 model.layers.*.self_attn.f_b_proj" in out and "gguf Q8_0 model.layers.*.mlp.experts" in out


def test_ssm_a_not_negative_is_an_error_naming_it(files, tmp_path):
    """A file holding A_log itself where llama.cpp stores A = -exp(A_log) (one value >= 0) is refused, not read."""
    import numpy as np
    from gguf_helpers import gguf_f32, rewrite_gguf

    from mlaserve.gguf.read.checkpoint import load_gguf

    src = files[0] / "model.gguf"
    a = gguf_f32(src, "blk.2.ssm_a").copy()
    a.flat[3] = 0.5
    rewrite_gguf(src, tmp_path / "bad.gguf", replace={"blk.2.ssm_a": a.astype(np.float32)})
    with pytest.raises(GGUFError, match=r"tensor 'blk\.2\.ssm_a' must be negative everywhere"):
        load_gguf(tmp_path / "bad.gguf")


def test_wrongly_typed_key_is_an_error(files, tmp_path):
    import gguf
    from gguf_helpers import rewrite_gguf

    from mlaserve.gguf.read.checkpoint import load_gguf

    bad = {"kimi-linear.kda.head_dim": ("thirty-two", gguf.GGUFValueType.STRING)}
    rewrite_gguf(files[0] / "model.gguf", tmp_path / "bad.gguf", set_keys=bad)
    with pytest.raises(GGUFError, match="'kimi-linear.kda.head_dim' must be an integer"):
        load_gguf(tmp_path / "bad.gguf")


def test_a_scalar_head_count_serves_both_layer_kinds(tmp_path):
    """llama.cpp may write attention.head_count as one number (the released model: 32 KDA and 32 MLA heads): both
    kinds read it, and the model equals transformers'."""
    import gguf
    from gguf_helpers import rewrite_gguf
    from transformers import KimiLinearForCausalLM

    from mlaserve.entrypoints.llm import LLM
    from mlaserve.gguf.read.checkpoint import load_gguf

    save_block_kimi(tmp_path / "float", seed=4, linear_num_heads=3)
    deq = write_kimi_gguf(tmp_path / "float", tmp_path / "arr.gguf")
    scalar = {"kimi-linear.attention.head_count": (3, gguf.GGUFValueType.UINT32)}
    rewrite_gguf(tmp_path / "arr.gguf", tmp_path / "model.gguf", set_keys=scalar)
    ck = load_gguf(tmp_path / "model.gguf")
    assert (ck.hf_config["linear_num_heads"], ck.hf_config["num_attention_heads"]) == (3, 3)
    ck.close()
    write_dequantized_folder(tmp_path / "float", deq, tmp_path / "deq")
    ref = float64_copy(KimiLinearForCausalLM.from_pretrained(tmp_path / "deq").float().eval())
    ids = random_ids(70, ref.config.vocab_size, 5)
    assert_close(LLM(str(tmp_path / "model.gguf")).prompt_logits(ids), hf_logits(ref, ids), BOUND, "scalar head_count")


def test_greedy_through_the_state_equals_transformers(files, llm):
    """Two prompts in flight together (KDA decode steps batched, the MLA layer's absorbed path on attn_k_b /
    attn_v_b blocks) generate transformers' full-recompute greedy tokens on the dequantized weights."""
    from mlaserve.sampling.params import SamplingParams

    _, ref = files
    prompts = [random_ids(9, ref.config.vocab_size, 1), random_ids(70, ref.config.vocab_size, 2)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, 10, hf_logits)


def test_router_keys_the_converter_does_not_write_take_llama_cpps_graph(files, tmp_path):
    """llama.cpp's converter writes no expert_weights_norm / expert_gating_func for kimi-linear (its graph always
    renormalizes, sigmoid routing): a file without them reads as that, and its logits equal transformers'."""
    from gguf_helpers import rewrite_gguf

    from mlaserve.entrypoints.llm import LLM
    from mlaserve.gguf.read.checkpoint import load_gguf

    root, ref = files
    drop = ("kimi-linear.expert_weights_norm", "kimi-linear.expert_gating_func")
    rewrite_gguf(root / "model.gguf", tmp_path / "model.gguf", drop_keys=drop)
    ck = load_gguf(tmp_path / "model.gguf")
    assert (ck.hf_config["norm_topk_prob"], ck.hf_config["scoring_func"]) == (True, "sigmoid")
    assert "llama.cpp kimi-linear graph" in ck.provenance["norm_topk_prob"][1]
    ck.close()
    ids = random_ids(40, ref.config.vocab_size, 9)
    assert_close(
        LLM(str(tmp_path / "model.gguf")).prompt_logits(ids), hf_logits(ref, ids), BOUND, "converter's keys only"
    )

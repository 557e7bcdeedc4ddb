"""GGUF -> HF config and tensor mapping, checked against the fixtures' config.json and logits."""

from __future__ import annotations

import json
import types
from functools import cache

import numpy as np
import pytest
import torch
from conftest import FP32_LOGITS_TOL
from gguf_helpers import (
    fixture_params,
    gguf_f32,
    hf_state_dict,
    need_fixtures,
    rewrite_gguf,
)

from mlaserve.gguf.read import checkpoint as gguf_checkpoint
from mlaserve.gguf.read.checkpoint import GGUFError, derive_hf_config, load_gguf
from mlaserve.gguf.read.config import ABSENT
from mlaserve.gguf.read.file import open_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# every config field the model needs (compared with the fixture's config.json)
MODEL_FIELDS = [
    "model_type",
    "architectures",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "qk_head_dim",
    "v_head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "scoring_func",
    "topk_method",
    "rms_norm_eps",
    "vocab_size",
    "tie_word_embeddings",
    "rope_parameters",
    "max_position_embeddings",
    "hidden_act",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "num_nextn_predict_layers",
    "rope_interleave",
    "index_topk",
    "index_n_heads",
    "index_head_dim",
    "indexer_types",
]
PROVENANCE_PREFIXES = ("gguf:", ABSENT, "derived", "llama.cpp")


def _config_json(model: str) -> dict:
    return json.loads((need_fixtures() / model / "config.json").read_text())


@pytest.mark.parametrize("model,qtype,path", fixture_params())
def test_config_matches_fixture_config_json(model, qtype, path):
    ck = load_gguf(path, validate_numeric=False)
    ref = _config_json(model)
    for f in MODEL_FIELDS:
        if f not in ref:
            continue  # e.g. ds2lite's config.json has no num_nextn_predict_layers
        if f == "bos_token_id" and model == "glm5":
            # GLM has no BOS in HF terms; the converter stores [gMASK] (the prompt prefix) as BOS
            assert ck.hf_config[f] == 792 and ref[f] is None
            continue
        assert ck.hf_config.get(f, "<missing>") == ref[f], f"{path.name}: {f}"
    for f, value in ck.hf_config.items():
        assert f in ck.provenance, f"no provenance for {f}"
        assert ck.provenance[f][0] == value
        assert ck.provenance[f][1].startswith(PROVENANCE_PREFIXES), ck.provenance[f]


def test_provenance_of_optional_keys():
    need_fixtures()
    ds2 = load_gguf(need_fixtures() / "ds2lite" / "model-f32.gguf", validate_numeric=False).provenance
    assert ds2["q_lora_rank"] == (None, f"{ABSENT}: 'deepseek2.attention.q_lora_rank' -> no query LoRA (tensor attn_q)")
    assert ds2["norm_topk_prob"] == (False, f"{ABSENT}: 'deepseek2.expert_weights_norm'")
    assert ds2["n_group"][1].startswith(f"{ABSENT}: 'deepseek2.expert_group_count'")
    q4 = load_gguf(need_fixtures() / "ds2lite" / "model-q4_k_m.gguf", validate_numeric=False).provenance
    assert q4["q_lora_rank"] == (None, "gguf:deepseek2.attention.q_lora_rank=0 -> no query LoRA (tensor attn_q)")
    ds3 = load_gguf(need_fixtures() / "ds3" / "model-f32.gguf", validate_numeric=False).provenance
    assert ds3["scoring_func"] == ("sigmoid", "gguf:deepseek2.expert_gating_func=2")
    assert ds3["rms_norm_eps"] == (1e-06, "gguf:deepseek2.attention.layer_norm_rms_epsilon")
    assert ds3["qk_nope_head_dim"][1].startswith("derived: gguf:deepseek2.attention.key_length_mla")


def _stub(path, drop=(), **set_keys):
    """An in-memory GGUFFile stand-in with edited metadata, for config-only checks."""
    gf = open_gguf(path)
    md = {k: v for k, v in gf.metadata.items() if k not in drop}
    md.update(set_keys)
    return types.SimpleNamespace(path=gf.path, metadata=md, tensors=gf.tensors)


def test_gating_func_absent_means_softmax():
    path = need_fixtures() / "ds2lite" / "model-f32.gguf"
    cfg, prov = derive_hf_config(_stub(path, drop={"deepseek2.expert_gating_func"}))
    assert cfg["scoring_func"] == "softmax" and cfg["model_type"] == "deepseek_v2"
    assert prov["scoring_func"][1] == f"{ABSENT}: 'deepseek2.expert_gating_func' -> softmax"
    # a V3 file whose converter saw no scoring_func: still V3 (exp_probs_b), scored as llama.cpp does
    cfg, prov = derive_hf_config(
        _stub(need_fixtures() / "ds3" / "model-f32.gguf", drop={"deepseek2.expert_gating_func"})
    )
    assert cfg["model_type"] == "deepseek_v3" and cfg["scoring_func"] == "softmax"
    assert "exp_probs_b" in prov["model_type"][1]


@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.707, 0.1, 1.25, 0.3333333])
def test_yarn_parameters_invert_the_converter(mscale_all_dim):
    path = need_fixtures() / "ds3" / "model-f32.gguf"
    # what convert_hf_to_gguf writes for DeepSeek YaRN (a float32 key, 0.1 * mscale_all_dim)
    log_mul = float(np.float32(0.1 * mscale_all_dim))
    cfg, prov = derive_hf_config(
        _stub(
            path,
            **{
                "deepseek2.rope.scaling.type": "yarn",
                "deepseek2.rope.scaling.factor": 40.0,
                "deepseek2.rope.scaling.original_context_length": 4096,
                "deepseek2.rope.scaling.yarn_beta_fast": 32.0,
                "deepseek2.rope.scaling.yarn_beta_slow": 1.0,
                "deepseek2.rope.scaling.yarn_log_multiplier": log_mul,
            },
        )
    )
    assert cfg["rope_parameters"] == {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale_all_dim": mscale_all_dim,
        "mscale": mscale_all_dim,
    }
    assert prov["rope_parameters.beta_fast"][1] == "gguf:deepseek2.rope.scaling.yarn_beta_fast"
    assert prov["rope_parameters.mscale_all_dim"][1] == "derived: gguf:deepseek2.rope.scaling.yarn_log_multiplier / 0.1"
    transformers.AutoConfig.for_model(**cfg)  # transformers accepts the derived rope_parameters


def test_yarn_defaults_and_attn_factor():
    path = need_fixtures() / "ds3" / "model-f32.gguf"
    cfg, prov = derive_hf_config(
        _stub(
            path,
            **{
                "deepseek2.rope.scaling.type": "yarn",
                "deepseek2.rope.scaling.factor": 4.0,
                "deepseek2.rope.scaling.original_context_length": 1024,
                "deepseek2.rope.scaling.yarn_attn_factor": float(np.float32(0.9)),
            },
        )
    )
    rp = cfg["rope_parameters"]
    assert (rp["beta_fast"], rp["beta_slow"], rp["attention_factor"]) == (32.0, 1.0, 0.9)
    assert "mscale_all_dim" not in rp
    assert prov["rope_parameters.beta_slow"][1] == f"{ABSENT}: 'deepseek2.rope.scaling.yarn_beta_slow'"


# ---------------------------------------------------------------------------------------------
# the mapping, checked through transformers' logits


@cache
def _expected(model: str) -> dict:
    return safetensors_torch.load_file(need_fixtures() / model / "expected.safetensors")


@cache
def _hf_model(model: str):
    cfg = transformers.AutoConfig.from_pretrained(need_fixtures() / model)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()


def _logits(model, ck) -> torch.Tensor:
    model.load_state_dict(hf_state_dict(ck.tensors.get, ck.tensors.names()), strict=True)
    with torch.no_grad():
        return model(_expected_key(ck)[None], use_cache=False).logits[0]


def _expected_key(ck) -> torch.Tensor:
    return _expected(ck.path.parent.name)["input_ids"]


@pytest.mark.parametrize("model,qtype,path", fixture_params())
def test_logits_match_hf_dequant_reference(model, qtype, path):
    ck = load_gguf(path)
    logits = _logits(_hf_model(model), ck)
    ref = _expected(model)[f"hf_dequant_logits_{qtype}"]
    diff = (logits - ref).abs().max().item()
    top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"\n{model} {qtype}: max|logits - hf_dequant_logits_{qtype}| = {diff:.3g}, top-1 {100 * top1:.1f}%")
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0  # transformers in both, batched differently: 2.4e-6..5.3e-6


@pytest.mark.parametrize("model", ["ds3", "ds2lite", "ds32", "glm5"])
def test_derived_config_builds_the_same_model(model):
    ck = load_gguf(need_fixtures() / model / "model-f32.gguf", validate_numeric=False)
    cfg = transformers.AutoConfig.for_model(**ck.hf_config)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    diff = (_logits(hf, ck) - _expected(model)["hf_logits"]).abs().max().item()
    print(f"\n{model}: derived config, max|logits - hf_logits| = {diff:.3g}")
    assert diff <= FP32_LOGITS_TOL  # measured 2.6e-6..4.5e-6


def test_wrong_k_b_transpose_is_caught(monkeypatch):
    """ds3 has qk_nope_head_dim == kv_lora_rank: a k_b used untransposed passes every shape check."""
    path = need_fixtures() / "ds3" / "model-f32.gguf"

    def join_untransposed(k_b, v_b):
        return torch.cat([k_b, v_b], dim=1).reshape(-1, k_b.shape[1])

    monkeypatch.setattr(gguf_checkpoint, "_join_kv_b", join_untransposed)
    ck = load_gguf(path, validate_numeric=False)
    diff = (_logits(_hf_model("ds3"), ck) - _expected("ds3")["hf_dequant_logits_f32"]).abs().max().item()
    assert diff > 0.1  # the logits catch it ...
    with pytest.raises(
        GGUFError,
        match=r"layer 0: MLA absorbed vs decompressed attention scores differ.*"
        r"blk\.0\.attn_k_b\.weight",
    ):
        load_gguf(path)  # ... and so does the load-time identity check of the rebuild


# ---------------------------------------------------------------------------------------------
# tensor view details


def test_names_shapes_and_sources():
    ck = load_gguf(need_fixtures() / "glm5" / "model-q4_k_m.gguf")
    t = ck.tensors
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in t and len(t) == len(t.names())
    assert t.shape("model.layers.1.self_attn.kv_b_proj.weight") == (4 * (48 + 64), 32)
    assert t.sources("model.layers.1.self_attn.kv_b_proj.weight") == ("blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight")
    assert t.sources("model.layers.2.mlp.gate.e_score_correction_bias") == ("blk.2.exp_probs_b.bias",)
    assert t.gguf_type("model.layers.0.mlp.down_proj.weight") == "Q4_K"
    for n in t.names():
        assert tuple(t.get(n).shape) == t.shape(n), n
    assert ck.skipped == []


def test_experts_are_slices_of_the_stack():
    path = need_fixtures() / "ds3" / "model-q4_k_m.gguf"
    ck = load_gguf(path, validate_numeric=False)
    stack = ck.tensors.get_experts(1, "gate_proj")
    assert stack.shape == (8, 32, 256)
    for e in range(8):
        assert torch.equal(ck.tensors.get(f"model.layers.1.mlp.experts.{e}.gate_proj.weight"), stack[e])
    assert np.array_equal(stack.numpy(), gguf_f32(path, "blk.1.ffn_gate_exps.weight"))


def test_mla_split_orientation():
    ck = load_gguf(need_fixtures() / "glm5" / "model-f16.gguf")
    w_uk, w_uv = ck.mla_split(2)
    assert w_uk.shape == (4, 32, 48) and w_uv.shape == (4, 64, 32)  # [H, L, n], [H, v, L]
    kv_b = ck.tensors.get("model.layers.2.self_attn.kv_b_proj.weight").reshape(4, 48 + 64, 32)
    assert torch.equal(kv_b[:, :48], w_uk.transpose(1, 2)) and torch.equal(kv_b[:, 48:], w_uv)


def _fused_kv_b(path, layer: int) -> np.ndarray:
    k_b, v_b = gguf_f32(path, f"blk.{layer}.attn_k_b.weight"), gguf_f32(path, f"blk.{layer}.attn_v_b.weight")
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])


def test_legacy_fused_kv_b_file(tmp_path):
    """Pre-split GGUFs: one attn_kv_b per layer, key_length/value_length = real head sizes."""
    src = need_fixtures() / "ds3" / "model-f32.gguf"
    drop = {f"blk.{i}.attn_{w}_b.weight" for i in range(3) for w in "kv"}
    dst = rewrite_gguf(
        src,
        tmp_path / "fused.gguf",
        drop_tensors=drop,
        add={f"blk.{i}.attn_kv_b.weight": _fused_kv_b(src, i) for i in range(3)},
        drop_keys={"deepseek2.attention.key_length_mla", "deepseek2.attention.value_length_mla"},
        set_keys={
            "deepseek2.attention.key_length": (48, gguf.GGUFValueType.UINT32),
            "deepseek2.attention.value_length": (32, gguf.GGUFValueType.UINT32),
        },
    )
    fused, split = load_gguf(dst), load_gguf(src)
    assert fused.hf_config == split.hf_config
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert fused.tensors.sources(name) == ("blk.1.attn_kv_b.weight",)
    assert torch.equal(fused.tensors.get(name), split.tensors.get(name))
    for a, b in zip(fused.mla_split(1), split.mla_split(1)):
        assert torch.equal(a, b)


def test_inconsistent_kv_b_and_split_pair(tmp_path):
    src = need_fixtures() / "ds3" / "model-f32.gguf"
    bad = _fused_kv_b(src, 1)
    bad[:32] *= -1.0  # head 0's k rows disagree with attn_k_b
    dst = rewrite_gguf(src, tmp_path / "both.gguf", add={"blk.1.attn_kv_b.weight": bad})
    with pytest.raises(
        GGUFError,
        match=r"both\.gguf: layer 1: MLA absorbed vs decompressed attention scores differ.*"
        r"blk\.1\.attn_k_b\.weight.*blk\.1\.attn_kv_b\.weight",
    ):
        load_gguf(dst)


def test_nextn_layers_are_skipped(tmp_path):
    src = need_fixtures() / "glm5" / "model-f32.gguf"
    reader = gguf.GGUFReader(src)
    extra = {
        t.name.replace("blk.2.", "blk.3."): gguf_f32(src, t.name) for t in reader.tensors if t.name.startswith("blk.2.")
    }
    extra["blk.3.nextn.eh_proj.weight"] = np.zeros((128, 256), np.float32)
    extra["blk.3.nextn.enorm.weight"] = np.ones(128, np.float32)
    dst = rewrite_gguf(
        src,
        tmp_path / "mtp.gguf",
        add=extra,
        set_keys={
            "glm-dsa.block_count": (4, gguf.GGUFValueType.UINT32),
            "glm-dsa.nextn_predict_layers": (1, gguf.GGUFValueType.UINT32),
            "glm-dsa.attention.indexer.types": ([True] * 4, gguf.GGUFValueType.ARRAY),
        },
    )
    ck, ref = load_gguf(dst), load_gguf(src)
    assert ck.hf_config["num_hidden_layers"] == 3 and ck.hf_config["num_nextn_predict_layers"] == 1
    assert sorted(ck.skipped) == sorted(extra)
    assert ck.tensors.names() == ref.tensors.names()

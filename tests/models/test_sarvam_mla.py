"""Sarvam-MLA (sarvam_mla) vs transformers on tiny random models written with its legacy config keys.

The folder's config.json is rewritten to the original sarvam-105b format (num_experts, num_shared_experts,
num_mtp_layers, head_dim = kv_lora_rank + qk_rope_head_dim, rope_scaling.type deepseek_yarn); the reference
is transformers reading that same folder (its SarvamMLAConfig translates the legacy keys itself), so a
mistranslated key shows as different logits. Measured max |logit diff| on 64 positions: see each test.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compare_logits, fp32_logits_tol
from hf_models import BASE, hf_logits, random_ids, reinit_

from mlaserve import LLM, SamplingParams
from mlaserve.config.model import ConfigError, ModelConfig

SHAPES = {
    # q_lora_rank None (the family default), YaRN given as the legacy deepseek_yarn type
    "yarn": dict(
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=32,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    # odd widths: 6 heads, vocabulary 257, hidden 72, expert width 40, two shared experts, no yarn
    "odd": dict(
        hidden_size=72,
        num_attention_heads=6,
        num_key_value_heads=6,
        vocab_size=257,
        intermediate_size=100,
        moe_intermediate_size=40,
        n_shared_experts=2,
        first_k_dense_replace=2,
        routed_scaling_factor=2.5,
    ),
}


def _legacy(cfg: dict) -> dict:
    """config.json as sarvam-105b's original one writes it (configuration_sarvam_mla.py: the legacy keys)."""
    out = {
        k: v for k, v in cfg.items() if k not in ("n_routed_experts", "n_shared_experts", "num_nextn_predict_layers")
    }
    out["num_experts"] = cfg["n_routed_experts"]
    out["num_shared_experts"] = cfg["n_shared_experts"]
    out["num_mtp_layers"] = cfg.get("num_nextn_predict_layers", 0)
    out["head_dim"] = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]  # what the original stores, for vLLM
    out.pop("q_lora_rank", None)  # the family default (None) is taken
    rope = out.pop("rope_parameters", None)
    if rope and rope.get("rope_type") == "yarn":
        out["rope_theta"] = rope["rope_theta"]
        out["rope_scaling"] = {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
        out["rope_scaling"]["type"] = "deepseek_yarn"
    elif rope:
        out["rope_theta"] = rope["rope_theta"]
    return out


@pytest.fixture(scope="module")
def sarvam(tmp_path_factory):
    """shape -> (legacy folder, transformers model read from that folder)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cache = {}

    def get(shape: str):
        if shape not in cache:
            folder = tmp_path_factory.mktemp(f"sarvam_{shape}")
            kwargs = {**BASE, "q_lora_rank": None, "n_group": 1, "topk_group": 1, **SHAPES[shape]}
            torch.manual_seed(0)
            built = AutoModelForCausalLM.from_config(
                AutoConfig.for_model("sarvam_mla", **kwargs), dtype=torch.float32, attn_implementation="eager"
            )
            reinit_(built, 0)
            built.save_pretrained(folder)
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps(_legacy(cfg), indent=2))
            ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
            # transformers' reading of the legacy folder is the model that was built (else the reference is moot)
            ids = random_ids(16, kwargs["vocab_size"])
            assert torch.equal(hf_logits(ref.eval(), ids), hf_logits(built.eval(), ids)), shape
            cache[shape] = (folder, ref.eval())
        return cache[shape]

    return get


def test_legacy_keys_are_translated_and_recorded(sarvam):
    folder, ref = sarvam("yarn")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "sarvam_mla" and "n_routed_experts" not in raw and "q_lora_rank" not in raw
    cfg = ModelConfig.from_hf(raw)
    hf = ref.config
    assert cfg.q_lora_rank is None and hf.q_lora_rank is None
    assert cfg.moe.n_routed_experts == hf.n_routed_experts == 8
    assert cfg.moe.n_shared_experts == hf.n_shared_experts == 1
    assert cfg.num_nextn_predict_layers == 0
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == hf.rope_parameters["factor"] == 4.0
    prov = {s.name: s.source for s in cfg.provenance}
    assert "from legacy key num_experts" in prov["n_routed_experts"]
    assert "from legacy key num_shared_experts" in prov["n_shared_experts"]
    assert "legacy key of sarvam_mla" in prov["num_nextn_predict_layers <- num_mtp_layers"]
    assert "'deepseek_yarn' read as 'yarn'" in prov["rope_type <- legacy"]
    assert "dropped" in prov["head_dim (dropped)"]
    assert prov["q_lora_rank"] == "class default (sarvam_mla; 'q_lora_rank' absent)"


def test_legacy_key_errors_name_the_legacy_key():
    base = dict(
        model_type="sarvam_mla",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=24,
        vocab_size=256,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts_per_tok=2,
    )
    with pytest.raises(ConfigError, match=r"n_routed_experts \(legacy key num_experts\) must be an integer"):
        ModelConfig.from_hf({**base, "num_experts": "8"})
    with pytest.raises(ConfigError, match="num_experts .legacy key for n_routed_experts. = 8 but n_routed_experts = 4"):
        ModelConfig.from_hf({**base, "num_experts": 8, "n_routed_experts": 4})


def test_inspect_shows_the_translated_keys(sarvam, capsys):
    from mlaserve.entrypoints.cli import main

    folder, _ = sarvam("yarn")
    main(["inspect", str(folder)])
    out = capsys.readouterr().out
    assert "from legacy key num_experts" in out and "'deepseek_yarn' read as 'yarn'" in out, out


@pytest.mark.parametrize("mla_path", ["auto", "absorbed", "decompressed"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_match_transformers(sarvam, shape, mla_path):
    """fp32, chunks of 32: measured max |diff| 1.9e-6..2.9e-6 (yarn) and 1.4e-6..2.9e-6 (odd) over the three
    attention paths, |max logit| < 8, so the shared bound fp32_logits_tol (1e-5 there: fp32 rounding at
    these widths is 1e-6..5e-6, several times below it) holds with margin; 100% top-1."""
    folder, ref_model = sarvam(shape)
    ids = random_ids(64, ref_model.config.vocab_size)
    ref = hf_logits(ref_model, ids)
    llm = LLM(str(folder), mla_path=mla_path, max_num_batched_tokens=32, page_size=8)
    diff, top1 = compare_logits(llm.prompt_logits(ids), ref)
    assert diff <= fp32_logits_tol(ref) and top1 == 1.0, (shape, mla_path, diff, top1)


def test_chunked_prefill_equals_one_pass_and_greedy_equals_transformers(sarvam):
    folder, ref_model = sarvam("odd")
    ids = random_ids(48, ref_model.config.vocab_size)
    one = LLM(str(folder), max_num_batched_tokens=64, page_size=8).prompt_logits(ids)
    chunked_llm = LLM(str(folder), max_num_batched_tokens=8, page_size=8)
    diff, top1 = compare_logits(chunked_llm.prompt_logits(ids), one)
    assert diff <= 1e-5 and top1 == 1.0, (diff, top1)  # same math in other row groups: fp32 rounding only
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = chunked_llm.generate([ids[:12]], greedy)[0].outputs[0].token_ids
    with torch.no_grad():
        want = ref_model.generate(
            torch.tensor([ids[:12]]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=2
        )[0, 12:].tolist()
    assert list(got) == want


def test_num_mtp_layers_declares_the_mtp_layer(sarvam, tmp_path):
    """The legacy num_mtp_layers is what lets a layer past num_hidden_layers load as an (unbuilt, skipped and
    reported) MTP layer; with 0 the same tensor is an extra layer, refused."""
    from safetensors.torch import load_file, save_file

    from mlaserve.loading.safetensors_source import WeightError

    folder, _ = sarvam("yarn")
    tensors = load_file(str(folder / "model.safetensors"))
    extra = f"model.layers.{BASE['num_hidden_layers']}.input_layernorm.weight"
    tensors[extra] = torch.ones(BASE["hidden_size"])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_mtp_layers": 0}))
    with pytest.raises(WeightError, match="num_nextn_predict_layers=0"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_mtp_layers": 1}))
    llm = LLM(str(tmp_path))
    assert llm.loaded.report.skipped == [extra]

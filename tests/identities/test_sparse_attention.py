"""DeepSeek Sparse Attention (deepseek_v32, glm_moe_dsa) against transformers, and the
dense/sparse switch that never flips by accident. Tiny models use 16 indexer heads: with few
heads many indexer scores are exactly 0 and top-k ties break arbitrarily (fixtures README)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
from conftest import FP32_LOGITS_TOL, compare_logits
from hf_models import hf_logits, random_ids
from safetensors.torch import load_file, save_file

from mlaserve import LLM
from mlaserve.config.model import ConfigError
from mlaserve.sampling.params import SamplingParams

DSA_KINDS = ["v32", "glm_dsa", "glm_dsa_shared"]  # index_topk 16


def _diff(a, b):
    return (a - b).abs().max().item()


def _top1(a, b):
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("kind", DSA_KINDS)
@pytest.mark.parametrize("mla_path,budget", [("auto", 4096), ("auto", 1), ("auto", 7), ("decompressed", 4096)])
def test_sparse_logits_match_transformers(hf_model_dir, kind, mla_path, budget):
    """64 tokens > index_topk 16: sparse selection is active. budget=1 is token-by-token decode."""
    folder, ref_model = hf_model_dir(kind)
    ids = random_ids(64, seed=11)
    ref = hf_logits(ref_model, ids)
    llm = LLM(str(folder), mla_path=mla_path, max_num_batched_tokens=budget, trace="memory")
    got = llm.prompt_logits(ids)
    diff, top1 = compare_logits(got, ref)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)
    rec = llm.runner.tracer.records[-1]
    assert rec["sparse"] and rec["num_sparse_tokens"] == rec["num_tokens"]
    assert rec["effective_topk"] == 16
    if mla_path == "auto":  # sparse sends prefill tokens down the absorbed path too
        assert rec["num_mqa_tokens"] == rec["num_tokens"]
        assert all(s["implementation"] == "torch:sparse_absorbed" for s in rec["segments"])
    if budget == 1:  # the first 16 steps fit in index_topk: no scoring, every row kept, and the ledger says so
        first = llm.runner.tracer.records[0]
        assert first["sparse"] and not first["needs_selection"]
        assert first["segments"][0]["implementation"].endswith("(all rows within index_topk)")


@pytest.mark.parametrize("kind", ["v32", "glm_dsa"])
def test_sparse_really_selects(hf_model_dir, kind):
    folder, _ = hf_model_dir(kind)
    ids = random_ids(64, seed=11)
    sparse = LLM(str(folder)).prompt_logits(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = LLM(str(folder), attention="dense").prompt_logits(ids)
    assert _diff(sparse[:16], dense[:16]) <= 1e-5  # context <= index_topk: every row is kept
    assert _diff(sparse[16:], dense[16:]) > 1e-2  # past index_topk the selection changes the answer


@pytest.mark.parametrize("kind", ["v32", "glm_dsa"])
def test_sparse_equals_dense_within_topk(hf_model_dir, kind):
    folder, _ = hf_model_dir(kind)
    ids = random_ids(40, seed=12)
    sparse = LLM(str(folder), index_topk=64).prompt_logits(ids)
    with pytest.warns(UserWarning, match="exact only up to index_topk|results equal the sparse model only"):
        dense = LLM(str(folder), attention="dense").prompt_logits(ids)
    assert _diff(sparse, dense) <= 1e-5


def test_sparse_batch_equals_alone(hf_model_dir):
    folder, _ = hf_model_dir("glm_dsa")
    prompts = [random_ids(n, seed=n) for n in (30, 3, 21, 1)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(folder), max_num_batched_tokens=16)
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == alone


def test_forced_dense_equals_dense_model_with_same_weights(hf_model_dir, tmp_path):
    """glm_moe_dsa run dense == the same weights as a deepseek_v3 model (no indexer, eps made explicit)."""
    folder, _ = hf_model_dir("glm_dsa")
    dense_dir = tmp_path / "as_v3"
    shutil.copytree(folder, dense_dir)
    cfg = json.loads((dense_dir / "config.json").read_text())
    cfg.update(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        rope_interleave=True,
        rms_norm_eps=cfg["rms_norm_eps"],
        first_k_dense_replace=1,
    )
    (dense_dir / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if ".indexer." not in k}
    save_file(tensors, str(dense_dir / "model.safetensors"))
    ids = random_ids(48, seed=13)
    with pytest.warns(UserWarning):
        forced = LLM(str(folder), attention="dense")
    assert not forced.config.attention.sparse
    assert _diff(forced.prompt_logits(ids), LLM(str(dense_dir)).prompt_logits(ids)) == 0.0


def test_provenance_says_why(hf_model_dir):
    folder, _ = hf_model_dir("v32")
    prov = {s.name: s for s in LLM(str(folder)).config.all_provenance()}
    assert prov["is_sparse"].value is True and "DSA architecture with indexer weights" in prov["is_sparse"].source
    assert prov["index_topk"].value == 16 and prov["index_topk"].source == "config.json:index_topk"
    assert prov["indexer_rope"].value == "half-split"
    prov = {s.name: s for s in LLM(str(folder), index_topk=8).config.all_provenance()}
    assert prov["index_topk"].value == 8 and prov["index_topk"].source == "user option"


def test_index_topk_absent_from_config_uses_named_class_default(hf_model_dir, tmp_path):
    folder, _ = hf_model_dir("glm_dsa")
    dst = tmp_path / "m"
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("index_topk")
    (dst / "config.json").write_text(json.dumps(cfg))
    prov = {s.name: s for s in LLM(str(dst)).config.all_provenance()}
    assert prov["index_topk"].value == 2048 and "class default" in prov["index_topk"].source


def test_switch_errors(hf_model_dir, tmp_path):
    dense_folder, _ = hf_model_dir("v3_yarn")
    with pytest.raises(ConfigError, match="attention='sparse' needs a DSA model"):
        LLM(str(dense_folder), attention="sparse")
    # indexer weights in a non-DSA checkpoint
    dsa_folder, _ = hf_model_dir("v32")
    dst = tmp_path / "lying"
    shutil.copytree(dsa_folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = "deepseek_v3"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="indexer weights but model_type deepseek_v3 is not a DSA architecture"):
        LLM(str(dst))
    # a DSA model whose checkpoint lost its indexer (the GGUF-loader trap): an error, not silent dense
    dst2 = tmp_path / "no_indexer"
    shutil.copytree(dsa_folder, dst2)
    t = {k: v for k, v in load_file(str(dst2 / "model.safetensors")).items() if ".indexer." not in k}
    save_file(t, str(dst2 / "model.safetensors"))
    with pytest.raises(ConfigError, match="DSA architecture but the checkpoint has no indexer weights"):
        LLM(str(dst2))


def test_kv_bytes_per_token_is_latent_plus_indexer_keys(hf_model_dir):
    folder, _ = hf_model_dir("glm_dsa_shared")
    llm = LLM(str(folder))
    m = llm.config.model
    want = ((m.kv_lora_rank + m.qk_rope_head_dim) * m.num_layers + m.indexer.head_dim * 2) * 4  # 2 full layers
    assert llm.runner.cache.measured_bytes_per_token() == want

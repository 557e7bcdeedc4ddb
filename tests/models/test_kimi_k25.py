"""Kimi-K2.5 (kimi_k25, text part) vs transformers' Kimi_K25ForConditionalGeneration on the same random
weights: the folder is transformers' own save of the whole wrapper (vision tower and projector included,
text tensors under language_model.model.blocks.N), and a copy renamed to the released layout
(language_model.model.layers.N). The engine serves the text model and reports the skipped tensors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compare_logits, fp32_logits_tol
from hf_models import BASE, hf_greedy, random_ids, reinit_
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.loading.safetensors_source import WeightError

# Kimi-K2's text layout (one expert group, sigmoid + bias, its scaling factor), odd widths; model_type kimi_k2
# as the released text_config writes it (transformers rewrites it to deepseek_v3, so does the engine)
TEXT = {
    **BASE,
    "model_type": "kimi_k2",
    "hidden_size": 72,
    "intermediate_size": 100,
    "moe_intermediate_size": 40,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "num_nextn_predict_layers": 0,
}
VISION = dict(
    num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, pos_emb_height=4, pos_emb_width=4
)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """tied -> (folder, transformers wrapper model)."""
    import transformers

    cache = {}

    def get(tied: bool):
        if tied not in cache:
            folder = tmp_path_factory.mktemp(f"kimi_k25_{'tied' if tied else 'untied'}")
            cfg = transformers.Kimi_K25Config(
                text_config=dict(TEXT, tie_word_embeddings=tied),
                vision_config=VISION,
                projection_hidden_size=32,
                tie_word_embeddings=tied,
            )
            torch.manual_seed(0)
            model = transformers.Kimi_K25ForConditionalGeneration(cfg).float().eval()
            reinit_(model, 0)
            if tied:
                model.tie_weights()
            model.save_pretrained(folder)
            cache[tied] = (folder, model)
        return cache[tied]

    return get


def ref_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def test_saved_layout_is_the_wrapper_one(kimi):
    """What the loader is written against: transformers saves the text model as language_model.model.blocks.N,
    the vision tower and projector beside it, and omits lm_head when tied."""
    for tied in (False, True):
        folder, _ = kimi(tied)
        names = load_file(str(folder / "model.safetensors")).keys()
        assert any(n.startswith("language_model.model.blocks.1.mlp.experts.0.") for n in names)
        assert any(n.startswith("vision_tower.") for n in names) and any(n.startswith("mm_projector.") for n in names)
        assert ("language_model.lm_head.weight" in names) is not tied


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(kimi, tied):
    """fp32: measured max |diff| 2.7e-6 (untied, |max logit| < 8: bound 1e-5) and 2.0e-5 (tied: the std-1
    embeddings as lm_head give |max logit| ~60, and fp32 rounding is relative, so fp32_logits_tol scales the
    1e-5 bound by |max|/8, as for v3_tied); 100% top-1. Also: the skipped tensors reported by name and bytes."""
    folder, ref_model = kimi(tied)
    ids = random_ids(64, TEXT["vocab_size"])
    ref = ref_logits(ref_model, ids)
    llm = LLM(str(folder), max_num_batched_tokens=32, page_size=8)
    diff, top1 = compare_logits(llm.prompt_logits(ids), ref)
    assert diff <= fp32_logits_tol(ref) and top1 == 1.0, (tied, diff, top1)
    report = llm.loaded.report
    skipped = [n for n in report.skipped if n.startswith(("vision_tower.", "mm_projector.", "model.mm_projector."))]
    stored = load_file(str(folder / "model.safetensors"))
    want = {n: t for n, t in stored.items() if not n.startswith("language_model.")}
    assert sorted(skipped) == sorted(want) and len(want) > 0
    nbytes = sum(t.numel() * t.element_size() for t in want.values())
    assert any(f"skipped {len(want)} vision tower / projector tensor(s), {nbytes} bytes" in n for n in report.notes)
    prov = {s.name: s for s in llm.loaded.config.model.provenance}
    assert prov["wrapper"].value == "kimi_k25"
    assert prov["tie_word_embeddings"].value is tied
    assert ("lm_head.weight is absent" if tied else "lm_head.weight is present") in prov["tie_word_embeddings"].source


def test_released_layout_and_absent_tie_flag(kimi, tmp_path):
    """The released checkpoint's names (language_model.model.layers.N) and a config.json without a top-level
    tie_word_embeddings (the wrapper class then says True): the lm_head present decides, untied."""
    folder, ref_model = kimi(False)
    stored = load_file(str(folder / "model.safetensors"))
    renamed = {n.replace("language_model.model.blocks.", "language_model.model.layers."): t for n, t in stored.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = random_ids(40, TEXT["vocab_size"])
    ref = ref_logits(ref_model, ids)
    llm = LLM(str(tmp_path), max_num_batched_tokens=16, page_size=8)
    diff, top1 = compare_logits(llm.prompt_logits(ids), ref)
    assert diff <= fp32_logits_tol(ref) and top1 == 1.0, (diff, top1)
    tie = next(s for s in llm.loaded.config.model.provenance if s.name == "tie_word_embeddings")
    assert tie.value is False and "config said True: class default (kimi_k25 wrapper: True" in tie.source
    # greedy through the cache == transformers' text model
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = llm.generate([ids[:10]], greedy)[0].outputs[0].token_ids
    assert list(got) == hf_greedy(ref_model, ids[:10], 6, ref_logits)


def test_config_errors_and_stray_tensors(kimi, tmp_path):
    with pytest.raises(ConfigError, match="kimi_k25 needs a text_config object"):
        ModelConfig.from_hf({"model_type": "kimi_k25"})
    with pytest.raises(ConfigError, match="text_config.model_type 'llama'"):
        ModelConfig.from_hf({"model_type": "kimi_k25", "text_config": {"model_type": "llama"}})
    with pytest.raises(ConfigError, match="tie_word_embeddings must be true or false"):
        ModelConfig.from_hf({"model_type": "kimi_k25", "text_config": TEXT, "tie_word_embeddings": "no"})
    folder, _ = kimi(False)
    stored = load_file(str(folder / "model.safetensors"))
    stored["audio_tower.w"] = torch.zeros(2)
    save_file(stored, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(WeightError, match="'audio_tower.w' is neither under 'language_model.'"):
        LLM(str(tmp_path))


def test_chunked_equals_one_pass_and_batch_equals_alone(kimi):
    """Chunks of 8 vs one pass of 64: the same math over other row groups, fp32 rounding only (bound 1e-5);
    three prompts of different lengths decoded together give each one's tokens alone."""
    folder, _ = kimi(False)
    ids = random_ids(56, TEXT["vocab_size"])
    one = LLM(str(folder), max_num_batched_tokens=64, page_size=8)
    chunked = LLM(str(folder), max_num_batched_tokens=8, page_size=8)
    diff, top1 = compare_logits(chunked.prompt_logits(ids), one.prompt_logits(ids))
    assert diff <= 1e-5 and top1 == 1.0, (diff, top1)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [ids[:7], ids[10:30], ids[30:41]]
    together = [o.outputs[0].token_ids for o in one.generate(prompts, greedy)]
    alone = [one.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert [list(t) for t in together] == [list(a) for a in alone]

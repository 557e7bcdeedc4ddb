"""The engine serving llama.cpp GGUF files: logits == transformers on that file's dequantized
weights (hf_dequant_logits_<type>), GGUF == safetensors, and the route/provenance from GGUF."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FP32_LOGITS_TOL, compare_logits, fixture_dir

from mlaserve import LLM

FILES = [(m, t) for m in ("ds3", "ds2lite", "ds32", "glm5") for t in ("f32", "f16", "q8_0", "q4_k_m", "q4_0")]


@pytest.mark.parametrize("name,gtype", FILES)
def test_gguf_logits_match_dequantized_reference(name, gtype):
    from safetensors.torch import load_file

    folder = fixture_dir(name)
    path = folder / f"model-{gtype}.gguf"
    if not path.exists():
        pytest.skip(f"../shared/fixtures/{name} has no {gtype} file")
    exp = load_file(str(folder / "expected.safetensors"))
    ids = exp["input_ids"].tolist()
    llm = LLM(str(path), max_num_batched_tokens=40, activations="float")  # the exact products FP32_LOGITS_TOL pins
    got = llm.prompt_logits(ids)
    ref = exp[f"hf_dequant_logits_{gtype}"]
    diff, top1 = compare_logits(got, ref)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)
    # llama.cpp itself rounds activations: its gap to the same reference is recorded, not asserted.
    lc = exp[f"llamacpp_logits_{gtype}"]
    print(
        f"{name} {gtype}: engine {diff:.2e}; llama.cpp {(lc - ref).abs().max().item():.2e}, "
        f"engine/llama.cpp top-1 {(got.argmax(-1) == lc.argmax(-1)).float().mean().item():.3f}"
    )
    # The tokenizer built from the GGUF alone reproduces the fixture's ids.
    assert llm.encode(json.loads((folder / "expected.json").read_text())["text"]) == ids


@pytest.mark.parametrize("name", ["ds3", "glm5"])
def test_gguf_equals_safetensors(name):
    folder = fixture_dir(name)
    ids = list(range(3, 60))
    a = LLM(str(folder / "model-f32.gguf")).prompt_logits(ids)
    b = LLM(str(folder)).prompt_logits(ids)
    assert torch.equal(a, b) or (a - b).abs().max().item() <= 1e-5


def test_gguf_provenance_names_metadata_keys():
    folder = fixture_dir("ds2lite")
    prov = {s.name: s for s in LLM(str(folder / "model-f32.gguf")).config.all_provenance()}
    assert prov["kv_lora_rank"].source.startswith("gguf:")
    assert prov["q_lora_rank"].value is None and "default" in prov["q_lora_rank"].source


def test_gguf_dsa_index_topk_from_metadata():
    folder = fixture_dir("glm5")
    llm = LLM(str(folder / "model-f32.gguf"))
    prov = {s.name: s for s in llm.config.all_provenance()}
    assert llm.config.attention.sparse and llm.config.attention.index_topk == 16
    assert "indexer" in prov["index_topk"].source

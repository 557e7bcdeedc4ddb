"""Broken inputs that used to load silently wrong or fail unclearly: each is refused (or warned
about, where llama.cpp documents a default) naming the file and the key, tensor or field."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import fixture_dir
from robustness_helpers import tiny_model
from test_gguf_helpers import rewrite_gguf

from mlaserve import LLM, SamplingParams
from mlaserve.gguf.read.checkpoint import GGUFError, load_gguf

gguf = pytest.importorskip("gguf")


def _ds3_f16():
    return fixture_dir("ds3") / "model-f16.gguf"


def test_gguf_without_merges_is_refused_naming_the_key(tmp_path):
    bad = rewrite_gguf(_ds3_f16(), tmp_path / "nomerges.gguf", drop_keys=["tokenizer.ggml.merges"])
    with pytest.raises(
        GGUFError, match=r"nomerges\.gguf: tokenizer\.ggml\.merges is missing, but the vocabulary has merged tokens"
    ):
        load_gguf(bad, validate_numeric=False).build_tokenizer()


def test_gguf_without_pre_warns_once_naming_the_key_and_uses_the_default(tmp_path):
    bad = rewrite_gguf(_ds3_f16(), tmp_path / "nopre.gguf", drop_keys=["tokenizer.ggml.pre"])
    ck = load_gguf(bad, validate_numeric=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        ck.build_tokenizer()
        ck.build_tokenizer()
    msgs = [str(w.message) for w in caught if "tokenizer.ggml.pre" in str(w.message)]
    assert len(msgs) == 1 and "nopre.gguf" in msgs[0] and "'default'" in msgs[0], msgs


def test_gguf_without_token_list_is_refused_naming_the_key(tmp_path):
    bad = rewrite_gguf(_ds3_f16(), tmp_path / "notokens.gguf", drop_keys=["tokenizer.ggml.tokens"])
    with pytest.raises(GGUFError, match=r"notokens\.gguf: tokenizer\.ggml\.tokens is missing or empty"):
        load_gguf(bad, validate_numeric=False).build_tokenizer()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory)


def test_prompt_logits_refuses_nan_like_generate(tiny):
    """NaN in a weight (set after the load): generate fails the request naming --check-tensors;
    prompt_logits raises the same advice instead of returning NaN."""
    with LLM(str(tiny[0])) as llm:
        llm.runner.model.model.embed_tokens.weight.data[6] = float("nan")
        with pytest.raises(FloatingPointError, match=r"prompt position 1 on .*--check-tensors"):
            llm.prompt_logits([5, 6, 7])
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        assert out.outputs[0].finish_reason == "error" and "--check-tensors" in out.outputs[0].error
        assert torch.isfinite(llm.prompt_logits([5, 7])).all()  # a prompt that avoids it is fine

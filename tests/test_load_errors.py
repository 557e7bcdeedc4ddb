"""Broken inputs that used to load silently wrong or fail unclearly: each is refused (or warned
about, where llama.cpp documents a default) naming the file and the key, tensor or field."""

from __future__ import annotations

import warnings

import pytest
from conftest import fixture_dir
from test_gguf_helpers import rewrite_gguf

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

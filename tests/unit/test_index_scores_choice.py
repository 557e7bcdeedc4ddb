"""index_scores (config/index_scores.py): auto's choice and its recorded reason, and the bf16 requests refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlaserve.config.cpu import OVERRIDE
from mlaserve.config.index_scores import choose_index_scores
from mlaserve.config.model import ConfigError
from mlaserve.config.provenance import ProvenanceLog

DSA = SimpleNamespace(indexer=SimpleNamespace(kpool=0))
POOLED = SimpleNamespace(indexer=SimpleNamespace(kpool=4))
DENSE_MLA = SimpleNamespace(indexer=None)
Q4_K_M = (5, "Q5_0")  # the DSA benchmark model's Q4_K_M file: wk Q4_K, wq_b Q5_0 (llama-quantize's fallback)
Q8_0 = (8, "Q8_0")


def _choose(requested="auto", model=DSA, sparse=True, kernels="native", backend="native", bits=Q4_K_M):
    log = ProvenanceLog()
    value = choose_index_scores(requested, model, sparse, kernels, backend, log, lambda: bits)
    return value, log.source("index_scores")


def test_auto_is_bf16_for_a_gguf_of_6_bit_indexer_weights_where_bf16_is_fast(monkeypatch):
    monkeypatch.setenv(OVERRIDE, "1")
    value, why = _choose()
    assert value == "bf16" and "Q5_0" in why and "index_scores='fp32'" in why
    value, why = _choose(bits=Q8_0)  # measured over the rule there (benchmarks/index_scores.py)
    assert value == "fp32" and "Q8_0, over 6 bits" in why
    assert _choose(bits=(6, "Q6_K"))[0] == "bf16"
    assert _choose(bits=None) == ("fp32", "auto: fp32 scores (not a GGUF file, or its indexer projections are float)")
    assert _choose(kernels="torch") == ("fp32", "auto: fp32 scores (kernels torch)")
    assert _choose(model=POOLED)[0] == "fp32" and "pooled" in _choose(model=POOLED)[1]
    assert _choose(backend="triton")[0] == "fp32"
    assert _choose(sparse=False)[0] == "fp32"
    monkeypatch.setenv(OVERRIDE, "0")
    value, why = _choose()
    assert value == "fp32" and OVERRIDE in why  # the machine's answer (here the override) is the reason


def test_explicit_choices_are_kept_or_refused(monkeypatch):
    monkeypatch.setenv(OVERRIDE, "0")
    assert _choose("bf16", bits=Q8_0) == ("bf16", "user option")  # without fast bf16: the rounded fp32 kernels
    assert _choose("fp32") == ("fp32", "user option")
    for kw, words in (
        ({"model": DENSE_MLA}, "no DSA indexer"),
        ({"model": POOLED}, "pooled indexer"),
        ({"sparse": False}, "dense"),
        ({"backend": "triton"}, "triton attention backend"),
    ):
        with pytest.raises(ConfigError, match=words):
            _choose("bf16", **kw)
    with pytest.raises(ConfigError, match="index_scores must be one of"):
        _choose("fp16")

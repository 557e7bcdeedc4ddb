"""kv_cache_memory: the pool sized in GiB from the bytes a token's rows take in the kv_cache_dtype layout, so the
same memory holds more tokens in 8 bits; recorded with the arithmetic; errors name the fields."""

from __future__ import annotations

import pytest
from hf_models import make_config

from mlaserve.config.engine import make_options, resolve
from mlaserve.config.model import ConfigError, ModelConfig


def _resolve(kind: str = "v3_yarn", **kw):
    model = ModelConfig.from_hf(make_config(kind).to_dict())
    return resolve(model, make_options(**kw), has_indexer_weights=kind == "v32")


@pytest.mark.parametrize(
    "kind,codes,per_token",
    [
        # 3 layers of [c_kv 32 | k_pe 16]: fp32 48 x 4 = 192 bytes; 8-bit 32 codes + 1 scale + 16 x 4 = 100
        ("v3_yarn", "auto", 3 * 192),
        ("v3_yarn", "int8", 3 * 100),
        # + every layer's index key (Di 32): fp32 128 bytes; FP8 32 codes + 1 scale = 36
        ("v32", "auto", 3 * (192 + 128)),
        ("v32", "fp8_e4m3", 3 * (100 + 36)),
    ],
)
def test_pages_from_memory_and_layout(kind, codes, per_token):
    cfg = _resolve(kind, kv_cache_memory=0.01, kv_cache_dtype=codes, page_size=16)
    assert cfg.cache.num_pages == int(0.01 * 2**30 // (16 * per_token))
    (pages,) = [s for s in cfg.provenance if s.name == "num_pages"]
    assert f"16 tokens x {per_token} bytes per token, {codes}" in pages.source
    assert [s.source for s in cfg.provenance if s.name == "kv_cache_memory"] == ["user option"]


def test_an_8bit_cache_holds_more_tokens_in_the_same_memory():
    full = _resolve(kv_cache_memory=0.05).cache.num_pages
    eight = _resolve(kv_cache_memory=0.05, kv_cache_dtype="int8").cache.num_pages
    assert eight / full == pytest.approx(192 / 100, rel=1e-3)


def test_errors_name_the_fields():
    with pytest.raises(ConfigError, match="kv_cache_memory and num_pages both"):
        _resolve(kv_cache_memory=1.0, num_pages=8)
    with pytest.raises(ConfigError, match="kv_cache_memory must be a number of GiB > 0, got -1"):
        _resolve(kv_cache_memory=-1)
    with pytest.raises(ConfigError, match="holds no page of 16 tokens x 576 bytes"):
        _resolve(kv_cache_memory=1e-9)

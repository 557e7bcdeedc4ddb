"""DeepSeek-V4's cache layout as declared (config/layer_kinds.py): paged pools, snapshotted request states,
the family's default page size and the bytes `inspect` reports, on V4-Flash's shape (43 layers: 2 sliding,
21 CSA at ratio 4, 20 HCA at 128; K=V head 512, index keys 128, window 128), each figure counted by hand."""

from __future__ import annotations

import pytest
import torch

from mlaserve.cache.model_cache import ModelCache
from mlaserve.config.deepseek_v4 import DeepseekV4Config
from mlaserve.config.deepseek_v4_layers import v4_page_size
from mlaserve.config.engine import make_options, resolve
from mlaserve.config.layer_kinds import (
    check_page_size,
    declare_layers,
    describe,
    prefix_caching_blocker,
)
from mlaserve.config.model import ConfigError

SW, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def _flash(**changes) -> DeepseekV4Config:
    raw = dict(
        model_type="deepseek_v4",
        vocab_size=129280,
        hidden_size=4096,
        num_hidden_layers=43,
        num_attention_heads=64,
        head_dim=512,
        q_lora_rank=1024,
        partial_rotary_factor=64 / 512,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        num_experts_per_tok=6,
        o_groups=8,
        o_lora_rank=1024,
        index_head_dim=128,
        index_n_heads=64,
        index_topk=512,
        sliding_window=128,
        compress_rates={CSA: 4, HCA: 128},
        layer_types=[SW, SW] + [CSA, HCA] * 20 + [CSA],
    )
    return DeepseekV4Config.from_hf(raw | changes)


def test_flash_pools_are_paged_and_its_bytes_per_token_are_the_hand_count():
    cfg = _flash()
    layers = declare_layers(cfg, sparse=True)
    assert {(s.name, s.tokens_per_row) for k in layers for s in k.paged} == {
        ("kv_pool", 4),
        ("index_pool", 4),
        ("kv_pool", 128),
    }
    # CSA (512 + 128) / 4 x 2 bytes x 21 layers + HCA 512 / 128 x 2 x 20
    assert ModelCache.bytes_per_token(layers, torch.bfloat16) == 6720 + 160
    # snapshots per page of 256: 43 rings [128 x 512], 21 x overlap halves 2 x 4 x (512 + 128), bf16
    assert ModelCache.snapshot_bytes_per_token(layers, torch.bfloat16, 256) == (43 * 65536 + 21 * 5120) * 2 / 256
    assert ModelCache.snapshot_bytes_per_token(layers, torch.bfloat16, 256) == 22856
    lines = describe(layers, 2, 256)
    per_token = sum(int(line.split("(")[-1].split(" bytes/token")[0]) for line in lines)
    snaps = sum(float(line.split(" + ")[-1].split(" bytes/token of snapshots")[0]) for line in lines)
    assert (per_token, snaps) == (6880, 22856)
    assert prefix_caching_blocker(layers) is None  # every request state restorable at a page boundary


def test_the_family_page_size_is_256_rounded_to_every_ratio_and_recorded():
    assert v4_page_size(_flash())[0] == 256
    assert v4_page_size(_flash(compress_rates={CSA: 3, HCA: 6}))[0] == 258  # 256 is no multiple of 3
    assert v4_page_size(_flash(compress_rates={CSA: 4, HCA: 512}))[0] == 512  # a ratio above 256
    cfg = resolve(_flash(), make_options(device="cpu"), has_indexer_weights=False, max_model_len=4096)
    assert cfg.cache.page_size == 256
    setting = next(s for s in cfg.provenance if s.name == "page_size")
    assert setting.value == 256 and "family default (DeepSeek-V4)" in setting.source and "(4, 128)" in setting.source
    user = resolve(_flash(), make_options(device="cpu", page_size=128), has_indexer_weights=False, max_model_len=4096)
    assert user.cache.page_size == 128  # the user's multiple is kept
    # a given 16 (the engine's own default elsewhere) is the user's too: kept and recorded as given, never
    # swapped for the family's 256; the cache then refuses it, naming the layer whose ratio it splits
    given = resolve(_flash(), make_options(device="cpu", page_size=16), has_indexer_weights=False, max_model_len=4096)
    assert given.cache.page_size == 16
    assert next(s for s in given.provenance if s.name == "page_size").source == "user option"
    with pytest.raises(ConfigError, match="kv_pool keeps one row per 128 tokens; page_size must be"):
        check_page_size(declare_layers(_flash(), sparse=True), given.cache.page_size)


def test_other_models_get_the_engine_page_size_recorded_as_its_default():
    from hf_models import make_config

    from mlaserve.config.model import ModelConfig

    cfg = resolve(ModelConfig.from_hf(make_config("v3_yarn").to_dict()), make_options(), has_indexer_weights=False)
    assert cfg.cache.page_size == 16
    assert next(s for s in cfg.provenance if s.name == "page_size").source == "engine default (16)"


def test_a_page_that_splits_a_pool_row_is_refused_naming_the_layer():
    layers = declare_layers(_flash(), sparse=True)
    with pytest.raises(ConfigError, match="layer 3's kv_pool keeps one row per 128 tokens; page_size must be"):
        check_page_size(layers, 64)
    check_page_size(layers, 128)

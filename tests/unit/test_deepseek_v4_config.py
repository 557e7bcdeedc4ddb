"""DeepSeek-V4's config reader (config/deepseek_v4.py): layer kinds with their source, named errors, and the
engine's refusal naming what it lacks. Configs here are written by transformers' DeepseekV4Config where a
real one is needed, so the reader is held to the reference's field layout."""

from __future__ import annotations

import copy

import pytest

from mlaserve.config.deepseek_v4 import DeepseekV4Config
from mlaserve.config.model import ConfigError, ModelConfig

RAW = dict(
    model_type="deepseek_v4",
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=3,
    head_dim=24,
    q_lora_rank=16,
    partial_rotary_factor=8 / 24,
    moe_intermediate_size=16,
    n_routed_experts=6,
    num_experts_per_tok=2,
    o_groups=3,
    o_lora_rank=8,
    index_head_dim=16,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
)


def read(**changes) -> DeepseekV4Config:
    raw = copy.deepcopy(RAW)
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    return DeepseekV4Config.from_hf(raw)


def source_of(cfg, name: str) -> str:
    return next(s.source for s in cfg.provenance if s.name == name)


def test_layer_kinds_from_layer_types_recorded():
    cfg = read()
    assert cfg.layer_kinds == ("sliding", "csa", "hca") and cfg.layer_kinds_source == "layer_types"
    assert source_of(cfg, "layer_kinds") == "config.json:layer_types"
    assert [cfg.ratio(i) for i in range(3)] == [0, 4, 128]  # compress_rates' class default, recorded
    assert source_of(cfg, "compress_rates").startswith("class default")


def test_layer_kinds_from_legacy_compress_ratios_recorded():
    cfg = read(layer_types=None, compress_ratios=[128, 0, 4])
    assert cfg.layer_kinds == ("hca", "sliding", "csa") and cfg.layer_kinds_source == "compress_ratios"
    assert source_of(cfg, "layer_kinds") == "config.json:compress_ratios"


def test_neither_key_is_an_error_naming_both():
    with pytest.raises(ConfigError, match="neither layer_types nor compress_ratios"):
        read(layer_types=None)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(layer_types=["sliding_attention"]), "layer_types must be a list of 3 entries"),
        (dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"]), "full_attention"),
        (dict(layer_types=None, compress_ratios=[0, 8, 4]), "compress_ratios must be a list of values"),
        (dict(compress_ratios=[0, 0, 0]), "layer_types and compress_ratios disagree"),
        (dict(compress_rates={"compressed_sparse_attention": 0}), "compress_rates.compressed_sparse_attention"),
        (dict(compress_rates={"csa": 4}), "compress_rates must be an object"),
        (dict(hc_mult="4"), "hc_mult must be an integer"),
        (dict(hc_eps=0.0), "hc_eps must be a finite number > 0"),
        (dict(swiglu_limit=True), "swiglu_limit must be a number"),
        (dict(o_groups=2), "o_groups=2 must divide num_attention_heads=3"),
        (dict(num_key_value_heads=3), "num_key_value_heads must be 1"),
        (dict(scoring_func="sigmoid"), "scoring_func 'sigmoid' is not supported"),
        (dict(num_experts_per_tok=7), "num_experts_per_tok must be in"),
        (dict(mlp_layer_types=["moe", "dense", "moe"]), "mlp_layer_types must be a list of 3 entries"),
        (dict(partial_rotary_factor=0.3), "rope width 7 must be even"),
        (dict(index_head_dim=6), "index_head_dim=6 must be even and >= the rope width 8"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "original_max_position_embeddings"),
        (dict(rope_parameters={"rope_type": "llama3"}), "rope_type 'llama3' is not supported"),
        (dict(moe_intermediate_size=None), "missing required field 'moe_intermediate_size'"),
    ],
)
def test_bad_fields_are_named(changes, message):
    with pytest.raises(ConfigError, match=message):
        read(**changes)


def test_hash_layers_and_defaults_recorded():
    cfg = read(num_hash_layers=2)
    assert cfg.mlp_layer_types == ("hash_moe", "hash_moe", "moe")
    assert source_of(cfg, "mlp_layer_types") == "config.json:num_hash_layers"
    cfg = read()
    assert cfg.mlp_layer_types == ("hash_moe", "hash_moe", "hash_moe")  # transformers' default: 3 hash layers
    assert source_of(cfg, "mlp_layer_types").startswith("class default")


def test_reads_what_transformers_writes():
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4Config(
        **{k: v for k, v in RAW.items() if k != "model_type"},
        rope_scaling=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=65536),
    )
    cfg = DeepseekV4Config.from_hf(hf.to_dict())
    assert cfg.layer_kinds == ("sliding", "csa", "hca")
    assert cfg.attention.rope_dim == hf.qk_rope_head_dim == 8
    assert cfg.rope.compress.rope_type == "yarn" and cfg.rope.compress.theta == hf.compress_rope_theta
    assert cfg.rope.compress_attention_factor == hf.rope_parameters["compress"]["attention_factor"] == 1.0
    assert cfg.mlp_layer_types == tuple(hf.mlp_layer_types)


def test_the_mla_reader_refuses_v4_and_the_loader_reads_it_with_its_own(tmp_path):
    import json

    from mlaserve.loading.safetensors_source import WeightError

    with pytest.raises(ConfigError, match="not MLA.*mlaserve.config.deepseek_v4"):
        ModelConfig.from_hf(copy.deepcopy(RAW))
    (tmp_path / "config.json").write_text(json.dumps(RAW))
    from mlaserve.entrypoints.llm import LLM

    with pytest.raises(WeightError, match="no \\*.safetensors file"):  # the config was read; the weights are next
        LLM(str(tmp_path))
    bad = dict(RAW, layer_types=None)  # a broken V4 config is named as such first
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in bad.items() if v is not None}))
    with pytest.raises(ConfigError, match="neither layer_types nor compress_ratios"):
        LLM(str(tmp_path))


def test_inspect_shows_each_layer_kind_with_its_source(tmp_path, capsys):
    import json

    from mlaserve.entrypoints.cli import main

    raw = dict(RAW, layer_types=None, compress_ratios=[0, 4, 128])
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "layers 0: sliding (sliding window 128; from compress_ratios)" in out
    assert "layers 1: csa (CSA m=4" in out and "index keys [16] per 4 tokens" in out
    assert "layers 2: hca (HCA m'=128" in out
    assert "layer_kinds" in out and "config.json:compress_ratios" in out
    assert "no weights in the folder: the config only" in out


def test_norm_topk_prob_is_recorded_as_not_read():
    assert source_of(read(norm_topk_prob=False), "norm_topk_prob").startswith("reference rule")

"""Kimi-Linear's config.json: the layer pattern (which layers are KDA, which MLA) and the KDA widths, each value
type-checked and recorded with the key it came from; the checkpoint's config names; NoPE; the layer kinds, their
request states and the rules they impose (prefix caching on: both states are snapshotted at page boundaries;
speculative decoding refused)."""

from __future__ import annotations

import pytest
import torch
from kimi_linear_models import RAW_CONFIG as RAW

from mlaserve.config.engine import EngineOptions, resolve
from mlaserve.config.layer_kinds import declare_layers, describe, prefix_caching_blocker
from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.executor.model_runner import with_request_state_rules

K, M = "linear_attention", "full_attention"
RELEASED = {  # the released checkpoint's form: 1-indexed lists and the widths inside linear_attn_config
    **{k: v for k, v in RAW.items() if not k.startswith(("layer_types", "linear_"))},
    "linear_attn_config": {
        "kda_layers": [1, 3, 4],
        "full_attn_layers": [2],
        "num_heads": 3,
        "head_dim": 8,
        "short_conv_kernel_size": 4,
    },
}


def _source(cfg: ModelConfig, name: str) -> str:
    return next(s.source for s in cfg.provenance if s.name == name)


@pytest.mark.parametrize("raw, where", [(RAW, "layer_types"), (RELEASED, "linear_attn_config.kda_layers")])
def test_the_layer_pattern_and_widths_are_read_with_their_source(raw, where):
    cfg = ModelConfig.from_hf(raw)
    assert cfg.kda.layers == (0, 2, 3) and (cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_kernel) == (3, 8, 4)
    assert where in _source(cfg, "kda_layers")
    assert cfg.moe.n_routed_experts == 4 and cfg.moe.num_experts_per_tok == 2 and cfg.max_position_embeddings == 4096
    assert "num_experts" in _source(cfg, "n_routed_experts")  # transformers' attribute_map names, recorded
    assert cfg.rope.rope_type == "none" and "never rotates" in _source(cfg, "rope")
    assert cfg.mlp_layer_types == ("dense", "moe", "moe", "moe")
    kinds = declare_layers(cfg, sparse=False)
    assert [k.attention for k in kinds] == ["kda", "mla", "kda", "kda"]
    rec = kinds[0].state("recurrent")
    assert rec.request_shape == (3, 8, 8) and rec.dtype == torch.float32 and rec.snapshot
    assert kinds[0].state("conv").request_shape == (3, 3 * 3 * 8)  # the last K - 1 inputs of q, k and v
    assert kinds[0].state("conv").snapshot
    assert kinds[1].state("latent").width == 16 + 8  # the "rope" slice is cached (never rotated)


def test_a_config_without_the_layer_pattern_is_refused_naming_the_keys():
    raw = {k: v for k, v in RAW.items() if k != "layer_types"}
    with pytest.raises(ConfigError, match="layer_types .* linear_attn_config.kda_layers \\+ full_attn_layers"):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(layer_types=[K, M, K]), "layer_types must be a list of 4 entries"),
        (dict(layer_types=[K, M, K, "sliding"]), "layer_types must be a list"),
        (dict(linear_num_heads="3"), "linear_num_heads must be an integer >= 1"),
        (dict(linear_head_dim=True), "linear_head_dim must be an integer >= 1"),
        (dict(linear_conv_kernel_dim=1), "linear_conv_kernel_dim must be an integer >= 2"),
        (dict(linear_attn_config=[1, 2]), "linear_attn_config must be a JSON object"),
        (dict(linear_attn_config={"num_heads": 5}), "linear_num_heads=3 and linear_attn_config.num_heads=5 differ"),
        (
            dict(linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4]}),
            "layer_types makes layers \\[0, 2, 3\\] KDA but linear_attn_config.kda_layers makes \\[0, 1, 2\\]",
        ),
        (dict(linear_attn_config={"kda_layers": [0, 1, 2], "full_attn_layers": [3]}), "1-indexed layer numbers"),
        (dict(linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2]}), "every layer 1..4 exactly once"),
        (dict(num_experts="4"), "n_routed_experts \\(legacy key num_experts\\) must be an integer"),
    ],
)
def test_bad_values_are_errors_naming_the_key(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf({**RAW, **change})


def test_prefix_caching_stays_on_and_speculation_is_refused():
    cfg = ModelConfig.from_hf(RAW)
    kinds = declare_layers(cfg, sparse=False)
    assert prefix_caching_blocker(kinds) is None  # both KDA states are snapshotted at page boundaries
    engine = with_request_state_rules(resolve(cfg, EngineOptions(enable_prefix_caching=True), False), kinds)
    assert engine.cache.enable_prefix_caching is True
    with pytest.raises(ConfigError, match="speculative='mtp': layer 0's request state 'recurrent'"):
        with_request_state_rules(resolve(cfg, EngineOptions(speculative="mtp", num_speculative_tokens=1), False), kinds)


def test_inspect_lines_name_each_kind_and_its_bytes_per_request():
    kinds = declare_layers(ModelConfig.from_hf(RAW), sparse=False)
    lines = describe(kinds, bytes_per_value=4, page_size=16)
    # KDA: recurrent 3 x 8 x 8 fp32 = 768 B + conv 3 x 72 x 4 B = 864 B, per layer, three layers; one snapshot of
    # both per page of 16 tokens: 4896 / 16 = 306 bytes/token
    assert lines[0].startswith(
        "layers 0, 2-3: kda; cache: recurrent [3 x 8 x 8] float32 per request (snapshots at page boundaries)"
    )
    assert lines[0].endswith("(0 bytes/token + 306 bytes/token of snapshots with prefix caching, 4896 bytes/request)")
    assert lines[1] == "layers 1: mla; cache: latent [24] (96 bytes/token)"


def test_convert_to_gguf_is_refused_naming_the_kda_layers(tmp_path):
    import json

    from mlaserve.gguf.convert.convert import ConvertError, convert_hf_to_gguf

    (tmp_path / "config.json").write_text(json.dumps(RAW))
    with pytest.raises(ConvertError, match="kimi_linear \\(KDA layers \\[0, 2, 3\\]\\) has no GGUF layout"):
        convert_hf_to_gguf(tmp_path, tmp_path / "out.gguf")

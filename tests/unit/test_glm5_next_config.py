"""GLM-5.3-Flash's text config reader (config/glm5_next.py) against transformers 5.24's own parse
(Glm5NextConfig / Glm5NextTextConfig) of the same config.json dicts: the layer schedule (KDA / indexed), the MLP
schedule, the indexer roles, the KDA widths and gate bound (flat keys and linear_attn_config), index_kpool and
mHC; each value with its source; bad values errors naming the key."""

from __future__ import annotations

import pytest

from mlaserve.config.glm5_next import INDEXED, KDA, read_glm5_next
from mlaserve.config.model import ConfigError

tf = pytest.importorskip("transformers")

SMALL = dict(num_hidden_layers=6, hidden_size=48, q_lora_rank=16, num_attention_heads=3, num_key_value_heads=3)
CASES = {
    "defaults": dict(SMALL),
    "released_shape": dict(SMALL, index_kpool=4, index_topk=16, linear_attn_config={"num_heads": 5, "head_dim": 8}),
    "explicit": dict(
        SMALL,
        layer_types=["linear_attention", "full_attention", "linear_attention", "indexed_attention"] * 1
        + ["indexed_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse", "dense", "sparse"],
        indexer_types=["full", "full", "full", "shared", "full", "full"],
        linear_lower_bound=-2.5,
        index_kpool=2,
        index_topk=6,
        hc_mult=3,
    ),
    "pattern_and_safe_gate": dict(SMALL, index_topk_pattern="FSSFSF", linear_attn_config={"safe_gate": True}),
    "no_bound": dict(SMALL, linear_lower_bound=None),
    # a null bound with a linear_attn_config: its safe_gate (default true) makes it -5; safe_gate false keeps none
    "safe_gate_default": dict(SMALL, linear_lower_bound=None, linear_attn_config={}),
    "safe_gate_off": dict(SMALL, linear_lower_bound=None, linear_attn_config={"safe_gate": False}),
    "nested_bound": dict(SMALL, linear_attn_config={"gate_lower_bound": -3.0, "short_conv_kernel_size": 3}),
    "freq": dict(SMALL, index_topk_freq=2, index_skip_topk_offset=1),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("wrapped", [False, True])
def test_the_layout_equals_transformers_parse(case, wrapped):
    from transformers import Glm5NextConfig, Glm5NextTextConfig

    raw = dict(CASES[case])
    ref = Glm5NextTextConfig(**raw)
    if wrapped:
        ref = Glm5NextConfig(text_config=dict(raw)).text_config
        raw = {"model_type": "glm5_next", "text_config": {**raw, "model_type": "glm5_next_text"}}
    got = read_glm5_next(raw)
    assert got.layer_types == tuple(ref.layer_types)
    assert got.kda.layers == tuple(i for i, t in enumerate(ref.layer_types) if t == KDA)
    assert set(got.layer_types) <= {KDA, INDEXED}
    assert got.mlp_layer_types == tuple(ref.mlp_layer_types)
    assert got.indexer_types == tuple(ref.indexer_types)
    assert (got.kda.num_heads, got.kda.head_dim, got.kda.conv_kernel) == (
        ref.linear_num_heads,
        ref.linear_head_dim,
        ref.linear_conv_kernel_dim,
    )
    assert got.kda.lower_bound == ref.linear_lower_bound
    assert (got.index_kpool, got.index_topk) == (ref.index_kpool, ref.index_topk)
    assert (got.hc.hc_mult, got.hc.sinkhorn_iters, got.hc.eps) == (ref.hc_mult, ref.hc_sinkhorn_iters, ref.hc_eps)
    assert got.hc.learned_head is False and got.swiglu_limit == ref.swiglu_limit


def test_each_value_says_where_it_came_from():
    got = read_glm5_next({"model_type": "glm5_next", "text_config": CASES["released_shape"]})
    src = {s.name: s.source for s in got.provenance}
    assert src["index_kpool"] == "config.json:text_config:index_kpool"
    assert src["linear_num_heads"] == "config.json:text_config:linear_attn_config.num_heads"
    assert "class default" in src["layer_types"] and "class default" in src["hc_mult"]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(qk_rope_head_dim=64), "qk_rope_head_dim must be 0"),
        (dict(index_kpool=3, index_topk=16), "index_topk=16 must be a multiple of index_kpool=3"),
        (dict(index_kpool=0), "index_kpool must be an integer >= 1"),
        (dict(index_kpool_always_select_tail=False), "index_kpool_always_select_tail=false is not run"),
        (dict(layer_types=["linear_attention"] * 5), "layer_types must be a list of 6 entries"),
        (dict(mlp_layer_types=["moe"] * 6), "mlp_layer_types must be a list of 6 entries"),
        (dict(index_topk_pattern="FFX"), "index_topk_pattern must be 6 letters"),
        (dict(linear_lower_bound=2.0), "linear_lower_bound must be a negative number or null"),
        (dict(linear_attn_config=[1]), "linear_attn_config must be a JSON object"),
        (dict(linear_attn_config={"head_dim": 0}), "linear_attn_config.head_dim must be an integer >= 1"),
    ],
)
def test_bad_values_are_errors_naming_the_key(change, match):
    with pytest.raises(ConfigError, match=match):
        read_glm5_next({**SMALL, **change})

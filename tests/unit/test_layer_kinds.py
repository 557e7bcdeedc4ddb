"""Layer kinds and cache kinds as data: what each family's layers declare, what the cache allocates from
that, the page-size rule, and the route planned per attention kind (recorded in the ledger)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.attention.router import route_step
from mlaserve.cache.model_cache import ModelCache
from mlaserve.config.layer_kinds import LayerKind, StateSpec, check_page_size, declare_layers, describe
from mlaserve.config.model import ConfigError
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.observability.trace import MemoryTracer


def _kinds(layers) -> list[tuple]:
    return [(k.attention, k.indexer, tuple(s.name for s in k.states)) for k in layers]


def test_each_family_declares_its_layers(hf_model_dir):
    dense = LLM(str(hf_model_dir("v3_yarn")[0])).config
    assert {k[0] for k in _kinds(declare_layers(dense.model, dense.attention.sparse))} == {"mla"}
    assert all(k.states == (StateSpec("latent", dense.model.latent_dim),) for k in declare_layers(dense.model, False))
    shared = LLM(str(hf_model_dir("glm_dsa_shared")[0])).config
    roles = shared.model.indexer.layer_types
    got = _kinds(declare_layers(shared.model, sparse=True))
    # only a layer with its own indexer keeps index keys; a shared layer reuses the previous full layer's top-k
    assert got == [("mla_dsa", r, ("latent", "index_keys") if r == "full" else ("latent",)) for r in roles]
    assert "shared" in roles and "full" in roles
    # a dense run of a DSA model keeps the kind (its route says dense) and caches no index keys
    assert _kinds(declare_layers(shared.model, sparse=False)) == [("mla_dsa", r, ("latent",)) for r in roles]


def test_cache_allocates_every_declared_state_and_counts_its_bytes(hf_model_dir):
    cfg = LLM(str(hf_model_dir("glm_dsa_shared")[0])).config
    layers = declare_layers(cfg.model, sparse=True)
    cache = ModelCache(layers, num_pages=3, page_size=4, dtype=torch.float32)
    for kind, state in zip(layers, cache.layers):
        assert set(state.tensors) == {s.name for s in kind.states}
        # 3 pages of 4 rows, then the pad row: zero, read by padded key positions, never written
        assert all(t.shape == (12 + 1, kind.state(n).width) for n, t in state.tensors.items())
    assert cache.pad_slot == 12
    assert cache.measured_bytes_per_token() == ModelCache.bytes_per_token(layers, torch.float32)
    # a state of one row per 4 tokens (a compressed pool's layout) has page_size / 4 rows per page
    pooled = (LayerKind(0, "mla", None, (StateSpec("latent", 8), StateSpec("pool", 8, tokens_per_row=4))),)
    assert ModelCache(pooled, 3, 8, torch.float32).layers[0].tensors["pool"].shape == (6 + 1, 8)
    assert ModelCache.bytes_per_token(pooled, torch.float32) == (8 + 2) * 4


def test_page_size_must_hold_whole_rows_of_every_state():
    pooled = (LayerKind(3, "mla", None, (StateSpec("pool", 8, tokens_per_row=4),)),)
    check_page_size(pooled, 8)
    with pytest.raises(ConfigError, match="layer 3's pool keeps one row per 4 tokens; page_size must be a multiple"):
        check_page_size(pooled, 6)
    with pytest.raises(ConfigError, match="page_size=6"):
        ModelCache(pooled, 2, 6, torch.float32)


def _batch() -> ForwardBatch:
    chunks = [SeqChunk("dec", (5,), 9, (0, 1, 2)), SeqChunk("pre", (1, 2, 3, 4, 5, 6), 0, (4, 5))]
    return ForwardBatch.build(chunks, 4, 1)


def test_route_is_planned_per_attention_kind():
    latent = (StateSpec("latent", 8),)
    layers = (
        LayerKind(0, "mla_dsa", "full", latent),
        LayerKind(1, "mla", None, latent),
        LayerKind(2, "mla_dsa", "shared", latent),
    )
    step = route_step(_batch(), layers, "auto", sparse=True, index_topk=4)
    assert [(p.kind, p.layers, p.sparse) for p in step.plans] == [("mla_dsa", (0, 2), True), ("mla", (1,), False)]
    # the dense kind routes decode -> absorbed, prefill -> decompressed; the sparse kind sends all to absorbed
    assert [(s.phase, s.path) for s in step.plan_of("mla").segments] == [
        ("decode", "absorbed"),
        ("prefill", "decompressed"),
    ]
    assert {s.path for s in step.plan_of("mla_dsa").segments} == {"absorbed"}
    rec = step.to_record()
    assert rec["kinds"] == [
        {"kind": "mla_dsa", "layers": "0, 2", "sparse": True, "num_mqa_tokens": 7, "num_mha_tokens": 0,
         "num_sparse_tokens": 7},
        {"kind": "mla", "layers": "1", "sparse": False, "num_mqa_tokens": 1, "num_mha_tokens": 6,
         "num_sparse_tokens": 0},
    ]  # fmt: skip
    assert [s["kind"] for s in rec["segments"]] == ["mla_dsa", "mla_dsa", "mla", "mla"]
    assert rec["index_topk"] == 4 and rec["needs_selection"] is True  # seq_len 10 > top-4
    with pytest.raises(KeyError, match="no route planned for attention kind 'linear'"):
        step.plan_of("linear")


def test_ledger_names_each_kinds_layers(hf_model_dir):
    folder, _ = hf_model_dir("glm_dsa_shared")
    tracer = MemoryTracer()
    llm = LLM(str(folder), trace=tracer)
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=2))
    n = llm.config.model.num_layers
    # each shared layer names the full layer whose selection it reuses (LayerKind.reuses)
    reuses = [{"layer": k.index, "selection_of": k.index - 1} for k in llm.runner.layer_kinds if k.indexer == "shared"]
    assert reuses
    for rec in tracer.records:
        assert rec["kinds"] == [
            {
                "kind": "mla_dsa",
                "layers": f"0-{n - 1}",
                "sparse": True,
                **{k: rec[k] for k in _COUNTS},
                "reuses": reuses,
            }
        ]
    with pytest.warns(UserWarning, match="attention='dense' on glm_moe_dsa"):
        dense = LLM(str(folder), attention="dense", trace=(tracer := MemoryTracer()))
    dense.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=1))
    assert {k["sparse"] for rec in tracer.records for k in rec["kinds"]} == {False}


_COUNTS = ("num_mqa_tokens", "num_mha_tokens", "num_sparse_tokens")


def test_describe_groups_layers_by_kind():
    latent, keys = StateSpec("latent", 576), StateSpec("index_keys", 128)
    layers = tuple(LayerKind(i, "mla_dsa", r, (latent, keys) if r == "full" else (latent,)) for i, r in
                   enumerate(("full", "shared", "full")))  # fmt: skip
    assert describe(layers, 2) == [
        "layers 0, 2: mla_dsa, indexer full; cache: latent [576] + index_keys [128] (2816 bytes/token)",
        "layers 1: mla_dsa, indexer shared; cache: latent [576] (1152 bytes/token)",
    ]
    assert describe((replace(layers[1], indexer=None, attention="mla"),), 4) == [
        "layers 1: mla; cache: latent [576] (2304 bytes/token)"
    ]


def test_the_family_declares_the_kind(hf_model_dir, monkeypatch):
    """config/families/<family>.py's layer_kinds is what a DSA layer is; a kind the engine lacks is refused."""
    from mlaserve.config import families

    cfg = LLM(str(hf_model_dir("glm_dsa")[0])).config.model
    assert cfg.family.layer_kinds == "mla_dsa" and {k.attention for k in declare_layers(cfg, True)} == {"mla_dsa"}
    monkeypatch.setitem(families._BY_TYPE, "glm_moe_dsa", cfg.family.derive("glm_moe_dsa", layer_kinds="swa_csa"))
    with pytest.raises(ConfigError, match="layer kind 'swa_csa' is not one this engine runs"):
        declare_layers(cfg, True)

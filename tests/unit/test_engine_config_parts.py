"""EngineConfig as frozen parts: every resolved switch lives in exactly one part, under the name the
provenance records (the option's name) or its documented rename; no flat read is left; the TP echo
names a differing field as "part.field"; the config pickles whole (a worker's echo travels by value)."""

import dataclasses
import pickle

import pytest
import torch
from hf_models import make_config

from mlaserve.config.engine import EngineConfig, EngineOptions, _token_budget, make_options, resolve
from mlaserve.config.model import ModelConfig
from mlaserve.config.provenance import ProvenanceLog
from mlaserve.distributed.worker import effective_config

# Provenance name (what the user typed, unchanged) -> where the resolved value lives.
WHERE = {
    "device": "runtime.device",
    "dtype": "runtime.dtype",
    "threads": "runtime.threads",
    "malloc_tuning": "runtime.malloc_tuning",
    "cuda_graphs": "runtime.cuda_graphs",
    "cuda_graph_max_batch": "runtime.cuda_graph_max_batch",
    "page_size": "cache.page_size",
    "num_pages": "cache.num_pages",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "kv_prefault": "cache.kv_prefault",
    "kv_cache_dtype": "cache.kv_cache_dtype",
    "prefix_cache_dir": "cache.prefix_cache_dir",
    "prefix_cache_dir_gib": "cache.prefix_cache_dir_gib",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "max_num_seqs": "scheduler.max_num_seqs",
    "decode_threshold": "scheduler.decode_threshold",
    "is_sparse": "attention.sparse",
    "index_topk": "attention.index_topk",
    "index_scores": "attention.index_scores",
    "mla_path": "attention.mla_path",
    "attention_backend": "attention.backend",
    "v4_kv_rounding": "attention.v4_kv_rounding",
    "v4_indexer": "attention.v4_indexer",
    "kernels": "kernels.impl",
    "activations": "kernels.activations",
    "prefill_matmul": "kernels.prefill_matmul",
    "quantization": "kernels.quantization",
    "experts_impl": "kernels.experts_impl",
    "gguf_weights": "kernels.gguf_weights",
    "gguf_mmap": "kernels.gguf_mmap",
    "gguf_prefetch": "kernels.gguf_prefetch",
    "speculative": "speculative.method",
    "num_speculative_tokens": "speculative.num_tokens",
    "speculative_max_seqs": "speculative.max_seqs",
    "speculative_min_acceptance": "speculative.min_acceptance",
    "speculative_probe_interval": "speculative.probe_interval",
    "speculative_acceptance_weight": "speculative.acceptance_weight",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "expert_parallel_size": "parallel.expert_parallel_size",
    "tool_call_parser": "chat.tool_call_parser",
    "reasoning_parser": "chat.reasoning_parser",
    "ui": "server.ui",
}
# Checked and recorded at resolve, acted on by the loader (it reads EngineOptions): no resolved field.
# attention="auto"/... resolves to attention.sparse; kv_cache_memory to cache.num_pages
NOT_RESOLVED = {"check_tensors", "attention", "kv_cache_memory"}


def _read(cfg: EngineConfig, path: str):
    part, name = path.split(".")
    return getattr(getattr(cfg, part), name)


def _leaves() -> list[str]:
    cfg = _config()  # the parts' types from an instance (engine.py's annotations are strings)
    parts = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "provenance")]
    return [f"{p}.{f.name}" for p in parts for f in dataclasses.fields(getattr(cfg, p))]


def _config(**opts) -> EngineConfig:
    model = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    return resolve(model, make_options(device="cpu", **opts), False)


# Non-default values, pairwise distinct where two switches share a type, so a value put in the wrong
# field (max_num_seqs into max_num_batched_tokens, ...) shows as a mismatch.
SPEC = dict(
    page_size=8,
    num_pages=96,
    max_num_batched_tokens=200,
    max_num_seqs=5,
    mla_path="absorbed",
    experts_impl="loop",
    enable_prefix_caching=False,
    kv_prefault=True,
    kv_cache_dtype="fp8_e4m3",
    threads=3,
    malloc_tuning=True,
    speculative="mtp",
    num_speculative_tokens=2,
    speculative_max_seqs=4,
    speculative_min_acceptance=0.3,
    speculative_probe_interval=7,
    speculative_acceptance_weight=0.5,
    ui=False,
)


def test_every_switch_lives_in_exactly_one_part():
    leaves = _leaves()
    assert len(leaves) == len(set(leaves))
    # one place per switch: the leaves are exactly the documented homes, no more (no duplicate, no orphan)
    assert sorted(leaves) == sorted(WHERE.values())
    # every option is either resolved into a part (under its provenance name) or named as not resolved
    options = {f.name for f in dataclasses.fields(EngineOptions)}
    assert options - NOT_RESOLVED == set(WHERE) - {"is_sparse"}


def test_no_flat_field_is_left_on_the_config():
    cfg = _config()
    flat = [name for name in {*WHERE, *(f.name for f in dataclasses.fields(EngineOptions))} if hasattr(cfg, name)]
    # the part names themselves are attributes (attention, kernels, speculative); none of them is a value
    flat = [n for n in flat if not dataclasses.is_dataclass(getattr(cfg, n))]
    assert flat == []


def test_resolve_fills_each_part_with_what_provenance_records():
    cfg = _config(**SPEC)
    recorded = {s.name: s.value for s in cfg.provenance}
    # not recorded by resolve: the chat formats (the loader decides them with the chat template),
    # index_topk (v3_yarn has no indexer), enable_prefix_caching (recorded only when the runner turns it off),
    # DeepSeek-V4's numerics (recorded for V4 models only; config/v4_numerics.py)
    assert set(WHERE) - set(recorded) == {
        "tool_call_parser",
        "reasoning_parser",
        "index_topk",
        "enable_prefix_caching",
        "v4_kv_rounding",
        "v4_indexer",
    }
    for name in set(WHERE) & set(recorded):
        assert _read(cfg, WHERE[name]) == recorded[name], name
    assert cfg.attention.index_topk is None and cfg.chat.tool_call_parser is None
    for name, value in SPEC.items():
        if name != "threads":  # recorded as chosen (asked-for 3 here), checked above via provenance
            assert _read(cfg, WHERE[name]) == value, name
    assert cfg.runtime.dtype == torch.float32


def test_parts_are_frozen_and_the_config_pickles_whole():
    cfg = _config(**SPEC)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache.page_size = 4
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and back.all_provenance() == cfg.all_provenance()


def test_rank_echo_names_the_differing_field_and_leaves_threads_apart():
    a, b = (
        _config(page_size=16, num_pages=64),
        _config(page_size=8, num_pages=64),
    )  # pages fixed: derived from page_size
    ea, eb = effective_config(a), effective_config(b)
    assert set(ea) == {"model", *WHERE.values()} - {"runtime.threads"}
    assert [k for k in ea if ea[k] != eb[k]] == ["cache.page_size"]
    assert effective_config(_config(threads=2)) == effective_config(_config(threads=1))


def test_the_token_budget_is_the_devices_default_unless_given():
    """max_num_batched_tokens=None: 1024 on the CPU (a step's temporaries are resident memory there), 2048 on a GPU,
    recorded as the engine's choice for that device; a given budget is kept and recorded as the user's."""
    cfg = _config()
    source = {s.name: s.source for s in cfg.provenance}["max_num_batched_tokens"]
    assert cfg.scheduler.max_num_batched_tokens == 1024 and source == "engine default on the CPU (1024)"
    log = ProvenanceLog()
    assert (
        _token_budget(None, "cuda", log) == 2048
        and log.source("max_num_batched_tokens") == "engine default on cuda (2048)"
    )
    given = _config(max_num_batched_tokens=2048)
    assert given.scheduler.max_num_batched_tokens == 2048
    assert {s.name: s.source for s in given.provenance}["max_num_batched_tokens"] == "user option"

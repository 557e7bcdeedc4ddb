"""The lightning indexer of the DSA families (deepseek_v32, glm_moe_dsa, glm5_next: `Family.has_indexer`): its
widths, top-k, rope layout (the family's rule) and per layer role (indexer_types: full | shared)."""

from __future__ import annotations

from mlaserve.config.mla_reader.raw import RawConfig
from mlaserve.config.model_parts import ConfigError, IndexerConfig


def read_indexer(r: RawConfig, num_layers: int) -> IndexerConfig | None:
    if not r.family.has_indexer:
        return None
    g = r.get
    types = r.raw.get("indexer_types")
    if r.family.glm5_next:  # per layer, KDA layers included: read and recorded by config/glm5_next.py
        types = ["full"] * num_layers  # (apply_glm5_next replaces these roles; recording them here listed it twice)
    elif types is None:
        types = ["full"] * num_layers
        r.log.record("indexer_types", "all full", "class default (no indexer_types)")
    else:
        r.log.record("indexer_types", tuple(types), f"{r.source}:indexer_types")
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"full", "shared"}:
        raise ConfigError(
            f"{r.source}: indexer_types must be a list of {num_layers} 'full'/'shared' entries, got {types!r}"
        )
    if types[0] != "full":
        raise ConfigError(f"{r.source}: indexer_types[0] must be 'full' (a shared layer reuses a previous one)")
    interleaved = r.family.indexer_rope_interleaved
    r.log.record(
        "indexer_rope",
        "interleaved" if interleaved else "half-split",
        f"family rule ({r.family.name}, as transformers)",
    )
    return IndexerConfig(
        n_heads=g("index_n_heads"),
        head_dim=g("index_head_dim"),
        topk=g("index_topk"),
        rope_interleaved=interleaved,
        layer_types=tuple(types),
    )

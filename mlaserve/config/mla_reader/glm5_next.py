"""GLM-5.3-Flash (glm5_next, glm5_next_text): its schedules, KDA layers, pooled indexer, mHC and SwiGLU clamp,
read by config/glm5_next.py (`read_glm5_next`, checked there against transformers' own parse), applied over the
config the MLA reader built from the DeepSeek-V3 fields, each recorded with its source."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, TypeVar

from mlaserve.config.glm5_next import read_glm5_next
from mlaserve.config.mla_reader.raw import RawConfig
from mlaserve.config.model_parts import ConfigError, IndexerConfig, MoEConfig
from mlaserve.config.provenance import Setting


class MLAFields(Protocol):
    """The fields of the config the MLA reader built that this reads (a Protocol, not config/model.py's ModelConfig:
    model.py applies this to the config it built, so naming its class here would make an import circle)."""

    @property
    def moe(self) -> MoEConfig | None: ...
    @property
    def indexer(self) -> IndexerConfig | None: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def provenance(self) -> tuple[Setting, ...]: ...


Config = TypeVar("Config", bound=MLAFields)  # a frozen dataclass (ModelConfig): replace() returns its own type


def apply_glm5_next(r: RawConfig, cfg: Config) -> Config:
    """GLM-5.3-Flash's schedules and the fields the MLA reader does not know, from config/glm5_next.py's reader
    (checked there against transformers' own parse), each recorded with its source."""
    layout = read_glm5_next(r.raw, r.source)
    mlp = tuple("dense" if t == "dense" else "moe" for t in layout.mlp_layer_types)
    if any(t == "moe" for t in mlp) and cfg.moe is None:
        raise ConfigError(f"{r.source}: mlp_layer_types names sparse layers but n_routed_experts is not set")
    # KDA layers have no indexer; an indexed layer's role is its indexer_types entry
    roles = tuple(
        "none" if t != "indexed_attention" else role for t, role in zip(layout.layer_types, layout.indexer_types)
    )
    indexer = replace(cfg.indexer, layer_types=roles, kpool=layout.index_kpool, topk=layout.index_topk)
    return replace(
        cfg,
        mlp_layer_types=mlp,
        indexer=indexer,
        kda=layout.kda,
        hyper=layout.hc,
        swiglu_limit=layout.swiglu_limit,
        latent_norm_eps=cfg.rms_norm_eps,
        provenance=cfg.provenance
        + tuple(s for s in layout.provenance if s not in cfg.provenance)  # a key both readers record: once
        + (
            Setting(
                "latent_norm_eps",
                cfg.rms_norm_eps,
                "reference: Glm5NextTextAttention builds q_a_layernorm / kv_a_layernorm with rms_norm_eps",
            ),
        ),
    )

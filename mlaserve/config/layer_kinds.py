"""Layer kinds and the cache state each one needs, declared per layer as plain data.

A model is a stack of layers; each layer has an *attention kind* and needs some *cache states*. The
router plans each kind's route (attention/router.py), the cache allocates each state (cache/), and the
ledger records both, so nothing downstream infers a layer's kind from a tensor or a config key.

Attention kinds today
  mla      Multi-head Latent Attention over paged latent rows [c_kv | k_pe] (DeepSeek-V2/V3, GLM-4.7-Flash)
  mla_dsa  MLA with a DSA lightning indexer: a "full" layer owns an indexer and caches its keys, a
           "shared" layer reuses the previous full layer's top-k (DeepSeek-V3.2, GLM-5)
A kind is the architecture's: an mla_dsa layer run with attention="dense" keeps its kind, its route says
sparse=False and it caches no index keys (the engine's choice, recorded in provenance).

Cache states (StateSpec)
  addressing "page": rows in the shared page pool. One block table per request serves every paged state;
  a page of page_size tokens holds page_size / tokens_per_row rows of each state (tokens_per_row 1 for
  latent rows and index keys). So page_size must be a multiple of every state's tokens_per_row
  (check_page_size), and a prefix-cached page carries every paged state of its tokens.

Kinds the next families need, and where they plug in (docs/ARCHITECTURE.md, "Layer and cache kinds"):
  a ring window (DeepSeek-V4's 128-token window): paged rows read through the last `window` slots of the
  block table, or a per-request ring ("request" addressing); compressed pools (V4's CSA at 1 row per 4
  tokens, HCA at 1 per 128): paged rows with tokens_per_row = the ratio plus a fixed compressor carry per
  request; linear attention (KDA): a fixed recurrent state per request, snapshotted at page boundaries
  for the prefix cache; two MLA sublayers (LongCat-Flash): two latent states in one layer.
DeepSeek-V4's states exist as fixed-size per-sequence tensors (models/deepseek_v4/state.py, whose docstring
maps each onto these rooms); its family declares layer_kinds "deepseek_v4", which attention_kind refuses
until the cache and router run it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlaserve.config.model import ConfigError, ModelConfig

ATTENTION_KINDS = ("mla", "mla_dsa")
ADDRESSING = ("page",)  # how a state's rows are found: by the request's block table


@dataclass(frozen=True)
class StateSpec:
    """One cache state a layer keeps: `width` values per row, one row per `tokens_per_row` tokens."""

    name: str  # "latent" | "index_keys"
    width: int
    tokens_per_row: int = 1
    addressing: str = "page"

    def rows(self, num_pages: int, page_size: int) -> int:
        return num_pages * page_size // self.tokens_per_row


@dataclass(frozen=True)
class LayerKind:
    """What one layer is (its attention kind) and what it keeps (its states, in the engine's running form)."""

    index: int  # the layer's index in its stack
    attention: str  # one of ATTENTION_KINDS
    indexer: str | None  # mla_dsa: "full" (own indexer and keys) | "shared" | None (no indexer in this layer)
    states: tuple[StateSpec, ...]

    def state(self, name: str) -> StateSpec | None:
        return next((s for s in self.states if s.name == name), None)


def declare_layers(model: ModelConfig, sparse: bool) -> tuple[LayerKind, ...]:
    """Every layer's kind and states. sparse: the engine runs DSA layers sparse (then "full" indexer layers
    cache their keys); a dense run of a DSA model keeps the kind but caches latent rows only."""
    return tuple(_layer(model, i, sparse) for i in range(model.num_layers))


def indexer_role(model: ModelConfig, i: int) -> str | None:
    """Layer i's DSA indexer: "full" (its own), "shared" (the previous full layer's top-k) or None."""
    if model.indexer is None:
        return None
    role = model.indexer.layer_types[i]
    return role if role in ("full", "shared") else None


def attention_kind(model: ModelConfig, i: int) -> str:
    """The family declares the kind of its layers (config/families: `layer_kinds`); a layer without an
    indexer role (an MTP block without indexer weights) is plain MLA."""
    declared = model.family.layer_kinds
    if declared not in ATTENTION_KINDS:
        raise ConfigError(f"{model.model_type}: layer kind {declared!r} is not one this engine runs: {ATTENTION_KINDS}")
    if indexer_role(model, i) is None:
        return "mla"
    if declared != "mla_dsa":
        raise ConfigError(f"{model.model_type}: layer {i} has a DSA indexer but the family declares {declared!r}")
    return declared


def _layer(model: ModelConfig, i: int, sparse: bool) -> LayerKind:
    latent = StateSpec("latent", model.latent_dim)
    role = indexer_role(model, i)
    keys = (StateSpec("index_keys", model.indexer.head_dim),) if sparse and role == "full" else ()
    return LayerKind(i, attention_kind(model, i), role, (latent, *keys))


def kinds_in_order(layers: tuple[LayerKind, ...]) -> tuple[str, ...]:
    """The distinct attention kinds of a stack, in the order their first layer appears."""
    return tuple(dict.fromkeys(k.attention for k in layers))


def check_page_size(layers: tuple[LayerKind, ...], page_size: int) -> None:
    """A page must hold whole rows of every paged state (a compressed pool's ratio divides the page)."""
    for layer in layers:
        for s in layer.states:
            if s.addressing == "page" and page_size % s.tokens_per_row:
                raise ConfigError(
                    f"page_size={page_size}: layer {layer.index}'s {s.name} keeps one row per {s.tokens_per_row} "
                    f"tokens; page_size must be a multiple of {s.tokens_per_row}"
                )


def describe(layers: tuple[LayerKind, ...], bytes_per_value: int) -> list[str]:
    """`mlaserve inspect`'s lines: layers grouped by kind, indexer role and states, with cache bytes per token."""
    groups: dict[tuple, list[int]] = {}
    for k in layers:
        groups.setdefault((k.attention, k.indexer, k.states), []).append(k.index)
    lines = []
    for (attention, indexer, states), ids in groups.items():
        role = f", indexer {indexer}" if indexer else ""
        kept = " + ".join(
            f"{s.name} [{s.width}]" + (f" per {s.tokens_per_row} tokens" if s.tokens_per_row > 1 else "")
            for s in states
        )
        per_token = sum(s.width // s.tokens_per_row for s in states) * bytes_per_value * len(ids)
        lines.append(f"layers {layer_ranges(ids)}: {attention}{role}; cache: {kept} ({per_token} bytes/token)")
    return lines


def layer_ranges(ids: tuple[int, ...] | list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    if not ids:
        return ""
    out, start = [], ids[0]
    for a, b in zip(ids, [*ids[1:], None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ", ".join(out)

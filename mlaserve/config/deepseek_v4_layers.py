"""DeepSeek-V4's layers by kind: `mlaserve inspect`'s lines for them (describe_layers: what each kind keeps per
sequence, in the bytes the cache allocates) and the default page size their compress ratios ask for (v4_page_size)."""

from __future__ import annotations

import math
from typing import Protocol

from mlaserve.config.deepseek_v4 import DeepseekV4Config


class KindStates(Protocol):
    """What describe_layers reads of a layer kind (config/layer_kinds.py LayerKind, which imports torch: named
    here by its field so that reading a config does not need torch)."""

    states: tuple


def describe_layers(
    cfg: DeepseekV4Config, layers: tuple[KindStates, ...], bytes_per_value: int, page_size: int | None = None
) -> list[str]:
    """`mlaserve inspect`'s lines for V4: layers grouped by kind, the key the kinds came from, what each kind
    keeps per sequence: rows that grow with the sequence (bytes per token), their page snapshots (given page_size:
    one per page, kept with prefix caching on) and fixed per-sequence state.
    layers: the stack's LayerKinds in the live layout (config/layer_kinds.py declare_layers, then config/kv_cache.py
    quantize_states for the kv_cache_dtype); every figure is their StateSpecs' bytes (bytes_per_row,
    request_bytes), the ones the cache allocates, so an 8-bit ring or pool counts its codes, scales and kept values."""
    a, c = cfg.attention, cfg.compression
    groups: dict[str, list[int]] = {}
    for i, kind in enumerate(cfg.layer_kinds):
        groups.setdefault(kind, []).append(i)
    names = {"window": "ring", "kv_pool": "kv rows", "index_pool": "index keys"}
    lines = []
    for kind, ids in groups.items():
        if kind == "sliding":
            what = f"sliding window {a.sliding_window}"
        elif kind == "csa":
            m = c.ratio(kind)
            what = f"CSA m={m}, overlapping 2m pooling, indexer top-{c.index_topk} ({c.index_n_heads} heads)"
        else:
            what = f"HCA m'={c.ratio(kind)}, non-overlapping pooling, every visible row"
        states = layers[ids[0]].states  # a kind's layers keep the same states (config/layer_kinds.py _v4_layer)
        kept = []
        for s in states:
            if s.name not in names:  # carries and overlap halves: in the fixed per-sequence bytes
                continue
            shape = " x ".join(map(str, s.request_shape)) if s.addressing == "request" else str(s.width)
            per = f" per {s.tokens_per_row} tokens" if s.addressing == "page" else ""
            kept.append(f"{names[s.name]} [{shape}]{per}" + (f" as {s.quant.label()}" if s.quant else ""))
        paged = [s for s in states if s.addressing == "page"]
        # a row of one per m tokens counts 1/m of its bytes (not floored: an 8-bit row's bytes need not divide by m)
        per_token = sum(s.bytes_per_row(bytes_per_value) / s.tokens_per_row for s in paged) * len(ids)
        sizes = f"{per_token:g} bytes/token"
        snapped = sum(s.request_bytes(bytes_per_value) for s in states if s.snapshot) * len(ids)
        if snapped and page_size:
            sizes += f" + {snapped / page_size:g} bytes/token of snapshots with prefix caching"
        fixed = sum(s.request_bytes(bytes_per_value) for s in states) * len(ids)
        lines.append(
            f"layers {_ranges(ids)}: {kind} ({what}; from {cfg.layer_kinds_source}); keeps {' + '.join(kept)} "
            f"({sizes}); fixed per sequence {fixed} bytes"
        )
    return lines


def _ranges(ids: list[int]) -> str:
    out, start = [], ids[0]
    for x, y in zip(ids, [*ids[1:], None]):
        if y != x + 1:
            out.append(f"{start}-{x}" if x > start else f"{x}")
            start = y
    return ", ".join(out)


# DeepSeek-V4's default page: vLLM's 256 tokens, rounded up to a multiple of every compress ratio
V4_PAGE_TOKENS = 256


def v4_page_size(model) -> tuple[int, str]:
    """The page size a DeepSeek-V4 stack gets when the user leaves page_size at the engine default, and why.
    The pools keep one row per m tokens in pages, so the page must be a multiple of every ratio m; prefix hits
    land on page boundaries, so a smaller page shares more; every page also keeps a snapshot of each layer's
    ring (W rows) and overlap halves, so a larger page costs fewer snapshot bytes per token. 256 (vLLM's): for
    V4-Flash (ratios 4, 128; W 128) the ring snapshots add W / 256 = half a K=V row per token and layer."""
    ratios = sorted({model.ratio(i) for i, k in enumerate(model.layer_kinds) if k != "sliding"})
    lcm = math.lcm(*ratios) if ratios else 1
    page = -(-V4_PAGE_TOKENS // lcm) * lcm
    why = (
        f"family default (DeepSeek-V4): {V4_PAGE_TOKENS} tokens as vLLM, the smallest multiple of every compress "
        f"ratio {tuple(ratios)} at or above it: compressed pool rows stay inside pages and a prefix hit lands on "
        "a page boundary, where each ring and overlap half has its snapshot row"
    )
    return page, why

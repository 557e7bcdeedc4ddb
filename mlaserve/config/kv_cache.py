"""The cache's storage layout (`kv_cache_dtype`), as data: which paged states keep 8-bit rows (the formats and
their error bound: config/row_format.py). Decided once from the config (`quantize_states`); the cache allocates
what a StateSpec's `quant` says and every reader dequantizes the rows it gathers."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.config.row_format import index_key_format, latent_format

if TYPE_CHECKING:  # annotations only: layer_kinds imports torch, which config/engine.py (the CLI's --help) must not
    from mlaserve.config.layer_kinds import LayerKind

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")


def check_kv_cache_dtype(value) -> str:
    if value not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {value!r}")
    return value


def quantize_states(layers: tuple[LayerKind, ...], kv_cache_dtype: str, model: ModelConfig) -> tuple[LayerKind, ...]:
    """The stack's kinds with each 8-bit state's RowFormat set (`StateSpec.quant`): every layer's latent rows and
    full indexer layers' keys (model: the config whose qk_rope_head_dim the latent rows keep). auto: the kinds as
    they are. A stack with neither (DeepSeek-V4's window and
    compressed states) is refused: nothing would be quantized, and the option must not claim it was."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return layers
    out = []
    for k in layers:
        states = []
        for s in k.states:
            # every attention sublayer's latent rows (LongCat-Flash: latent, latent_1)
            if s.addressing == "page" and (s.name == "latent" or s.name in k.sublayers):
                s = replace(s, quant=latent_format(kv_cache_dtype, s.width, model.qk_rope_head_dim))
            elif s.addressing == "page" and s.name == "index_keys":
                s = replace(s, quant=index_key_format(s.width))
            states.append(s)
        out.append(replace(k, states=tuple(states)))
    if not any(s.quant for k in out for s in k.states):
        raise ConfigError(
            f"kv_cache_dtype={kv_cache_dtype!r} quantizes MLA latent rows and DSA index keys; this model's cache "
            "keeps neither (DeepSeek-V4's window and compressed states stay in the compute dtype): use 'auto'"
        )
    return tuple(out)


def describe_layout(layers: tuple[LayerKind, ...], kv_cache_dtype: str, dtype_name: str) -> str:
    """The live layout in one line (the ledger's `kv_cache`, `inspect`)."""
    if kv_cache_dtype == "auto":
        return f"auto ({dtype_name})"
    formats = {s.name: s.quant for k in layers for s in k.states if s.quant is not None}
    parts = [f"{name} {fmt.label()}" for name, fmt in formats.items()]
    return f"{kv_cache_dtype}: " + "; ".join(parts) + f"; kept values and other states {dtype_name}"

"""The cache's storage layout (`kv_cache_dtype`), as data: which paged states keep 8-bit or 16-bit rows (the
formats and their error bound: config/row_format.py). Decided once from the config (`quantize_states`); the cache allocates
what a StateSpec's `quant` says and every reader dequantizes the rows it gathers.

`auto` is the compute dtype for every checkpoint, GGUF files included (decided 2026-12-02, docs/PERFORMANCE.md "A
16-bit latent cache"): float16 meets the rule for a lossy default (`verify --against` measured the error it adds
to an attention block at 0.7-1.0% of a Q8_0 file's own e(X), 0.07-0.1% of a Q4_K_M's), but a decode step at 4096
context showed no measurable gain, and `auto` is the exact cache every reference test relies on."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.config.row_format import HALF_CODES, index_key_format, latent_format
from mlaserve.config.v4_numerics import KV_BLOCK, kv_format

if TYPE_CHECKING:  # annotations only: layer_kinds imports torch, which config/engine.py (the CLI's --help) must not
    from mlaserve.config.layer_kinds import LayerKind

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", *HALF_CODES)
V4_FP8_STATES = ("kv_pool", "window")  # DeepSeek-V4's states kept in FP8 under fp8_e4m3 (_quantize_v4)
# The keys an indexer scores every step, kept as DeepSeek-V3.2's reference keeps its key cache (FP8, a scale per
# row): a full DSA layer's `index_keys`, and GLM-5.3-Flash's pooled keys `index_pools`. The pooled indexer's
# per-token [k | gate] rows (`index_rows`) stay in the compute dtype: each is read once, when its pool completes,
# and its gate enters a softmax, so rounding it would round the pooled key twice (docs/GLM5_NEXT.md).
INDEX_KEY_STATES = ("index_keys", "index_pools")


def check_kv_cache_dtype(value) -> str:
    if value not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {value!r}")
    return value


def quantize_states(layers: tuple[LayerKind, ...], kv_cache_dtype: str, model: ModelConfig) -> tuple[LayerKind, ...]:
    """The stack's kinds with each 8-bit (or 16-bit) state's RowFormat set (`StateSpec.quant`): every layer's latent
    rows and the keys indexers score (INDEX_KEY_STATES) (model: the config whose qk_rope_head_dim the latent rows keep);
    DeepSeek-V4's compressed K=V rows (_quantize_v4). auto: the kinds as they are. A stack with none of them is refused:
    nothing would be quantized, and the option must not claim it was."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return layers
    if any(k.attention.startswith("v4_") for k in layers):  # DeepSeek-V4's kinds (config/layer_kinds.py)
        return _quantize_v4(layers, kv_cache_dtype, model)
    out = []
    for k in layers:
        states = []
        for s in k.states:
            # every attention sublayer's latent rows (LongCat-Flash: latent, latent_1)
            if s.addressing == "page" and (s.name == "latent" or s.name in k.sublayers):
                s = replace(s, quant=latent_format(kv_cache_dtype, s.width, model.qk_rope_head_dim))
            elif s.addressing == "page" and s.name in INDEX_KEY_STATES:
                s = replace(s, quant=index_key_format(s.width, kv_cache_dtype))
            states.append(s)
        out.append(replace(k, states=tuple(states)))
    if not any(s.quant for k in out for s in k.states):
        raise ConfigError(
            f"kv_cache_dtype={kv_cache_dtype!r} quantizes MLA latent rows and DSA index keys; this model's cache "
            "keeps neither: use 'auto'"
        )
    return tuple(out)


def _quantize_v4(layers: tuple[LayerKind, ...], kv_cache_dtype: str, model) -> tuple[LayerKind, ...]:
    """DeepSeek-V4 (model: a DeepseekV4Config): fp8_e4m3 keeps every K=V row the attention reads in the official
    code's FP8 format (config/v4_numerics.py kv_format: the non-rope part as e4m3 codes with a power-of-two scale
    per 64, stored as one e8m0 byte; the rope part kept): every CSA / HCA layer's compressed pool (`kv_pool`,
    paged) and every layer's sliding-window ring (`window`, a request state of W rows per slot, and with it its
    page snapshots, which the cache allocates in the state's form). The run's FP8 rounding is implied
    (resolve_v4_numerics), so the rows a step writes are already what the codes hold: a rounded value
    re-quantizes to itself under a power-of-two scale, and a ring row read back and written again (a snapshot,
    a rollback's restore) keeps its codes. What stays in the compute dtype, and why: the indexer's pool (the
    official code keeps its keys in bf16), the carries and overlap halves and their snapshots (raw projections
    the pooling still needs: rounding them would change the pooled rows, so they could not be restored
    exactly). int8 and the 16-bit layouts are refused: the official code rounds V4's rows through FP8 only, and
    the V4 numerics (config/v4_numerics.py) tie the stored rows to that rounding."""
    if kv_cache_dtype in HALF_CODES:
        raise ConfigError(
            f"kv_cache_dtype={kv_cache_dtype!r}: DeepSeek-V4's compressed pools and window rings are not offered in "
            "16 bits (their stored rows are the official code's FP8 rounding): use 'fp8_e4m3' or 'auto'"
        )
    if kv_cache_dtype != "fp8_e4m3":
        raise ConfigError(
            f"kv_cache_dtype={kv_cache_dtype!r}: DeepSeek-V4's compressed rows are kept only as the official code "
            "rounds them, FP8 e4m3 (kv_cache_dtype='fp8_e4m3'); an int8 layout is not offered"
        )
    a = model.attention
    if a.nope_dim % KV_BLOCK:
        raise ConfigError(
            f"kv_cache_dtype='fp8_e4m3': DeepSeek-V4's {a.nope_dim} non-rope values per row (head_dim {a.head_dim} - "
            f"rope {a.rope_dim}) do not split into the official blocks of {KV_BLOCK}: use 'auto'"
        )
    fmt = kv_format(a.nope_dim, a.rope_dim)
    out = []
    for k in layers:
        states = tuple(replace(s, quant=fmt) if s.name in V4_FP8_STATES else s for s in k.states)
        out.append(replace(k, states=states))
    return tuple(out)


def describe_layout(layers: tuple[LayerKind, ...], kv_cache_dtype: str, dtype_name: str) -> str:
    """The live layout in one line (the ledger's `kv_cache`, `inspect`)."""
    if kv_cache_dtype == "auto":
        return f"auto ({dtype_name})"
    formats = {s.name: s.quant for k in layers for s in k.states if s.quant is not None}
    parts = [f"{name} {fmt.label()}" for name, fmt in formats.items()]
    rest = "other states" if kv_cache_dtype in HALF_CODES else "kept values and other states"
    return f"{kv_cache_dtype}: " + "; ".join(parts) + f"; {rest} {dtype_name}"

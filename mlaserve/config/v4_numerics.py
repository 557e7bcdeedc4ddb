"""DeepSeek-V4's numerics where DeepSeek's own inference code (the release's inference/model.py and kernel.py)
departs from transformers, as data: which of the official roundings a run applies. Default: neither
(transformers' DeepseekV4ForCausalLM, the reference every other V4 test compares against).

  kv_rounding "fp8_ue8m0"  every K=V row the attention reads (the sliding window's rows and the compressed
                           pools' rows, after kv_norm and rope) has its non-rope part [:head_dim - rope_dim]
                           rounded through FP8 e4m3 in blocks of KV_BLOCK = 64 values, one power-of-two scale
                           per block (2^ceil(log2(amax / 448)), amax floored at 1e-4): the official code's
                           act_quant(kv[..., :-rd], 64, "ue8m0", inplace=True), its "FP8-simulate non-rope
                           dims to match QAT". The rope part stays in the compute dtype. The release's
                           config (scale_dtype fp8) makes the scales ue8m0; the fp32-scale variant of the
                           same code (scale_dtype fp32) is not offered.
  indexer "hadamard_fp4"   the CSA indexer's queries (after rope) and its compressed keys (after kv_norm and
                           rope) are rotated by the normalised Walsh-Hadamard matrix H / sqrt(c) (Sylvester's
                           order, c = index_head_dim, a power of two), then rounded through FP4 e2m1 in blocks
                           of FP4_BLOCK = 32 with power-of-two scales 2^ceil(log2(amax / 6)) (amax floored at
                           6 * 2^-126): the official rotate_activation + fp4_act_quant(x, 32, inplace=True)
                           ("use fp4 simulation for q and kv in indexer"). In exact arithmetic the rotation of
                           both sides leaves every score unchanged; the FP4 rounding after it is what changes
                           the selection.

kv_cache_dtype fp8_e4m3 on a V4 model keeps the compressed pools' rows and the window rings as those FP8 codes
and scales (config/kv_cache.py `_quantize_v4`; the scales as one e8m0 byte each), so it implies kv_rounding "fp8_ue8m0" (every other row the attention
reads is rounded alike); `resolve_v4_numerics` records that and refuses "none" beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlaserve.config.model_parts import ConfigError
from mlaserve.config.row_format import RowFormat

V4_KV_ROUNDINGS = ("auto", "none", "fp8_ue8m0")
V4_INDEXERS = ("exact", "hadamard_fp4")
KV_BLOCK = 64  # values per scale of the official KV simulation (act_quant(kv[..., :-rd], 64, ...))
FP4_BLOCK = 32  # values per scale of the official indexer simulation (fp4_block_size)
FP4_MAX = 6.0  # the largest e2m1 magnitude


@dataclass(frozen=True)
class V4Numerics:
    """The roundings a V4 model applies (resolved: kv_rounding "none" | "fp8_ue8m0")."""

    kv_rounding: str = "none"
    indexer: str = "exact"

    @property
    def official(self) -> bool:
        return self.kv_rounding != "none" or self.indexer != "exact"


TRANSFORMERS = V4Numerics()  # the default: transformers' numerics, no official rounding


def kv_format(nope_dim: int, rope_dim: int) -> RowFormat:
    """The official FP8 KV row: [nope (8-bit e4m3 codes, a ue8m0 scale per 64) | rope (kept)]."""
    return RowFormat("fp8_e4m3", nope_dim, KV_BLOCK, rope_dim, scale="ue8m0")


def check_v4_numerics(model, numerics: V4Numerics) -> V4Numerics:
    """model: a DeepseekV4Config. The shapes each rounding needs, as the official kernels assert them."""
    a, c = model.attention, model.compression
    if numerics.kv_rounding == "fp8_ue8m0" and (a.nope_dim < KV_BLOCK or a.nope_dim % KV_BLOCK):
        raise ConfigError(
            f"v4_kv_rounding='fp8_ue8m0' rounds the {a.nope_dim} non-rope values of a K=V row (head_dim "
            f"{a.head_dim} - rope {a.rope_dim}) in blocks of {KV_BLOCK}: not a multiple (config.json head_dim / "
            "partial_rotary_factor)"
        )
    if numerics.indexer == "hadamard_fp4" and "csa" in model.layer_kinds:
        d = c.index_head_dim
        if d & (d - 1) or d % FP4_BLOCK:
            raise ConfigError(
                f"v4_indexer='hadamard_fp4' needs index_head_dim a power of two (the Hadamard rotation) and a "
                f"multiple of {FP4_BLOCK} (the FP4 blocks); config.json index_head_dim={d}"
            )
    return numerics


def resolve_v4_numerics(model, kv_rounding: str, indexer: str, kv_cache_dtype: str, log) -> V4Numerics:
    """The engine options -> V4Numerics, each recorded in `log` (a ProvenanceLog). Only a V4 model takes
    anything but the defaults; kv_cache_dtype fp8_e4m3 on V4 implies the FP8 rounding (module docstring)."""
    if kv_rounding not in V4_KV_ROUNDINGS:
        raise ConfigError(f"v4_kv_rounding must be one of {V4_KV_ROUNDINGS}, got {kv_rounding!r}")
    if indexer not in V4_INDEXERS:
        raise ConfigError(f"v4_indexer must be one of {V4_INDEXERS}, got {indexer!r}")
    v4 = model.family is not None and model.family.layer_kinds == "deepseek_v4"
    if not v4:
        if kv_rounding not in ("auto", "none") or indexer != "exact":
            raise ConfigError(
                f"v4_kv_rounding={kv_rounding!r} / v4_indexer={indexer!r} are DeepSeek-V4's official-code numerics; "
                f"this model is {model.model_type!r}"
            )
        return V4Numerics()
    fp8_cache = kv_cache_dtype == "fp8_e4m3"
    if fp8_cache:
        log.record(
            "v4_kv_cache_layout",
            "fp8_e4m3 / 64 + e8m0 scales (1 byte) + rope kept: kv_pool, window ring and its snapshots",
            "kv_cache_dtype=fp8_e4m3 (config/kv_cache.py _quantize_v4): the official code's ue8m0 scales are "
            "powers of two, so one exponent byte holds each exactly (an fp32 slot would add 3 bytes per 64 "
            "values and no precision)",
        )
    if kv_rounding == "auto":
        if fp8_cache:
            kv_rounding = log.record(
                "v4_kv_rounding",
                "fp8_ue8m0",
                "kv_cache_dtype=fp8_e4m3: the pools keep the official FP8 rows, so every row attended is rounded alike",
            )
        else:
            kv_rounding = log.record(
                "v4_kv_rounding", "none", "engine default (transformers: rows in the compute dtype)"
            )
    elif kv_rounding == "none" and fp8_cache:
        raise ConfigError(
            "kv_cache_dtype='fp8_e4m3' keeps DeepSeek-V4's compressed rows in the official FP8 format; with "
            "v4_kv_rounding='none' the window's rows would not be rounded alike: leave v4_kv_rounding at auto"
        )
    else:
        log.record("v4_kv_rounding", kv_rounding, "user option")
    log.record("v4_indexer", indexer, "user option" if indexer != "exact" else "engine default (transformers)")
    return check_v4_numerics(model, V4Numerics(kv_rounding, indexer))

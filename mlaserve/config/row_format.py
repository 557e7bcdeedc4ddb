"""How a paged state's 8-bit rows are stored (`kv_cache_dtype`): the row formats and their error bound.

Notation
  r = kv_lora_rank, dr = qk_rope_head_dim, Di = index_head_dim, c = the compute dtype's bytes per value
  latent row  [c_kv (r) | k_pe (dr)]: with kv_cache_dtype int8 / fp8_e4m3, c_kv is stored as r 8-bit codes
              in blocks of `block` values with one fp32 scale each; k_pe stays in the compute dtype
              bytes per row = r + 4 * r / block + dr * c   (auto: (r + dr) * c)
  index key   [Di]: FP8 e4m3 codes with one fp32 scale per token (block = Di) whenever the latent rows are
              8-bit (DeepSeek-V3.2's reference inference keeps its indexer key cache this way)
              bytes per row = Di + 4   (auto: Di * c)
  scale = max(amax(|block|), AMAX_FLOOR) / QMAX (QMAX 127 int8, 448 e4m3), or with `scale` "ue8m0" that value
  rounded up to a power of two, 2^ceil(log2(max(amax, AMAX_FLOOR) * (1/QMAX))) (DeepSeek's act_quant with
  scale_fmt ue8m0: DeepSeek-V4's KV rows, config/v4_numerics.py);  y = x / scale;
  code = round(y) clamped to +-127 (int8) | y rounded to the nearest e4m3 value, +-448 at most (fp8_e4m3)
  x~ = code * scale (one fp32 rounding, relative 2^-24) and
  |x - x~| <= scale / 2 (int8) | <= max(|x| / 16, scale / 1024) (e4m3: half a step of its 3 mantissa bits,
  2^-10 below the smallest normal code 2^-6): the per-value error bound every 8-bit-vs-full check derives from.
  Stored scales: fp32 (4 bytes) for "amax"; for "ue8m0" one byte, the e8m0 exponent b of 2^(b - 127)
  (DeepSeek's ue8m0 and vLLM's fp8_ds_mla scales): a power of two is its exponent alone, so the byte holds
  the scale exactly (cache/quantized_rows.py encode_scales / decode_scales; byte 255 is NaN, a non-finite
  block's scale; byte 0, never a scale since amax is floored, reads as 0: the zero pad row).
  bytes per row = quantized + scale_bytes * quantized / block + kept * c

Why blocks of 128 latent values: DeepSeek's FP8 uses 1 x 128 activation blocks and vLLM's `fp8_ds_mla` cache
keeps 4 scales per 512-value latent row, i.e. 128 values per scale; an fp32 scale per 128 codes costs 3% of
the codes' bytes, and a smaller block would follow a row's local magnitude more closely at more bytes. A
latent rank below 128 (the tiny test models) is one block. Decided once from the config (`quantize_states`);
the cache allocates what a StateSpec's `quant` says and every reader dequantizes the rows it gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlaserve.config.model import ConfigError

LATENT_BLOCK = 128  # latent values per fp32 scale (see the module docstring)
INDEX_KEY_CODES = "fp8_e4m3"  # the DSA key cache's codes under any 8-bit kv_cache_dtype, as DeepSeek keeps them
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}  # the largest code magnitude; scale = amax / QMAX
# The smallest amax a scale is made from (DeepSeek's act_quant clamps amax the same way): a zero row (the pad
# row, a zero block) gets a finite scale and zero codes instead of 0 / 0.
AMAX_FLOOR = 1e-4
SCALE_BYTES = {"amax": 4, "ue8m0": 1}  # fp32; e8m0 (a power of two is held exactly by its exponent byte)
SCALE_RULES = ("amax", "ue8m0")


@dataclass(frozen=True)
class RowFormat:
    """How one paged state's rows are stored when they are 8-bit: `quantized` leading values as codes in blocks
    of `block` with a scale each (fp32, or one e8m0 byte for power-of-two scales), then `kept` trailing values in
    the compute dtype."""

    codes: str  # "int8" | "fp8_e4m3"
    quantized: int
    block: int
    kept: int = 0
    scale: str = "amax"  # "amax": amax / QMAX; "ue8m0": rounded up to a power of two (SCALE_RULES)

    def __post_init__(self) -> None:
        if self.codes not in QMAX:
            raise ConfigError(f"row codes {self.codes!r} are not one of {tuple(QMAX)}")
        if self.scale not in SCALE_RULES:
            raise ConfigError(f"row scale rule {self.scale!r} is not one of {SCALE_RULES}")
        if self.block < 1 or self.quantized % self.block:
            raise ConfigError(f"{self.quantized} quantized values do not split into blocks of {self.block}")

    @property
    def scales(self) -> int:
        return self.quantized // self.block

    @property
    def width(self) -> int:
        return self.quantized + self.kept

    @property
    def scale_bytes(self) -> int:
        """Bytes of one stored scale: 4 (fp32) for "amax", 1 (e8m0) for "ue8m0"."""
        return SCALE_BYTES[self.scale]

    def bytes_per_row(self, compute_bytes: int) -> int:
        return self.quantized + self.scale_bytes * self.scales + self.kept * compute_bytes

    def label(self) -> str:
        kept = f" + {self.kept} kept" if self.kept else ""
        rule = " (ue8m0: power-of-two scales, 1 byte each)" if self.scale == "ue8m0" else ""
        return f"{self.codes} [{self.quantized}] / {self.block} per scale{rule}{kept}"


def latent_format(kv_cache_dtype: str, latent_dim: int, rope_dim: int) -> RowFormat:
    """c_kv in 8-bit blocks of LATENT_BLOCK (one block when r < LATENT_BLOCK), k_pe kept."""
    r = latent_dim - rope_dim
    block = min(LATENT_BLOCK, r)
    if r % block:
        raise ConfigError(
            f"kv_cache_dtype={kv_cache_dtype!r}: kv_lora_rank={r} is not a multiple of the {LATENT_BLOCK}-value "
            "scale block (use kv_cache_dtype='auto')"
        )
    return RowFormat(kv_cache_dtype, r, block, rope_dim)


def index_key_format(head_dim: int) -> RowFormat:
    """One index key per token: FP8 e4m3 codes, one fp32 scale per token (DeepSeek-V3.2: k_cache fp8 with
    k_scale_cache [.., Di / 128], and Di = 128)."""
    return RowFormat(INDEX_KEY_CODES, head_dim, head_dim)

"""How a paged state's rounded rows are stored (`kv_cache_dtype`): the row formats and their error bound.

Notation
  r = kv_lora_rank, dr = qk_rope_head_dim, Di = index_head_dim, c = the compute dtype's bytes per value
  16-bit rows (kv_cache_dtype float16 / bfloat16): every value of the row ([c_kv | k_pe], or an index key) is
              stored as one IEEE half / bfloat16, rounded to nearest (ties to even), no scales, nothing kept
              bytes per row = 2 * width (llama.cpp's F16 cache for MLA models: the same row, the same bytes)
              x~ = round16(x): |x - x~| <= u |x| with u = 2^-11 (float16) / 2^-8 (bfloat16) in the normal range,
              so |x - x~| <= u / (1 - u) |x~| from what the cache holds; below the smallest normal the step is
              fixed, |x - x~| <= 2^-25 (float16 subnormals 2^-24 apart) / 2^-134 (bfloat16, fp32's range);
              |x| beyond float16's largest finite value 65504 rounds to inf (the bound is then inf: nothing is
              promised for it), bfloat16 has fp32's range
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
SCALE_BYTES = {"amax": 4, "ue8m0": 1, "none": 0}  # fp32; e8m0 (a power of two is held exactly by its exponent byte)
SCALE_RULES = ("amax", "ue8m0", "none")  # "none": 16-bit rows, each value stored alone (HALF_CODES)
# 16-bit storage: unit roundoff u (half the relative spacing of the stored values) and the absolute rounding
# error below the smallest normal (half the subnormal step); the module docstring derives both
HALF_CODES = {"float16": (2.0**-11, 2.0**-25), "bfloat16": (2.0**-8, 2.0**-134)}


@dataclass(frozen=True)
class RowFormat:
    """How one paged state's rows are stored when they are 8-bit: `quantized` leading values as codes in blocks
    of `block` with a scale each (fp32, or one e8m0 byte for power-of-two scales), then `kept` trailing values in
    the compute dtype; when they are 16-bit (HALF_CODES): every value as one 16-bit float (block = quantized =
    the row, scale "none", nothing kept)."""

    codes: str  # "int8" | "fp8_e4m3" | "float16" | "bfloat16"
    quantized: int
    block: int
    kept: int = 0
    scale: str = "amax"  # "amax": amax / QMAX; "ue8m0": rounded up to a power of two (SCALE_RULES)

    def __post_init__(self) -> None:
        if self.codes not in QMAX and self.codes not in HALF_CODES:
            raise ConfigError(f"row codes {self.codes!r} are not one of {tuple(QMAX) + tuple(HALF_CODES)}")
        if (self.codes in HALF_CODES) != (self.scale == "none") or (self.half and self.kept):
            raise ConfigError(f"16-bit rows ({self.codes}) have no scales and keep nothing; 8-bit rows have scales")
        if self.scale not in SCALE_RULES:
            raise ConfigError(f"row scale rule {self.scale!r} is not one of {SCALE_RULES}")
        if self.block < 1 or self.quantized % self.block:
            raise ConfigError(f"{self.quantized} quantized values do not split into blocks of {self.block}")

    @property
    def half(self) -> bool:
        """16-bit rows (every value stored alone, no scales)."""
        return self.codes in HALF_CODES

    @property
    def scales(self) -> int:
        return 0 if self.half else self.quantized // self.block

    @property
    def width(self) -> int:
        return self.quantized + self.kept

    @property
    def scale_bytes(self) -> int:
        """Bytes of one stored scale: 4 (fp32) for "amax", 1 (e8m0) for "ue8m0"."""
        return SCALE_BYTES[self.scale]

    def bytes_per_row(self, compute_bytes: int) -> int:
        code_bytes = 2 if self.half else 1
        return code_bytes * self.quantized + self.scale_bytes * self.scales + self.kept * compute_bytes

    def label(self) -> str:
        if self.half:
            return f"{self.codes} [{self.quantized}]"
        kept = f" + {self.kept} kept" if self.kept else ""
        rule = " (ue8m0: power-of-two scales, 1 byte each)" if self.scale == "ue8m0" else ""
        return f"{self.codes} [{self.quantized}] / {self.block} per scale{rule}{kept}"


def half_format(kv_cache_dtype: str, width: int) -> RowFormat:
    """The whole row [width] in 16 bits (kv_cache_dtype float16 / bfloat16)."""
    return RowFormat(kv_cache_dtype, width, width, 0, scale="none")


def latent_format(kv_cache_dtype: str, latent_dim: int, rope_dim: int) -> RowFormat:
    """16-bit: the whole row [c_kv | k_pe] (as llama.cpp's F16 cache); 8-bit: c_kv in blocks of LATENT_BLOCK (one
    block when r < LATENT_BLOCK), k_pe kept."""
    if kv_cache_dtype in HALF_CODES:
        return half_format(kv_cache_dtype, latent_dim)
    r = latent_dim - rope_dim
    block = min(LATENT_BLOCK, r)
    if r % block:
        raise ConfigError(
            f"kv_cache_dtype={kv_cache_dtype!r}: kv_lora_rank={r} is not a multiple of the {LATENT_BLOCK}-value "
            "scale block (use kv_cache_dtype='auto')"
        )
    return RowFormat(kv_cache_dtype, r, block, rope_dim)


def index_key_format(head_dim: int, kv_cache_dtype: str = INDEX_KEY_CODES) -> RowFormat:
    """One index key per token. Under an 8-bit kv_cache_dtype: FP8 e4m3 codes, one fp32 scale per token
    (DeepSeek-V3.2: k_cache fp8 with k_scale_cache [.., Di / 128], and Di = 128); under a 16-bit one the key in
    the same 16 bits as the latent rows."""
    if kv_cache_dtype in HALF_CODES:
        return half_format(kv_cache_dtype, head_dim)
    return RowFormat(INDEX_KEY_CODES, head_dim, head_dim)

"""8-bit cache rows (kv_cache_dtype): the quantizer and dequantizer bit-exact against a plain reference written
here (numpy, value by value, with its own table of e4m3 values), the rows a cache hands its readers, the bytes it
counts, the layout the config declares, and the option's errors.

The reference follows the definition in config/kv_cache.py, not the code under test: per block of `block` values,
scale = max(amax, 1e-4) / QMAX in fp32; int8 codes = round half to even of x / scale, clamped to +-127;
e4m3 codes = the nearest finite e4m3fn value to x / scale clamped to +-448, ties to the even mantissa.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlaserve.cache.model_cache import ModelCache
from mlaserve.cache.quantized_rows import QuantizedRows, dequantize, error_bound, plain_zeros, quantize
from mlaserve.config.kv_cache import describe_layout, quantize_states
from mlaserve.config.layer_kinds import LayerKind, StateSpec, describe
from mlaserve.config.model import ConfigError
from mlaserve.config.row_format import RowFormat, index_key_format, latent_format


def _e4m3_table() -> np.ndarray:
    """The value of every e4m3fn bit pattern (sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 is
    subnormal; 0x7F and 0xFF are NaN, there is no infinity), from the format's definition."""
    values = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp, man = (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and man == 0x7:
            values[code] = np.nan
        elif exp == 0:
            values[code] = sign * man / 8 * 2.0**-6
        else:
            values[code] = sign * (1 + man / 8) * 2.0 ** (exp - 7)
    return values


E4M3 = _e4m3_table()


def _e4m3_encode(y: float) -> int:
    """The nearest finite e4m3 value's bit pattern (ties: the even mantissa); a value that rounds to zero keeps
    its sign (IEEE rounding: -0, 0x80, for a negative value)."""
    finite = [c for c in range(256) if not np.isnan(E4M3[c]) and c != 0x80]
    dist = [abs(E4M3[c] - y) for c in finite]
    best = min(dist)
    ties = [c for c, d in zip(finite, dist) if d == best]
    code = min(ties, key=lambda c: (c & 1, c))
    return 0x80 if code == 0 and np.signbit(y) else code


def _reference(x: np.ndarray, codes: str, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [N, q] float32 -> (codes as uint8 bytes, scales fp32, dequantized fp32), value by value."""
    qmax = np.float32(127.0 if codes == "int8" else 448.0)
    n, q = x.shape
    out_codes = np.zeros((n, q), dtype=np.uint8)
    scales = np.zeros((n, q // block), dtype=np.float32)
    deq = np.zeros((n, q), dtype=np.float32)
    for i in range(n):
        for b in range(q // block):
            part = x[i, b * block : (b + 1) * block]
            scale = np.float32(max(np.float32(np.abs(part).max()), np.float32(1e-4))) / qmax
            scales[i, b] = scale
            for j, v in enumerate(part):
                y = np.float32(v) / scale
                if codes == "int8":
                    c = int(np.clip(np.rint(y), -127, 127))
                    out_codes[i, b * block + j] = c & 0xFF
                    deq[i, b * block + j] = np.float32(c) * scale
                else:
                    c = _e4m3_encode(float(np.clip(y, -448.0, 448.0)))
                    out_codes[i, b * block + j] = c
                    deq[i, b * block + j] = np.float32(E4M3[c]) * scale
    return out_codes, scales, deq


def _rows(seed: int, n: int, q: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, q, generator=g) * torch.rand(n, 1, generator=g) * 3
    x[0] = 0.0  # a zero row: the floor keeps its scale finite and its codes zero
    x[1, :5] = torch.tensor([0.5, -0.5, 1.5, 2.5, -2.5]) * (x[1].abs().max() / 127)  # int8 ties (half to even)
    x[2, 3] = 1e30  # one huge value: the rest of its block rounds to zero codes
    return x


@pytest.mark.parametrize("codes", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("block", [32, 16])
def test_quantize_dequantize_bit_exact(codes, block):
    x = _rows(0, 6, 32)
    fmt = RowFormat(codes, 32, block)
    got_codes, got_scales = quantize(x, fmt)
    want_codes, want_scales, want_deq = _reference(x.numpy(), codes, block)
    assert np.array_equal(got_codes.numpy(), want_codes)
    assert np.array_equal(got_scales.numpy(), want_scales)
    got_deq = dequantize(got_codes, got_scales, fmt)
    assert np.array_equal(got_deq.numpy(), want_deq)
    assert torch.equal(got_deq[0], torch.zeros(32))
    # the per-value bound holds for every value quantized (and is what the 8-bit-vs-full checks start from)
    bound = error_bound(got_codes, got_scales, fmt)
    assert bool(((x - got_deq).abs() <= bound).all())


def test_e4m3_reference_table_agrees_with_the_format():
    """The test's own table has the format's landmarks: 448 the largest, 2^-9 the smallest subnormal."""
    finite = E4M3[~np.isnan(E4M3)]
    assert finite.max() == 448.0 and finite.min() == -448.0
    assert np.min(np.abs(finite[finite != 0])) == 2.0**-9
    assert np.isnan(E4M3[0x7F]) and np.isnan(E4M3[0xFF]) and len(finite) == 254


def test_cache_rows_write_once_read_dequantized():
    """index_copy_ quantizes the codes, keeps k_pe in the compute dtype; rows() returns [dequantized | kept] at
    any slot shape, the pad row zero; a NaN row reads back NaN (its block's scale is NaN)."""
    fmt = latent_format("int8", 32 + 8, 8)
    cache = QuantizedRows(fmt, 11, torch.float32, "cpu", lambda n, w, dt, dev: torch.zeros(n, w, dtype=dt))
    x = _rows(1, 4, 40)
    x[3, 0] = float("nan")
    slots = torch.tensor([7, 2, 5, 9])
    cache.index_copy_(0, slots, x)
    want_codes, want_scales, want_deq = _reference(x[:3, :32].numpy(), "int8", 32)  # row 3: the NaN row
    got = cache.rows(torch.tensor([[7, 2], [10, 9]]))  # 10: the pad row
    assert got.shape == (2, 2, 40) and got.dtype == torch.float32
    assert np.array_equal(got[0, 0, :32].numpy(), want_deq[0]) and np.array_equal(got[0, 1, :32].numpy(), want_deq[1])
    assert torch.equal(got[0, 0, 32:], x[0, 32:]) and torch.equal(got[0, 1, 32:], x[1, 32:])
    assert torch.equal(got[1, 0], torch.zeros(40))
    assert bool(got[1, 1, :32].isnan().all()) and torch.equal(got[1, 1, 32:], x[3, 32:])
    assert np.array_equal(cache.codes[5].numpy(), want_codes[2]) and cache.scales[5].item() == want_scales[2, 0]


def _kinds(dsa: bool) -> tuple[LayerKind, ...]:
    """Two layers of DeepSeek-V3's widths (r 512, dr 64); with dsa, the first a full indexer layer (Di 128)."""
    latent = StateSpec("latent", 576)
    keys = (StateSpec("index_keys", 128),) if dsa else ()
    return (
        LayerKind(0, "mla_dsa" if dsa else "mla", "full" if dsa else None, (latent, *keys)),
        LayerKind(1, "mla_dsa" if dsa else "mla", "shared" if dsa else None, (latent,)),
    )


class _Model:
    qk_rope_head_dim = 64


@pytest.mark.parametrize("codes", ["int8", "fp8_e4m3"])
def test_bytes_per_token_truthful(codes):
    """Counted from the layout, measured from the allocation, equal; the latent part holds ~4x the tokens of
    fp32: c_kv 512 x 4 bytes -> 512 codes + 4 scales x 4 bytes (3.88x); whole rows with k_pe kept in fp32:
    2304 -> 784 bytes (2.94x), 1152 -> 656 (1.76x) in bf16 (vLLM's fp8_ds_mla row is 656 bytes too)."""
    kinds = quantize_states(_kinds(dsa=True), codes, _Model())
    lat, keys = kinds[0].state("latent").quant, kinds[0].state("index_keys").quant
    assert (lat.codes, lat.quantized, lat.block, lat.kept) == (codes, 512, 128, 64)
    assert (keys.codes, keys.quantized, keys.block, keys.kept) == ("fp8_e4m3", 128, 128, 0)
    assert lat.bytes_per_row(4) == 784 and lat.bytes_per_row(2) == 656 and keys.bytes_per_row(4) == 132
    per_token = ModelCache.bytes_per_token(kinds, torch.float32)
    assert per_token == 784 * 2 + 132
    full = ModelCache.bytes_per_token(_kinds(dsa=True), torch.float32)
    assert full == 576 * 4 * 2 + 128 * 4
    cache = ModelCache(kinds, num_pages=3, page_size=16, dtype=torch.float32)
    assert cache.measured_bytes_per_token() == per_token
    assert ModelCache(_kinds(dsa=True), 3, 16, torch.float32).measured_bytes_per_token() == full
    assert isinstance(cache.layers[0].latent, QuantizedRows) and isinstance(cache.layers[0].index_keys, QuantizedRows)
    assert (512 * 4) / lat.bytes_per_row(0) > 3.8
    lines = describe(kinds, 4)
    assert "latent [576] as " + codes + " [512] / 128 per scale + 64 kept" in lines[0]
    assert "index_keys [128] as fp8_e4m3 [128] / 128 per scale" in lines[0] and "916 bytes/token" in lines[0]
    assert describe_layout(kinds, codes, "float32").startswith(f"{codes}: latent {codes} [512]")
    assert describe_layout(_kinds(dsa=False), "auto", "float32") == "auto (float32)"


def test_layout_errors_name_the_field():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of .*'int4'"):
        quantize_states(_kinds(dsa=False), "int4", _Model())
    with pytest.raises(ConfigError, match="kv_lora_rank=192 is not a multiple of the 128-value"):
        latent_format("int8", 192 + 64, 64)
    assert latent_format("int8", 32 + 16, 16).block == 32  # a rank below 128 is one block (tiny models)
    assert index_key_format(32).scales == 1
    v4 = (LayerKind(0, "v4_sliding", None, (StateSpec("window", 64, addressing="request", per_request=(8,)),)),)
    with pytest.raises(ConfigError, match="DeepSeek-V4.s compressed rows .* int8 layout is not offered"):
        quantize_states(v4, "int8", _Model())
    assert quantize_states(v4, "auto", _Model()) is v4


def test_engine_option_resolved_and_recorded():
    from hf_models import make_config

    from mlaserve.config.engine import make_options, resolve
    from mlaserve.config.model import ModelConfig

    model = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    cfg = resolve(model, make_options(kv_cache_dtype="fp8_e4m3"), has_indexer_weights=False)
    assert cfg.cache.kv_cache_dtype == "fp8_e4m3"
    (setting,) = [s for s in cfg.provenance if s.name == "kv_cache_dtype"]
    assert (setting.value, setting.source) == ("fp8_e4m3", "user option")
    auto = resolve(model, make_options(), has_indexer_weights=False)
    assert auto.cache.kv_cache_dtype == "auto"
    assert [s.source for s in auto.provenance if s.name == "kv_cache_dtype"] == ["engine default ('auto')"]
    with pytest.raises(
        ConfigError,
        match="kv_cache_dtype must be one of \\('auto', 'int8', 'fp8_e4m3', 'float16', 'bfloat16'\\), got 'fp8'",
    ):
        resolve(model, make_options(kv_cache_dtype="fp8"), has_indexer_weights=False)


def test_prefault_writes_every_part():
    kinds = quantize_states(_kinds(dsa=True), "fp8_e4m3", _Model())
    cache = ModelCache(kinds, num_pages=2, page_size=16, dtype=torch.float32, prefault=True)
    assert all(bool((t == 0).all()) for t in cache.layers[0].latent.tensors())


@pytest.mark.parametrize("codes", ["float16", "bfloat16"])
def test_16bit_rows_round_once_read_exactly_and_stay_within_their_bound(codes):
    """16-bit rows (config/row_format.py half_format): the write is torch's cast, the read widens exactly, a row
    moved between two 16-bit states is copied as stored, and |x - x~| <= u / (1 - u) |x~| + the subnormal half-step
    for every finite x~ over sixteen decades (float16's subnormals included); float16's overflow reads inf, and
    its bound is inf (nothing is promised there)."""
    from mlaserve.config.row_format import half_format

    fmt = half_format(codes, 48)
    assert (fmt.half, fmt.scales, fmt.kept, fmt.bytes_per_row(4), fmt.label()) == (True, 0, 0, 96, f"{codes} [48]")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g) * 10.0 ** torch.randint(-9, 7, (64, 1), generator=g).float()
    x[0, 0] = 1e6  # beyond float16's 65504
    rows = QuantizedRows.of(x, fmt)
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[codes]
    assert rows.codes.dtype == dtype and rows.scales is None and rows.kept is None and rows.tensors() == (rows.codes,)
    slots = torch.arange(64)
    got = rows.rows(slots)
    assert torch.equal(got, x.to(dtype).float())
    bound = rows.error(slots)
    finite = got.isfinite()
    assert bool(((x - got).abs()[finite] <= bound[finite]).all())
    assert (codes == "float16") == bool(bound[0, 0].isinf())  # float16 overflowed, bfloat16 has fp32's range
    other = QuantizedRows(fmt, 65, torch.float32, "cpu", plain_zeros)
    other.index_copy_(0, slots + 1, rows.take(slots))  # moved as stored: no second rounding
    assert torch.equal(other.rows(slots + 1), got) and bool((other.rows(torch.tensor([0])) == 0).all())
    other.index_fill_(0, torch.tensor([1]), 0)
    assert bool((other.rows(torch.tensor([1])) == 0).all())
    with pytest.raises(ValueError, match="cannot be copied into"):
        other.index_copy_(0, slots, QuantizedRows.of(x, latent_format("int8", 48, 16)))
    with pytest.raises(ConfigError, match="16-bit rows .* have no scales and keep nothing"):
        RowFormat(codes, 48, 48, 16, "none")
    with pytest.raises(ConfigError, match="16-bit rows"):
        RowFormat(codes, 48, 48, 0, "amax")

"""The ue8m0 scale rule of an 8-bit row format (DeepSeek-V4's official FP8 K=V rows, config/v4_numerics.py):
scales are powers of two 2^ceil(log2(max(amax, 1e-4) / 448)), bit-exact against a plain float64 reference,
and the stored values reproduce x / scale and code * scale exactly."""

from __future__ import annotations

import pytest
import torch

from mlaserve.cache.quantized_rows import QuantizedRows, block_scales, dequantize, error_bound, quantize
from mlaserve.config.model_parts import ConfigError
from mlaserve.config.row_format import RowFormat

FMT = RowFormat("fp8_e4m3", 128, 64, 8, scale="ue8m0")


def test_scales_are_the_power_of_two_at_or_above_amax_over_448():
    g = torch.Generator().manual_seed(0)
    amax = (torch.rand(4096, generator=g) * torch.logspace(-4, 4, 4096)).clamp(min=1e-4)
    amax = torch.cat([amax, torch.tensor([448.0, 896.0, 224.0, 448.0 * 2.0**-20, 1e-4])])  # exact powers x 448
    ref = 2.0 ** torch.ceil(torch.log2(amax.double() / 448.0))
    assert torch.equal(block_scales(amax, FMT), ref.float())
    assert torch.isnan(block_scales(torch.tensor([float("nan")]), FMT)).all()  # a NaN row stays NaN


def test_rows_round_trip_through_codes_and_power_of_two_scales():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(32, 136, generator=g) * torch.logspace(-3, 3, 32)[:, None]
    codes, scales = quantize(rows[:, :128], FMT)
    assert torch.equal(torch.frexp(scales).mantissa, torch.full_like(scales, 0.5))  # powers of two
    back = dequantize(codes, scales, FMT)
    # codes * scale exact: the dequantized values divided by the scale are e4m3 values
    per_block = (back.unflatten(-1, (2, 64)) / scales[..., None]).flatten(-2)
    assert torch.equal(per_block.to(torch.float8_e4m3fn).float(), per_block)
    assert ((back - rows[:, :128]).abs() <= error_bound(codes, scales, FMT)).all()
    # a rounded row re-quantizes to itself (why an 8-bit V4 cache equals the rounding on full rows)
    stored = QuantizedRows.of(torch.cat([back, rows[:, 128:]], dim=-1), FMT)
    assert torch.equal(stored.rows(torch.arange(32)), torch.cat([back, rows[:, 128:]], dim=-1))


def test_the_rule_is_named_and_checked():
    assert "ue8m0" in FMT.label() and "ue8m0" not in RowFormat("fp8_e4m3", 128, 64, 8).label()
    with pytest.raises(ConfigError, match="row scale rule 'e8m0' is not one of"):
        RowFormat("fp8_e4m3", 128, 64, 8, scale="e8m0")

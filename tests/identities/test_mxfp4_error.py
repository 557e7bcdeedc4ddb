"""The quantization error model of MXFP4 (observability/weight_error.py), which `verify --against` allows per
block: checked against the true error of values quantized by the gguf package (an independent quantizer).
Measured estimate / actual on random normal rows at scales 0.01-10: 1.07-1.10 (each value's grid step counted;
the error is a little below the uniform-rounding model's because the e2m1 levels sit closer where the values are
dense). Rows with many values near their block's maximum read low (uniform rows: 0.76), since values between
6S and 8S clamp to 6S, an error the stored values cannot show: a tighter tolerance, never a looser one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlaserve.observability.weight_error import relative_error


@pytest.mark.parametrize("scale", [0.01, 1.0, 10.0])
def test_mxfp4_error_estimate_matches_the_true_error(scale):
    gguf = pytest.importorskip("gguf")
    x = (np.random.default_rng(3).standard_normal((32, 256)) * scale).astype(np.float32)
    qt = gguf.GGMLQuantizationType.MXFP4
    deq = np.ascontiguousarray(gguf.quants.dequantize(gguf.quants.quantize(x, qt), qt), dtype=np.float32)
    actual = np.linalg.norm(deq - x) / np.linalg.norm(x)
    ratio = relative_error(torch.from_numpy(deq), "MXFP4") / actual
    print(f"MXFP4 error estimate / actual at scale {scale}: {ratio:.3f}")
    assert 1.0 <= ratio <= 1.15, ratio


def test_zero_blocks_and_exact_levels():
    """An all-zero tensor has no error; a zero block beside others adds none (its scale is 0); a block of 1.0s
    (S = 2^-2: 1.0 is the level 4S) is charged its grid step, 2S = 0.5, per value: e = 0.5 / sqrt(12)."""
    assert relative_error(torch.zeros(4, 64), "MXFP4") == 0.0
    ones = relative_error(torch.ones(1, 32), "MXFP4")
    assert ones == pytest.approx(0.5 / 12**0.5)
    assert relative_error(torch.cat([torch.zeros(1, 32), torch.ones(1, 32)]), "MXFP4") == pytest.approx(ones)

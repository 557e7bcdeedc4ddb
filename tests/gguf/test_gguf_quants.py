"""Dequantization must equal gguf-py's `gguf.quants.dequantize` bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_helpers import fixture_params

from mlaserve.gguf.quants import DEQUANTIZABLE, GGML_TYPES, dequantize
from mlaserve.gguf.read.file import open_gguf

gguf = pytest.importorskip("gguf")


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality; NaNs only need to be NaN in both (their payloads may differ)."""
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    if a.shape != b.shape:
        return False
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return bool((nan_a == nan_b).all() and (a.view(np.uint32)[~nan_a] == b.view(np.uint32)[~nan_b]).all())


def test_type_table_matches_gguf_package():
    for qt in gguf.GGMLQuantizationType:
        block, size = gguf.GGML_QUANT_SIZES[qt]
        mine = GGML_TYPES[int(qt)]
        assert (mine.name, mine.block_size, mine.type_size) == (qt.name, block, size)


@pytest.mark.parametrize("model,qtype,path", fixture_params())
def test_every_fixture_tensor_dequantizes_exactly(model, qtype, path):
    reader = gguf.GGUFReader(path)
    gf = open_gguf(path)
    seen = set()
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        mine = gf.tensor(t.name)
        assert mine.dtype == torch.float32
        assert _same_bits(mine.numpy(), ref), f"{path.name}: {t.name} ({t.tensor_type.name}) differs"
        seen.add(t.tensor_type.name)
    assert seen, "no tensors"


@pytest.mark.parametrize("type_id", sorted(DEQUANTIZABLE), ids=lambda i: GGML_TYPES[i].name)
def test_random_blocks_dequantize_exactly(type_id):
    """Random bytes cover every bit pattern of scales and quants (incl. fp16 inf/nan/subnormal)."""
    t = GGML_TYPES[type_id]
    rng = np.random.default_rng(type_id)
    rows, row_len = 6, t.block_size * 8
    raw = rng.integers(0, 256, size=rows * row_len // t.block_size * t.type_size, dtype=np.uint8)
    qt = gguf.GGMLQuantizationType(type_id)
    with np.errstate(all="ignore"):  # random fp16 scales include inf/nan
        ref = gguf.quants.dequantize(raw.reshape(rows, -1), qt)
    mine = dequantize(torch.from_numpy(raw.copy()), type_id, (rows, row_len))
    assert mine.shape == (rows, row_len)
    assert _same_bits(mine.numpy(), ref)


@pytest.mark.parametrize("type_id", [2, 3, 6, 7, 8, 30], ids=lambda i: GGML_TYPES[i].name)
def test_quantized_realistic_values_roundtrip(type_id):
    """Values quantized by gguf-py (it has no K-quant quantizers) dequantize identically."""
    qt = gguf.GGMLQuantizationType(type_id)
    x = np.random.default_rng(7).standard_normal((4, 512)).astype(np.float32)
    q = gguf.quants.quantize(x, qt)
    ref = gguf.quants.dequantize(q, qt)
    mine = dequantize(torch.from_numpy(np.ascontiguousarray(q)), type_id, (4, 512))
    assert _same_bits(mine.numpy(), ref)
    assert np.abs(mine.numpy() - x).max() < 0.6  # sanity: it is an approximation of x


def test_unsupported_type_raises():
    t = GGML_TYPES[40]  # NVFP4 (the i-quants are decoded now: tests/gguf/test_gguf_iquants.py)
    with pytest.raises(NotImplementedError, match="NVFP4"):
        dequantize(torch.zeros(t.type_size, dtype=torch.uint8), t.id, (1, t.block_size))

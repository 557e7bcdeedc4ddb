"""Attention over an 8-bit cache (kv_cache_dtype int8 / fp8_e4m3) or a 16-bit one (float16 / bfloat16: the whole
row [c_kv | k_pe] rounded, u = 2^-11 / 2^-8 per stored value, config/row_format.py), on the backend harness's
inputs (test_attention_backends.py: scattered pages, two decodes and two prompt chunks, one after cached context).

1. Every registered backend over the 8-bit cache == the reference over the same 8-bit cache (fp32 rounding:
   FP32_TOL, the harness's bound for two fp32 computations of the same sums in another order).
2. The reference over the 8-bit cache vs over the full cache: within the bound derived from the stored scales
   (attention/cache_error.py, from cache/quantized_rows.py error_bound) + FP32_TOL for the two fp32 runs. Not
   tuned: it is computed per output value from the rows, the queries and the scales; the measured error is
   printed next to it, and rows read one slot off break it (the bound is not vacuous).
3. DSA: index_topk over FP8 keys with a scale per token, every backend == the reference over the same keys (the
   set, compared by the dequantized keys' exact scores, as the harness compares sets).
Every backend that reads 8-bit rows: `triton` does not (the engine refuses kv_cache_dtype with it at config time,
tests/identities/test_triton_attention.py test_option_resolution; its kernels' caller raises on such a cache, below).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_attention_backends import DN, FP32_TOL, NAMES, REF, TOPK, Case, _as_mask, _case, _check, _selection

from mlaserve.attention.backends import BACKENDS
from mlaserve.attention.cache_error import attention_error_bound
from mlaserve.cache.quantized_rows import QuantizedRows
from mlaserve.config.row_format import index_key_format, latent_format

CODES = ["int8", "fp8_e4m3", "float16", "bfloat16"]
EIGHT_BIT = [n for n in NAMES if n != "triton"]
OPS = ["absorbed", "decompressed", "sparse_absorbed", "sparse_decompressed"]


def _eight_bit(c: Case, codes: str) -> Case:
    """The same case with its cache rows (and index keys) stored in 8 bits (or 16: the keys then in 16 too)."""
    r, dr = c.w_uk.shape[-1], c.q_pe.shape[-1]
    cache = QuantizedRows.of(c.cache, latent_format(codes, r + dr, dr))
    keys = QuantizedRows.of(c.keys, index_key_format(c.keys.shape[1], codes))
    return Case(**{**c.__dict__, "cache": cache, "keys": keys})


def _run(op: str, backend, c: Case, seg, index, valid) -> torch.Tensor:
    if op == "absorbed":
        return backend.absorbed(c.q_nope, c.q_pe, c.cache, c.w_uk, c.w_uv, seg, c.scale)
    if op == "decompressed":
        return backend.decompressed(c.q_nope, c.q_pe, c.cache, c.kv_b, seg, c.scale, DN)
    if op == "sparse_absorbed":
        return backend.sparse_absorbed(c.q_nope, c.q_pe, c.cache, c.w_uk, c.w_uv, seg, c.scale, index, valid)
    return backend.decompressed(c.q_nope, c.q_pe, c.cache, c.kv_b, seg, c.scale, DN, _as_mask(seg, index, valid))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("name", EIGHT_BIT)
def test_backend_over_8bit_equals_reference_over_8bit(name, codes, op):
    c = _eight_bit(_case(0, torch.float32, "cpu"), codes)
    for i, seg in enumerate(c.segments(name)):
        index, valid = _selection(seg, i)
        _check(_run(op, BACKENDS[name], c, seg, index, valid), _run(op, REF, c, seg, index, valid), seg, torch.float32)


def _bound(full: Case, eight: Case, seg, allowed) -> torch.Tensor:
    rows = full.cache[seg.kv_slots]
    delta = eight.cache.error(seg.kv_slots)
    return attention_error_bound(full.q_nope, full.q_pe, rows, delta, full.w_uk, full.w_uv, seg, full.scale, allowed)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_8bit_vs_full_within_the_derived_bound(seed, codes, op):
    full = _case(seed, torch.float32, "cpu")
    eight = _eight_bit(full, codes)
    worst = 0.0
    for i, seg in enumerate(full.segments("reference")):
        index, valid = _selection(seg, i)
        allowed = _as_mask(seg, index, valid) if op.startswith("sparse") else None
        got = _run(op, REF, eight, seg, index, valid)[seg.q_valid]
        want = _run(op, REF, full, seg, index, valid)[seg.q_valid]
        bound = _bound(full, eight, seg, allowed)[seg.q_valid]
        err = (got - want).abs()
        assert bool((err <= bound + FP32_TOL).all()), (err - bound).max().item()
        assert err.max() > 0  # the 8-bit (16-bit) rows really differ
        worst = max(worst, (err / bound).max().item())
    print(f"{codes} {op}: worst error / bound {worst:.3f}")


@pytest.mark.parametrize("codes", CODES)
def test_the_bound_sees_rows_one_slot_off(codes):
    """The 8-bit cache read one slot off (an off-by-one in a write or a gather) breaks the bound for some output:
    it is no blanket allowance, though a worst case over the signs of the per-value errors (sum_j |q_lat_j|
    delta_j), so it sits well above the typical error of independent roundings (printed above)."""
    full = _case(0, torch.float32, "cpu")
    eight = _eight_bit(full, codes)
    seg = full.segments("reference")[1]
    off = replace(seg, kv_slots=(seg.kv_slots + 1) % full.cache.shape[0])
    got = _run("absorbed", REF, eight, off, None, None)[seg.q_valid]
    want = _run("absorbed", REF, full, seg, None, None)[seg.q_valid]
    bound = _bound(full, eight, seg, None)[seg.q_valid]
    assert bool(((got - want).abs() > bound + FP32_TOL).any()), ((got - want).abs() / bound).max()


@pytest.mark.parametrize("codes", ["int8", "float16"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", EIGHT_BIT)
def test_index_topk_over_fp8_keys_equals_reference(name, seed, codes):
    c = _eight_bit(_case(seed, torch.float32, "cpu"), codes)
    want_fmt = ("fp8_e4m3", 1) if codes == "int8" else ("float16", 0)  # FP8 + a scale per key, or 16 bits
    assert isinstance(c.keys, QuantizedRows) and (c.keys.fmt.codes, c.keys.fmt.scales) == want_fmt
    for seg in c.segments(name, torch.float32):
        got = BACKENDS[name].index_topk(c.q_idx, c.w, c.keys, seg, TOPK)
        want = REF.index_topk(c.q_idx, c.w, c.keys, seg, TOPK)
        keys = c.keys.rows(seg.kv_slots)  # the dequantized keys both scored
        q = c.q_idx[seg.q_index]
        exact = torch.einsum("bqh,bqhl->bql", c.w[seg.q_index], torch.einsum("bqhd,bld->bqhl", q, keys).relu())
        exact = exact.masked_fill(~seg.mask, float("-inf"))
        chosen = [exact.gather(2, i).sort(dim=-1).values[seg.q_valid] for i in (got, want)]
        torch.testing.assert_close(chosen[0], chosen[1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("codes", ["int8", "float16"])
def test_triton_refuses_8bit_rows(codes):
    c = _eight_bit(_case(0, torch.float32, "cpu"), codes)
    seg = c.segments("triton")[0]
    with pytest.raises(TypeError, match="kv_cache_dtype is not supported with attention_backend='triton'"):
        BACKENDS["triton"].absorbed(c.q_nope, c.q_pe, c.cache, c.w_uk, c.w_uv, seg, c.scale)

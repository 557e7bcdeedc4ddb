"""Tensor parallelism over an 8-bit (or 16-bit) cache: every rank resolves the same kv_cache_dtype (rank 0 compares the echoed
configurations), keeps the whole 8-bit cache (replicated, as the full one), and TP=2 writes the same rows as one
process up to boundary flips (each within both rows' bounds), with one process's logits to fp32 rounding where
no code flipped (FP32_LOGITS_TOL, as tests/distributed/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
from conftest import FP32_LOGITS_TOL
from hf_models import random_ids
from test_kv8_engine import _compare_caches

from mlaserve import LLM
from mlaserve.cache.quantized_rows import QuantizedRows


@pytest.mark.parametrize("codes", ["int8", "float16"])
def test_tp2_over_8bit_rows_equals_one_process(hf_model_dir, codes):
    folder, _ = hf_model_dir("v32")
    ids = random_ids(30, seed=6)  # > index_topk 16: FP8 (float16) keys select
    opts = dict(kv_cache_dtype=codes, page_size=8, max_num_batched_tokens=24)
    one = LLM(str(folder), **opts)
    want = one.prompt_logits(ids)
    with LLM(str(folder), tensor_parallel_size=2, **opts) as split:
        got = split.prompt_logits(ids)
        assert isinstance(split.runner.cache.layers[0].latent, QuantizedRows)
        assert all(e["config"]["cache.kv_cache_dtype"] == repr(codes) for e in split.runner.rank_echoes)
        flips = _compare_caches(split, one, len(ids))
    diff = (got - want).abs().max().item()
    print(f"TP=2 {codes}: {flips} codes flipped, max |logit diff| {diff:.3g}")
    if not flips:
        assert diff <= FP32_LOGITS_TOL

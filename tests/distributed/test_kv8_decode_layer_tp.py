"""Tensor parallelism with the one-call decode layers over an 8-bit cache (kv_cache_dtype int8, ds3 Q8_0 GGUF):
every rank keeps the whole 8-bit cache and runs each decoder layer's decode step as one native call over it (its
reduce hook sums o_proj's and the MLP's partial outputs), and TP=2's decode-step logits equal one process's
(which runs the same calls) to fp32 rounding, FP32_LOGITS_TOL, where no code flipped: the ranks' partial sums
add in another order, so a row one rounding apart may take a neighbouring code (each within its bound)."""

from __future__ import annotations

import pytest
import torch
from conftest import FP32_LOGITS_TOL, compare_logits, fixture_dir
from test_tp_quantized import _decode_step

from mlaserve import LLM
from mlaserve.cache.quantized_rows import QuantizedRows
from mlaserve.kernels import native

pytestmark = pytest.mark.skipif(not native.status().available, reason="native kernels unavailable")


def test_tp2_one_call_layers_over_8bit_rows_equal_one_process():
    path = fixture_dir("ds3") / "model-q8_0.gguf"
    if not path.exists():
        pytest.skip("../shared/fixtures/ds3 has no q8_0 file")
    opts = dict(kv_cache_dtype="int8", max_num_batched_tokens=40)
    exp_ids = list(range(3, 83))
    seqs = [exp_ids[:50], exp_ids[:70], exp_ids]
    one = LLM(str(path), **opts)
    base = _decode_step(one, seqs)
    with LLM(str(path), tensor_parallel_size=2, trace="memory", **opts) as two:
        start = len(two.runner.tracer.records)
        got = _decode_step(two, seqs)
        last = [r for r in list(two.runner.tracer.records)[start:] if r["num_decode_tokens"] == 3]
        assert sorted(r["rank"] for r in last) == [0, 1], last
        assert all(r["kernels"]["decode_layer"] == "native" and r["kv_cache"] == "int8" for r in last), last
        assert isinstance(two.runner.cache.layers[0].latent, QuantizedRows)
        rows = [(s.codes.clone(), s.scales.clone()) for s in two.runner.cache.state("latent")]
    ref = [(s.codes, s.scales) for s in one.runner.cache.state("latent")]
    flips = sum(int((a[0] != b[0]).sum()) for a, b in zip(rows, ref))
    diff, top1 = compare_logits(got, base)
    print(f"TP=2 one-call int8: {flips} codes flipped, max |logit diff| {diff:.3g}, top-1 {top1}")
    assert flips <= 1e-3 * sum(int((b[1] != 0).any(-1).sum()) * b[0].shape[1] for b in ref)
    if not flips:
        assert diff <= FP32_LOGITS_TOL and top1 == 1.0
    assert torch.isfinite(got).all()

"""`mlaserve verify` with an 8-bit cache: the 8-bit-vs-full checks pass on a correct model, report the logits and
the DSA top-k agreement, keep the route identities (run over the full cache), and catch a dequantizer that is off.
"""

from __future__ import annotations

import pytest
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.cache import quantized_rows
from mlaserve.entrypoints.verify import format_checks, run_checks


def test_verify_with_an_8bit_cache_passes_and_reports(hf_model_dir):
    folder, _ = hf_model_dir("glm_dsa")
    checks = run_checks(LLM(str(folder), kv_cache_dtype="int8"), random_ids(40))
    print(format_checks(checks))
    by_name = {c.name: c for c in checks}
    attention = by_name["8-bit cache (int8) vs full: attention, every layer"]
    assert attention.passed and attention.tolerance == 1.0 and 0 < attention.max_abs_diff <= 1.0
    assert "over 3 attention calls" in attention.note  # one prefill step, three layers
    logits = by_name["8-bit cache (int8) vs full: logits"]
    assert logits.tolerance is None and logits.max_abs_diff > 1e-5  # reported; the cache really is 8-bit
    topk = by_name["top-k from FP8 index keys vs exact keys"]
    assert topk.tolerance is None and "selecting queries" in topk.note and 0.5 < topk.top1_agreement <= 1.0
    identities = [c for c in checks if c.tolerance == 1e-4]  # the route identities, judged at fp32
    assert len(identities) == 7 and all(c.passed for c in identities)  # as without the option (test_verify.py)
    assert "FAIL" not in format_checks(checks)


def test_verify_without_the_option_has_no_8bit_checks(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    assert not any("8-bit" in c.name for c in run_checks(LLM(str(folder)), random_ids(24)))


@pytest.mark.parametrize("codes,factor", [("int8", 1.2), ("fp8_e4m3", 2.0)])
def test_verify_catches_a_dequantizer_that_is_off(hf_model_dir, monkeypatch, codes, factor):
    """Rows read back with scales 20% too large (int8) or a power of two off (e4m3: an exponent slip, as a
    scale of the wrong block or format gives) break the derived bound. Measured on this model and prompt
    (worst |error| / bound): int8 0.02 -> 0.21 / 0.53 / 2.1 at 2% / 5% / 20% off; e4m3 0.03 -> 0.37 / 0.91 / 1.8
    at 20% / 50% / 2x. The bound is a worst case over the errors' signs, so smaller systematic slips stay
    inside it: the bit-exact tests (tests/unit/test_quantized_rows.py) are what pin the dequantizer."""
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder), kv_cache_dtype=codes)
    real = quantized_rows.dequantize
    monkeypatch.setattr(quantized_rows, "dequantize", lambda c, s, fmt: real(c, s * factor, fmt))
    (attention,) = [c for c in run_checks(llm, random_ids(24)) if c.name.endswith("attention, every layer")]
    assert not attention.passed and attention.max_abs_diff > 1.0


@pytest.mark.parametrize("codes,slip", [("float16", 2**-6), ("bfloat16", 2**-4)])
def test_verify_with_a_16bit_cache_passes_and_catches_a_widening_that_is_off(hf_model_dir, monkeypatch, codes, slip):
    """The 16-bit cache's checks (the bound from the unit roundoff, k_pe's rounding in the score error) pass on a
    correct model, name the layout, and fail when the stored rows are read back `slip` too large (32 ulps of
    float16, 16 of bfloat16). Measured worst |error| / bound: float16 0.04 correct; bfloat16 0.04 correct, 0.39 at
    2^-6 off: the bound is a worst case over the errors' signs, so a systematic slip must exceed it to show."""
    folder, _ = hf_model_dir("glm_dsa")
    llm = LLM(str(folder), kv_cache_dtype=codes)
    checks = run_checks(llm, random_ids(40))
    by_name = {c.name: c for c in checks}
    attention = by_name[f"16-bit cache ({codes}) vs full: attention, every layer"]
    assert attention.passed and 0 < attention.max_abs_diff <= 1.0 and "over 3 attention calls" in attention.note
    assert f"top-k from {codes} index keys vs exact keys" in by_name
    real = quantized_rows.QuantizedRows.rows
    monkeypatch.setattr(quantized_rows.QuantizedRows, "rows", lambda self, s: real(self, s) * (1 + slip))
    (attention,) = [c for c in run_checks(llm, random_ids(40)) if c.name.endswith("attention, every layer")]
    assert not attention.passed and attention.max_abs_diff > 1.0

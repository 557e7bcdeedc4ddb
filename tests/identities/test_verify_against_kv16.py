"""`verify --against` with a rounded cache (kv_cache_dtype): the error the cache rows add to each teacher-forced
attention block is reported beside the file's own quantization error e(X) (the rule for a lossy default), and a
run without the option reports none.

Measured on ds3 (52-token prompt): float16 adds 2.0-2.8e-4 to the attention blocks, 0.7-1.0% of the Q8_0 file's
e(X) 2.7e-2 and 0.07-0.1% of Q4_K_M's 0.28; bfloat16 1.7-2.3e-3 (6-8% of Q8_0's). The assertion below is the
rule's condition (cache well inside e, taken as <= e / 10 for float16) and cache > 0 (the rows really are 16-bit).
"""

from __future__ import annotations

import pytest
from conftest import fixture_dir

from mlaserve.entrypoints.against_report import format_report, to_json
from mlaserve.entrypoints.verify_against import compare, encode_prompt, open_side

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


@pytest.fixture(scope="module")
def ds3():
    src = fixture_dir("ds3")
    if not (src / "model-q8_0.gguf").exists():
        pytest.skip("../shared/fixtures/ds3 has no q8_0 file")
    return {"dir": src, "hf": open_side(str(src))}


@pytest.mark.parametrize("gtype", ["q8_0", "q4_k_m"])
def test_float16_cache_error_is_reported_well_inside_the_files_own(ds3, gtype):
    model = open_side(str(ds3["dir"] / f"model-{gtype}.gguf"), kv_cache_dtype="float16")
    ids, _ = encode_prompt(model, ds3["hf"], PROMPT)
    report = compare(model, ds3["hf"], ids)
    assert set(report.cache_error) == {f"layer.{i}.attn" for i in range(3)}
    for block, err in report.cache_error.items():
        e = report.file_error[block]
        assert 0 < err <= e / 10, (block, err, e)
    assert "cache rows in float16" in format_report(report)
    assert to_json(report)["cache_error"]["layer.0.attn"]["file_error"] > 0


def test_no_cache_error_without_the_option(ds3):
    model = open_side(str(ds3["dir"] / "model-q8_0.gguf"))
    ids, _ = encode_prompt(model, ds3["hf"], PROMPT)
    report = compare(model, ds3["hf"], ids)
    assert report.cache_error == {} and report.kv_cache_dtype == "auto"

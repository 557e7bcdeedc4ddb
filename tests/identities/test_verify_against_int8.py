"""`verify --against` with int8 activations: both copies are judged on exact products (the files are compared),
and the error int8 activations add is reported per block beside the file's own quantization error e(X).

Measured on ds3 q4_k_m (107 tokens): act(X) 7e-3 .. 1.1e-2 on the attention and MoE blocks against e(X) 0.24 ..
0.41, and 7.2e-3 on the logits (lm_head Q6_K, e 1.9e-2): the rule's condition (act well inside e, taken as
act <= e / 2) holds everywhere. act > 0 shows the int8 products really ran.
"""

from __future__ import annotations

import pytest
from conftest import fixture_dir

from mlaserve.entrypoints.against_report import format_report, to_json
from mlaserve.entrypoints.verify_against import compare, encode_prompt, open_side
from mlaserve.kernels import native

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2
pytestmark = pytest.mark.skipif(not native.status().available, reason="native kernels unavailable")


@pytest.fixture(scope="module")
def ds3():
    src = fixture_dir("ds3")
    return {"dir": src, "hf": open_side(str(src))}


def _compare(model, against):
    ids, _ = encode_prompt(model, against, PROMPT)
    return compare(model, against, ids)


def test_q4_k_m_reports_the_activation_error_inside_the_files_own(ds3):
    model = open_side(str(ds3["dir"] / "model-q4_k_m.gguf"))
    assert model.activations == "int8_6bit" and model.llm.config.kernels.activations == "float"
    report = _compare(model, ds3["hf"])
    assert report.passed  # judged on exact products, as before
    want = {f"layer.{i}.{p}" for i in range(3) for p in ("attn", "mlp")} | {"logits"}
    assert set(report.activation_error) == want
    for block, act in report.activation_error.items():
        e = report.file_error[block]
        assert 0 < act <= e / 2, (block, act, e)
    text = format_report(report)
    assert "int8 activations (int8_6bit)" in text and "layer.1.mlp" in text
    out = to_json(report)
    assert out["activations"] == "int8_6bit" and out["activation_error"]["logits"]["file_error"] > 0


def test_float_and_q8_0_report_no_activation_error(ds3):
    exact = _compare(open_side(str(ds3["dir"] / "model-q4_k_m.gguf"), activations="float"), ds3["hf"])
    assert exact.activations == "float" and exact.activation_error == {}
    q8 = _compare(open_side(str(ds3["dir"] / "model-q8_0.gguf")), ds3["hf"])
    assert q8.activations == "int8_6bit" and q8.activation_error == {}  # no Q8_0 product takes int8 by default
    forced = _compare(open_side(str(ds3["dir"] / "model-q8_0.gguf"), activations="int8"), ds3["hf"])
    assert set(forced.activation_error) >= {"layer.0.attn", "layer.2.mlp", "logits"}
    print("\nq8_0 with int8:", {b: f"{v:.1e}/{forced.file_error[b]:.1e}" for b, v in forced.activation_error.items()})

"""The one-call decode layers under the default activations of a Q4_K_M file (int8_6bit): the fused path and the
per-op path quantize the same activations (q8_K for Q4_K / Q6_K, none for the Q5_0 / Q8_0 / F32 tensors the
file also holds) with the same kernels, so they agree to fp32 rounding (the bound and its reason as in
test_decode_layer.py), not merely to the int8 error; a holder and the C struct disagreeing on one type's
activations (takes_int8 vs q8rows_in) shows as that error, ~1e-2."""

from __future__ import annotations

import pytest
from test_decode_layer import NATIVE, PROMPTS, _llm, _max_diff, _run

pytestmark = pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")


@pytest.mark.parametrize("name", ["ds3", "ds2lite"])
def test_native_layers_equal_the_per_op_path_with_int8_k_quants(name, monkeypatch):
    llm = _llm(name, "q4_k_m")
    assert llm.config.kernels.activations == "int8_6bit"
    model = llm.runner.model
    assert all(layer.native_layer is not None for layer in model.model.layers) and model.native_decode is not None
    assert all(layer.native_layer.args.int8 == 6 for layer in model.model.layers)
    tok_a, lp_a, calls = _run(llm, PROMPTS, monkeypatch)
    assert calls >= 9 * len(model.model.layers)
    native_decode, model.native_decode = model.native_decode, None
    tok_b, lp_b, calls_b = _run(llm, PROMPTS, monkeypatch)
    model.native_decode = native_decode
    assert calls_b == 0 and tok_a == tok_b
    diff = _max_diff(lp_a, lp_b)
    print(f"\n{name} q4_k_m int8_6bit: native layers vs per-op max |dlogprob| {diff:.2e}")
    assert diff <= 1e-5, diff

"""Decoder layers run as one native call per pure decode step (quant.ggml_layer.GGUFDecodeLayer, blocks.c
mls_decode_layer) against their per-op path, on llama.cpp's GGUF fixtures (../shared/fixtures/).

The native layer repeats the per-op native path's operations in C, so the two differ only where that path leaves
C: torch's silu in a dense SwiGLU, and the MoE block's gate logits / shared silu (tests/kernels/test_moe_block.py); the
logits then agree to fp32 rounding (1e-5 on these fixtures' log-probabilities, as tests/gguf/test_gguf_quantized.py
holds the native kernels to the dequantized file). Requests of different lengths decode together, so each
request's own rows and mask are exercised, and a one-token prompt is decoded from its first step."""

from __future__ import annotations

import pytest
from conftest import fixture_dir

from mlaserve import LLM
from mlaserve.kernels import native, native_layers
from mlaserve.observability.capture import Capture
from mlaserve.sampling.params import SamplingParams

NATIVE = native.status()
pytestmark = pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")
# ds3: q_lora, a dense first layer, sigmoid / noaux_tc MoE; ds2lite: q_proj (no q_lora), softmax greedy MoE
FILES = [("ds3", "q8_0"), ("ds3", "q4_0"), ("ds3", "q4_k_m"), ("ds2lite", "q8_0"), ("ds2lite", "q4_k_m")]
PROMPTS = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [8], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]


def _llm(name: str, gtype: str, **kw) -> LLM:
    path = fixture_dir(name) / f"model-{gtype}.gguf"
    if not path.exists():
        pytest.skip(f"../shared/fixtures/{name} has no {gtype} file")
    return LLM(str(path), kernels="native", **kw)


def _run(llm: LLM, prompts: list[list[int]], monkeypatch) -> tuple[list, list, int]:
    calls = []
    real, real_stack = native_layers.decode_layer, native_layers.decode_layers
    monkeypatch.setattr(native_layers, "decode_layer", lambda *a: calls.append(1) or real(*a))
    # the layers' calls in one (GGUFDecodeStack): one per layer
    monkeypatch.setattr(native_layers, "decode_layers", lambda s, *a: calls.extend([1] * s.n) or real_stack(s, *a))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    monkeypatch.setattr(native_layers, "decode_layer", real)
    monkeypatch.setattr(native_layers, "decode_layers", real_stack)
    return [o.token_ids for o in outs], [[sorted(s.values()) for s in o.logprobs] for o in outs], len(calls)


@pytest.mark.parametrize(
    "name,gtype,activations", [(*f, "float") for f in FILES] + [("ds3", "q8_0", "int8"), ("ds3", "q4_0", "int8")]
)
def test_native_layers_equal_the_per_op_path(name, gtype, activations, monkeypatch):
    """float: the same products (fp32 rounding apart); int8: within the int8 error (below: flipped codes)."""
    llm = _llm(name, gtype, activations=activations)
    model = llm.runner.model
    layers = model.model.layers
    assert all(layer.native_layer is not None for layer in layers) and model.native_decode is not None
    assert any("decoder layer(s) run pure decode steps" in n for n in llm.loaded.report.notes)
    tok_a, lp_a, calls = _run(llm, PROMPTS, monkeypatch)
    # 9 decode steps of 4 requests after the prompts' step (whose one-token prompt rides in a prefill step)
    assert calls >= 9 * len(layers) and calls % len(layers) == 0
    native_decode, model.native_decode = model.native_decode, None
    tok_b, lp_b, calls_b = _run(llm, PROMPTS, monkeypatch)
    model.native_decode = native_decode
    assert calls_b == 0 and tok_a == tok_b
    diff = _max_diff(lp_a, lp_b)
    print(f"{name} {gtype} {activations}: native layers vs per-op max |dlogprob| {diff:.2e}")
    if activations == "float":  # the same products, summed in another order: fp32 rounding (measured <= 1e-6)
        assert diff <= 1e-5, diff
        return
    # int8: both paths quantize their activations with the same kernels, but their fp32 inputs differ by rounding
    # (torch's vectorized SiLU vs the C layer's libm expf, sums in another order: ~1e-7), and an activation within
    # that of a rounding boundary takes the neighbouring code in one path: one flipped code moves the logprobs by
    # ~1e-2 (measured 1.2e-2 on ds3 Q4_0 on an AVX-512 Xeon, where it happens; 9.5e-7 on an AMD EPYC, where it did
    # not). A flip is one step of the activations' quantization, a small part of the int8 error itself, so the two
    # int8 paths must agree within the int8 error measured on the same prompts (int8 against exact float
    # activations): a fault of the native layer (a wrong row, scale or block) moves them by far more than that.
    _, lp_f, _ = _run(_llm(name, gtype, activations="float"), PROMPTS, monkeypatch)
    int8_error = _max_diff(lp_b, lp_f)
    print(f"{name} {gtype}: int8 vs float activations (per-op) max |dlogprob| {int8_error:.2e}")
    assert 0 < int8_error and diff <= int8_error, (diff, int8_error)


def _max_diff(lp_a: list, lp_b: list) -> float:
    return max(abs(a - b) for ra, rb in zip(lp_a, lp_b) for sa, sb in zip(ra, rb) for a, b in zip(sa, sb))


def test_one_token_prompt_decodes_natively_from_its_first_step(monkeypatch):
    """A single-token prompt is a decode step (context 0, one key: its own row, written first)."""
    llm = _llm("ds3", "q8_0")
    n = len(llm.runner.model.model.layers)
    tok_a, lp_a, calls = _run(llm, [[8]], monkeypatch)
    assert calls == 10 * n  # every step, the first included
    llm.runner.model.native_decode = None
    tok_b, lp_b, _ = _run(llm, [[8]], monkeypatch)
    assert tok_a == tok_b
    assert max(abs(a - b) for sa, sb in zip(lp_a[0], lp_b[0]) for a, b in zip(sa, sb)) <= 1e-5


def test_where_the_native_layers_do_not_run(monkeypatch):
    """Not attached: the torch kernels, W_UK / W_UV without blocks (glm5's are F16). Attached but not run: prefill
    steps and layers under forward hooks (observability.capture must see every sub-block). Sparse (DSA) decode
    steps do run them (tests/kernels/test_decode_layer_sparse.py holds them to the per-op path)."""
    llm = LLM(str(fixture_dir("ds3") / "model-q8_0.gguf"), kernels="torch")
    assert all(layer.native_layer is None for layer in llm.runner.model.model.layers)
    assert llm.runner.model.native_decode is None
    glm5 = fixture_dir("glm5") / "model-q8_0.gguf"
    assert glm5.exists(), glm5  # the fixtures README lists it; a missing file is a broken fixture, not a skip
    llm = LLM(str(glm5), kernels="native")
    assert all(layer.native_layer is None for layer in llm.runner.model.model.layers)
    n = len(llm.runner.model.model.layers)  # the load report says which layers and why
    assert (
        f"decoder layer(s) 0-{n - 1} decode per op: attention without the native kernels or without attn_k_b / attn_v_b blocks"
        in llm.loaded.report.notes
    )
    ds32 = fixture_dir("ds32") / "model-q8_0.gguf"
    assert ds32.exists(), ds32
    llm = LLM(str(ds32), kernels="native")  # attention auto: sparse on a DSA model
    assert llm.runner.model.native_decode is not None
    _, _, calls = _run(llm, PROMPTS[:2], monkeypatch)
    assert calls > 0
    dense = LLM(str(ds32), kernels="native", attention="dense")
    _, _, calls = _run(dense, PROMPTS[:2], monkeypatch)
    assert calls > 0
    llm = _llm("ds3", "q8_0")
    _, _, calls = _run(llm, [list(range(3, 40))], monkeypatch)
    n = len(llm.runner.model.model.layers)
    assert calls == 9 * n  # the 37-token prompt's prefill step took the per-op path
    with Capture(llm.runner.model) as acts:
        _, _, calls = _run(llm, [[5, 9, 2, 7]], monkeypatch)
    assert calls == 0 and acts.tensors


@pytest.mark.parametrize("name,gtype", [("ds3", "q4_k_m"), ("ds2lite", "q8_0")])
def test_the_layers_in_one_call_equal_their_calls_one_by_one(name, gtype, monkeypatch):
    """GGUFDecodeStack (mls_decode_layers) runs each layer's own C code in order, so a pure decode step gives the same
    bits as the layers' calls one by one; a replaced native layer is picked up (a new stack), and a layer under a
    hook takes the per-layer path (tested above: test_where_the_native_layers_do_not_run)."""
    llm = _llm(name, gtype, trace="memory")
    model = llm.runner.model
    n = len(model.model.layers)
    stacked: list[int] = []
    real = native_layers.decode_layers
    monkeypatch.setattr(native_layers, "decode_layers", lambda s, *a: stacked.append(s.n) or real(s, *a))

    def calls_recorded() -> list:  # the ledger's decode_calls of the native steps since the last look
        recs = [r["kernels"] for r in llm.runner.tracer.records]
        llm.runner.tracer.records.clear()
        return [k["decode_calls"] for k in recs if k["decode_layer"] == "native"]

    tok_a, lp_a, calls = _run(llm, PROMPTS, monkeypatch)
    assert len(stacked) >= 9 and set(stacked) == {n} and calls == n * len(stacked)
    assert calls_recorded() == ["one"] * len(stacked)  # the ledger names the one call, decided before the step
    stacks, model.native_stack = model.native_stack, None  # layer by layer
    stacked.clear()
    tok_b, lp_b, calls_b = _run(llm, PROMPTS, monkeypatch)
    assert not stacked and calls_b == calls
    assert tok_a == tok_b and lp_a == lp_b  # the same bits
    assert set(calls_recorded()) == {"per_layer"}
    model.native_stack = stacks
    handle = model.model.layers[-1].register_forward_hook(lambda *a: None)
    try:  # a hooked layer: the other layers' calls one by one, said so
        _run(llm, PROMPTS, monkeypatch)
    finally:
        handle.remove()
    assert not stacked and set(calls_recorded()) == {"per_layer"}
    model.native_stack = stacks
    first = stacks([layer.native_layer for layer in model.model.layers])
    model.model.layers[0].native_layer = type(first.layers[0])(model.model.layers[0], first.layers[0].args.interleaved)
    assert stacks([layer.native_layer for layer in model.model.layers]) is not first
    tok_c, lp_c, _ = _run(llm, PROMPTS, monkeypatch)
    assert tok_c == tok_a and lp_c == lp_a

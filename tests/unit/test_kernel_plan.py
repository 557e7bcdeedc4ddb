"""The kernel registry and the KernelPlan: every module that performs an op gets one implementation, chosen at
load with its reason; a check that fails moves that module (and the fused blocks that need it) to the
reference with the reason recorded, never to an error at run time; the ledger names the plan and says per
step whether the decoder layers ran as one native call."""

from __future__ import annotations

import pytest
import torch
from conftest import fixture_dir

from mlaserve import LLM, SamplingParams
from mlaserve.kernels import native, registry
from mlaserve.observability.trace import MemoryTracer

NATIVE = native.status()
needs_native = pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")
PROMPTS = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [8]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


def _gguf(name: str, gtype: str = "q8_0") -> str:
    return str(fixture_dir(name) / f"model-{gtype}.gguf")


def _ops(model: torch.nn.Module) -> list[tuple[str, str]]:
    return [(n, m.KERNEL_OP) for n, m in model.named_modules() if getattr(m, "KERNEL_OP", None)]


def test_every_op_module_has_one_choice(hf_model_dir):
    llm = LLM(str(hf_model_dir("glm_dsa")[0]))
    plan = llm.loaded.kernel_plan
    assert sorted((c.module, c.op) for c in plan.choices) == sorted(_ops(llm.runner.model))
    # float weights on the torch kernels: the reference everywhere, saying why
    assert {(c.impl, c.reason) for c in plan.choices if c.op in registry.MODULE_OPS and c.op != "latent_write"} == {
        ("torch", "not native: engine kernels=torch")
    }
    # the latent write has a Triton kernel too: why not (no GPU, or the interpreter not asked for), then native
    why_not = registry._triton_latent(llm.runner.model.model.layers[0].self_attn, registry.KernelContext("torch", 0))
    assert {(c.impl, c.reason) for c in plan.choices if c.op == "latent_write"} == {
        ("torch", f"not triton: {why_not}; not native: engine kernels=torch")
    }
    assert {c.impl for c in plan.choices if c.op in ("moe_block", "decode_layer")} == {"per_op"}


@needs_native
def test_plan_of_a_gguf_on_the_native_kernels():
    llm = LLM(_gguf("ds3"), kernels="native")
    plan, model = llm.loaded.kernel_plan, llm.runner.model
    rows = {(op, impl): layers for op, impl, layers, _ in plan.summary()}
    assert rows[("decode_layer", "native")] == "0-2" and rows[("moe_block", "native")] == "1-2"
    assert rows[("router", "native")] == "1-2" and rows[("heads", "native")] == "0-2"
    # the plan is what the modules run: each module's switch / attachment as its choice says
    for c in plan.choices:
        module = model.get_submodule(c.module)
        if c.op in registry.MODULE_OPS:
            assert module.kernel == c.impl, c
        elif c.op == "moe_block":
            assert (module.native_block is not None) == (c.impl == "native"), c
        elif c.op == "mlp_rows":
            assert (module.row_part is not None) == (c.impl == "row_parts"), c
        else:
            assert (module.native_layer is not None) == (c.impl == "native"), c


@needs_native
def test_a_router_the_native_kernels_lack_falls_back_with_its_reason(monkeypatch):
    """A torch-only change to the router (here: a scoring function the C router does not know) moves the gate,
    the MoE block and the decode layers that need it to the per-op torch router, with the reason in the plan;
    the model runs and agrees with the unchanged native run to fp32 rounding (the same routing)."""
    want = LLM(_gguf("ds3"), kernels="native").generate(PROMPTS, GREEDY)
    monkeypatch.delitem(native.SCORING, "sigmoid")  # restored after the test
    llm = LLM(_gguf("ds3"), kernels="native")
    plan = llm.loaded.kernel_plan
    why = "not native: router sigmoid / noaux_tc not in the native router"
    assert {(c.layer, c.impl, c.reason) for c in plan.choices if c.op == "router"} == {
        ("1", "torch", why),
        ("2", "torch", why),
    }
    moe = {c.layer: c.reason for c in plan.choices if c.op == "moe_block"}
    assert moe == {
        i: "not native: routed experts or router not ggml blocks / INT4 experts with the native kernels" for i in "12"
    }
    dec = {c.layer: c.impl for c in plan.choices if c.op == "decode_layer"}
    assert dec == {"0": "native", "1": "per_op", "2": "per_op"}  # layer 0 is dense: no router
    got = llm.generate(PROMPTS, GREEDY)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [sorted(d.values()) for d in a.outputs[0].logprobs]
        lb = [sorted(d.values()) for d in b.outputs[0].logprobs]
        # fp32 rounding of the per-op vs the one-call path on this fixture: measured <= 2e-6 -> 1e-5
        assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-5, rtol=0)


@needs_native
@pytest.mark.parametrize("name,decodes", [("ds3", "native"), ("ds32", "native")])
def test_ledger_names_the_plan_and_the_steps_decode_layers(name, decodes):
    tracer = MemoryTracer()
    llm = LLM(_gguf(name), kernels="native", trace=tracer)
    llm.generate(PROMPTS, GREEDY)
    digest = llm.loaded.kernel_plan.digest
    assert {r["kernels"]["plan"] for r in tracer.records} == {digest}
    pure_decode = [r for r in tracer.records if r["num_tokens"] == r["num_decode_tokens"]]
    assert pure_decode and all(r["kernels"]["decode_layer"] == decodes for r in pure_decode)
    # the DSA model's native decode layers take its sparse decode steps too (indexer and top-k in the call)
    prefill = [r for r in tracer.records if r["num_tokens"] != r["num_decode_tokens"]]
    assert prefill and all(r["kernels"]["decode_layer"] == "per_op" for r in prefill)


def test_registry_refuses_unknown_ops_and_duplicates():
    with pytest.raises(ValueError, match="unknown kernel op 'matmul'"):
        registry.register("matmul", "native", registry.always, registry.set_kernel("native"))
    with pytest.raises(ValueError, match="norm: implementation 'torch' registered twice"):
        registry.register("norm", "torch", registry.always, registry.set_kernel("torch"))

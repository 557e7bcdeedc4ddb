"""The KernelPlan's choice is what a module calls (kernels/registry.py KernelSwitch): setting `kernel` binds the
chosen implementation's method, the model code calls it without comparing names; a native method's step contract
(its row limit) hands larger steps to its declared fallback, which the plan records; checks known at load (a
weight's dtype or device) are in `native_unfit`, so the plan names them instead of a step silently falling back.

The fallbacks are compared with torch.equal: a step past the limit must run exactly the fallback's code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import fixture_dir
from test_moe_block import D, make_moe

import mlaserve
from mlaserve.config.model import MoEConfig
from mlaserve.kernels import ggml, native, native_layers, panels, registry
from mlaserve.models.layers import RMSNorm
from mlaserve.models.moe import ROUTE_TOKENS, Gate
from mlaserve.quant.ggml_linear import BLOCK_TOKENS

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
NATIVE = registry.KernelContext("native", False)


def _counting(monkeypatch, owner, name: str) -> list:
    calls, real = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _gate(experts: int = 16) -> Gate:
    cfg = MoEConfig(experts, 4, 0, 32, "sigmoid", "noaux_tc", 4, 2, True, 2.5)
    gate = Gate(64, cfg)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(experts, 64, generator=torch.Generator().manual_seed(1)) * 0.1)
        gate.e_score_correction_bias.copy_(torch.randn(experts, generator=torch.Generator().manual_seed(2)) * 0.05)
    return gate


def _bound(module: torch.nn.Module, impl: str) -> None:
    """Every call the module's forward makes is the method of `impl` (bound to this module)."""
    for call, methods in type(module).KERNEL_CALLS.items():
        got = getattr(module, call)
        assert got.__self__ is module and got.__func__ is getattr(type(module), methods[impl]), (module, call)


def test_setting_kernel_binds_the_implementation():
    norm, gate = RMSNorm(8, 1e-6), _gate()
    for m in (norm, gate):
        _bound(m, "torch")  # the reference until the plan says otherwise
        m.kernel = "native"
        _bound(m, "native")
        m.kernel = "torch"
        _bound(m, "torch")
    with pytest.raises(ValueError, match=r"RMSNorm: no kernel 'cuda' \(it has native, torch\)"):
        norm.kernel = "cuda"
    _bound(norm, "torch")  # a refused name changes nothing


def test_checks_known_at_load_are_in_the_plan():
    """A bf16 norm weight or a gate off the CPU: the plan keeps the torch implementation and says why (before,
    the norm was planned native and fell back on every step)."""
    model = torch.nn.ModuleDict({"n32": RMSNorm(8, 1e-6), "n16": RMSNorm(8, 1e-6).bfloat16(), "gate": _gate()})
    model["meta_gate"] = _gate().to("meta")
    plan = registry.plan_kernels(model, NATIVE)
    got = {c.module: (c.impl, c.reason) for c in plan.choices}
    assert got == {
        "n32": ("native", "first choice, kernels=native"),
        "n16": ("torch", "not native: norm weight not fp32 on the CPU"),
        "gate": ("native", f"native up to {ROUTE_TOKENS} rows per step, else torch"),
        "meta_gate": ("torch", "not native: gate weight not on the CPU"),
    }
    for name, (impl, _) in got.items():
        _bound(model[name], impl)


@needs_native
def test_the_router_hands_steps_past_its_rows_to_torch(monkeypatch):
    gate = _gate()
    gate.kernel = "native"
    calls = _counting(monkeypatch, native, "moe_route")
    x = torch.randn(ROUTE_TOKENS + 1, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gate(x[:ROUTE_TOKENS])
        assert len(calls) == 1  # up to the limit: the C router
        w, idx = gate(x)
        assert len(calls) == 1  # past it: the torch router, exactly
        gate.kernel = "torch"
        want_w, want_idx = gate(x)
    assert torch.equal(w, want_w) and torch.equal(idx, want_idx)


@needs_native
def test_the_moe_block_hands_other_steps_to_the_per_op_path(monkeypatch):
    moe = make_moe("v3", "q8_0")
    registry.plan_kernels(moe, NATIVE)
    assert moe.native_block is not None and moe.step is moe.native_block
    calls = _counting(monkeypatch, native_layers, "moe_block")
    x = torch.randn(BLOCK_TOKENS + 1, D, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        moe(x[:BLOCK_TOKENS])
        assert len(calls) == 1
        for other in (x, x.t().contiguous().t()[:BLOCK_TOKENS]):  # past the rows; rows not contiguous
            assert torch.equal(moe(other), moe.per_op(other))
        assert len(calls) == 1
    moe.native_block = None  # the plan's per_op choice: forward calls the per-op path itself
    assert moe.step == moe.per_op


@needs_native
def test_the_experts_call_pair_by_pair_only_up_to_their_pairs(monkeypatch):
    moe = make_moe("v3", "q8_0", shared=False)
    ex = moe.experts
    assert ex.NATIVE_ROWS == ggml.MOE_PAIRS
    calls = _counting(monkeypatch, ggml, "moe_experts")
    k = moe.gate.cfg.num_experts_per_tok
    x = torch.randn(ggml.MOE_PAIRS // k + 1, D, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        w, idx = moe.gate(x)
        ex(x[: ggml.MOE_PAIRS // k], w[: ggml.MOE_PAIRS // k], idx[: ggml.MOE_PAIRS // k])
        assert len(calls) == 1
        got = ex(x, w, idx)
        assert len(calls) == 1  # more pairs: grouped by expert, each product native
        want = ex._grouped(x.float(), w, idx, ggml.expert_linear_native)
    assert torch.equal(got, want)


@pytest.mark.fixtures
@needs_native
def test_a_loaded_model_calls_what_its_plan_records():
    path = fixture_dir("ds3") / "model-q8_0.gguf"
    llm = mlaserve.LLM(str(path), kernels="native")
    plan, model = llm.loaded.kernel_plan, llm.runner.model
    seen = set()
    for c in plan.choices:
        module = model.get_submodule(c.module)
        if c.op in registry.MODULE_OPS:
            _bound(module, c.impl)
            seen.add((c.op, c.impl))
        elif c.op == "moe_block":
            assert module.step is (module.native_block if c.impl == "native" else module.per_op)
    # every module op but DeepSeek-V4's own (test_deepseek_v4_kernels_line.py checks their binding)
    assert {op for op, _ in seen} == set(registry.MODULE_OPS) - {"sink_attention", "hyper_connection"}
    notes = {(c.op, c.reason) for c in plan.choices if c.impl == "native"}
    assert ("router", f"native up to {ROUTE_TOKENS} rows per step, else torch") in notes
    # the fp32 model's Q8_0 products of more rows: on decoded panels where the build has them (kernels/panels.py)
    up_to = f" up to {ggml.PANEL_ROWS} rows (decode-then-BLAS above)"
    pan = f"; fp32 prefill for Q8_0 on decoded panels{up_to} ({panels.UNIT})" if panels.available() else ""
    fused = f"native ({native.isa()} Q8_0 decode-and-dot{pan}) up to {ggml.GEMV_ROWS} rows per step"
    linear = {reason for op, reason in notes if op == "linear"}  # why not triton first (no GPU / not asked for)
    assert linear and all(r.startswith("not triton: ") for r in linear), linear
    assert all(r.endswith(f"; {fused}, else native decode, then BLAS") for r in linear), linear
    assert ("moe_block", f"one call for steps of up to {BLOCK_TOKENS} fp32 tokens, else per_op") in notes


def test_no_model_code_compares_a_kernel_name():
    """The modules call what the plan bound; only the registry reads the name (a fused op's load-time check)."""
    root = Path(mlaserve.__file__).parent
    pattern = re.compile(r"\bkernel\s*[!=]=|[!=]=\s*self\.kernel\b")
    found = [
        f"{p.relative_to(root)}:{i}"
        for p in root.rglob("*.py")
        if p.name != "registry.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found

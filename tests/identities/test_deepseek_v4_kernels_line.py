"""`mlaserve inspect` on DeepSeek-V4: the kernels line and the kernel plan are true of the checkpoint. An FP8 /
FP4-expert folder's holders have the native kernels (FP8Linear, FP8GroupedLinear, FP8V4Experts / FP4V4Experts:
quant/deepseek_v4.py), so kernels auto resolves to native where the library builds and the plan names every
holder's implementation; kernels="torch" binds the torch reference on every holder; a float folder holds no
quantized weights, so there is nothing for the native kernels to run. The attention's padded softmax with sinks
(op sink_attention) follows the engine's kernels: native with them, torch otherwise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from v4_models import save_hf_v4  # noqa: E402

from mlaserve.entrypoints.cli import main  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.kernels import native  # noqa: E402
from mlaserve.quant.writer import write_fp8_folder  # noqa: E402

needs_native = pytest.mark.skipif(not native.status().available, reason="native kernels unavailable")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4_kernels_line")
    save_hf_v4("all_kinds", root / "float", seed=7)
    for experts in ("fp8", "fp4"):
        write_fp8_folder(root / "float", root / experts, block=(16, 16), keep_dtype=torch.float32, experts=experts)
    return root


def _line(out: str, name: str) -> str:
    return next(ln for ln in out.splitlines() if ln.lstrip().startswith(name))


@needs_native
@pytest.mark.parametrize("experts", ["fp8", "fp4"])
def test_a_quantized_folder_runs_its_holders_on_the_native_kernels(folders, experts, capsys):
    assert main(["inspect", str(folders / experts)]) == 0
    out = capsys.readouterr().out
    line = _line(out, "kernels")
    assert "native" in line and "engine default (auto: built for this CPU)" in line, line
    plan = out.split("kernel plan ", 1)[1]
    holder = "FP4V4Experts" if experts == "fp4" else "FP8V4Experts"
    assert f"{holder} native" in out and "FP8GroupedLinear native" in out and "FP8Linear native" in out
    planned = {tuple(ln.split()[:2]) for ln in plan.splitlines()[1:] if ln.startswith("  ")}
    assert ("grouped_experts", "native") in planned and ("linear", "native") in planned, plan
    llm = LLM(str(folders / experts))
    assert llm.config.kernels.impl == "native" and llm.config.runtime.dtype == torch.float32
    # every op native but the MoE's one-call decode step, which takes GGUF experts only (quant/ggml_moe_block.py),
    # and so the one-call FFN sublayer that runs it (models/deepseek_v4/model.py)
    choices = llm.loaded.kernel_plan.choices
    blocks = ("moe_block", "v4_ffn")
    assert {c.impl for c in choices if c.op not in blocks} == {"native"}
    assert {c.impl for c in choices if c.op in blocks} == {"per_op"}
    ops = {"linear", "grouped_experts", "sink_attention", "hyper_connection", "norm", *blocks}
    assert {c.op for c in choices} == ops
    assert "MoE decode step per_op in 4 layers" in out and "FFN sublayer per_op in 4 layers" in out
    assert llm.runner.model.inner.model.layers[0].attn_hc.mix.__func__.__name__ == "_mix_native"
    attention = llm.runner.model.inner.model.layers[0].self_attn
    assert attention.sink_softmax.__func__.__name__ == "_sink_softmax_native"
    assert attention.attend_step.__func__.__name__ == "_attend_step_native"
    assert "attention softmax native in 4 layers" in out and "mHC mixing native in 8 hyper-connections" in out
    # the ledger's implementation names the softmax's kernel (models/deepseek_v4/serving.py v4_implementation)
    assert llm.runner.model.v4_implementation == "native:padded_batch+batched_state"


def test_kernels_torch_binds_the_reference_on_every_holder(folders):
    llm = LLM(str(folders / "fp8"), kernels="torch")
    plan = llm.loaded.kernel_plan
    assert plan.choices and {c.impl for c in plan.choices if c.op not in ("moe_block", "v4_ffn")} == {"torch"}
    assert {c.impl for c in plan.choices if c.op == "moe_block"} == {"per_op"}
    experts = llm.runner.model.inner.model.layers[1].mlp.experts
    assert experts.routed.__func__.__name__ == "_routed_torch"
    attention = llm.runner.model.inner.model.layers[0].self_attn
    assert attention.sink_softmax.__func__.__name__ == "_sink_softmax_torch"
    assert llm.runner.model.v4_implementation == "torch:padded_batch+batched_state"


def test_a_float_folder_holds_none(folders, capsys):
    assert main(["inspect", str(folders / "float")]) == 0
    out = capsys.readouterr().out
    line = _line(out, "kernels")
    assert "the checkpoint holds no quantized weights" in line, line
    assert "no quantized holders" in out and "float routed experts" in out

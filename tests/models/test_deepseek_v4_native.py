"""DeepSeek-V4's quantized holders on the native kernels, and the batched routed experts of every quantized form.

The fast paths (the KernelPlan binds them at load: kernels/registry.py) against the plain references:
  FP8V4Experts / FP4V4Experts / GGUFV4Experts  `routed` (pairs sorted by expert, grouped products, the clamped
      SwiGLU batched, one index_add; native: the C grouped decode-and-dot at few rows per expert, or for GGUF at
      <= 8 pairs the C pair-by-pair call with its clamp, else the routed experts decoded natively and grouped
      GEMMs; torch: decoded by torch, then grouped GEMMs) == `reference` (models/deepseek_v4/moe.experts_loop:
      one pass per expert over torch's dequantization)
  FP8GroupedLinear / GGUFGroupedLinear  native (the groups as the experts of one grouped decode-and-dot, or the
      weight decoded natively then the block products) == the float64 product of the dequantized weight
Tolerances from what was measured (this file's cases, fp32, 2-core AVX-512 Xeon): the fast paths differ from the
reference loop by <= 9e-8 on outputs of 0.26-0.56 (1-2 ulps: the same products summed in another order; the torch
path by 0), so 1e-6; the grouped o_a_proj differs from the float64 product of its dequantized weight by <= 1.0e-6
on outputs up to 4.7 (48-64 terms), so 1e-5. (The worst-case fp32 summation bound, Higham's gamma_n |x|.|w| carried
through both products, is ~1e-4 here: three orders above what happens, too wide to catch a one-block error.)
At the model: FP8 and FP4-expert folders written by the project's writer, loaded with the native plan, equal
transformers on the dequantized weights (<= 1e-5 as every V4 logits test; 100% top-1) both at 5 tokens (the
decode-and-dot products) and 100 tokens (decoded, then GEMMs), a spy confirming which kernels ran.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlaserve.kernels import native, panels
from mlaserve.models.deepseek_v4.moe import clamped_swiglu
from mlaserve.quant import fp4_group, fp8_block
from mlaserve.quant.config import parse_quantization
from mlaserve.quant.deepseek_v4 import FP4V4Experts, FP8GroupedLinear, FP8V4Experts
from mlaserve.quant.ggml_deepseek_v4 import GGUFGroupedLinear, GGUFV4Experts

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not native.status().available, reason="native kernels unavailable")

E, D, INTER, K_TOP, LIMIT = 6, 64, 32, 2, 0.5  # LIMIT binds at O(1) activations: the clamp is exercised
TOL_EXPERTS = 1e-6  # measured <= 9e-8 (above)
TOL_GROUPED = 1e-5  # measured <= 1.0e-6 against the float64 product


def fp8_scheme(block=(16, 16), experts="fp8"):
    q = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    return parse_quantization({"quantization_config": q | ({"expert_dtype": experts} if experts != "fp8" else {})})


def routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(t)])
    return x, torch.rand(t, K_TOP, generator=g) + 0.1, idx


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, D, generator=g) * D**-0.5, torch.randn(E, D, INTER, generator=g) * INTER**-0.5


def fp8_experts() -> FP8V4Experts:
    h = FP8V4Experts(D, E, INTER, LIMIT, fp8_scheme(), "cpu")
    gate_up, down = _weights(1)
    q, s = fp8_block.quantize(gate_up.unflatten(1, (2, -1)), h.block)
    h.gate_up_proj.data.copy_(q.flatten(1, 2))
    h.gate_up_scale.data.copy_(s)
    q, s = fp8_block.quantize(down, h.block)
    h.down_proj.data.copy_(q)
    h.down_scale.data.copy_(s)
    return h


def fp4_experts() -> FP4V4Experts:
    h = FP4V4Experts(D, E, INTER, LIMIT, fp8_scheme(experts="fp4"), "cpu")
    gate_up, down = _weights(2)
    q, s = fp4_group.quantize(gate_up.unflatten(1, (2, -1)))
    h.gate_up_proj.data.copy_(q.flatten(1, 2))
    h.gate_up_scale.data.copy_(s)
    q, s = fp4_group.quantize(down)
    h.down_proj.data.copy_(q)
    h.down_scale.data.copy_(s)
    return h


def gguf_experts() -> GGUFV4Experts:
    """MXFP4 gate/up (as llama.cpp's converter repacks V4's FP4) and Q8_0 down, quantized by the gguf package."""
    T = gguf.GGMLQuantizationType
    h = GGUFV4Experts(D, E, INTER, LIMIT, int(T.MXFP4), int(T.Q8_0), "cpu")
    gate_up, down = _weights(3)
    for p, w, t in ((h.gate_up_proj, gate_up, T.MXFP4), (h.down_proj, down, T.Q8_0)):
        p.data.copy_(torch.from_numpy(gguf.quants.quantize(w.numpy(), t).reshape(p.shape)))
    return h


HOLDERS = {"fp8": fp8_experts, "fp4": fp4_experts, "gguf": gguf_experts}


class Calls:
    """Counts the native entry points a step reaches (monkeypatched wrappers that still run them)."""

    NAMES = ("grouped_gemm", "moe_experts", "dequantize", "dequantize_experts")

    def __init__(self, monkeypatch) -> None:
        self.n = dict.fromkeys((*self.NAMES, "panels"), 0)
        for name in self.NAMES:
            monkeypatch.setattr(native, name, self._counted(name, getattr(native, name)))
        monkeypatch.setattr(panels, "grouped", self._counted("panels", panels.grouped))

    def _counted(self, name, fn):
        def call(*args, **kwargs):
            self.n[name] += 1
            return fn(*args, **kwargs)

        return call

    def ran(self) -> set[str]:
        return {k for k, v in self.n.items() if v}


# rows (tokens) -> the native path a step of that size takes with E = 6, k = 2: per-expert rows <= 16 take the
# grouped decode-and-dot (GGUF: <= 8 pairs the pair-by-pair call), more the routed experts decoded, then GEMMs (GGUF
# in an AVX-512 build: on decoded panels, kernels/panels.py)
PATHS = {
    "fp8": {1: {"grouped_gemm"}, 9: {"grouped_gemm"}, 120: {"dequantize"}},
    "fp4": {1: {"grouped_gemm"}, 9: {"grouped_gemm"}, 120: {"dequantize"}},
    "gguf": {1: {"moe_experts"}, 9: {"grouped_gemm"}, 120: {"panels" if panels.available() else "dequantize_experts"}},
}


@pytest.mark.parametrize("form", sorted(HOLDERS))
@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("rows", [1, 9, 120])
def test_routed_experts_equal_the_reference_loop(form, kernel, rows, monkeypatch):
    h = HOLDERS[form]()
    h.kernel = kernel
    assert h.impl == "grouped_mm"
    x, weights, idx = routing(rows, seed=rows)
    want = h.reference(x, weights, idx)
    calls = Calls(monkeypatch)
    got = h(x, weights, idx)
    assert calls.ran() == (PATHS[form][rows] if kernel == "native" else set()), calls.n
    assert (got - want).abs().max().item() <= TOL_EXPERTS
    assert want.abs().max() > 0.1  # not a vacuous comparison of zeros
    gate_up, _ = h.dequantize()
    gate = torch.einsum("td,tkid->tki", x, gate_up[idx][:, :, :INTER])
    assert (gate > LIMIT).any()  # the clamp binds in this case


def test_the_clamp_is_what_the_fast_paths_apply(monkeypatch):
    """The fast paths apply V4's clamped SwiGLU (not the plain one of the shared FP8Experts / GGUFExperts):
    a limit wide enough never to bind gives another result, far outside the bound."""
    for make in HOLDERS.values():
        h = make()
        h.kernel = "native"
        x, weights, idx = routing(9, seed=5)
        clamped = h(x, weights, idx)
        h.limit = 1e9
        if isinstance(h, GGUFV4Experts):
            h.swiglu_limit = 1e9
        assert (h(x, weights, idx) - clamped).abs().max() > 1e-2


def test_the_native_pair_call_clamps_like_torch():
    """The C pair-by-pair call's limit == clamped_swiglu in torch, per pair."""
    h = gguf_experts()
    gate_up, down = h.dequantize()
    x, weights, idx = routing(3, seed=9)  # 6 pairs: the pair-by-pair call
    got = native.moe_experts(
        h.type_gate_up, h.type_down, x, h.gate_proj, h.up_proj, h.down_proj, idx.contiguous(), weights, limit=LIMIT
    )
    gu = torch.einsum("td,tkid->tki", x.double(), gate_up[idx].double())
    hh = clamped_swiglu(*gu.chunk(2, -1), LIMIT)
    want = (torch.einsum("tki,tkdi->tkd", hh, down[idx].double()) * weights.double()[..., None]).sum(1)
    assert (got.double() - want).abs().max().item() <= TOL_EXPERTS  # measured 4.6e-8
    plain = native.moe_experts(
        h.type_gate_up, h.type_down, x, h.gate_proj, h.up_proj, h.down_proj, idx.contiguous(), weights
    )
    assert (plain - got).abs().max() > 1e-2  # inf (the default): no clamp


def exact_grouped(x: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
    return torch.einsum("sgk,gok->sgo", x.double(), w.double().view(groups, -1, x.shape[-1])).flatten(1)


def fp8_grouped(o: int) -> FP8GroupedLinear:
    g, k = 3, 48
    m = FP8GroupedLinear(k, g * o, g, fp8_scheme(), "cpu")
    q, s = fp8_block.quantize(torch.randn(g * o, k, generator=torch.Generator().manual_seed(o)) * k**-0.5, m.block)
    m.weight.data.copy_(q)
    m.weight_scale_inv.data.copy_(s)
    return m


def gguf_grouped() -> GGUFGroupedLinear:
    g, o, k, t = 3, 8, 64, gguf.GGMLQuantizationType.Q8_0
    m = GGUFGroupedLinear(k, g * o, g, int(t), "cpu")
    w = torch.randn(g * o, k, generator=torch.Generator().manual_seed(4)) * k**-0.5
    m.weight.data.copy_(torch.from_numpy(gguf.quants.quantize(w.numpy(), t)))
    return m


GROUPED = {
    # o 16, blocks of 16 rows: each group owns whole rows of scale blocks -> one grouped decode-and-dot
    "fp8_aligned": (lambda: fp8_grouped(16), {2: {"grouped_gemm"}, 40: {"dequantize"}}),
    # o 8 inside a 16-row block: the weight decoded natively, then the block products, at any row count
    "fp8_straddling": (lambda: fp8_grouped(8), {2: {"dequantize"}, 40: {"dequantize"}}),
    "gguf_q8_0": (gguf_grouped, {2: {"grouped_gemm"}, 40: {"dequantize"}}),
}


@pytest.mark.parametrize("case", sorted(GROUPED))
@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("rows", [2, 40])
def test_grouped_o_a_proj_equals_the_exact_product(case, kernel, rows, monkeypatch):
    make, paths = GROUPED[case]
    m = make()
    m.kernel = kernel
    x = torch.randn(rows, m.groups, m.in_features, generator=torch.Generator().manual_seed(rows))
    w = m.dequantize()
    calls = Calls(monkeypatch)
    got = m(x)
    assert calls.ran() == (paths[rows] if kernel == "native" else set()), calls.n
    assert (got.double() - exact_grouped(x, w, m.groups)).abs().max().item() <= TOL_GROUPED
    assert got.abs().max() > 0.1


def test_grouped_o_a_proj_prefill_takes_the_plans_setting_per_group(monkeypatch):
    """With the plan's prefill setting (set_prefill_bf16, cap 6: Q8_0 takes the bf16 pairs where the process has the
    AMX-BF16 tiles, int16 activations on AVX512-VNNI, fp32 elsewhere) a GGUF o_a_proj past NATIVE_ROWS rows runs
    each group's row block as a GGUF product of its own (ggml.linear_native), never decoding the whole weight, within
    the setting's bound of the float64 product: 3e-5 (the pairs measured 9.1e-6 on outputs up to 4.7, fp32 grade:
    ~2^-16 per product; the fp32 path 1.0e-6). Where the setting leaves Q8_0 in fp32 it is the decoded weight's
    block products as before."""
    from mlaserve.kernels import bf16_prefill, ggml

    m = gguf_grouped()
    m.kernel = "native"
    m.set_prefill_bf16(6)
    assert m.bf16 == bf16_prefill.takes_bf16(m.ggml_type, 6)
    x = torch.randn(40, m.groups, m.in_features, generator=torch.Generator().manual_seed(40))
    per_group = []
    real = ggml.linear_native

    def spy(x_a, w_a, *args, **kwargs):
        per_group.append(w_a.data_ptr())
        return real(x_a, w_a, *args, **kwargs)

    monkeypatch.setattr(ggml, "linear_native", spy)
    calls = Calls(monkeypatch)
    got = m(x)
    if m.bf16 == bf16_prefill.FP32:
        assert calls.ran() == {"dequantize"} and per_group == []
    else:  # group a's rows start a * o rows into the weight, one product each, in order
        row = m.weight.stride(0) * m.weight.element_size()
        o = m.out_features // m.groups
        assert per_group == [m.weight.data_ptr() + a * o * row for a in range(m.groups)]
        assert "dequantize" not in calls.ran()
    assert (got.double() - exact_grouped(x, m.dequantize(), m.groups)).abs().max().item() <= 3e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pytest.importorskip("transformers")
    from v4_models import dequantized_folder, save_hf_v4

    from mlaserve.quant.writer import write_fp8_folder

    root = tmp_path_factory.mktemp("v4_native")
    save_hf_v4("all_kinds", root / "float", seed=11)
    for experts in ("fp8", "fp4"):
        # blocks of 8: o_lora_rank 8 owns whole blocks, so o_a_proj takes the grouped decode-and-dot
        write_fp8_folder(root / "float", root / experts, block=(8, 8), keep_dtype=torch.float32, experts=experts)
        dequantized_folder(root / experts, root / f"{experts}_deq", (8, 8))
    return root


@pytest.mark.parametrize("experts", ["fp8", "fp4"])
def test_native_plan_logits_equal_transformers_on_the_dequantized_weights(folders, experts, monkeypatch):
    from transformers import DeepseekV4ForCausalLM

    from mlaserve.loading.deepseek_v4 import load_folder, plan_v4_kernels

    ours, _ = load_folder(folders / experts)
    plan, line = plan_v4_kernels(ours, "native", 0)
    blocks = ("moe_block", "v4_ffn")  # the one-call MoE step takes GGUF experts, and the FFN sublayer runs it
    assert {c.impl for c in plan.choices if c.op not in blocks} == {"native"} and "FP8GroupedLinear native" in line
    assert {c.impl for c in plan.choices if c.op in blocks} == {"per_op"}
    holder = ours.model.layers[1].mlp.experts
    assert isinstance(holder, FP4V4Experts if experts == "fp4" else FP8V4Experts)
    assert holder.routed.__func__.__name__ == "_routed_native"
    ref = DeepseekV4ForCausalLM.from_pretrained(
        folders / f"{experts}_deq", dtype=torch.float32, experts_implementation="eager"
    ).eval()
    rng = np.random.default_rng(3)
    for n, path in ((5, "grouped_gemm"), (100, "dequantize")):
        ids = [0, *rng.integers(2, 96, n - 1).tolist()]
        calls = Calls(monkeypatch)
        with torch.no_grad():
            got = ours(torch.tensor(ids), ours.new_state(len(ids)))
            want = ref(torch.tensor([ids]), use_cache=False).logits[0]
        assert calls.n[path] > 0, calls.n
        assert (got - want).abs().max().item() <= 1e-5
        assert torch.equal(got.argmax(-1), want.argmax(-1))

"""The Triton kernels for stored-format weights (mlaserve/kernels/triton/: FP8 e4m3 blocks, GGUF Q8_0 and Q4_K
blocks) under Triton's interpreter on CPU, against references that are not their own code.

Decoding: each kernel's tile decoder (the same @triton.jit function its GEMM calls) writes out the weight, which
equals torch's float8 cast times the block scale (fp8_block.dequantize_reference: all 256 e4m3 codes, partial
edge blocks, channel and tensor scales) and gguf-py's dequantizer (random Q8_0 / Q4_K blocks), bit for bit.
Products: y = x @ W^T of 1, 3 and 16 rows (the small-batch kernel) within the fp32 summation-order bound
|y - y_ref| <= 2 K u (|x| @ |W|^T), u = 2^-24, against dequantize-then-F.linear (the bound of test_kernels.py:
each side's error is at most K u sum |x w|; the kernels sum in fp32 with input_precision="ieee"); measured here
at most 0.03 of it. Past TRITON_ROWS rows the decoded weight goes to F.linear: equal to the reference exactly.
The kernel plan: which holder takes `triton` and why the others do not (engine kernels, format not covered,
no GPU); the kernels option's resolution; and a tiny GGUF model (Q4_K_M: Q4_K and Q8_0 linears) and a tiny FP8
folder served end to end through the kernels against transformers on their dequantized weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import FP32_LOGITS_TOL, compare_logits, fixture_dir
from test_kernels import assert_within_sum_bound, gguf_py_dense, random_blocks

from mlaserve.config.engine import EngineOptions, resolve
from mlaserve.config.machine import choose_kernels
from mlaserve.config.model import ConfigError
from mlaserve.config.provenance import ProvenanceLog
from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import registry, triton_linear
from mlaserve.platform.triton_runtime import TritonMode, triton_mode
from mlaserve.quant import fp8_block

pytestmark = pytest.mark.skipif(
    triton_mode("cpu").mode != "interpreter", reason=f"Triton's interpreter is off: {triton_mode('cpu').reason}"
)

ROWS = (1, 3, 16)
FP8_SHAPES = [((200, 300), (128, 128)), ((70, 50), (32, 24)), ((9, 7), (1, 7)), ((33, 65), (33, 65))]
GGUF_SHAPES = {"Q8_0": (200, 320), "Q4_K": (200, 512)}  # N, K: ragged against the 64 x 64 tiles where K allows


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_e4m3_decode_of_every_code_equals_torch():
    k = triton_linear.kernel_module("fp8")
    codes = torch.arange(256, dtype=torch.uint8).view(fp8_block.FP8)[None]  # one row of all 256 codes
    got, ref = k.dequantize(codes, torch.ones(1, 1), (1, 256)), codes.float()
    nan = ref.isnan()
    assert nan.sum() == 2 and torch.equal(got.isnan(), nan)  # s.1111.111: NaN (its bits are not specified)
    assert _bits_equal(got[~nan], ref[~nan])


@pytest.mark.parametrize("shape, block", FP8_SHAPES)
def test_fp8_block_gemm_equals_dequantize_then_matmul(shape, block):
    k = triton_linear.kernel_module("fp8")
    g = torch.Generator().manual_seed(11)
    q, s = fp8_block.quantize(torch.randn(shape, generator=g), block)
    ref = fp8_block.dequantize_reference(q, s, block)
    assert _bits_equal(k.dequantize(q, s, block), ref)
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=g)
        assert_within_sum_bound(k.linear(x, q, s, block), F.linear(x, ref), x, ref)
    x = torch.randn(triton_linear.TRITON_ROWS + 4, shape[1], generator=g)
    assert torch.equal(triton_linear.fp8_linear(x, q, s, block), F.linear(x, ref))


@pytest.mark.parametrize("name", list(GGUF_SHAPES))
def test_gguf_kernel_decodes_as_gguf_py_and_multiplies_within_the_fp32_bound(name):
    n, k = GGUF_SHAPES[name]
    mod = triton_linear.kernel_module(name)
    g = torch.Generator().manual_seed(12)
    raw = random_blocks(name, n, k, g)
    ref = gguf_py_dense(raw, name)
    assert _bits_equal(mod.dequantize(raw, k), ref)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        assert_within_sum_bound(mod.linear(x, raw, k), F.linear(x, ref), x, ref)
    x = torch.randn(triton_linear.TRITON_ROWS + 4, k, generator=g)
    assert torch.equal(triton_linear.gguf_linear(x, raw, name, k), F.linear(x, ref))


def test_gguf_kernel_refuses_a_weight_of_another_shape():
    raw = torch.zeros(4, 34 * 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q8_0 weight: \(4, 102\) torch.uint8 is not \[N, 64 / 32 \* 34\]"):
        triton_linear.kernel_module("Q8_0").linear(torch.zeros(1, 64), raw, 64)


def _holders() -> torch.nn.Module:
    """An FP8Linear, GGUFLinear of Q8_0 / Q4_K (Triton kernels), of Q6_K (none), an FP8GroupedLinear (none)."""
    from mlaserve.quant.config import parse_quantization
    from mlaserve.quant.deepseek_v4 import FP8GroupedLinear
    from mlaserve.quant.ggml_linear import GGUFLinear
    from mlaserve.quant.linear import FP8Linear

    g = torch.Generator().manual_seed(13)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 32], "activation_scheme": "dynamic"}
    scheme = parse_quantization({"quantization_config": qc})
    m = torch.nn.Module()
    m.fp8 = FP8Linear(100, 90, scheme, True, torch.float32, "cpu")
    q, s = fp8_block.quantize(torch.randn(90, 100, generator=g), (64, 32))
    m.fp8.weight.data.copy_(q)
    getattr(m.fp8, m.fp8.scale_name).data.copy_(s)
    m.fp8.bias.data.copy_(torch.randn(90, generator=g))
    m.grouped = FP8GroupedLinear(64, 128, 2, scheme, "cpu")
    for name in ("Q8_0", "Q4_K", "Q6_K"):
        lin = GGUFLinear(256, 70, GGML_TYPE_IDS[name], False, torch.float32, "cpu")
        lin.weight.data.copy_(random_blocks(name, 70, 256, g))
        setattr(m, name.lower(), lin)
    return m


def test_plan_takes_triton_where_asked_and_names_why_not_elsewhere(monkeypatch):
    m = _holders()
    plan = registry.plan_kernels(m, registry.KernelContext("triton", 0))
    got = {c.module: (c.impl, c.reason) for c in plan.choices}
    for name, fmt in (("fp8", "fp8 e4m3 (64, 32)"), ("q8_0", "Q8_0"), ("q4_k", "Q4_K")):
        assert got[name][0] == "triton", got[name]
        assert got[name][1].startswith(f"triton {fmt} decode-and-multiply (interpreter) up to 16 rows"), got[name]
    assert got["q6_k"] == (
        "torch",
        "not triton: gguf Q6_K: the Triton kernels cover Q8_0 and Q4_K; not native: engine kernels=triton",
    )
    assert got["grouped"][1].startswith("not triton: FP8GroupedLinear has no Triton kernel")
    g = torch.Generator().manual_seed(14)
    for name in ("fp8", "q8_0", "q4_k"):  # the holders as the plan bound them, against their torch reference
        lin = getattr(m, name)
        w = lin.dequantize()
        for rows in (1, 16):
            x = torch.randn(rows, lin.in_features, generator=g)
            lin.kernel = "triton"
            y = lin(x)
            lin.kernel = "torch"
            bias = lin.bias if lin.bias is not None else 0.0
            assert_within_sum_bound(y - bias, lin(x) - bias, x, w)
    # the engine's other kernels: triton not taken, and the plan says why (not asked; no GPU)
    native = registry.plan_kernels(m, registry.KernelContext("native", 0))
    assert native.of("fp8", "linear").reason.startswith("not triton: engine kernels=native (interpreter Triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = registry.plan_kernels(m, registry.KernelContext("triton", 0))
    assert all(c.impl != "triton" for c in cpu.choices)
    assert "not triton: Triton compiles for GPUs only; on cpu" in cpu.of("q4_k", "linear").reason


def test_kernels_option_resolves_triton_only_on_a_gpu_or_by_name_under_the_interpreter(monkeypatch):
    from hf_models import make_config

    from mlaserve.config.model import ModelConfig

    cfg = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    ok = lambda: (True, "built")  # noqa: E731
    kw = {"native_kernels": ok, "triton": triton_mode}
    cpu = lambda kernels: resolve(cfg, EngineOptions(device="cpu", kernels=kernels), False, **kw).kernels.impl  # noqa: E731
    assert cpu("auto") == "native"  # the CPU's default is unchanged
    assert cpu("triton") == "triton"  # by name, with TRITON_INTERPRET=1: the interpreter (tests)
    assert resolve(cfg, EngineOptions(device="cpu", kernels="triton"), False).kernels.impl == "torch"  # nothing held
    compiled = lambda device: TritonMode("compiled", "CUDA device: Triton compiles the kernels")  # noqa: E731
    log = ProvenanceLog()
    assert choose_kernels("auto", "cuda", ok, log, triton=compiled) == "triton"
    assert "not yet run on a GPU" in log.source("kernels")  # auto's untested choice says so
    assert choose_kernels("auto", "cuda", ok, ProvenanceLog(), triton=triton_mode) == "torch"  # interpreted: no
    assert choose_kernels("auto", "cuda", None, ProvenanceLog(), triton=compiled) == "torch"  # nothing quantized
    assert choose_kernels("torch", "cuda", ok, ProvenanceLog(), triton=compiled) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="kernels='triton' cannot run on cpu: Triton compiles for GPUs only"):
        cpu("triton")


def test_gguf_model_through_the_triton_kernels_matches_transformers():
    """ds3's Q4_K_M file: its Q4_K and Q8_0 linears through the kernels (prefill chunks of 16 and 4 rows: the
    small-batch kernel), the rest in torch, against transformers on the file's dequantized weights."""
    from safetensors.torch import load_file

    from mlaserve import LLM

    folder = fixture_dir("ds3")
    exp = load_file(str(folder / "expected.safetensors"))
    ids = exp["input_ids"].tolist()[:20]  # a prefix: the interpreter runs each tile in numpy
    llm = LLM(str(folder / "model-q4_k_m.gguf"), kernels="triton", dtype="float32", max_num_batched_tokens=16)
    taken = {
        c.reason.split(" decode")[0] for c in llm.loaded.kernel_plan.choices if c.impl == "triton" and c.op == "linear"
    }
    assert taken == {"triton Q4_K", "triton Q8_0"}
    diff, top1 = compare_logits(llm.prompt_logits(ids), exp["hf_dequant_logits_q4_k_m"][:20])
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)


def test_fp8_folder_through_the_triton_kernels_matches_transformers(hf_model_dir, tmp_path):
    """A DeepSeek-V3 FP8 folder in (32, 24) blocks (partial edge blocks): its FP8Linear holders through the
    kernels (a 12-token prompt: one small-batch step), against transformers on the folder's dequantized weights
    (tests/models/test_fp8.py's oracle: q.float() * the block's scale, computed there)."""
    from hf_models import hf_logits, random_ids
    from test_fp8 import _hf_from, dequantized_folder

    from mlaserve import LLM
    from mlaserve.quant.writer import write_fp8_folder

    src, _ = hf_model_dir("v3_yarn")
    write_fp8_folder(src, tmp_path / "fp8", "fp8", (32, 24))
    ids = random_ids(12)
    ref = hf_logits(_hf_from(dequantized_folder(tmp_path / "fp8", tmp_path / "deq")), ids)
    llm = LLM(str(tmp_path / "fp8"), kernels="triton", dtype="float32")
    fp8 = [c for c in llm.loaded.kernel_plan.choices if c.impl == "triton" and c.op == "linear"]
    assert fp8 and all(c.reason.startswith("triton fp8 e4m3 (32, 24) decode-and-multiply") for c in fp8)
    diff, top1 = compare_logits(llm.prompt_logits(ids), ref)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)

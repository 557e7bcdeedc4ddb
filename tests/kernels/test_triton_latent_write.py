"""The Triton latent write (kernels/triton/latent_write.py: kv_a norm, rope of k_pe and q_pe, the cache row write
in one kernel) under Triton's interpreter on CPU, against the torch reference (MLAAttention._write_latent_torch,
the model's own code path, on the same inputs).

The rope is elementwise with the reference's operations in its order (fp fusion off): q_pe and the cache's k_pe
columns equal the reference bit for bit, in both rope styles. The norm's sum of squares is summed in another
order (a tree sum against torch's): each side's sum is within (r - 1) u of the true one (u = 2^-24), so the
two rstd differ by at most (r - 1) u relative (the square root halves the sums' 2 (r - 1) u), plus the
roundings of sqrt / reciprocal and the two products (at most 4 u each side): |y - y_ref| <= (r + 8) u |y_ref|.
Measured here (interpreter): at most 7.2e-7 absolute, 0.015 of that bound.
Rows no token writes keep their content (the cache starts random), and padding rows (token 0 at position 0,
all writing the pad slot) write it as the reference does. A tiny GGUF model (Q4_K_M: its linears take the Triton
GEMMs, so kernels=triton applies) runs end to end with the kernel in every layer, against transformers, and with
an int8 cache (the kernel's rows quantized by the cache) against kernels=torch.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import FP32_LOGITS_TOL, compare_logits, fixture_dir

from mlaserve.kernels import registry
from mlaserve.models.deepseek import MLAAttention
from mlaserve.models.layers import RMSNorm, apply_rope
from mlaserve.platform.triton_runtime import triton_mode

pytestmark = pytest.mark.skipif(
    triton_mode("cpu").mode != "interpreter", reason=f"Triton's interpreter is off: {triton_mode('cpu').reason}"
)

U = 2.0**-24
EPS = 1e-6
# (kv_lora_rank r, rope dim dr, heads H, nope dim dn, tokens T, page size)
SHAPES = [(512, 64, 16, 128, 1, 64), (256, 64, 3, 32, 7, 16), (512, 64, 5, 16, 13, 1), (256, 64, 20, 64, 4, 32)]


class _Rope:
    """The rope the reference calls (RotaryEmbedding's forward without its config)."""

    def __init__(self, interleaved: bool) -> None:
        self.interleaved = interleaved

    def __call__(self, x, cos, sin):
        return apply_rope(x, cos, sin, self.interleaved)


def _attention(r: int, dr: int, h: int, dn: int, g: torch.Generator) -> SimpleNamespace:
    """What the latent write methods read of MLAAttention: its dims and kv_a_layernorm."""
    norm = RMSNorm(r, EPS)
    norm.weight.data.copy_(torch.rand(r, generator=g) + 0.5)
    cfg = SimpleNamespace(kv_lora_rank=r, qk_rope_head_dim=dr, qk_nope_head_dim=dn, num_heads=h)
    return SimpleNamespace(cfg=cfg, kv_a_layernorm=norm)


def _step(shape, pad_rows: int, g: torch.Generator):
    """A step of T real tokens on random pages plus pad_rows padding rows, and a random cache with its pad slot."""
    r, dr, h, dn, t, ps = shape
    pages = max(6, t + 2)  # room for the T rows at any page size
    cache = torch.randn(pages * ps + 1, r + dr, generator=g)
    pad = pages * ps
    slots = torch.randperm(pages * ps, generator=g)[:t]
    q = torch.randn(t + pad_rows, h, dn + dr, generator=g)
    kv = torch.randn(t + pad_rows, r + dr, generator=g) * 3
    cos, sin = torch.randn(t + pad_rows, dr // 2, generator=g), torch.randn(t + pad_rows, dr // 2, generator=g)
    if pad_rows:  # padding rows: the same token at the same position, written to the pad slot
        q[t:], kv[t:], cos[t:], sin[t:] = q[t], kv[t], cos[t], sin[t]
        slots = torch.cat([slots, torch.full((pad_rows,), pad)])
    return q, kv, SimpleNamespace(slot_mapping=slots, cos=cos, sin=sin), cache


def _both(attn, q, kv, step, rope, cache, device: str = "cpu"):
    """(q_nope, q_pe, cache) of the reference (on the CPU) and of the Triton method on `device`, each on its own
    copy of the cache."""
    ref_cache = cache.clone()
    ref = MLAAttention._write_latent_torch(attn, q.clone(), kv, step, rope, ref_cache)
    on = SimpleNamespace(cfg=attn.cfg, kv_a_layernorm=copy.deepcopy(attn.kv_a_layernorm).to(device))
    on._write_latent_torch = lambda *a: MLAAttention._write_latent_torch(on, *a)  # the method's fallback
    step_on = SimpleNamespace(**{k: v.to(device) for k, v in vars(step).items()})
    tri_cache = cache.to(device, copy=True)
    got = MLAAttention._write_latent_triton(on, q.to(device, copy=True), kv.to(device), step_on, rope, tri_cache)
    return (*ref, ref_cache), tuple(x.cpu() for x in (*got, tri_cache))


def check_against_the_reference(shape, interleaved: bool, device: str = "cpu") -> None:
    """The Triton latent write on `device` against the reference on the CPU: the rope bit for bit, the norm
    within (r + 8) u relative, rows no token writes untouched, the pad slot as the reference writes it."""
    r = shape[0]
    g = torch.Generator().manual_seed(31)
    attn = _attention(*shape[:4], g)
    q, kv, step, cache = _step(shape, pad_rows=3, g=g)
    (ref_nope, ref_pe, ref_cache), (nope, pe, got_cache) = _both(attn, q, kv, step, _Rope(interleaved), cache, device)
    assert torch.equal(nope, ref_nope) and torch.equal(pe, ref_pe)  # the query rope: bit for bit
    written = torch.zeros(cache.shape[0], dtype=torch.bool)
    written[step.slot_mapping] = True
    assert torch.equal(got_cache[~written], cache[~written])  # every other row untouched
    assert torch.equal(got_cache[:, r:], ref_cache[:, r:])  # k_pe: bit for bit
    ref_norm = ref_cache[written, :r]
    err = (got_cache[written, :r] - ref_norm).abs()
    assert (err <= (r + 8) * U * ref_norm.abs()).all(), (err / ref_norm.abs()).max().item() / U


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_latent_write_equals_the_reference(shape, interleaved):
    check_against_the_reference(shape, interleaved)


def test_non_fp32_step_takes_the_reference():
    """A bf16 step is outside the kernel's contract (fp32): the method hands it to the reference, bit for bit."""
    g = torch.Generator().manual_seed(32)
    shape = SHAPES[1]
    attn = _attention(*shape[:4], g)
    q, kv, step, cache = _step(shape, pad_rows=0, g=g)
    q, kv, cache = q.bfloat16(), kv.bfloat16(), cache.bfloat16()
    step = SimpleNamespace(slot_mapping=step.slot_mapping, cos=step.cos.bfloat16(), sin=step.sin.bfloat16())
    (ref_nope, ref_pe, ref_cache), (nope, pe, got_cache) = _both(attn, q, kv, step, _Rope(False), cache)
    assert torch.equal(pe, ref_pe) and torch.equal(nope, ref_nope) and torch.equal(got_cache, ref_cache)


def test_kernel_names_the_input_at_fault():
    from mlaserve.kernels.triton import latent_write

    q, kv = torch.zeros(2, 3, 96), torch.zeros(2, 256 + 64)
    cos, w, cache, slots = torch.zeros(2, 32), torch.ones(256), torch.zeros(8, 320), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"latent write: sin \(3, 32\) torch.float32 is not \[2, 32\]"):
        latent_write.latent_write(kv, q, 32, w, EPS, cos, torch.zeros(3, 32), False, cache, slots)
    with pytest.raises(ValueError, match=r"cache \(8, 300\) is not \[S, 320\]"):
        latent_write.latent_write(kv, q, 32, w, EPS, cos, cos, False, torch.zeros(8, 300), slots)
    with pytest.raises(ValueError, match=r"takes fp32 tensors, not \['torch.bfloat16', 'torch.float32'\]"):
        latent_write.latent_write(kv, q, 32, w, EPS, cos, cos, False, cache.bfloat16(), slots)


def test_plan_takes_triton_for_the_latent_write_where_asked(monkeypatch):
    from hf_models import make_config

    from mlaserve.config.model import ModelConfig

    cfg = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    m = torch.nn.Module()
    m.attn = MLAAttention(cfg, 0)
    plan = registry.plan_kernels(m, registry.KernelContext("triton", 0))
    choice = plan.of("attn", "latent_write")
    assert choice.impl == "triton" and m.attn.write_latent.__name__ == "_write_latent_triton"
    assert (
        choice.reason == "triton norm + rope + cache write in one kernel per step (interpreter), fp32 steps, else torch"
    )
    native = registry.plan_kernels(m, registry.KernelContext("native", 0)).of("attn", "latent_write")
    assert native.impl == "native"
    assert native.reason.startswith("not triton: engine kernels=native (interpreter Triton not asked for)")
    fp32 = m.attn.kv_a_layernorm.weight.data
    m.attn.kv_a_layernorm.weight.data = fp32.bfloat16()
    bf16 = registry.plan_kernels(m, registry.KernelContext("triton", 0)).of("attn", "latent_write")
    assert (bf16.impl, bf16.reason.split(";")[0]) == (
        "torch",
        "not triton: kv_a_layernorm weight torch.bfloat16, the Triton kernel takes fp32",
    )
    m.attn.kv_a_layernorm.weight.data = fp32
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = registry.plan_kernels(m, registry.KernelContext("triton", 0)).of("attn", "latent_write")
    assert cpu.impl == "torch" and "not triton: Triton compiles for GPUs only; on cpu" in cpu.reason


def test_gguf_model_with_the_triton_latent_write_matches_transformers():
    """ds3's Q4_K_M file with kernels=triton: every layer's latent write is the Triton kernel (the plan says so),
    prefill chunks of 8 rows (later chunks read the rows earlier ones wrote), against transformers on the file's
    dequantized weights."""
    from safetensors.torch import load_file

    from mlaserve import LLM

    folder = fixture_dir("ds3")
    exp = load_file(str(folder / "expected.safetensors"))
    ids = exp["input_ids"].tolist()[:16]  # a prefix: the interpreter runs each program in numpy
    llm = LLM(str(folder / "model-q4_k_m.gguf"), kernels="triton", dtype="float32", max_num_batched_tokens=8)
    writes = [c for c in llm.loaded.kernel_plan.choices if c.op == "latent_write"]
    assert writes and all(c.impl == "triton" for c in writes), llm.loaded.kernel_plan.format()
    diff, top1 = compare_logits(llm.prompt_logits(ids), exp["hf_dequant_logits_q4_k_m"][:16])
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)


def test_int8_cache_rows_through_the_triton_latent_write_match_the_torch_kernels():
    """kv_cache_dtype=int8 (cache/quantized_rows.py): the kernel writes the step's fp32 rows to a buffer, the cache
    quantizes them. Against kernels=torch on the same file and cache (the reference path; transformers has no
    8-bit cache): measured 2.1e-6 apart (the linears' and the norm's fp32 sum orders; no int8 code flipped)."""
    from mlaserve import LLM

    folder = fixture_dir("ds3")
    ids = load_file_ids(folder)[:16]
    logits = {}
    for kernels in ("triton", "torch"):
        llm = LLM(
            str(folder / "model-q4_k_m.gguf"),
            kernels=kernels,
            dtype="float32",
            max_num_batched_tokens=8,
            kv_cache_dtype="int8",
        )
        assert {c.impl for c in llm.loaded.kernel_plan.choices if c.op == "latent_write"} == {kernels}
        logits[kernels] = llm.prompt_logits(ids)
    diff, top1 = compare_logits(logits["triton"], logits["torch"])
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)


def load_file_ids(folder) -> list[int]:
    from safetensors.torch import load_file

    return load_file(str(folder / "expected.safetensors"))["input_ids"].tolist()

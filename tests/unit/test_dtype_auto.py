"""dtype="auto": bfloat16 for a checkpoint whose matrices are stored in bf16, on a CPU with AVX512-BF16/AMX
(where it is ~2x faster than float32), in one process; float32 otherwise: other stored types (bf16 would round
them), quantized weights (the native kernels take fp32 activations), tensor parallel, off the CPU. The suite
pins the detection off (conftest: MLASERVE_FAST_BF16=0) so its outcomes never depend on the machine; these
tests set it both ways and check the choice, its recorded reason, and the engines it builds.
"""

from __future__ import annotations

import torch
from hf_models import make_config
from safetensors.torch import load_file, save_file

from mlaserve import LLM
from mlaserve.config import cpu
from mlaserve.config.engine import EngineOptions, resolve
from mlaserve.config.model import ModelConfig

CFG = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
BUILT = lambda: (True, "built")  # noqa: E731  (the loader's probe: passed only for quantized weights)


def _dtype(opts: EngineOptions, **kw):
    cfg = resolve(CFG, opts, False, **kw)
    return cfg.runtime.dtype, {s.name: s for s in cfg.provenance}["dtype"].source


def test_auto_is_bfloat16_only_for_bf16_weights_on_a_fast_bf16_cpu(monkeypatch):
    bf16, fp32 = (lambda: True), (lambda: False)
    monkeypatch.setenv(cpu.OVERRIDE, "1")
    dtype, why = _dtype(EngineOptions(device="cpu"), stored_bf16=bf16)
    assert dtype == torch.bfloat16 and "MLASERVE_FAST_BF16=1" in why and "dtype='float32'" in why
    dtype, why = _dtype(EngineOptions(device="cpu"), stored_bf16=fp32)
    assert dtype == torch.float32 and "would round them" in why
    dtype, why = _dtype(EngineOptions(device="cpu"), stored_bf16=bf16, native_kernels=BUILT)
    assert dtype == torch.float32 and "quantized" in why
    dtype, why = _dtype(EngineOptions(device="cpu", tensor_parallel_size=2), stored_bf16=bf16)
    assert dtype == torch.float32 and "tensor_parallel_size" in why
    dtype, why = _dtype(EngineOptions(device="cpu", dtype="float32"), stored_bf16=bf16)
    assert dtype == torch.float32 and why == "user option"
    monkeypatch.setenv(cpu.OVERRIDE, "0")
    dtype, why = _dtype(EngineOptions(device="cpu"), stored_bf16=bf16)
    assert dtype == torch.float32 and "MLASERVE_FAST_BF16=0" in why and "exact" in why


def test_detection_reads_the_cpu_flags(monkeypatch):
    monkeypatch.delenv(cpu.OVERRIDE, raising=False)
    for flags, want in (({"avx2", "avx512_bf16"}, True), ({"amx_bf16"}, True), ({"avx2", "avx512f"}, False)):
        monkeypatch.setattr(cpu, "cpu_flags", lambda f=flags: f)
        fast, why = cpu.fast_bf16()
        assert fast is want and (next(iter(flags & set(cpu.BF16_FLAGS))) in why if want else "neither" in why)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx512_bf16"})
    assert _dtype(EngineOptions(device="cpu"), stored_bf16=lambda: True)[0] == torch.bfloat16


def _bf16_copy(folder, dst):
    """The tiny model with its matrices stored in bf16 (norms and the router bias stay F32)."""
    dst.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    save_file({n: t.bfloat16() if t.dim() >= 2 else t for n, t in tensors.items()}, dst / "model.safetensors")
    return dst


def test_engines_follow_the_choice(hf_model_dir, monkeypatch, tmp_path):
    folder, _ = hf_model_dir("v3_yarn")
    stored = _bf16_copy(folder, tmp_path / "bf16")
    ids = list(range(3, 40))
    monkeypatch.setenv(cpu.OVERRIDE, "1")
    assert LLM(str(folder)).config.runtime.dtype == torch.float32  # fp32 weights: bf16 would round them
    fast = LLM(str(stored))
    assert fast.config.runtime.dtype == torch.bfloat16 and fast.runner.cache.layers[0].latent.dtype == torch.bfloat16
    monkeypatch.setenv(cpu.OVERRIDE, "0")
    exact = LLM(str(stored))
    assert exact.config.runtime.dtype == torch.float32
    assert torch.equal(exact.prompt_logits(ids), LLM(str(stored), dtype="float32").prompt_logits(ids))
    got, ref = fast.prompt_logits(ids), exact.prompt_logits(ids)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9  # bf16, as test_bf16_close_to_fp32_reference


def test_an_f16_gguf_stays_float32(monkeypatch):
    """F16 matrices would lose mantissa bits in bfloat16: auto keeps float32 for them."""
    from conftest import fixture_dir

    monkeypatch.setenv(cpu.OVERRIDE, "1")
    llm = LLM(str(fixture_dir("ds3") / "model-f16.gguf"))
    assert llm.config.runtime.dtype == torch.float32

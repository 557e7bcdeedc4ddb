"""dtype="auto": bfloat16 for float weights on CPUs with AVX512-BF16/AMX (where it is ~2x faster than
float32), float32 elsewhere, for quantized weights (the native kernels take fp32 activations) and off the
CPU. The suite pins the detection off (conftest: MLASERVE_FAST_BF16=0) so its outcomes never depend on the
machine; these tests set it both ways and check the choice, its recorded reason, and the engine it builds.
"""

from __future__ import annotations

import torch
from hf_models import make_config

from mlaserve import LLM
from mlaserve.config import cpu
from mlaserve.config.engine import EngineOptions, resolve
from mlaserve.config.model import ModelConfig

CFG = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
BUILT = lambda: (True, "built")  # noqa: E731  (the loader's probe: passed only for quantized weights)


def _dtype(opts: EngineOptions, **kw):
    cfg = resolve(CFG, opts, False, **kw)
    return cfg.dtype, {s.name: s for s in cfg.provenance}["dtype"].source


def test_auto_is_bfloat16_only_for_float_weights_on_a_fast_bf16_cpu(monkeypatch):
    monkeypatch.setenv(cpu.OVERRIDE, "1")
    dtype, why = _dtype(EngineOptions(device="cpu"))
    assert dtype == torch.bfloat16 and "MLASERVE_FAST_BF16=1" in why and "dtype='float32'" in why
    dtype, why = _dtype(EngineOptions(device="cpu"), native_kernels=BUILT)
    assert dtype == torch.float32 and "quantized" in why
    dtype, why = _dtype(EngineOptions(device="cpu", dtype="float32"))
    assert dtype == torch.float32 and why == "user option"
    monkeypatch.setenv(cpu.OVERRIDE, "0")
    dtype, why = _dtype(EngineOptions(device="cpu"))
    assert dtype == torch.float32 and "MLASERVE_FAST_BF16=0" in why and "exact" in why


def test_detection_reads_the_cpu_flags(monkeypatch):
    monkeypatch.delenv(cpu.OVERRIDE, raising=False)
    for flags, want in (({"avx2", "avx512_bf16"}, True), ({"amx_bf16"}, True), ({"avx2", "avx512f"}, False)):
        monkeypatch.setattr(cpu, "cpu_flags", lambda f=flags: f)
        fast, why = cpu.fast_bf16()
        assert fast is want and (next(iter(flags & set(cpu.BF16_FLAGS))) in why if want else "neither" in why)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx512_bf16"})
    assert _dtype(EngineOptions(device="cpu"))[0] == torch.bfloat16


def test_engines_follow_the_choice(hf_model_dir, monkeypatch):
    folder, _ = hf_model_dir("v3_yarn")
    ids = list(range(3, 40))
    monkeypatch.setenv(cpu.OVERRIDE, "1")
    fast = LLM(str(folder))
    assert fast.config.dtype == torch.bfloat16 and fast.runner.cache.layers[0].dtype == torch.bfloat16
    monkeypatch.setenv(cpu.OVERRIDE, "0")
    exact = LLM(str(folder))
    assert exact.config.dtype == torch.float32
    assert torch.equal(exact.prompt_logits(ids), LLM(str(folder), dtype="float32").prompt_logits(ids))
    got, ref = fast.prompt_logits(ids), exact.prompt_logits(ids)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9  # bf16, as test_bf16_close_to_fp32_reference

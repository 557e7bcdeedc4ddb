"""prefill_matmul on DeepSeek-V4: its kernel plan (loading/deepseek_v4.plan_v4_kernels) binds the engine's prefill
products as the other GGUF models' plans do, so auto resolves as it does for them (the rule is the CPU's and the
file's, not the family's), and the holders take the setting: a V4 GGUF's Q8_0 projections record the bf16 pairs,
its Q4_K ones bf16 (their types' rule, kernels/bf16_prefill.takes_bf16). Until 2026-12-07 the plan bound none,
auto recorded fp32 for V4 and bf16 requests were refused."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
from hf_models import make_config  # noqa: E402
from v4_models import make_v4_config, save_hf_v4  # noqa: E402

from mlaserve.config.deepseek_v4 import DeepseekV4Config  # noqa: E402
from mlaserve.config.engine import EngineOptions, resolve  # noqa: E402
from mlaserve.config.model import ModelConfig  # noqa: E402
from mlaserve.kernels import bf16_prefill, native  # noqa: E402


def _resolve(monkeypatch, hf_config, **kw):
    monkeypatch.setenv("MLASERVE_FAST_BF16", "1")
    monkeypatch.setenv("MLASERVE_AMX_INT8", "0")
    monkeypatch.setenv("MLASERVE_INT8_ROWS", "0")
    raw = hf_config.to_dict()
    cfg = DeepseekV4Config.from_hf(raw) if raw["model_type"] == "deepseek_v4" else ModelConfig.from_hf(raw)
    eng = resolve(cfg, EngineOptions(device="cpu", **kw), False, native_kernels=lambda: (True, "built"), gguf=True)
    return eng.kernels.prefill_matmul, {s.name: s for s in eng.provenance}["prefill_matmul"].source


def test_v4_gguf_auto_resolves_as_the_other_families(monkeypatch):
    v4 = _resolve(monkeypatch, make_v4_config("all_kinds"))
    assert v4[0] == "bf16_6bit", v4[1]
    assert v4 == _resolve(monkeypatch, make_config("v3_yarn"))


@pytest.mark.parametrize("requested", ["bf16", "bf16_6bit", "float"])
def test_v4_takes_a_request(monkeypatch, requested):
    assert _resolve(monkeypatch, make_v4_config("all_kinds"), prefill_matmul=requested)[0] == requested


@pytest.mark.parametrize("requested, cap", [("bf16_6bit", 6), ("bf16", bf16_prefill.BF16_ALL)])
def test_the_v4_plan_binds_the_setting_on_its_holders(tmp_path, requested, cap):
    """A V4 GGUF (Q8_0 projections) through LLM with a bf16 prefill_matmul: its GGUFLinear holders carry the setting
    their type takes under it, as a DeepSeek-V3 file's do. Under bf16_6bit Q8_0 takes the bf16 pairs or the int16
    products where the CPU has them and fp32 elsewhere (an AVX2-only CPU: the CPU's rule, not the family's); under
    bf16 every type takes bf16 on every CPU, so there a holder left unbound fails on any machine."""
    if not native.status().available:
        pytest.skip(f"native kernels unavailable: {native.status().detail}")
    from v4_gguf import BLOCK_DIMS, write_v4_gguf

    from mlaserve.entrypoints.llm import LLM
    from mlaserve.gguf.quants import GGML_TYPE_IDS

    save_hf_v4("all_kinds", tmp_path / "float", seed=5, **BLOCK_DIMS)
    write_v4_gguf(tmp_path / "float", tmp_path / "model.gguf")
    llm = LLM(str(tmp_path / "model.gguf"), prefill_matmul=requested)
    q_a = llm.runner.model.inner.model.layers[0].self_attn.q_a_proj
    assert q_a.ggml_type == GGML_TYPE_IDS["Q8_0"]
    assert q_a.bf16 == bf16_prefill.takes_bf16(q_a.ggml_type, cap)
    if requested == "bf16":
        assert q_a.bf16 == bf16_prefill.BF16

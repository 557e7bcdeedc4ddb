"""prefill_matmul on DeepSeek-V4: its kernel plan (loading/deepseek_v4.plan_v4_kernels) binds no bf16 prefill
products, so the recorded switch says fp32 with that reason instead of claiming bf16 GEMMs (auto on a CPU with
fast bf16 picked bf16_6bit for a V4 GGUF before), and an explicit bf16 request is refused naming the option."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
from hf_models import make_config  # noqa: E402
from v4_models import make_v4_config  # noqa: E402

from mlaserve.config.deepseek_v4 import DeepseekV4Config  # noqa: E402
from mlaserve.config.engine import EngineOptions, resolve  # noqa: E402
from mlaserve.config.model import ConfigError, ModelConfig  # noqa: E402


def _resolve(monkeypatch, hf_config, **kw):
    monkeypatch.setenv("MLASERVE_FAST_BF16", "1")
    raw = hf_config.to_dict()
    cfg = DeepseekV4Config.from_hf(raw) if raw["model_type"] == "deepseek_v4" else ModelConfig.from_hf(raw)
    eng = resolve(cfg, EngineOptions(device="cpu", **kw), False, native_kernels=lambda: (True, "built"), gguf=True)
    return eng.kernels.prefill_matmul, {s.name: s for s in eng.provenance}["prefill_matmul"].source


def test_v4_gguf_auto_records_fp32_with_the_reason(monkeypatch):
    value, why = _resolve(monkeypatch, make_v4_config("all_kinds"))
    assert value == "float", why
    assert "DeepSeek-V4's kernel plan" in why and "binds no bf16 prefill products" in why
    # the same resolve on an MLA model still takes bf16 (the rule is the family's, not the file's)
    assert _resolve(monkeypatch, make_config("v3_yarn"))[0] == "bf16_6bit"


@pytest.mark.parametrize("requested", ["bf16", "bf16_6bit"])
def test_v4_bf16_request_is_refused_naming_the_option(monkeypatch, requested):
    with pytest.raises(ConfigError, match=rf"prefill_matmul='{requested}': DeepSeek-V4's kernel plan"):
        _resolve(monkeypatch, make_v4_config("all_kinds"), prefill_matmul=requested)
    assert _resolve(monkeypatch, make_v4_config("all_kinds"), prefill_matmul="float")[0] == "float"

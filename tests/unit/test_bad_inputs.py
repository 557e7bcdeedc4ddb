"""Bad checkpoints and configs fail with an error naming the field, tensor or file at fault."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlaserve import LLM
from mlaserve.config.model import ConfigError
from mlaserve.loading.safetensors_source import WeightError


@pytest.fixture
def model_copy(hf_model_dir, tmp_path):
    folder, _ = hf_model_dir("v3_yarn")
    dst = tmp_path / "model"
    shutil.copytree(folder, dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder, fn):
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_unknown_model_type(model_copy):
    _edit_config(model_copy, model_type="llama")
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        LLM(str(model_copy))


@pytest.mark.parametrize("field", ["kv_lora_rank", "qk_rope_head_dim", "hidden_size"])
def test_missing_config_field(model_copy, field):
    _edit_config(model_copy, **{field: None})
    with pytest.raises(ConfigError, match=f"missing required field '{field}'"):
        LLM(str(model_copy))


def test_missing_tensor(model_copy):
    _edit_tensors(model_copy, lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    with pytest.raises(WeightError, match=r"missing .*model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        LLM(str(model_copy))


def test_missing_expert(model_copy):
    _edit_tensors(model_copy, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(WeightError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        LLM(str(model_copy))


def test_wrong_shape(model_copy):
    def shrink(t):
        t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] = t[
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
        ][:-1]

    _edit_tensors(model_copy, shrink)
    with pytest.raises(
        WeightError, match=r"kv_a_proj_with_mqa\.weight' has shape \[47, 64\], the config implies \[48, 64\]"
    ):
        LLM(str(model_copy))


def test_unexpected_tensor(model_copy):
    _edit_tensors(model_copy, lambda t: t.__setitem__("model.layers.0.self_attn.surprise.weight", torch.zeros(2)))
    with pytest.raises(WeightError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.surprise\.weight'"):
        LLM(str(model_copy))


def test_mtp_layer_is_skipped_and_reported(model_copy):
    _edit_tensors(model_copy, lambda t: t.__setitem__("model.layers.3.eh_proj.weight", torch.zeros(2, 2)))
    _edit_config(model_copy, num_nextn_predict_layers=1)  # layers past num_hidden_layers are MTP only if declared
    llm = LLM(str(model_copy))
    assert llm.loaded.report.skipped == ["model.layers.3.eh_proj.weight"]


def test_corrupted_file(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError, match="model.safetensors"):
        LLM(str(model_copy))


def test_kv_heads_must_equal_heads(model_copy):
    _edit_config(model_copy, num_key_value_heads=1)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        LLM(str(model_copy))

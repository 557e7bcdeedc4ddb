"""DeepSeek-V4 FP8 folders (e4m3 blocks, ue8m0 scales, written by the project's writer from a transformers
save_pretrained folder) load into the quantized holders, bytes as stored, and equal transformers run on the
dequantized weights (the independent reference: fp8_block.dequantize_reference, then transformers' loader).

Bound 1e-5 as the float tests: both sides multiply the same dequantized fp32 weights (measured 0 .. 2e-6)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from v4_models import dequantized_folder, save_hf_v4  # noqa: E402

from mlaserve.loading.deepseek_v4 import load_folder  # noqa: E402
from mlaserve.quant import fp8_block  # noqa: E402
from mlaserve.quant.deepseek_v4 import FP8GroupedLinear, FP8V4Experts  # noqa: E402
from mlaserve.quant.linear import FP8Linear  # noqa: E402
from mlaserve.quant.writer import write_fp8_folder  # noqa: E402

BLOCK = (16, 16)  # several blocks per tiny weight, partial edge blocks included


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4_fp8")
    save_hf_v4("all_kinds", root / "float", seed=4)
    counts = write_fp8_folder(root / "float", root / "fp8", block=BLOCK, keep_dtype=torch.float32, scale_fmt="ue8m0")
    # the reference's weights: every quantized tensor dequantized, the scales dropped, no quantization_config
    stored = load_file(root / "fp8" / "model.safetensors")
    deq = {}
    for name, t in stored.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = stored.get(name.removesuffix("weight") + "weight_scale_inv")
        deq[name] = t if scale is None else fp8_block.dequantize_reference(t, scale.float(), BLOCK)
    (root / "deq").mkdir()
    save_file(deq, root / "deq" / "model.safetensors")
    config = json.loads((root / "fp8" / "config.json").read_text())
    config.pop("quantization_config")
    (root / "deq" / "config.json").write_text(json.dumps(config))
    return root, counts, stored


def test_fp8_folder_loads_into_holders_and_equals_the_dequantized_reference(folders):
    from transformers import DeepseekV4ForCausalLM

    root, counts, stored = folders
    assert counts["quantized"] > 0
    assert stored["model.layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.attn.wq_a.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    for kept in ("head.weight", "model.layers.1.ffn.gate.weight", "model.layers.1.attn.compressor.wkv.weight"):
        assert stored[kept].dtype == torch.float32, kept  # as the release keeps them
    ours, _ = load_folder(root / "fp8")
    layer = ours.model.layers[1]
    assert isinstance(layer.self_attn.q_a_proj, FP8Linear)
    assert isinstance(layer.self_attn.o_a_proj, FP8GroupedLinear)
    assert isinstance(layer.mlp.experts, FP8V4Experts)
    assert isinstance(layer.mlp.shared_experts.down_proj, FP8Linear)
    assert isinstance(layer.self_attn.compressor.indexer.q_b_proj, FP8Linear)
    assert type(layer.self_attn.compressor.kv_proj) is torch.nn.Linear  # kept float
    assert layer.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn  # no dequantized copy kept
    ref = DeepseekV4ForCausalLM.from_pretrained(root / "deq", dtype=torch.float32, experts_implementation="eager")
    ids = [0, *range(5, 34)]
    with torch.no_grad():
        want = ref.eval()(torch.tensor([ids]), use_cache=False).logits[0]
        got = ours(torch.tensor(ids), ours.new_state(len(ids)))
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_float_tensor_where_fp8_is_planned_is_named(folders, tmp_path):
    root, _, stored = folders
    bad = dict(stored)
    bad["model.layers.1.attn.wq_a.weight"] = bad["model.layers.1.attn.wq_a.weight"].float()
    (tmp_path / "bad").mkdir()
    save_file(bad, tmp_path / "bad" / "model.safetensors")
    (tmp_path / "bad" / "config.json").write_text((root / "fp8" / "config.json").read_text())
    from mlaserve.loading.safetensors_source import WeightError

    with pytest.raises(WeightError, match=r"wq_a.weight'.*stored as torch.float32 but .*q_a_proj.weight holds"):
        load_folder(tmp_path / "bad")


def test_fp4_routed_experts_load_packed_and_equal_the_dequantized_reference(tmp_path):
    """The release's form: routed experts as packed e2m1 with group-32 scales (expert_dtype fp4), the rest FP8."""
    from transformers import DeepseekV4ForCausalLM

    from mlaserve.quant.deepseek_v4 import FP4V4Experts

    save_hf_v4("all_kinds", tmp_path / "float", seed=5)
    write_fp8_folder(tmp_path / "float", tmp_path / "fp4", block=BLOCK, keep_dtype=torch.float32, experts="fp4")
    stored = load_file(tmp_path / "fp4" / "model.safetensors")
    assert stored["model.layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8  # two e2m1 codes per byte
    assert json.loads((tmp_path / "fp4" / "config.json").read_text())["quantization_config"]["expert_dtype"] == "fp4"
    dequantized_folder(tmp_path / "fp4", tmp_path / "deq", BLOCK)
    ours, _ = load_folder(tmp_path / "fp4")
    assert all(isinstance(layer.mlp.experts, FP4V4Experts) for layer in ours.model.layers)
    ref = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32, experts_implementation="eager")
    ids = [0, *range(9, 38)]
    with torch.no_grad():
        want = ref.eval()(torch.tensor([ids]), use_cache=False).logits[0]
        got = ours(torch.tensor(ids), ours.new_state(len(ids)))
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))

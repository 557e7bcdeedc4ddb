"""DeepSeek-V4 weights: a folder written by transformers' save_pretrained, and the released layout, load through
loading/deepseek_v4.py and give transformers' logits; a broken folder is an error naming the tensor."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from v4_models import hf_v4_logits, save_hf_v4  # noqa: E402

from mlaserve.loading.deepseek_v4 import load_folder  # noqa: E402
from mlaserve.loading.safetensors_source import WeightError  # noqa: E402

BOUND = 1e-5  # as tests/models/test_deepseek_v4.py (measured 0 to 2e-6 on these configs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4_saved")
    hf, _ = save_hf_v4("all_kinds", folder, seed=3)
    return folder, hf


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids), model.new_state(len(ids)))


def _rewrite(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")
    return dst


def test_save_pretrained_folder_loads_and_matches(saved):
    folder, hf = saved
    names = load_file(folder / "model.safetensors")
    assert "model.layers.1.attn.compressor.ape" in names and "head.weight" in names  # the released names
    model, report = load_folder(folder)
    assert report.skipped == []
    ids = [0, *range(5, 40)]
    ref = hf_v4_logits(hf, ids)
    assert (_logits(model, ids) - ref).abs().max().item() <= BOUND


def _released(tensors: dict) -> dict:
    """save_pretrained's names -> the original release layout (no `model.` prefix, embed / head / hc_head_*,
    attn.kv_norm), plus an MTP tensor the loader must skip."""
    out = {}
    for name, t in tensors.items():
        name = re.sub(r"^model\.", "", name)
        name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
        name = re.sub(r"^hc_head\.hc_", "hc_head_", name)
        name = re.sub(r"\.attn\.norm\.", ".attn.kv_norm.", name)
        out[name] = t.to(torch.int32) if name.endswith("tid2eid") else t  # the release stores int32
    out["mtp.0.attn.wq_a.weight"] = torch.zeros(2, 2)
    return out


def test_released_layout_loads_and_matches(saved, tmp_path):
    folder, hf = saved
    model, report = load_folder(_rewrite(folder, tmp_path / "released", _released))
    assert report.skipped == ["mtp.0.attn.wq_a.weight"]
    ids = [0, *range(7, 30)]
    assert (_logits(model, ids) - hf_v4_logits(hf, ids)).abs().max().item() <= BOUND


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: {k: v for k, v in t.items() if k != "model.layers.1.attn.indexer.wq_b.weight"}, "no tensor for"),
        (lambda t: {k: v for k, v in t.items() if k != "model.layers.2.ffn.experts.3.w3.weight"}, "experts/parts"),
        (lambda t: {**t, "model.layers.0.attn.attn_sink": torch.zeros(4)}, r"attn_sink'.*shape \(4,\)"),
        (lambda t: {**t, "model.layers.0.attn.wq_c.weight": torch.zeros(1)}, "unknown DeepSeek-V4 tensor"),
        (lambda t: {**t, "model.layers.9.attn.wq_a.weight": torch.zeros(1)}, "has no such tensor"),
    ],
    ids=["missing", "missing_expert", "shape", "unknown", "extra_layer"],
)
def test_a_broken_folder_names_the_tensor(saved, tmp_path, edit, message):
    folder, _ = saved
    with pytest.raises(WeightError, match=message):
        load_folder(_rewrite(folder, tmp_path / "broken", edit))


def test_bfloat16_keeps_the_references_fp32_parts(saved):
    """Loaded in bf16, the model keeps what transformers keeps in fp32 (norms, sinks, position biases, mHC, the
    router bias) and computes where it computes: logits equal transformers' bf16 from_pretrained (measured
    0.0 on this config). Bound 1e-2, below one bf16 step at these logits (|logit| 2..4: 0.016 .. 0.03); casting
    the sinks to bf16 before the softmax (transformers' fp32 sink column promotes the row) measured 0.57."""
    from transformers import DeepseekV4ForCausalLM

    folder, _ = saved
    ref = DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, experts_implementation="eager").eval()
    ours, _ = load_folder(folder, dtype=torch.bfloat16)
    kept = {n for n, p in ref.named_parameters() if p.dtype == torch.float32}
    assert kept and kept == {n for n, p in ours.named_parameters() if p.dtype == torch.float32}
    ids = [0, *range(5, 35)]
    with torch.no_grad():
        want = ref(torch.tensor([ids]), use_cache=False).logits[0].float()
    got = _logits(ours, ids).float()
    assert (got - want).abs().max().item() <= 1e-2
    assert torch.equal(got.argmax(-1), want.argmax(-1))

"""`mlaserve verify MODEL --against OTHER` names the first layer (and sub-block) where two copies part
ways, and passes copies that differ only by their GGUF quantization."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import fixture_dir
from safetensors.torch import load_file, save_file

from mlaserve.entrypoints.against_report import describe_failure, to_json
from mlaserve.entrypoints.cli import main
from mlaserve.entrypoints.verify_against import compare, encode_prompt, open_side

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


def _copy_with(src, dst, edit):
    """A copy of an HF fixture folder with edit(tensors) applied to its weights."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _swap_heads(t):  # layer 1 kv_b_proj: heads 0 and 1 swapped (W_UK and W_UV rows of each head)
    name, heads = "model.layers.1.self_attn.kv_b_proj.weight", 4
    w = t[name].view(heads, -1, t[name].shape[1]).clone()
    w[[0, 1]] = w[[1, 0]]
    t[name] = w.reshape(t[name].shape)


def _scale_expert(t):  # layer 2, routed expert 3: down-projection x 1.01
    t["model.layers.2.mlp.experts.3.down_proj.weight"] = t["model.layers.2.mlp.experts.3.down_proj.weight"] * 1.01


@pytest.fixture(scope="module")
def ds3(tmp_path_factory):
    src = fixture_dir("ds3")
    root = tmp_path_factory.mktemp("against")
    return {
        "hf": open_side(str(src)),
        "swapped": open_side(str(_copy_with(src, root / "swapped", _swap_heads))),
        "scaled": open_side(str(_copy_with(src, root / "scaled", _scale_expert))),
        "dir": src,
    }


def _compare(model, against):
    ids, _ = encode_prompt(model, against, PROMPT)
    return compare(model, against, ids)


def test_swapped_kv_b_heads_named_at_layer_1_attention(ds3):
    report = _compare(ds3["swapped"], ds3["hf"])
    assert not report.passed
    assert to_json(report)["first_divergence"] == {"block": "layer.1.attn", "layer": 1, "sub_block": "attention"}
    by = {b.block: b for b in report.blocks}
    assert by["layer.1.attn"].rel_diff > 0.5  # two of four heads' outputs are another head's
    assert all(b.rel_diff == 0.0 for name, b in by.items() if name != "layer.1.attn")  # teacher forcing
    assert report.layers[1].rel_diff > 0.1 and report.layers[0].rel_diff == 0.0  # free-running: travels on


def test_scaled_expert_named_at_layer_2_moe(ds3):
    report = _compare(ds3["scaled"], ds3["hf"])
    f = report.first_failure
    assert (f.block, describe_failure(report).split(":")[1].strip()) == ("layer.2.mlp", "layer 2 (MoE)")
    assert 1e-4 < f.rel_diff < 1e-2 and f.tolerance == pytest.approx(1e-5)  # fp32 vs fp32: tight


@pytest.mark.parametrize("qtype", ["f32", "q8_0", "q4_k_m"])
def test_gguf_of_the_same_weights_passes(ds3, qtype):
    gguf = open_side(str(ds3["dir"] / f"model-{qtype}.gguf"))
    report = _compare(gguf, ds3["hf"])
    assert report.passed, describe_failure(report)
    (path, check) = report.dequant_checks[0]
    assert check.available and check.passed and path.endswith(f"{qtype}.gguf")
    attn = [b for b in report.blocks if b.block.endswith(".attn")]
    if qtype == "f32":  # identical weights: exact
        assert check.checked == 0 and all(b.rel_diff < 1e-6 and b.tolerance == 1e-5 for b in attn)
        assert report.types["layer.1.attn"] == {"F32": 9}  # norms, q_a, q_b, kv_a, k_b, v_b, o
    else:  # a real quantization error, within what the file's own types predict
        assert all(1e-3 < b.rel_diff < b.tolerance for b in attn)
        assert check.checked > 0
    if qtype == "q4_k_m":
        assert "Q4_K" in report.types["layer.1.mlp"]


def test_quantized_file_with_a_scrambled_layer_fails(ds3):
    """q4_k_m's allowance is ~10x fp32's and still far below a changed layer's divergence."""
    report = _compare(open_side(str(ds3["dir"] / "model-q4_k_m.gguf")), ds3["swapped"])
    assert report.first_failure.block == "layer.1.attn"


def test_copies_of_different_models_are_refused(ds3):
    with pytest.raises(ValueError, match="not copies of one model: hidden_size 128 vs 256"):
        _compare(open_side(str(fixture_dir("ds2lite"))), ds3["hf"])


def test_cli_exit_code_and_json(ds3, capsys):
    swapped = ds3["swapped"].path
    assert main(["verify", swapped, "--against", str(ds3["dir"]), "--prompt", PROMPT]) == 1
    assert "FAIL: first divergence: layer 1 (attention)" in capsys.readouterr().out
    assert main(["verify", str(ds3["dir"] / "model-q8_0.gguf"), "--against", str(ds3["dir"]), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and out["first_divergence"] is None and len(out["layers"]) == 3
    assert out["dequant_checks"][0]["available"] and out["tensor_types"]["embed"] == {"Q8_0": 1}


def test_dsa_layers_attend_over_the_reference_selection():
    """glm5 q4_k_m past index_topk: the top-k differs a little (reported), the attention is judged on
    the same rows, so the merely quantized file passes."""
    d = fixture_dir("glm5")
    model, against = open_side(str(d / "model-q4_k_m.gguf")), open_side(str(d))
    report = _compare(model, against)
    assert report.passed, describe_failure(report)
    assert set(report.topk_overlap) == {0, 1, 2} and all(0.8 < v <= 1.0 for v in report.topk_overlap.values())
    assert torch.isfinite(torch.tensor([b.rel_diff for b in report.blocks])).all()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantization_error_estimate_matches_the_true_error(qtype):
    """e(W) is read off the dequantized values alone; here the originals are known (quantized by the
    gguf package, an independent quantizer), so the estimate can be checked against the real error."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from mlaserve.observability.weight_error import relative_error

    x = np.random.default_rng(3).standard_normal((32, 256)).astype(np.float32)
    qt = gguf.GGMLQuantizationType[qtype]
    deq = np.ascontiguousarray(gguf.quants.dequantize(gguf.quants.quantize(x, qt), qt), dtype=np.float32)
    actual = np.linalg.norm(deq - x) / np.linalg.norm(x)
    assert relative_error(torch.from_numpy(deq), qtype) == pytest.approx(actual, rel=0.05)


def test_dequant_check_says_when_gguf_is_missing(monkeypatch):
    import sys

    from mlaserve.gguf.read.file import open_gguf
    from mlaserve.observability.weight_error import check_dequantization

    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    gf = open_gguf(fixture_dir("ds3") / "model-q8_0.gguf")
    check = check_dequantization(gf)
    assert not check.available and check.passed and "gguf package not installed" in check.describe()

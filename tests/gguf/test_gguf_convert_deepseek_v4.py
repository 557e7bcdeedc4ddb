"""`mlaserve convert` on DeepSeek-V4 folders -> llama.cpp's `deepseek4` GGUF.

The references are independent of the converter: transformers' deepseek_v4 on the folder (F32) or on the
`gguf` package's dequantization of the bytes written (Q8_0, MXFP4), and tests/v4_gguf.py's file for the same
weights (written with the `gguf` package from llama.cpp's converter's names and keys, not from the project's
reader) for the metadata, names and bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from v4_gguf import (  # noqa: E402
    _EXPERT,
    _EXPERT_STACK,
    _LAYER,
    _LAYER_RE,
    _ROOT,
    BLOCK_DIMS,
    default_type,
    release_name,
    write_dequantized_folder,
    write_v4_gguf,
)
from v4_models import save_hf_v4  # noqa: E402

from mlaserve.entrypoints.cli import main as cli  # noqa: E402
from mlaserve.gguf.convert.convert import ConvertError, convert_hf_to_gguf  # noqa: E402
from mlaserve.loading.deepseek_v4 import load_folder, load_gguf  # noqa: E402

# fp32 on the same weights: the V4 suites measure 0 to 2e-6 between our model and transformers at these sizes
# (tests/models/test_deepseek_v4.py; 1.8e-6 measured here on the F32 file, 1.3e-6 .. 2.0e-6 on the deepseek4
# files of tests/gguf/test_gguf_deepseek_v4.py); the file's blocks change the weights, not the arithmetic, so
# the quantized files use the same bound against transformers on their own dequantized weights.
BOUND = 1e-5
IDS = [0, *range(5, 40)]  # 36 tokens: CSA (4) and HCA (8) windows close inside the prompt, past the window 6
T = gguf.GGMLQuantizationType


def byte_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (3 specials + byte symbols, no merges): the converter needs tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())[: vocab_size - 3]
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2} | {s: i + 3 for i, s in enumerate(symbols)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<s>", "</s>", "<pad>"])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tk.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def gguf_name(saved: str) -> tuple[str, int]:
    """A save_pretrained name -> (its GGUF tensor, its expert index or -1), by tests/v4_gguf.py's table."""
    rel = release_name(saved)
    e = _EXPERT.match(rel)
    if e:
        return f"blk.{e[1]}.{_EXPERT_STACK[e[3]]}", int(e[2])
    if rel in _ROOT:
        return _ROOT[rel], -1
    m = _LAYER_RE.match(rel)
    return f"blk.{m[1]}.{_LAYER[m[2]]}", -1


def dequantized(path: Path, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors as the `gguf` package decodes them, under the folder's names."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    out = {}
    for name, t in saved.items():
        g, e = gguf_name(name)
        info = tensors[g]
        if info.tensor_type == T.I32:
            out[name] = t
            continue
        values = torch.from_numpy(gguf.quants.dequantize(info.data, info.tensor_type).astype(np.float32).copy())
        out[name] = (values[e] if e >= 0 else values).reshape(t.shape)
    return out


def logits_of(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(ids), model.new_state(len(ids)))


def transformers_logits(folder: Path, ids=IDS) -> torch.Tensor:
    from transformers import DeepseekV4ForCausalLM

    ref = DeepseekV4ForCausalLM.from_pretrained(folder, experts_implementation="eager").float().eval()
    with torch.no_grad():
        return ref(torch.tensor([ids]), use_cache=False).logits[0].float()


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """all_kinds: a hash layer, CSA (layers 1, 3), HCA (layer 2), hc_mult 4; dims in whole 32-blocks."""
    root = tmp_path_factory.mktemp("v4_convert")
    save_hf_v4("all_kinds", root / "float", seed=5, **BLOCK_DIMS)
    byte_tokenizer(root / "float", 96)
    reports = {t: convert_hf_to_gguf(root / "float", root / f"{t}.gguf", t) for t in ("f32", "q8_0")}
    return root, reports, transformers_logits(root / "float")


def test_f32_file_equals_the_folder_and_transformers(converted):
    root, reports, want = converted
    assert set(reports["f32"].type_counts()) == {"F32", "I32"}
    model, _, ck = load_gguf(root / "f32.gguf")
    got = logits_of(model)
    err = (got - want).abs().max().item()
    assert err <= BOUND, err
    assert (got.argmax(-1) == want.argmax(-1)).all()
    folder_model, _ = load_folder(root / "float")
    assert (got - logits_of(folder_model)).abs().max().item() <= BOUND
    ck.close()


def test_q8_0_file_equals_transformers_on_its_own_blocks(converted, tmp_path):
    """Q8_0 changes the weights (measured ~0.25 on O(4) logits against the float folder): the reference is
    transformers on the `gguf` package's dequantization of the written bytes, at the fp32 bound."""
    root, reports, _ = converted
    types = reports["q8_0"].tensors
    assert types["blk.1.ffn_gate_exps.weight"] == "Q8_0" and types["blk.2.attn_output_a.weight"] == "Q8_0"
    assert types["blk.1.hc_attn_fn.weight"] == "F32" and types["output_hc_fn.weight"] == "F32"
    assert types["blk.1.attn_compressor_ape.weight"] == "F32" and types["blk.1.ffn_gate_inp.weight"] == "F32"
    assert types["blk.0.ffn_gate_tid2eid.weight"] == "I32" and types["blk.3.attn_q_a_norm.weight"] == "F32"
    deq = dequantized(root / "q8_0.gguf", saved_tensors(root / "float"))
    write_dequantized_folder(root / "float", deq, tmp_path / "deq")
    want = transformers_logits(tmp_path / "deq")
    model, report, ck = load_gguf(root / "q8_0.gguf")
    assert {m: t for m, t, _ in report.gguf.kept}["model.layers.1.mlp.experts"] == "Q8_0"
    err = (logits_of(model) - want).abs().max().item()
    assert err <= BOUND, err
    ck.close()


def _keys(path: Path) -> list[tuple[str, list, object]]:
    """deepseek4.* and general.architecture: (key, GGUF value types, value), in the file's order."""
    out = []
    for f in gguf.GGUFReader(str(path)).fields.values():
        if f.name.startswith("deepseek4.") or f.name == "general.architecture":
            out.append((f.name, [int(t) for t in f.types], f.contents()))
    return out


def _tensors(path: Path) -> dict[str, tuple[str, tuple, bytes]]:
    return {t.name: (t.tensor_type.name, tuple(t.shape), t.data.tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_same_keys_names_and_bytes_as_llama_cpps_layout(converted, tmp_path, outtype):
    """The llama.cpp-layout file of tests/v4_gguf.py for the same weights, its types chosen as ours (F32 for
    f32; for q8_0 its own choice with Q8_0 routed experts, as a float folder has no FP4 to repack): every key
    (type and value, same order), every tensor name, type, shape and byte equal (Q8_0 too: the writer's
    quantizer is gguf-py's bit for bit). Tensor order differs on purpose: ours is llama.cpp's converter's
    (tid2eid, expert stacks, then the checkpoint's order), the helper's the checkpoint's."""
    root, *_ = converted

    def choose(name: str, ndim: int):
        if outtype == "f32":
            return T.F32
        return T.Q8_0 if name.endswith("_exps.weight") else default_type(name, ndim)

    write_v4_gguf(root / "float", tmp_path / "llama_cpp_layout.gguf", choose_type=choose)
    assert _keys(root / f"{outtype}.gguf") == _keys(tmp_path / "llama_cpp_layout.gguf")
    ours, theirs = _tensors(root / f"{outtype}.gguf"), _tensors(tmp_path / "llama_cpp_layout.gguf")
    assert sorted(ours) == sorted(theirs)
    order = list(ours)  # llama.cpp's converter's order: tid2eid, then each layer's stacks gate / down / up
    assert order[:4] == [
        "blk.0.ffn_gate_tid2eid.weight",
        *(f"blk.0.ffn_{p}_exps.weight" for p in ("gate", "down", "up")),
    ]
    differ = [n for n in ours if ours[n] != theirs[n]]
    assert not differ, differ[:5]


def test_mtp_layer_is_dropped_and_said(tmp_path, capsys):
    """A folder with the release's mtp.0.* tensors: dropped as llama.cpp's converter drops them, listed in the
    report and printed by the CLI; the file is the trunk (block_count = main layers, no nextn key) and loads."""
    from v4_mtp_models import save_v4_with_mtp

    trunk, _, _ = save_v4_with_mtp("all_kinds", tmp_path / "mtp", seed=3)
    byte_tokenizer(tmp_path / "mtp", 96)
    mtp_names = [n for n in saved_tensors(tmp_path / "mtp") if n.startswith("mtp.")]
    assert mtp_names
    report = convert_hf_to_gguf(tmp_path / "mtp", tmp_path / "mtp.gguf", "f32")
    assert sorted(report.skipped) == sorted(mtp_names)
    assert any("MTP" in n and str(len(mtp_names)) in n for n in report.notes)
    keys = {k: v for k, _, v in _keys(tmp_path / "mtp.gguf")}
    assert keys["deepseek4.block_count"] == 4 and "deepseek4.nextn_predict_layers" not in keys
    assert not any(n.startswith("blk.4.") for n in _tensors(tmp_path / "mtp.gguf"))
    model, _, ck = load_gguf(tmp_path / "mtp.gguf")
    with torch.no_grad():
        want = trunk(torch.tensor([IDS]), use_cache=False).logits[0].float()
    assert (logits_of(model) - want).abs().max().item() <= BOUND
    ck.close()
    assert cli(["convert", str(tmp_path / "mtp"), str(tmp_path / "cli.gguf"), "--outtype", "f32"]) == 0
    out = capsys.readouterr().out
    assert "deepseek4" in out and f"dropped {len(mtp_names)} MTP tensor(s)" in out


def test_fp8_folder_with_fp4_experts(converted, tmp_path):
    """The project's writer's DeepSeek FP8 folder (e4m3 128x128 blocks, ue8m0 scales, FP4 routed experts):
    FP8 matrices -> Q8_0 (llama.cpp's tensor_force_quant), FP4 experts repacked into MXFP4 (the `gguf`
    package decodes them to exactly the folder's FP4 values), bf16 kept tensors at the outtype; the file ==
    transformers on its own dequantized weights."""
    from mlaserve.quant import fp4_group
    from mlaserve.quant.writer import write_fp8_folder

    root, *_ = converted
    write_fp8_folder(root / "float", tmp_path / "fp8", experts="fp4", scale_fmt="ue8m0")
    report = convert_hf_to_gguf(tmp_path / "fp8", tmp_path / "fp8.gguf", "f32")
    types = report.tensors
    assert types["blk.1.ffn_gate_exps.weight"] == "MXFP4" and types["blk.3.ffn_down_exps.weight"] == "MXFP4"
    assert types["blk.1.attn_q_a.weight"] == "Q8_0" and types["blk.2.ffn_up_shexp.weight"] == "Q8_0"
    assert types["output.weight"] == "F32"  # kept bf16 in the folder: the outtype
    stored = saved_tensors(tmp_path / "fp8")
    files = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "fp8.gguf")).tensors}
    stack = gguf.quants.dequantize(files["blk.1.ffn_gate_exps.weight"].data, T.MXFP4)
    name = "model.layers.1.ffn.experts.2.w1.weight"
    fp4 = fp4_group.dequantize_reference(stored[name], stored[name + "_scale_inv"].float())
    assert torch.equal(torch.from_numpy(stack[2].astype(np.float32)), fp4)  # the repack changes no value
    shapes = saved_tensors(root / "float")  # the float folder's names and shapes (FP4 stores two codes a byte)
    write_dequantized_folder(root / "float", dequantized(tmp_path / "fp8.gguf", shapes), tmp_path / "deq")
    model, _, ck = load_gguf(tmp_path / "fp8.gguf")
    err = (logits_of(model) - transformers_logits(tmp_path / "deq")).abs().max().item()
    assert err <= BOUND, err
    ck.close()


def test_what_llama_cpp_cannot_store_is_refused(tmp_path):
    """CSA ratio 3 (llama.cpp gives an indexer to exactly the layers of ratio 4): an error naming the field,
    before any file is written."""
    save_hf_v4("hc2_learned", tmp_path / "odd")  # compress_rates CSA 3 / HCA 6
    byte_tokenizer(tmp_path / "odd", 96)
    with pytest.raises(ConvertError, match="CSA ratio 3"):
        convert_hf_to_gguf(tmp_path / "odd", tmp_path / "odd.gguf", "f32")
    assert not (tmp_path / "odd.gguf").exists()


def test_hash_layers_everywhere_kinds_from_compress_ratios(tmp_path):
    """hc3_hash: every layer hash-routed, the kinds from the legacy compress_ratios [4, 0, 4], hc_mult 3, 9 heads in
    3 groups, YaRN on the compressed table: the F32 file == transformers."""
    _, raw = save_hf_v4("hc3_hash", tmp_path / "f", seed=4)
    byte_tokenizer(tmp_path / "f", 96)
    report = convert_hf_to_gguf(tmp_path / "f", tmp_path / "h.gguf", "f32")
    assert sum(n.endswith("tid2eid.weight") for n in report.tensors) == 3
    keys = {k: v for k, _, v in _keys(tmp_path / "h.gguf")}
    assert keys["deepseek4.hash_layer_count"] == 3 and keys["deepseek4.attention.compress_ratios"] == [4, 0, 4]
    model, _, ck = load_gguf(tmp_path / "h.gguf")
    err = (logits_of(model) - transformers_logits(tmp_path / "f")).abs().max().item()
    assert err <= BOUND, err
    ck.close()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.2.ffn.experts.3.w3.weight"), "blk.2.ffn_up_exps.weight: experts [3] missing"),
        (lambda t: t.update({"model.layers.1.attn.foo.weight": torch.ones(2)}), "unknown DeepSeek-V4 tensor"),
        (
            lambda t: t.update({"model.layers.1.attn.wq_a.weight": torch.ones(16, 32)}),
            "model.layers.1.attn.wq_a.weight has shape [16, 32], blk.1.attn_q_a.weight needs [32, 32]",
        ),
    ],
    ids=["missing_expert", "unknown", "shape"],
)
def test_a_broken_folder_names_the_tensor(converted, tmp_path, edit, message):
    import shutil

    from safetensors.torch import save_file

    root, *_ = converted
    shutil.copytree(root / "float", tmp_path / "bad")
    tensors = saved_tensors(tmp_path / "bad")
    edit(tensors)
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(ConvertError) as e:
        convert_hf_to_gguf(tmp_path / "bad", tmp_path / "bad.gguf", "f32")
    assert message in str(e.value) and str(tmp_path / "bad") in str(e.value)


def test_fp4_experts_without_power_of_two_scales_are_dequantized(converted, tmp_path):
    """fp32 group scales (not ue8m0) have no MXFP4 form: the experts are dequantized and written at the outtype,
    each value the folder's FP4 value exactly (F32), and the report says which forms were converted."""
    from mlaserve.quant import fp4_group
    from mlaserve.quant.writer import write_fp8_folder

    root, *_ = converted
    write_fp8_folder(root / "float", tmp_path / "fp4", experts="fp4")
    report = convert_hf_to_gguf(tmp_path / "fp4", tmp_path / "fp4.gguf", "f32")
    assert report.tensors["blk.1.ffn_gate_exps.weight"] == "F32"
    assert any("fp4" in n and "fp8" in n for n in report.notes)
    stored = saved_tensors(tmp_path / "fp4")
    files = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "fp4.gguf")).tensors}
    name = "model.layers.3.ffn.experts.5.w2.weight"
    want = fp4_group.dequantize_reference(stored[name], stored[name + "_scale_inv"].float())
    assert torch.equal(torch.from_numpy(np.array(files["blk.3.ffn_down_exps.weight"].data[5])), want)

"""quantization="int8" | "int4": a float checkpoint's weights put into Q8_0 / Q4_0 blocks at load.

Oracle, independent of the engine: gguf-py quantizes and dequantizes each weight the engine holds
in blocks (gguf.quants: llama.cpp's reference arithmetic), the results are written into a copy of
the folder, and transformers runs that copy. The engine on the original folder with quantization
must agree with it to fp32 rounding (<= fp32_logits_tol, 100% top-1): same quantized values, same model.
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from conftest import compare_logits, fp32_logits_tol
from hf_models import hf_logits, random_ids
from safetensors.torch import load_file, save_file

from mlaserve import LLM
from mlaserve.config.model import ConfigError
from mlaserve.quant.ggml_linear import GGUFEmbedding, GGUFExperts, GGUFLinear

TYPES = {"int8": gguf.GGMLQuantizationType.Q8_0, "int4": gguf.GGMLQuantizationType.Q4_0}
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _roundtrip(w: torch.Tensor, t) -> torch.Tensor:
    q = gguf.quants.quantize(w.float().numpy(), t)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(q, t))).reshape(w.shape)


def held_in_blocks(model) -> dict[str, int]:
    """checkpoint tensor name -> ggml type, for every weight the engine holds in blocks."""
    out = {}
    tied = model.lm_head.weight is model.model.embed_tokens.weight  # no lm_head tensor of its own
    for name, m in model.named_modules():
        if isinstance(m, (GGUFLinear, GGUFEmbedding)) and not (tied and name == "lm_head"):
            out[f"{name}.weight"] = m.ggml_type
        elif isinstance(m, GGUFExperts):
            for e in range(m.down_proj.shape[0]):
                for proj, t in (("gate_proj", m.type_gate_up), ("up_proj", m.type_gate_up), ("down_proj", m.type_down)):
                    out[f"{name}.{e}.{proj}.weight"] = t
    return out


def fake_quantized_folder(src, dst, held: dict[str, int]):
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    for f in src.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name in tensors:
            if name in held:
                tensors[name] = _roundtrip(tensors[name], gguf.GGMLQuantizationType(held[name])).to(tensors[name].dtype)
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    return dst


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["v3_yarn", "v32", "v3_tied"])
def test_engine_with_quantization_equals_transformers_on_the_same_quantized_values(
    hf_model_dir, tmp_path, kind, scheme
):
    folder, _ = hf_model_dir(kind)
    llm = LLM(str(folder), quantization=scheme, max_num_batched_tokens=24, page_size=8)
    held = held_in_blocks(llm.loaded.model)
    # the rule: every linear with whole 32-value rows but kv_b_proj and the router, experts, embedding, lm_head
    assert any(".mlp.experts." in n for n in held) and "model.embed_tokens.weight" in held
    assert not any("kv_b_proj" in n or n.endswith("mlp.gate.weight") for n in held)
    assert held["model.embed_tokens.weight"] == Q8_0  # int4 keeps the embedding (and lm_head) at 8 bits
    assert {t for n, t in held.items() if "experts" in n} == {TYPES[scheme]}
    ids = random_ids(48)
    ref = hf_logits(_hf(fake_quantized_folder(folder, tmp_path / "fake", held)), ids)
    got = llm.prompt_logits(ids)
    diff, top1 = compare_logits(got, ref)
    assert diff <= fp32_logits_tol(ref) and top1 == 1.0, (kind, scheme, diff, top1)


def test_native_and_torch_kernels_agree_and_decode_runs(hf_model_dir):
    from mlaserve import SamplingParams
    from mlaserve.kernels import native

    if not native.status().available:
        pytest.skip(f"native kernels unavailable: {native.status().detail}")
    folder, _ = hf_model_dir("v3_yarn")
    ids = random_ids(30)
    runs = {}
    for kernel in ("native", "torch"):
        llm = LLM(str(folder), quantization="int4", kernels=kernel, device="cpu", max_num_batched_tokens=8)
        out = llm.generate([ids[:10]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        runs[kernel] = llm.prompt_logits(ids), out[0].outputs[0].token_ids
    assert (runs["native"][0] - runs["torch"][0]).abs().max().item() <= 1e-5
    assert runs["native"][1] == runs["torch"][1]


def test_resident_weights_shrink(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")

    def weight_bytes(llm):
        m = llm.loaded.model
        return sum(t.nbytes for t in {id(p): p for p in list(m.parameters()) + list(m.buffers())}.values())

    full = weight_bytes(LLM(str(folder)))
    int8 = weight_bytes(LLM(str(folder), quantization="int8"))
    int4 = weight_bytes(LLM(str(folder), quantization="int4"))
    # tiny model: q_b_proj (48-wide rows) and kv_b_proj stay fp32, so the ratios are above 34/128 and 18/128
    assert int4 < int8 < 0.45 * full, (full, int8, int4)


def test_quantization_is_recorded_and_refused_where_it_does_not_apply(hf_model_dir, tmp_path):
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder), quantization="int8")
    prov = {s.name: s for s in llm.config.provenance}
    assert prov["quantization"].value == "int8" and "Q8_0" in prov["quantization"].source
    rows = {s.name: s for s in llm.loaded.quantized_at_load}
    assert "blocks at load" in rows["quantized model.layers.*.mlp.experts"].source
    assert "kv_b_proj" in " ".join(rows)
    with pytest.raises(ConfigError, match="quantization must be one of"):
        LLM(str(folder), quantization="int3")
    from mlaserve.quant.writer import write_fp8_folder

    write_fp8_folder(folder, tmp_path / "fp8", "fp8", (16, 16))
    with pytest.raises(ConfigError, match="is for float checkpoints"):
        LLM(str(tmp_path / "fp8"), quantization="int8")


def test_a_gguf_is_already_quantized():
    from conftest import fixture_dir

    gguf_file = next(fixture_dir("ds3").glob("*q8_0*.gguf"))
    with pytest.raises(ConfigError, match="already GGUF block-quantized"):
        LLM(str(gguf_file), quantization="int4")


def test_a_nan_weight_is_named(hf_model_dir, tmp_path):
    from mlaserve.loading.safetensors_source import WeightError

    folder, _ = hf_model_dir("v3_yarn")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        shutil.copy(f, bad / f.name)
    for f in bad.glob("*.safetensors"):
        tensors = load_file(str(f))
        if "model.layers.1.self_attn.o_proj.weight" in tensors:
            tensors["model.layers.1.self_attn.o_proj.weight"][3, 5] = float("nan")
            save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"model\.layers\.1\.self_attn\.o_proj.*NaN"):
        LLM(str(bad), quantization="int8")

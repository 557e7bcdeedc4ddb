"""`mlaserve convert` (HF folder -> GGUF) against llama.cpp's own converter and transformers.

1. Every fixture converted to f32/f16/q8_0 equals llama.cpp's model-<type>.gguf: same tensor
   names, shapes, ggml types and bytes; same metadata keys, value types and values; in fact
   the same file, byte for byte.
2. Round trips HF -> `mlaserve convert` -> `LLM(out.gguf)`: f32 vs hf_logits; f16/q8_0 vs the
   fixture's hf_dequant_logits_<type> (our files are byte-identical to llama.cpp's, test 1);
   bf16 (no llama.cpp file) vs transformers run on our file's dequantized weights; tiny models
   for what the fixtures lack (YaRN, tied embeddings + half-split rope, glm4_moe_lite, shared
   DSA indexers, MTP layers, FP8 checkpoints).
3. Our F16/BF16/Q8_0 tensors equal the gguf package's quantization of the same values.
4. (optional) llama-cpp-python loads our file and reproduces the fixture's llama.cpp logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compare_logits, fixture_dir, fp32_logits_tol
from hf_models import hf_logits, random_ids

from mlaserve import LLM
from mlaserve.entrypoints.cli import main as cli
from mlaserve.gguf.convert.convert import ConvertError, convert_hf_to_gguf, tensor_type
from mlaserve.gguf.convert.writer import (
    BF16,
    BOOL,
    F16,
    F32,
    FLOAT64,
    INT8,
    INT32,
    Q4_0,
    Q8_0,
    STRING,
    UINT64,
    GGUFWriteError,
    GGUFWriter,
    MetaValue,
    array,
    boolean,
    f32,
    i32,
    quantize,
    string,
    u32,
)
from mlaserve.gguf.read.file import open_gguf

gguf = pytest.importorskip("gguf")

MODELS = ("ds3", "ds2lite", "ds32", "glm5")
# Keys llama.cpp may write that we do not: descriptive general.* keys its Metadata heuristics take
# from a model card / repo id (none for the fixtures, whose folders have no README).
LLAMACPP_ONLY_ALLOWED = {
    "general.basename",
    "general.finetune",
    "general.version",
    "general.organization",
    "general.license",
    "general.license.name",
    "general.license.link",
    "general.tags",
    "general.languages",
    "general.datasets",
    "general.base_model.count",
    "general.repo_url",
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(model, outtype) -> our GGUF written by the CLI, once per module."""
    out_dir, done = tmp_path_factory.mktemp("converted"), {}

    def get(model: str, outtype: str) -> Path:
        if (model, outtype) not in done:
            out = out_dir / f"{model}-{outtype}.gguf"
            assert cli(["convert", str(fixture_dir(model)), str(out), "--outtype", outtype]) == 0
            done[model, outtype] = out
        return done[model, outtype]

    return get


def _expected(model: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(fixture_dir(model) / "expected.safetensors"))


def _assert_logits(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float | None = None) -> None:
    """Within fp32 rounding of the reference's own scale (conftest.fp32_logits_tol) unless `tol` says otherwise."""
    tol = fp32_logits_tol(ref) if tol is None else tol
    diff, top1 = compare_logits(got, ref)
    assert diff <= tol and top1 == 1.0, f"{what}: max|diff| {diff:.3g}, top-1 {100 * top1:.1f}%"


# =============================================================================================
# 1. same file as llama.cpp's converter


def _metadata_diff(ours, theirs) -> tuple[list, list, list]:
    a, b = ours.metadata, theirs.metadata
    differ = [k for k in set(a) & set(b) if a[k] != b[k] or ours.value_types[k] != theirs.value_types[k]]
    return sorted(set(a) - set(b)), sorted(set(b) - set(a)), sorted(differ)


def _tensor_diff(ours, theirs) -> list[str]:
    bad = sorted(set(ours.tensors) ^ set(theirs.tensors))
    for name in set(ours.tensors) & set(theirs.tensors):
        x, y = ours.tensors[name], theirs.tensors[name]
        if x.ne != y.ne or x.ggml_type != y.ggml_type:
            bad.append(f"{name}: ne {x.ne} {x.type_name} vs {y.ne} {y.type_name}")
        elif not torch.equal(ours.raw(name), theirs.raw(name)):
            bad.append(f"{name}: data")
    return bad


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("model", MODELS)
def test_same_file_as_llamacpp_converter(converted, model, outtype):
    ours_path, theirs_path = converted(model, outtype), fixture_dir(model) / f"model-{outtype}.gguf"
    ours, theirs = open_gguf(ours_path), open_gguf(theirs_path)
    only_ours, only_theirs, differ = _metadata_diff(ours, theirs)
    assert not only_ours and not differ, (only_ours, [(k, ours.metadata[k], theirs.metadata[k]) for k in differ])
    assert set(only_theirs) <= LLAMACPP_ONLY_ALLOWED, only_theirs
    assert _tensor_diff(ours, theirs) == []
    # and even key / tensor order and padding: the whole file is the same
    assert ours_path.read_bytes() == theirs_path.read_bytes()


# =============================================================================================
# 2. round trips through the engine


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("model", MODELS)
def test_round_trip_fixture(converted, model, outtype):
    exp = _expected(model)
    got = LLM(str(converted(model, outtype)), max_num_batched_tokens=128).prompt_logits(exp["input_ids"].tolist())
    # f32: the weights round-trip exactly; f16/q8_0: the file is llama.cpp's, byte for byte (test 1)
    ref = exp["hf_logits"] if outtype == "f32" else exp[f"hf_dequant_logits_{outtype}"]
    _assert_logits(got, ref, f"{model} {outtype}")


# HF matrices the converter keeps in F32 (llama.cpp: ffn_gate_inp, indexer.proj): the router and indexer weights
F32_MATRICES = ("mlp.gate.weight", "indexer.weights_proj.weight")


def _transformers_on_bf16_rounded(path: Path, config_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers (fp32, eager) on the HF folder's own weights, each rounded as the bf16 file stores it: every
    matrix in BF16 but the router / indexer weights, every vector in F32. That storage is read from the file with
    the gguf package (llama.cpp's reader, not ours): its BF16 and F32 element counts must be those of the rule."""
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    def rounded(name: str, t: torch.Tensor) -> bool:
        return t.dim() >= 2 and not name.endswith(F32_MATRICES)

    tensors = load_file(str(config_dir / "model.safetensors"))
    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    rule = {"BF16": sum(t.numel() for n, t in tensors.items() if rounded(n, t))}
    rule["F32"] = sum(t.numel() for t in tensors.values()) - rule["BF16"]
    assert counts == rule, (counts, rule)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        config_dir, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for name, param in model.named_parameters():  # transformers' names (its experts merged): the same rule
            if rounded(name, param):
                param.copy_(param.bfloat16().float())
        return model.eval()(torch.tensor([ids]), use_cache=False).logits[0]


@pytest.mark.parametrize("model", MODELS)
def test_round_trip_bf16(converted, model):
    """No llama.cpp bf16 file: the reference is transformers on the original weights rounded to bf16 as the file
    stores them."""
    ids = _expected(model)["input_ids"].tolist()
    path = converted(model, "bf16")
    got = LLM(str(path), max_num_batched_tokens=128).prompt_logits(ids)
    _assert_logits(got, _transformers_on_bf16_rounded(path, fixture_dir(model), ids), f"{model} bf16")
    types = {t.type_name for t in open_gguf(path).tensors.values()}
    assert types == {"F32", "BF16"}


def _byte_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (3 specials + byte symbols, no merges) for tiny test models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())[: vocab_size - 3]
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2} | {s: i + 3 for i, s in enumerate(symbols)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<s>", "</s>", "<pad>"])
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    tk.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


TINY = {  # kind -> metadata the file must have (GGUF key suffix after the arch -> value)
    "v3_yarn": {
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 32,
        "rope.scaling.yarn_log_multiplier": np.float32(0.1),
        "expert_gating_func": 2,
    },
    "v3_tied": {"leading_dense_block_count": 2, "expert_gating_func": 2},
    "glm_lite": {"leading_dense_block_count": 1, "expert_group_count": 1},
    "glm_dsa_shared": {"attention.indexer.types": [True, False, True], "attention.indexer.top_k": 16},
}


@pytest.mark.parametrize("kind", list(TINY))
def test_round_trip_tiny_model(hf_model_dir, tmp_path, kind):
    shared, model = hf_model_dir(kind)
    folder = tmp_path / kind  # a copy: the session's model folder has no tokenizer and keeps none
    shutil.copytree(shared, folder)
    _byte_tokenizer(folder, model.config.vocab_size)
    out = tmp_path / f"{kind}.gguf"
    assert cli(["convert", str(folder), str(out), "--outtype", "f32"]) == 0
    md = open_gguf(out).metadata
    arch = md["general.architecture"]
    for key, value in TINY[kind].items():
        assert md[f"{arch}.{key}"] == value, key
    assert ("output.weight" in open_gguf(out).tensors) != model.config.tie_word_embeddings
    ids = random_ids(40, vocab=model.config.vocab_size)
    _assert_logits(LLM(str(out), max_num_batched_tokens=16).prompt_logits(ids), hf_logits(model, ids), kind)


def _copy_fixture(model: str, dst: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import load_file, save_file

    src = fixture_dir(model)
    dst.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    cfg = json.loads((src / "config.json").read_text()) | config
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(load_file(str(src / "model.safetensors")) | tensors, str(dst / "model.safetensors"))
    return dst


def _mtp_layer(model: str, n: int) -> dict[str, torch.Tensor]:
    """A fake MTP block N (a copy of layer N-1 plus the nextn extras), as DeepSeek/GLM ship it."""
    from safetensors.torch import load_file

    sd = load_file(str(fixture_dir(model) / "model.safetensors"))
    out = {k.replace(f"layers.{n - 1}.", f"layers.{n}."): v for k, v in sd.items() if f"layers.{n - 1}." in k}
    emb = sd["model.embed_tokens.weight"]
    D = emb.shape[1]
    extra = {
        "eh_proj.weight": torch.randn(D, 2 * D),
        "enorm.weight": torch.ones(D),
        "hnorm.weight": torch.ones(D),
        "embed_tokens.weight": emb.clone(),
        "shared_head.head.weight": emb.clone(),
        "shared_head.norm.weight": torch.ones(D),
    }
    return out | {f"model.layers.{n}.{k}": v for k, v in extra.items()}


@pytest.mark.parametrize("model,kept", [("ds32", True), ("ds3", False)])
def test_mtp_layers(tmp_path, model, kept):
    """deepseek32/glm-dsa keep the nextn block (block_count counts it); deepseek2 drops it."""
    folder = _copy_fixture(model, tmp_path / model, _mtp_layer(model, 3), {"num_nextn_predict_layers": 1})
    report = convert_hf_to_gguf(folder, tmp_path / "out.gguf", "f32")
    gf = open_gguf(report.path)
    arch = gf.metadata["general.architecture"]
    assert gf.metadata[f"{arch}.block_count"] == (4 if kept else 3)
    assert ("blk.3.nextn.eh_proj.weight" in gf.tensors) == kept and ("blk.3.attn_k_b.weight" in gf.tensors) == kept
    assert (len(report.skipped) == 0) == kept
    if kept:
        assert gf.metadata[f"{arch}.nextn_predict_layers"] == 1
        assert gf.tensors["blk.3.nextn.enorm.weight"].type_name == "F32"
    exp = _expected(model)
    _assert_logits(LLM(str(report.path)).prompt_logits(exp["input_ids"].tolist()), exp["hf_logits"], f"{model} + MTP")


def test_fp8_block_scaled_checkpoint(tmp_path):
    """DeepSeek's released FP8 weights (weight_scale_inv per 128x128 block) are dequantized."""
    from safetensors.torch import load_file

    name = "model.layers.1.self_attn.q_b_proj.weight"
    w = load_file(str(fixture_dir("ds3") / "model.safetensors"))[name]  # [192, 48]
    scale = torch.tensor([[0.5], [0.25]])  # blocks of 128 rows
    fp8 = (w / scale.repeat_interleave(128, 0)[: w.shape[0]]).to(torch.float8_e4m3fn)
    folder = _copy_fixture(
        "ds3",
        tmp_path / "ds3fp8",
        {name: fp8, name + "_scale_inv": scale},
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
    )
    out = convert_hf_to_gguf(folder, tmp_path / "fp8.gguf", "f32").path
    want = fp8.float() * torch.cat([torch.full((128, 48), 0.5), torch.full((64, 48), 0.25)])
    assert torch.equal(open_gguf(out).tensor("blk.1.attn_q_b.weight"), want)


def test_cli_reports_errors(tmp_path, capsys):
    assert cli(["convert", str(tmp_path / "missing"), str(tmp_path / "x.gguf")]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


def test_unrecognized_pre_tokenizer_is_an_error(tmp_path):
    folder = _copy_fixture("ds2lite", tmp_path / "m", {}, {})
    tj = json.loads((folder / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, tj["pre_tokenizer"]],
    }
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ConvertError, match="pre-tokenizer not recognized"):
        convert_hf_to_gguf(folder, tmp_path / "o.gguf", "f32")
    report = convert_hf_to_gguf(folder, tmp_path / "o.gguf", "f32", pre_tokenizer="deepseek-v3")
    assert open_gguf(report.path).metadata["tokenizer.ggml.pre"] == "deepseek-v3"


# =============================================================================================
# 3. quantization equals the gguf package's


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_tensors_equal_gguf_package_quantization(converted, outtype):
    """glm5 has every case: forced F32 (norms, router, indexer.proj, biases), Q8_0 -> F16 fallback
    (48-wide rows of attn_q_b / attn_k_b), 3-D stacks."""
    ours, source = open_gguf(converted("glm5", outtype)), open_gguf(converted("glm5", "f32"))
    fallbacks = 0
    for name, info in ours.tensors.items():
        values = source.tensor(name).numpy()
        assert info.ggml_type == tensor_type(name, info.shape, outtype), name
        ref = np.asarray(gguf.quants.quantize(values, gguf.GGMLQuantizationType(info.ggml_type))).view(np.uint8)
        assert np.array_equal(ours.raw(name).numpy(), ref.reshape(-1)), name
        fallbacks += outtype == "q8_0" and info.ggml_type == F16
    assert outtype != "q8_0" or fallbacks > 0
    assert ours.tensors["blk.1.indexer.proj.weight"].ggml_type == F32
    assert ours.tensors["blk.1.ffn_gate_inp.weight"].ggml_type == F32


def _edge_values() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**32, (16, 64), generator=g).to(torch.int32).view(torch.float32)
    return [
        torch.randn(32, 64, generator=g),
        torch.randn(8, 64, generator=g) * 1e-30,
        torch.randn(8, 64, generator=g) * 1e5,
        torch.zeros(2, 64),
        torch.randint(-254, 255, (8, 64), generator=g) / 2.0,  # exact .5 ties
        bits,
    ]  # every bit pattern, NaN/Inf too


@pytest.mark.parametrize("ggml_type", [F32, F16, BF16, Q8_0, Q4_0], ids=["F32", "F16", "BF16", "Q8_0", "Q4_0"])
def test_quantizers_match_gguf_package(ggml_type):
    for x in _edge_values():
        if ggml_type in (Q8_0, Q4_0) and not bool(torch.isfinite(x).all()):
            with pytest.raises(GGUFWriteError, match="NaN or Inf"):
                quantize(x, ggml_type)
            continue
        with np.errstate(all="ignore"):
            ref = np.asarray(gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType(ggml_type))).view(np.uint8)
        assert np.array_equal(quantize(x, ggml_type).numpy(), ref.reshape(-1))


# =============================================================================================
# the writer itself


def _write_small(path: Path, alignment: int = 32, chunks=None) -> GGUFWriter:
    w = GGUFWriter(path, alignment=alignment)
    values = {
        "t.u32": u32(7),
        "t.i32": i32(-3),
        "t.f32": f32(0.25),
        "t.bool": boolean(True),
        "t.str": string("héllo"),
        "t.i8": MetaValue(-5, INT8),
        "t.u64": MetaValue(2**40, UINT64),
        "t.f64": MetaValue(1e-300, FLOAT64),
        "t.strs": array(["a", "b c", ""], STRING),
        "t.bools": array([True, False], BOOL),
        "t.ints": array([1, -2], INT32),
    }
    for k, v in values.items():
        w.add(k, v)
    w.add_tensor("a", (3, 64), Q8_0)
    w.add_tensor("b", (5,), F32)
    data = {"a": torch.linspace(-1, 1, 192).reshape(3, 64), "b": torch.arange(5.0)}
    w.write(chunks or (lambda spec: iter([data[spec.name]])))
    return w


@pytest.mark.parametrize("alignment", [32, 64])
def test_writer_round_trips_through_both_readers(tmp_path, alignment):
    path = tmp_path / "small.gguf"
    _write_small(path, alignment)
    gf = open_gguf(path)
    assert gf.metadata["t.str"] == "héllo" and gf.metadata["t.strs"] == ["a", "b c", ""]
    assert gf.metadata["t.u64"] == 2**40 and gf.metadata["t.ints"] == [1, -2]
    assert gf.metadata["t.bools"] == [True, False]
    assert ("general.alignment" in gf.metadata) == (alignment != 32)
    assert all(i.offset % alignment == 0 for i in gf.tensors.values())
    assert torch.equal(gf.tensor("b"), torch.arange(5.0))
    r = gguf.GGUFReader(path)
    assert r.fields["t.f64"].contents() == 1e-300 and r.fields["t.i8"].contents() == -5
    a = next(t for t in r.tensors if t.name == "a")
    ref = gguf.quants.dequantize(
        gguf.quants.quantize(np.linspace(-1, 1, 192, dtype=np.float32).reshape(3, 64), gguf.GGMLQuantizationType.Q8_0),
        gguf.GGMLQuantizationType.Q8_0,
    )
    assert np.array_equal(gguf.quants.dequantize(a.data, a.tensor_type), ref)


def test_writer_refuses_bad_input(tmp_path):
    w = GGUFWriter(tmp_path / "x.gguf")
    w.add("k", u32(1))
    with pytest.raises(GGUFWriteError, match="twice"):
        w.add("k", u32(2))
    with pytest.raises(GGUFWriteError, match="cannot be stored as Q8_0"):
        w.add_tensor("q", (4, 48), Q8_0)
    with pytest.raises(GGUFWriteError, match="'neg': cannot store"):
        w.add("neg", u32(-1))
    short = tmp_path / "short.gguf"
    with pytest.raises(GGUFWriteError, match="needs"):
        _write_small(short, chunks=lambda spec: iter([torch.zeros(1, spec.shape[-1])]))
    assert not short.exists() and not (tmp_path / "short.gguf.part").exists()


# =============================================================================================
# 4. llama.cpp itself (optional: needs llama-cpp-python)


@pytest.mark.parametrize("model", MODELS)
def test_llama_cpp_loads_our_file(converted, model):
    llama_cpp = pytest.importorskip("llama_cpp")
    exp = _expected(model)
    ids = exp["input_ids"].tolist()
    kw = dict(
        n_ctx=max(len(ids), 64),
        n_batch=len(ids),
        n_ubatch=len(ids),
        logits_all=True,
        type_k=0,
        type_v=0,
        n_threads=2,
        verbose=False,
    )
    overrides = {"deepseek2.attention.q_lora_rank": 0} if model == "ds2lite" else None  # see fixtures README
    llm = llama_cpp.Llama(str(converted(model, "f32")), kv_overrides=overrides, **kw)
    llm.eval(ids)
    got = torch.tensor(np.asarray(llm.scores[: len(ids)]), dtype=torch.float32)
    # not measured here (llama_cpp is an optional dependency): llama.cpp's own rounding differs from the fixture's
    # run only by its thread split, kept at the earlier bound until measured
    _assert_logits(got, exp["llamacpp_logits_f32"], f"llama.cpp on our {model} f32", tol=1e-4)

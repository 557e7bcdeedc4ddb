"""GGUF container parsing, split files, and clear errors for malformed files / checkpoints."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_helpers import (
    FIXTURES,
    fixture_params,
    gguf_f32,
    need_fixtures,
    rewrite_gguf,
)

from mlaserve.gguf.read.checkpoint import load_gguf
from mlaserve.gguf.read.file import GGUFError, open_gguf

gguf = pytest.importorskip("gguf")


# ---------------------------------------------------------------------------------------------
# small synthetic files (no fixtures needed)


def write_small(path: Path, *, alignment: int | None = None, names=("t.f32", "t.f16", "t.q8")) -> Path:
    """A tiny GGUF with every metadata value type and F32/F16/Q8_0 tensors."""
    w = gguf.GGUFWriter(path, "test")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("v.u8", 200), w.add_int8("v.i8", -5), w.add_uint16("v.u16", 60000)
    w.add_int16("v.i16", -30000), w.add_uint32("v.u32", 4_000_000_000), w.add_int32("v.i32", -7)
    w.add_float32("v.f32", 0.1), w.add_uint64("v.u64", 2**63 + 5), w.add_int64("v.i64", -(2**40))
    w.add_float64("v.f64", 1e-300), w.add_bool("v.bool", True), w.add_string("v.str", "héllo ✓")
    w.add_array("v.arr_i", [1, -2, 3]), w.add_array("v.arr_f", [0.5, 1.5]), w.add_array("v.arr_s", ["a", "bé", ""])
    w.add_array("v.arr_b", [True, False]), w.add_array("v.nested", [[1, 2], [3]])
    x = np.arange(64, dtype=np.float32).reshape(2, 32) / 7
    w.add_tensor(names[0], x)
    w.add_tensor(names[1], x.astype(np.float16))
    w.add_tensor(
        names[2], gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def info_field_offset(path: Path, name: str, field: str) -> int:
    """Byte offset of a tensor-info field ('name' or 'type') in the header."""
    data = path.read_bytes()
    enc = name.encode()
    at = data.find(struct.pack("<Q", len(enc)) + enc)
    assert at > 0
    if field == "name":
        return at + 8
    p = at + 8 + len(enc)
    n_dims = struct.unpack_from("<I", data, p)[0]
    return p + 4 + 8 * n_dims


def patch(path: Path, offset: int, payload: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + len(payload)] = payload
    path.write_bytes(bytes(data))


def test_metadata_of_every_value_type(tmp_path):
    gf = open_gguf(write_small(tmp_path / "s.gguf"))
    md = gf.metadata
    assert gf.version == 3
    assert (md["v.u8"], md["v.i8"], md["v.u16"], md["v.i16"]) == (200, -5, 60000, -30000)
    assert (md["v.u32"], md["v.i32"], md["v.u64"], md["v.i64"]) == (4_000_000_000, -7, 2**63 + 5, -(2**40))
    assert md["v.f32"] == float(np.float32(0.1)) and md["v.f64"] == 1e-300
    assert md["v.bool"] is True and md["v.str"] == "héllo ✓"
    assert md["v.arr_i"] == [1, -2, 3] and md["v.arr_f"] == [0.5, 1.5] and md["v.arr_s"] == ["a", "bé", ""]
    assert md["v.arr_b"] == [True, False] and md["v.nested"] == [[1, 2], [3]]
    assert gf.value_types["v.f64"] == 12 and gf.value_types["v.arr_s"] == 9


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_tensors_and_alignment(tmp_path, alignment):
    path = write_small(tmp_path / "s.gguf", alignment=alignment)
    gf, ref = open_gguf(path), gguf.GGUFReader(path)
    for t in ref.tensors:
        info = gf.tensors[t.name]
        assert info.ne == tuple(int(x) for x in t.shape) and info.ggml_type == int(t.tensor_type)
        assert info.offset == t.data_offset and info.offset % (alignment or 32) == 0
        assert np.array_equal(gf.tensor(t.name).numpy(), gguf.quants.dequantize(t.data, t.tensor_type))
    assert gf.tensor("t.f32").shape == (2, 32)


def test_version_2_is_accepted(tmp_path):
    path = write_small(tmp_path / "v2.gguf")
    patch(path, 4, struct.pack("<I", 2))  # v2 and v3 share the little-endian layout
    assert open_gguf(path).version == 2


@pytest.mark.parametrize("model,qtype,path", fixture_params())
def test_fixture_headers_match_gguf_package(model, qtype, path):
    gf, ref = open_gguf(path), gguf.GGUFReader(path)
    for key, fld in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        assert gf.value_types[key] == int(fld.types[0]), key
        if key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            assert gf.metadata[key] == fld.contents(), key
    assert gf.metadata["tokenizer.ggml.tokens"] == ref.fields["tokenizer.ggml.tokens"].contents()
    assert [(t.name, tuple(int(x) for x in t.shape), int(t.tensor_type), t.data_offset) for t in ref.tensors] == [
        (i.name, i.ne, i.ggml_type, i.offset) for i in gf.tensors.values()
    ]


def test_f32_tensors_are_views_of_the_map():
    path = need_fixtures() / "ds3" / "model-f32.gguf"
    gf = open_gguf(path)
    base, size = gf.shards[0].mm.ctypes.data, len(gf.shards[0].mm)
    for name in ("token_embd.weight", "blk.1.ffn_up_exps.weight"):
        ptr = gf.tensor(name).untyped_storage().data_ptr()
        assert base <= ptr < base + size, f"{name} was copied"
    expert = gf.slice0("blk.1.ffn_up_exps.weight", 3)
    assert base <= expert.data_ptr() < base + size
    assert torch.equal(expert, gf.tensor("blk.1.ffn_up_exps.weight")[3])


# ---------------------------------------------------------------------------------------------
# split files


def test_split_gguf_is_merged(tmp_path):
    src = need_fixtures() / "ds3" / "model-f32.gguf"
    rewrite_gguf(src, tmp_path / "model.gguf", split_max_tensors=20)
    shards = sorted(tmp_path.glob("model-*-of-*.gguf"))
    assert len(shards) == 3
    whole, split = open_gguf(src), open_gguf(shards[1])  # any shard opens the whole model
    assert split.paths == shards
    assert list(split.tensors) == list(whole.tensors)
    for key, value in whole.metadata.items():
        assert split.metadata[key] == value, key
    assert split.metadata["split.count"] == 3
    for name in ("token_embd.weight", "blk.2.attn_k_b.weight", "output.weight"):
        assert torch.equal(split.tensor(name), whole.tensor(name))
    ck = load_gguf(shards[0])
    assert ck.hf_config == load_gguf(src).hf_config


def test_split_gguf_missing_shard(tmp_path):
    src = need_fixtures() / "ds3" / "model-f32.gguf"
    rewrite_gguf(src, tmp_path / "model.gguf", split_max_tensors=20)
    (tmp_path / "model-00003-of-00003.gguf").unlink()
    with pytest.raises(GGUFError, match="missing shard.*model-00003-of-00003.gguf"):
        open_gguf(tmp_path / "model-00001-of-00003.gguf")


# ---------------------------------------------------------------------------------------------
# malformed containers


def test_bad_magic(tmp_path):
    path = write_small(tmp_path / "magic.gguf")
    patch(path, 0, b"GGUX")
    with pytest.raises(GGUFError, match=r"magic\.gguf: bad magic b'GGUX'"):
        open_gguf(path)


@pytest.mark.parametrize("version", [1, 4, 0x03000000])
def test_unsupported_version(tmp_path, version):
    path = write_small(tmp_path / "ver.gguf")
    patch(path, 4, struct.pack("<I", version))
    with pytest.raises(GGUFError, match=rf"ver\.gguf: unsupported GGUF version {version}"):
        open_gguf(path)


def test_truncated_tensor_data(tmp_path):
    path = write_small(tmp_path / "trunc.gguf")
    path.write_bytes(path.read_bytes()[:-40])  # the last tensor is padded to 32
    with pytest.raises(GGUFError, match=r"trunc\.gguf: truncated file: tensor 't\.q8'"):
        open_gguf(path)


def test_truncated_header(tmp_path):
    path = write_small(tmp_path / "head.gguf")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(GGUFError, match=r"head\.gguf: truncated file"):
        open_gguf(path)


def test_truncated_fixture(tmp_path):
    src = need_fixtures() / "ds3" / "model-q4_k_m.gguf"
    dst = tmp_path / "cut.gguf"
    dst.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(GGUFError, match=r"cut\.gguf: truncated file: tensor '.+' needs bytes"):
        load_gguf(dst)


def test_unknown_ggml_type(tmp_path):
    path = write_small(tmp_path / "type.gguf")
    patch(path, info_field_offset(path, "t.q8", "type"), struct.pack("<I", 99))
    with pytest.raises(GGUFError, match=r"type\.gguf: tensor 't\.q8' has unknown ggml type id 99"):
        open_gguf(path)


def test_duplicate_tensor_name(tmp_path):
    path = write_small(tmp_path / "dup.gguf", names=("dup.a", "dup.b", "dup.c"))
    patch(path, info_field_offset(path, "dup.c", "name"), b"dup.a")
    with pytest.raises(GGUFError, match=r"dup\.gguf: duplicate tensor name 'dup\.a'"):
        open_gguf(path)


def test_not_a_file(tmp_path):
    with pytest.raises(GGUFError, match="no such GGUF file"):
        open_gguf(tmp_path / "nope.gguf")


# ---------------------------------------------------------------------------------------------
# malformed checkpoints (valid containers, wrong model contents)


def _fixture(model: str, qtype: str = "f32") -> Path:
    return need_fixtures() / model / f"model-{qtype}.gguf"


def test_missing_tensor(tmp_path):
    dst = rewrite_gguf(_fixture("ds3"), tmp_path / "m.gguf", drop_tensors={"blk.1.attn_kv_a_norm.weight"})
    with pytest.raises(
        GGUFError,
        match=r"m\.gguf: missing tensor 'blk\.1\.attn_kv_a_norm\.weight' "
        r"\(needed for model\.layers\.1\.self_attn\.kv_a_layernorm\.weight\)",
    ):
        load_gguf(dst)


def test_missing_expert_tensor(tmp_path):
    dst = rewrite_gguf(_fixture("ds32"), tmp_path / "m.gguf", drop_tensors={"blk.2.ffn_down_exps.weight"})
    with pytest.raises(GGUFError, match=r"missing tensor 'blk\.2\.ffn_down_exps\.weight'.*experts\.\*\.down_proj"):
        load_gguf(dst)


def test_missing_global_tensor(tmp_path):
    dst = rewrite_gguf(_fixture("ds2lite"), tmp_path / "m.gguf", drop_tensors={"output_norm.weight"})
    with pytest.raises(GGUFError, match=r"m\.gguf: missing tensor 'output_norm\.weight'"):
        load_gguf(dst)


def _k_b_wrong_way(path: Path, layer: int) -> np.ndarray:
    k_b = gguf_f32(path, f"blk.{layer}.attn_k_b.weight")  # [H, kv_lora, nope]
    return np.ascontiguousarray(k_b.transpose(0, 2, 1))  # [H, nope, kv_lora]: the HF orientation


def test_k_b_stored_the_wrong_way(tmp_path):
    src = _fixture("glm5")  # nope 48 != kv_lora 32, so the orientation is visible in the shape
    dst = rewrite_gguf(src, tmp_path / "kb.gguf", replace={"blk.1.attn_k_b.weight": _k_b_wrong_way(src, 1)})
    with pytest.raises(
        GGUFError,
        match=r"kb\.gguf: tensor 'blk\.1\.attn_k_b\.weight' is stored the wrong way round: "
        r"torch shape \[4, 48, 32\].*expected .*\[4, 32, 48\]",
    ):
        load_gguf(dst)


def test_v_b_stored_the_wrong_way(tmp_path):
    src = _fixture("glm5")  # v 64 != kv_lora 32
    v_b = gguf_f32(src, "blk.0.attn_v_b.weight").transpose(0, 2, 1)
    dst = rewrite_gguf(src, tmp_path / "vb.gguf", replace={"blk.0.attn_v_b.weight": v_b})
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.attn_v_b\.weight' is stored the wrong way round"):
        load_gguf(dst)


def test_wrong_shape_names_tensor(tmp_path):
    dst = rewrite_gguf(
        _fixture("ds32"), tmp_path / "s.gguf", replace={"blk.2.indexer.attn_k.weight": np.zeros((32, 128), np.float32)}
    )
    with pytest.raises(
        GGUFError,
        match=r"s\.gguf: tensor 'blk\.2\.indexer\.attn_k\.weight' has shape \[32, 128\].*"
        r"expected \[64, 128\]",
    ):
        load_gguf(dst)


@pytest.mark.parametrize(
    "key",
    [
        "attention.kv_lora_rank",
        "block_count",
        "embedding_length",
        "attention.head_count",
        "attention.indexer.top_k",
        "context_length",
    ],
)
def test_required_key_missing(tmp_path, key):
    dst = rewrite_gguf(_fixture("glm5"), tmp_path / "k.gguf", drop_keys={f"glm-dsa.{key}"})
    with pytest.raises(GGUFError, match=rf"k\.gguf: required metadata key 'glm-dsa\.{key}' is missing"):
        load_gguf(dst)


def test_unknown_tensor_names(tmp_path):
    dst = rewrite_gguf(_fixture("ds3"), tmp_path / "u.gguf", add={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(GGUFError, match=r"u\.gguf: unexpected tensor 'blk\.0\.mystery\.weight'"):
        load_gguf(dst)
    dst = rewrite_gguf(_fixture("ds3"), tmp_path / "g.gguf", add={"rope_freqs.weight": np.zeros(4, np.float32)})
    with pytest.raises(GGUFError, match=r"g\.gguf: unknown tensor 'rope_freqs\.weight'"):
        load_gguf(dst)


def test_tensor_beyond_block_count(tmp_path):
    dst = rewrite_gguf(_fixture("ds3"), tmp_path / "b.gguf", add={"blk.3.attn_norm.weight": np.ones(256, np.float32)})
    with pytest.raises(GGUFError, match=r"b\.gguf: tensor 'blk\.3\.attn_norm\.weight' belongs to no block"):
        load_gguf(dst)


def test_q_lora_key_inconsistent_with_tensors(tmp_path):
    dst = rewrite_gguf(_fixture("ds3"), tmp_path / "q.gguf", drop_keys={"deepseek2.attention.q_lora_rank"})
    with pytest.raises(GGUFError, match=r"missing tensor 'blk\.0\.attn_q\.weight'"):
        load_gguf(dst)


def test_not_an_mla_architecture(tmp_path):
    with pytest.raises(GGUFError, match=r"general\.architecture='test' is not an MLA architecture"):
        load_gguf(write_small(tmp_path / "s.gguf"))


def test_fixture_folder_constant():
    """The GGUF helpers and conftest look for the shared fixtures in the same folder."""
    import conftest

    assert FIXTURES == conftest.FIXTURES, (FIXTURES, conftest.FIXTURES)

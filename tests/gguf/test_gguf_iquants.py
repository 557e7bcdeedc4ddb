"""The i-quants (IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) and the ternary TQ1_0 /
TQ2_0: decoded bit-identically to gguf-py's dequantizers (the reference), on blocks that reach every code of the
type's table or grid, and on tensors of hidden size 256 (one super-block per row)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES, dequantize
from mlaserve.loading.tensor_check import SCALE_OFFSETS

gguf = pytest.importorskip("gguf")

IQ_TYPES = ("IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")
# grid entries per type (ggml-common.h): a test's blocks must index every one of them
GRID_ENTRIES = {
    "IQ2_XXS": 256,
    "IQ2_XS": 512,
    "IQ2_S": 1024,
    "IQ3_XXS": 256,
    "IQ3_S": 512,
    "IQ1_S": 2048,
    "IQ1_M": 2048,
}


def iq_blocks(name: str, n_blocks: int, seed: int) -> np.ndarray:
    """Random valid blocks [n_blocks, type_size]: random bytes, every fp16 d a finite value of a sane size
    (IQ1_M: its d's 16 bits spread over the top nibbles of the 4 scale words)."""
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, t.type_size), dtype=np.uint8)
    d = (rng.random(n_blocks) * 0.02 + 0.001).astype(np.float16)
    for off in SCALE_OFFSETS[name]:
        raw[:, off : off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    if name == "IQ1_M":
        bits = d.view(np.uint16).astype(np.uint16)
        words = raw[:, 48:56].copy().view(np.uint16)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        raw[:, 48:56] = words.view(np.uint8)
    return raw


def _grid_indices(name: str, raw: np.ndarray) -> np.ndarray:
    """The grid index of every 8 (IQ3: 4) values of the blocks, read as the format lays them out."""
    b = raw.astype(np.int64)
    n = b.shape[0]
    if name in ("IQ2_XXS",):
        return b[:, 2:66].reshape(n, 8, 8)[..., :4].reshape(-1)
    if name == "IQ3_XXS":
        return b[:, 2:66].reshape(-1)
    if name == "IQ2_XS":
        return (b[:, 2:66:2] | (b[:, 3:66:2] << 8)).reshape(-1) & 511
    if name == "IQ2_S":
        qh = (b[:, 66:74, None] >> np.array([0, 2, 4, 6])) & 3
        return (b[:, 2:34] | (qh.reshape(n, 32) << 8)).reshape(-1)
    if name == "IQ3_S":
        qh = (b[:, 66:74, None] >> np.arange(8)) & 1
        return (b[:, 2:66] | (qh.reshape(n, 64) << 8)).reshape(-1)
    if name == "IQ1_S":
        qh = b[:, 34:50:2] | (b[:, 35:50:2] << 8)
        hi = (qh[..., None] >> np.array([0, 3, 6, 9])) & 7
        return (b[:, 2:34] | (hi.reshape(n, 32) << 8)).reshape(-1)
    nib = (b[:, 32:48, None] >> np.array([0, 4])) & 7  # IQ1_M
    return (b[:, :32] | (nib.reshape(n, 32) << 8)).reshape(-1)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("name", IQ_TYPES)
def test_every_code_decodes_as_gguf_py(name):
    """Enough random blocks that every grid entry / table code occurs (asserted), each block's values equal to
    gguf-py's bit for bit."""
    tid = GGML_TYPE_IDS[name]
    t = GGML_TYPES[tid]
    n = 4096 if name in GRID_ENTRIES else 64
    raw = iq_blocks(name, n, seed=tid)
    if name in GRID_ENTRIES:
        assert len(np.unique(_grid_indices(name, raw))) == GRID_ENTRIES[name]
    if name in ("IQ4_NL", "IQ4_XS"):
        codes = raw[:, 2:] if name == "IQ4_NL" else raw[:, 8:]
        assert len(np.unique(np.concatenate([codes & 0x0F, codes >> 4]))) == 16
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(tid)).reshape(n, t.block_size)
    got = dequantize(torch.from_numpy(raw.copy()), tid, (n, t.block_size)).numpy()
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    assert _same_bits(got, want), (name, np.abs(got - want).max())


@pytest.mark.parametrize("name", IQ_TYPES)
def test_hidden_256_tensor_decodes_as_gguf_py(name):
    """A [24, 256] weight (hidden size 256: one super-block, or eight IQ4_NL blocks, per row) in torch shape."""
    tid = GGML_TYPE_IDS[name]
    t = GGML_TYPES[tid]
    rows = 24
    raw = iq_blocks(name, rows * 256 // t.block_size, seed=100 + tid).reshape(rows, -1)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(tid))
    got = dequantize(torch.from_numpy(raw.copy()), tid, (rows, 256))
    assert got.shape == (rows, 256) and _same_bits(got.numpy(), want)
    with pytest.raises(ValueError, match=f"do not hold a {name} tensor of shape"):
        dequantize(torch.from_numpy(raw.copy()), tid, (rows, 128))  # half the values: not this many bytes


def test_iq1_m_delta_sign_and_split_scale():
    """IQ1_M's two easy-to-miss details, against gguf-py: bit 3 of a qh nibble flips the group's delta
    (+1/8 -> -1/8), and the fp16 d is the top nibbles of the scale words, lowest word first."""
    raw = iq_blocks("IQ1_M", 1, seed=7)
    raw[0, 32:48] = 0x00  # every group: grid entry qs, delta +1/8
    a = dequantize(torch.from_numpy(raw.copy()), GGML_TYPE_IDS["IQ1_M"], (1, 256))
    raw[0, 32] = 0x08  # group 0: delta -1/8
    b = dequantize(torch.from_numpy(raw.copy()), GGML_TYPE_IDS["IQ1_M"], (1, 256))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.IQ1_M)
    assert _same_bits(b.numpy(), want)
    assert torch.equal(a[0, 8:], b[0, 8:]) and (a[0, :8] > b[0, :8]).all()


def _one_tensor_file(path, name: str, blocks: np.ndarray, kind: str, ne: tuple[int, int] | None = None):
    """A GGUF holding one tensor of `kind` with the given bytes; ne (ggml order) patched into its tensor info
    afterwards where given (the dims a broken writer could record)."""
    writer = gguf.GGUFWriter(path, "deepseek2")
    writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if ne is not None:
        data = bytearray(path.read_bytes())
        at = data.index(name.encode()) + len(name)  # then n_dims (u32), ne[0], ne[1] (u64)
        assert int.from_bytes(data[at : at + 4], "little") == 2
        data[at + 4 : at + 20] = ne[0].to_bytes(8, "little") + ne[1].to_bytes(8, "little")
        path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("name", IQ_TYPES)
def test_read_back_and_layout_checked(name, tmp_path):
    """A tensor of the type reads back as gguf-py decodes it; a row length that is not whole blocks, and more
    rows than the bytes hold, are refused with the file and the tensor named."""
    from mlaserve.gguf.read.file import GGUFError, open_gguf

    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    tensor = "blk.0.ffn_up.weight"
    raw = iq_blocks(name, 2 * 256 // t.block_size, seed=5).reshape(2, -1)
    ok = _one_tensor_file(tmp_path / "ok.gguf", tensor, raw, name)
    assert open_gguf(ok).tensors[tensor].ne[:2] == (256, 2)
    got = open_gguf(ok).tensor(tensor)
    assert _same_bits(got.numpy(), gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]))
    bad = _one_tensor_file(tmp_path / "rows.gguf", tensor, raw, name, ne=(t.block_size + 16, 2))
    with pytest.raises(
        GGUFError, match=rf"rows.gguf: tensor '{tensor}' row length {t.block_size + 16} .* {name} block"
    ):
        open_gguf(bad)
    short = _one_tensor_file(tmp_path / "short.gguf", tensor, raw, name, ne=(256, 3))  # the bytes of 2 rows
    with pytest.raises(GGUFError, match=rf"short.gguf: .*tensor '{tensor}'"):
        open_gguf(short)


@pytest.mark.parametrize("name", IQ_TYPES)
def test_check_tensors_names_a_non_finite_scale(name, tmp_path):
    """`--check-tensors` on a file of the type: clean as written; an Inf fp16 d in block 1 is named (by its
    offset in the block; IQ1_M, whose d is spread over its scale words, by the value scan)."""
    from mlaserve.gguf.read.file import open_gguf
    from mlaserve.loading.tensor_check import scan_gguf

    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    tensor = "blk.0.ffn_up.weight"
    raw = iq_blocks(name, 4 * 256 // t.block_size, seed=9).reshape(4, -1)
    assert scan_gguf(open_gguf(_one_tensor_file(tmp_path / "ok.gguf", tensor, raw, name))) == []
    blocks = raw.reshape(-1, t.type_size)
    if name == "IQ1_M":  # d = +Inf (0x7c00): top nibbles 0, 0, c, 7 of the four words (bytes 49, 51, 53, 55)
        for byte, nib in zip((49, 51, 53, 55), (0x0, 0x0, 0xC, 0x7), strict=True):
            blocks[1, byte] = (blocks[1, byte] & 0x0F) | (nib << 4)
    else:
        off = SCALE_OFFSETS[name][0]
        blocks[1, off : off + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    found = scan_gguf(open_gguf(_one_tensor_file(tmp_path / "bad.gguf", tensor, raw, name)))
    assert [b.name for b in found] == [f"bad.gguf:{tensor}"], found
    want = "Inf" if name == "IQ1_M" else "block scale NaN/Inf in blocks 1 "
    assert want in found[0].detail, found

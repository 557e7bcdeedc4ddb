"""The header's string arrays (a vocabulary, its merges: 10^5 strings) read in one loop over a memoryview of the
map (gguf/read/file.py _Cursor.strings): the same strings as gguf-py's reader, and the same clear errors as a
single string (invalid UTF-8 naming its byte, a truncated header)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from gguf_helpers import fixture_params

from mlaserve.gguf.read.file import GGUFError, open_gguf

gguf = pytest.importorskip("gguf")

WORDS = ["a", "bé", "", "✓✓", "x" * 300]


def write_strings(path: Path) -> Path:
    w = gguf.GGUFWriter(path, "test")
    w.add_array("v.words", WORDS)
    w.add_string("v.after", "end")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def word_offset(path: Path, i: int) -> int:
    """Byte offset of WORDS[i]'s length field in the header."""
    data, at = path.read_bytes(), 0
    for word in WORDS[: i + 1]:
        enc = struct.pack("<Q", len(word.encode())) + word.encode()
        at = data.index(enc, at)
        if word != WORDS[i]:
            at += len(enc)
    return at


@pytest.mark.parametrize("model,qtype,path", fixture_params())
def test_vocabulary_and_merges_match_gguf_package(model, qtype, path):
    gf, ref = open_gguf(path), gguf.GGUFReader(path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key in ref.fields:
            assert gf.metadata[key] == ref.fields[key].contents(), key


def test_string_array_and_the_key_after_it(tmp_path):
    gf = open_gguf(write_strings(tmp_path / "s.gguf"))
    assert gf.metadata["v.words"] == WORDS and gf.metadata["v.after"] == "end"


def test_invalid_utf8_in_a_string_array_names_the_byte(tmp_path):
    path = write_strings(tmp_path / "utf.gguf")
    at = word_offset(path, 1) + 8  # "bé": b"b\xc3\xa9" -> b"b\xff\xa9"
    data = bytearray(path.read_bytes())
    data[at + 1] = 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=rf"utf\.gguf: invalid UTF-8 string at byte {at}:"):
        open_gguf(path)


@pytest.mark.parametrize("cut", ["length", "bytes"])
def test_header_cut_inside_a_string_array(tmp_path, cut):
    """The error names the bytes of the word that is cut (its length field, or its 300 bytes)."""
    path = write_strings(tmp_path / "cut.gguf")
    at = word_offset(path, 4)
    path.write_bytes(path.read_bytes()[: at + (4 if cut == "length" else 8 + 100)])
    need = f"{at}..{at + 8}" if cut == "length" else f"{at + 8}..{at + 8 + 300}"
    with pytest.raises(GGUFError, match=rf"cut\.gguf: truncated file: the header needs bytes {need} but the file"):
        open_gguf(path)


def test_a_word_longer_than_the_file(tmp_path):
    path = write_strings(tmp_path / "long.gguf")
    at = word_offset(path, 0)
    data = bytearray(path.read_bytes())
    data[at : at + 8] = struct.pack("<Q", 2**40)
    path.write_bytes(bytes(data))
    with pytest.raises(
        GGUFError, match=rf"long\.gguf: truncated file: the header needs bytes {at + 8}\.\.{at + 8 + 2**40} "
    ):
        open_gguf(path)

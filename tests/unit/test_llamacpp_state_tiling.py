"""benchmarks/llamacpp_session.py gives llama.cpp's cache N cells by rewriting a P-token sequence state
(llama_state_seq_get_data's bytes) into one of N cells, cell i holding cell (i mod P)'s rows. The expected bytes
here are written from llama.cpp's state layout (src/llama-context.cpp state_seq_get_data, src/llama-kv-cache.cpp
state_write / state_write_meta / state_write_data), not from the function under test. Also
benchmarks/common.py's with_max_positions: the same weights (a link), only max_position_embeddings changed."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
MAGIC = 0x67677371  # any u32: the function copies the header


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    for name in ("llamacpp_session", "common"):
        sys.modules.pop(name, None)
    import common
    import llamacpp_session

    yield llamacpp_session, common
    for name in ("llamacpp_session", "common"):
        sys.modules.pop(name, None)


def rows_of(layer: int, cells: int, row: int) -> list[bytes]:
    return [bytes((layer * 31 + c * 7 + b) % 251 for b in range(row)) for c in range(cells)]


def cache_part(cells: int, row_sizes: list[int], streams: int, rows_for) -> bytes:
    """One cache's state for sequence 0 in stream 0 of `streams` (the others empty), MLA: K rows only."""
    out = struct.pack("<I", streams) + struct.pack("<I", cells)
    for pos in range(cells):
        out += struct.pack("<iIi", pos, 1, 0)  # pos, n_seq_id, seq_id
    out += struct.pack("<II", 0, len(row_sizes))  # v_trans, n_layer
    for layer, row in enumerate(row_sizes):
        out += struct.pack("<iQ", 8, row) + b"".join(rows_for(layer, cells, row))
    return out + struct.pack("<I", 0) * (streams - 1)


def state(cells: int, caches: list[list[int]], streams: int, rows_for) -> bytes:
    return struct.pack("<Ii", MAGIC, 0) + b"".join(cache_part(cells, r, streams, rows_for) for r in caches)


def tiled_rows(p: int):
    def rows_for(layer: int, cells: int, row: int) -> list[bytes]:
        base = rows_of(layer, p, row)
        return [base[c % p] for c in range(cells)]

    return rows_for


@pytest.mark.parametrize(
    "caches, streams",
    [([[340, 340, 340]], 1), ([[340, 340], [136, 136]], 4)],  # MLA; DSA: the latent cache then the index keys'
    ids=["mla", "dsa-4-streams"],
)
@pytest.mark.parametrize("n", [5, 12, 13])
def test_tiled_state_repeats_rows_to_n_cells(bench, caches, streams, n):
    session, _ = bench
    p = 5
    got = session.tiled_state(state(p, caches, streams, rows_of), p, n)
    assert got == state(n, caches, streams, tiled_rows(p))


def test_tiled_state_refuses_what_it_cannot_rewrite(bench):
    session, _ = bench
    good = state(4, [[68, 68]], 1, rows_of)
    with pytest.raises(ValueError, match="holds 4 cells, the prefill made 3"):
        session.tiled_state(good, 3, 8)
    with pytest.raises(ValueError, match="bytes left over"):  # a V part (a cache that is not MLA's)
        session.tiled_state(good + struct.pack("<iQ", 8, 68) + bytes(4 * 68), 4, 8)
    shared = bytearray(good)
    struct.pack_into("<iIi", shared, 8 + 8 + 12, 1, 2, 0)  # cell 1 in two sequences
    with pytest.raises(ValueError, match="cell 1 at position 1 with 2 sequences"):
        session.tiled_state(bytes(shared), 4, 8)


def test_with_max_positions_links_the_weights_and_edits_one_field(bench, tmp_path):
    _, common = bench
    folder = tmp_path / "m"
    folder.mkdir()
    cfg = {"model_type": "deepseek_v3", "max_position_embeddings": 8192, "vocab_size": 99}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").write_bytes(b"weights")
    out = common.with_max_positions(folder, 65536)
    assert out.name == "m-pos65536"
    assert (out / "model.safetensors").is_symlink()
    assert (out / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
    assert json.loads((out / "config.json").read_text()) == dict(cfg, max_position_embeddings=65536)
    assert json.loads((folder / "config.json").read_text()) == cfg  # the source untouched
    assert common.with_max_positions(folder, 65536) == out  # again: the same folder, still linked
    assert (out / "model.safetensors").read_bytes() == b"weights"

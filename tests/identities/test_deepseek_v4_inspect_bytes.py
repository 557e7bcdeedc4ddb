"""`mlaserve inspect`'s config-level DeepSeek-V4 lines (config/deepseek_v4_layers.py describe_layers) against the
cache the engine allocates for the same options: per kind, the bytes per token of the paged pools, the bytes per
token of the page snapshots and the fixed bytes per sequence, read from the printed text, equal what the allocated
tensors hold (counted here from their nbytes: codes, e8m0 scales and kept values for an 8-bit state), under
kv_cache_dtype auto and fp8_e4m3. Exact: both sides are integers of bytes divided by the same page and ratio,
printed with %g, so the figures are compared as the command prints them (no tolerance).

The tiny config takes the official FP8 shapes (tests/official_v4.py OFFICIAL_SHAPES: 128 non-rope values per row),
every kind: sliding, CSA 4, HCA 8, CSA 4. Page 8 (a multiple of both ratios), prefix caching on (the default).
"""

from __future__ import annotations

import re
import shutil

import pytest

pytest.importorskip("transformers")

from official_v4 import OFFICIAL_SHAPES  # noqa: E402
from v4_models import build_hf_v4  # noqa: E402

from mlaserve.cache.quantized_rows import QuantizedRows  # noqa: E402
from mlaserve.entrypoints.cli import main  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402

PAGE, PAGES = 8, 16
KIND_OF = {"v4_sliding": "sliding", "v4_csa": "csa", "v4_hca": "hca"}
LINE = re.compile(
    r"layers (?P<ids>[\d, -]+): (?P<kind>\w+) .*?\((?P<rows>[\d.e+-]+) bytes/token"
    r" \+ (?P<snaps>[\d.e+-]+) bytes/token of snapshots with prefix caching\); fixed per sequence (?P<fixed>\d+) bytes"
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(a folder with weights, the same config.json alone: inspect prints its config-level lines and stops)."""
    hf = build_hf_v4("all_kinds", seed=2, **OFFICIAL_SHAPES)
    path = tmp_path_factory.mktemp("v4_inspect_bytes")
    hf.save_pretrained(path)
    bare = tmp_path_factory.mktemp("v4_inspect_config")
    shutil.copy(path / "config.json", bare / "config.json")
    return path, bare


def _nbytes(t) -> int:
    parts = t.tensors() if isinstance(t, QuantizedRows) else (t,)
    return sum(p.numel() * p.element_size() for p in parts)


def _allocated(llm: LLM) -> dict[str, tuple[str, str, int]]:
    """Per kind, from the allocated tensors: (paged bytes/token, snapshot bytes/token, bytes per slot), the pad row
    and the pad slot left out, as %g strings where the command prints %g."""
    cache = llm.runner.cache
    tokens = cache.num_pages * cache.page_size
    rows, snaps, fixed = {}, {}, {}
    for layer in cache.layers:
        kind = KIND_OF[layer.kind.attention]
        for s in layer.kind.states:
            t = layer.tensors[s.name]
            n = t.shape[0]
            if s.addressing == "page":  # [rows + 1 pad, ...]
                rows[kind] = rows.get(kind, 0) + _nbytes(t) * (n - 1) // n
            else:  # [slots + 1 pad, ...], and its snapshots [pages + 1 pad, ...]
                fixed[kind] = fixed.get(kind, 0) + _nbytes(t) // n
                if s.snapshot:
                    snap = layer.tensors[s.name + "_snapshot"]
                    m = snap.shape[0]
                    snaps[kind] = snaps.get(kind, 0) + _nbytes(snap) * (m - 1) // m
    return {k: (f"{rows.get(k, 0) / tokens:g}", f"{snaps[k] / tokens:g}", fixed[k]) for k in fixed}


def _printed(folder, capsys, kv: str) -> dict[str, tuple[str, str, int]]:
    argv = ["inspect", str(folder), "--dtype", "float32", "--page-size", str(PAGE), "--kv-cache-dtype", kv]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"(float32 values, kv_cache_dtype {kv};" in out
    found = {m["kind"]: (m["rows"], m["snaps"], int(m["fixed"])) for m in LINE.finditer(out)}
    assert set(found) == {"sliding", "csa", "hca"}, out
    return found


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_printed_bytes_are_the_allocation(folders, capsys, kv):
    path, bare = folders
    printed = _printed(bare, capsys, kv)
    llm = LLM(str(path), dtype="float32", page_size=PAGE, num_pages=PAGES, max_num_seqs=2, kv_cache_dtype=kv)
    assert llm.runner.cache.keeps_snapshots
    assert printed == _allocated(llm)


def test_fp8_lines_name_the_8bit_rows(folders, capsys):
    """Under fp8_e4m3 the ring and the kv pools are 8-bit (the index keys are not: config/kv_cache.py), and every
    figure that holds them is smaller than under auto: the bytes the fix is about."""
    _, bare = folders
    full, eight = _printed(bare, capsys, "auto"), _printed(bare, capsys, "fp8_e4m3")
    argv = ["inspect", str(bare), "--dtype", "float32", "--page-size", str(PAGE), "--kv-cache-dtype", "fp8_e4m3"]
    main(argv)
    out = capsys.readouterr().out
    assert out.count("ring [6 x 136] as fp8_e4m3 [128] / 64 per scale (ue8m0") == 3
    assert "kv rows [136] per 4 tokens as fp8_e4m3" in out and "index keys [64] per 4 tokens (" in out
    for kind in ("sliding", "csa", "hca"):
        assert eight[kind][2] < full[kind][2] and float(eight[kind][1]) < float(full[kind][1]), kind
    assert float(eight["hca"][0]) < float(full["hca"][0])

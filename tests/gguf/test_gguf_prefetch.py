"""gguf_prefetch: a mapped GGUF's files read into the page cache in the background after load (loading/prefetch.py).

The read skips what mincore says is resident and reads the rest, chunk by chunk; it is not started when the files
exceed 80% of the available memory; the option is recorded with its source, off (and said why) where the blocks are
not a mapped file's; the load report says what was started. Timings are the benchmarks' (docs/PERFORMANCE.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gguf_helpers import need_fixtures

from mlaserve.config.model import ConfigError
from mlaserve.loading import prefetch
from mlaserve.loading.prefetch import Prefetch, Residency, available_bytes, prefetch_unfit, start_prefetch


def _file(tmp_path: Path, size: int) -> Path:
    path = tmp_path / "weights.gguf"
    path.write_bytes(os.urandom(size))
    return path


def test_the_memory_rule():
    assert prefetch_unfit(8 << 30, 10 << 30) is None  # 80% of the available memory: read
    assert "exceed 80% of the available memory" in prefetch_unfit((8 << 30) + 1, 10 << 30)
    assert "no available memory" in prefetch_unfit(1, None)


def test_available_bytes_reads_meminfo(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2000000 kB\n")
    assert available_bytes(str(info)) == 2000000 * 1024
    assert available_bytes(str(tmp_path / "absent")) is None


def test_reads_every_chunk_that_is_not_resident(tmp_path, monkeypatch):
    """Chunks of FILE_CHUNK (made small: 3 whole chunks and a part); with the residency check answering "not
    resident" every byte is read once; a file just written is in the page cache, so nothing is read."""
    monkeypatch.setattr(prefetch, "FILE_CHUNK", 3 * 4096)
    path = _file(tmp_path, 3 * 3 * 4096 + 1000)
    reads = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: reads.append(off) or real(fd, bufs, off))
    monkeypatch.setattr(Residency, "__call__", lambda self, off, n: False)
    run = Prefetch([path]).start()
    assert run.done.wait(30) and run.error is None
    assert run.bytes_read == path.stat().st_size and reads == [0, 12288, 24576, 36864]
    monkeypatch.undo()
    resident = Residency(os.open(path, os.O_RDONLY), path.stat().st_size)
    assert resident(0, path.stat().st_size)  # mincore over the map of a file just written
    resident.close()
    run = Prefetch([path]).start()
    assert run.done.wait(30) and run.error is None and run.bytes_read == 0


def test_a_failed_read_is_named_and_harms_nothing(tmp_path):
    run = Prefetch([tmp_path / "gone.gguf"]).start()
    assert run.done.wait(30) and "gone.gguf" in run.error and run.bytes_read == 0


def test_start_prefetch_says_what_it_did(tmp_path):
    path = _file(tmp_path, 5000)
    run, note = start_prefetch([path], available=1 << 30)
    assert run is not None and run.done.wait(30) and "reading weights.gguf" in note
    run, note = start_prefetch([path], available=5000)
    assert run is None and note.startswith("gguf_prefetch: not read ahead: the files")


@pytest.mark.fixtures
def test_engine_option_and_load_report():
    from mlaserve import LLM

    path = need_fixtures() / "ds3" / "model-q8_0.gguf"
    if not path.is_file():
        pytest.skip(f"fixture {path.name} not present")
    llm = LLM(str(path), num_pages=16)
    recorded = {s.name: s for s in llm.config.provenance}["gguf_prefetch"]
    assert llm.config.kernels.gguf_prefetch is True and recorded.source.startswith("engine default")
    run = llm.loaded.prefetch
    assert run is not None and run.done.wait(60) and run.error is None
    assert any(n.startswith("gguf_prefetch: reading model-q8_0.gguf") for n in llm.loaded.report.notes)
    off = LLM(str(path), num_pages=16, gguf_prefetch=False)
    assert off.loaded.prefetch is None and off.config.kernels.gguf_prefetch is False
    copied = LLM(str(path), num_pages=16, gguf_mmap=False)
    recorded = {s.name: s for s in copied.config.provenance}["gguf_prefetch"]
    assert copied.loaded.prefetch is None and "not a mapped GGUF's" in recorded.source
    with pytest.raises(ConfigError, match="gguf_prefetch must be a bool"):
        LLM(str(path), num_pages=16, gguf_prefetch="yes")

"""Memory a process holds for what it loads and caches (Linux: read from /proc/self/status).

The latent cache's CPU memory becomes resident as rows are written, not at startup; a memory-mapped
checkpoint's file pages are dropped as the loader copies each tensor (GGUF: madvise on the private
map; safetensors: the file handle is closed every RELEASE_BYTES), so a load peaks at the model's size,
not the model's plus the file's. Values read after a release are the file's again."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import fixture_dir

from mlaserve.cache.model_cache import _zeros
from mlaserve.gguf.read.file import open_gguf
from mlaserve.loading import safetensors_source
from mlaserve.loading.safetensors_source import SafetensorsSource

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
MiB = 1 << 20


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@linux
def test_latent_cache_memory_is_resident_only_where_written():
    before = _status_kib("RssAnon")
    cache = _zeros(1 << 20, 128, torch.float32, "cpu")  # 512 MiB of rows
    allocated = _status_kib("RssAnon") - before
    assert allocated * 1024 < 32 * MiB, f"{allocated} KiB resident right after allocation"
    assert cache.dtype == torch.float32 and cache.shape == (1 << 20, 128)
    cache[: 1 << 17].fill_(1.0)  # 64 MiB of rows written
    grown = _status_kib("RssAnon") - before
    assert 60 * MiB <= grown * 1024 < 100 * MiB, f"{grown} KiB resident after writing 64 MiB"
    assert bool((cache[(1 << 17) : (1 << 17) + 4096] == 0).all())  # unwritten rows read as zeros
    half = _zeros(64, 32, torch.bfloat16, "cpu")
    assert half.dtype == torch.bfloat16 and bool((half == 0).all())


@linux
def test_gguf_release_drops_file_pages_and_rereads_the_same_bytes():
    gf = open_gguf(fixture_dir("ds3") / "model-f32.gguf")
    names = list(gf.tensors)
    sums = {n: int(gf.raw(n).to(torch.int64).sum()) for n in names}  # touch every page
    touched = _status_kib("RssFile")
    for n in names:
        gf.release(n)
    dropped = touched - _status_kib("RssFile")
    size = sum(gf.info(n).nbytes for n in names)
    assert dropped * 1024 >= 0.8 * size, f"released {dropped} KiB of {size // 1024} KiB"
    assert all(int(gf.raw(n).to(torch.int64).sum()) == sums[n] for n in names)


def test_safetensors_source_closes_its_handle_and_reopens(monkeypatch):
    import gc

    monkeypatch.setattr(safetensors_source, "RELEASE_BYTES", 1)
    src = SafetensorsSource(fixture_dir("ds3"))
    names = src.names()[:3]
    kept = {n: src.get(n) for n in names}  # not cloned: still valid once the handle is closed
    copies = {n: t.clone() for n, t in kept.items()}
    for n in names:
        src.release(n)
        assert not src._handles  # closed as soon as it handed out RELEASE_BYTES
    gc.collect()
    assert all(torch.equal(kept[n], copies[n]) for n in names)
    assert all(torch.equal(src.get(n), copies[n]) for n in names)

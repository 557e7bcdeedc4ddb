"""A mapped GGUF's files read into the page cache in the background after load (engine option gguf_prefetch).

With gguf_mmap the kept blocks are views of the file mapped read-only: a step reads them where they lie, and a page
that is not in the page cache is read from disk when a step first touches it, a fault at a time. The first prompts
after a start then wait on the disk: glm-real's Q8_0 file (2.1 GB) out of the page cache, started and left idle for
6 s, took 2.04 s for two 16-token prompts and 1.84 s for its first 512-token prompt, against 0.31 s and 1.17 s once
the file was read (docs/PERFORMANCE.md). llama.cpp asks the kernel for its whole file at load (madvise WILLNEED);
on a disk where that advice reads nothing ahead (measured: ext4 on a virtual block device, and posix_fadvise the
same) only a read does. So once the model is loaded a daemon thread reads each file through, FILE_CHUNK at a time
into one buffer, while the engine serves: read(2) fills the page cache and leaves this process's mapping, and so
its resident memory, as it was. The files are not read when they exceed AVAILABLE_SHARE of the memory the kernel
reports available: reading more than fits would push out the pages the steps use.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

import numpy as np

FILE_CHUNK = 16 << 20  # bytes per read into the thread's one buffer
AVAILABLE_SHARE = 0.8  # the files are read only when their size is at most this share of MemAvailable


def available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's MemAvailable in bytes, or None where it reports none."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def prefetch_unfit(total: int, available: int | None) -> str | None:
    """Why files of `total` bytes are not read ahead with `available` bytes of memory available, or None."""
    if available is None:
        return "the kernel reports no available memory (no /proc/meminfo)"
    if total > AVAILABLE_SHARE * available:
        return (
            f"the files ({total / 1e9:.2f} GB) exceed {AVAILABLE_SHARE:.0%} of the available memory "
            f"({available / 1e9:.2f} GB): their pages come in as steps touch them"
        )
    return None


class Prefetch:
    """One background read of the files, start to end. `done` is set when it ends; `bytes_read` counts what it read
    from disk (chunks already in the page cache are skipped: mincore says so, so a cached file costs no copy, and no
    CPU taken from the steps' threads); `error` names the file and the error where a read failed (the engine does
    not depend on it: a page the read did not bring in is read when a step touches it, as without the prefetch)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = list(paths)
        self.bytes_read = 0
        self.error: str | None = None
        self.done = threading.Event()

    def start(self) -> Prefetch:
        threading.Thread(target=self._run, name="mlaserve-gguf-prefetch", daemon=True).start()
        return self

    def _run(self) -> None:
        buf = bytearray(FILE_CHUNK)
        path = None
        try:
            for path in self.paths:
                self._read(path, buf)
        except OSError as e:
            self.error = f"{path}: {e}"
        finally:
            self.done.set()

    def _read(self, path: Path, buf: bytearray) -> None:
        """Every chunk of the file that is not wholly in the page cache, read into buf (the GIL is released while
        the read waits on the disk)."""
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            resident = Residency(f.fileno(), size)
            try:
                for off in range(0, size, FILE_CHUNK):
                    n = min(FILE_CHUNK, size - off)
                    if not resident(off, n):
                        self.bytes_read += os.preadv(f.fileno(), [memoryview(buf)[:n]], off)
            finally:
                resident.close()


class Residency:
    """Whether a file's byte range is wholly in the page cache: mincore(2) over a read-only map of the file (the
    map only asks; it reads nothing). Where mincore is unavailable every range answers False (read it)."""

    def __init__(self, fd: int, size: int) -> None:
        self.map, self.base, self.mincore = None, 0, None
        try:
            self.mincore = ctypes.CDLL(None, use_errno=True).mincore
            self.map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except (OSError, AttributeError, ValueError):
            return
        self.base = np.frombuffer(self.map, dtype=np.uint8).ctypes.data  # ctypes takes no read-only buffer

    def __call__(self, off: int, n: int) -> bool:
        if self.map is None:
            return False
        page = mmap.PAGESIZE
        lo = off // page * page
        pages = -(-(off + n - lo) // page)
        vec = (ctypes.c_ubyte * pages)()
        if self.mincore(ctypes.c_void_p(self.base + lo), ctypes.c_size_t(pages * page), vec) != 0:
            return False
        return bool((np.frombuffer(vec, dtype=np.uint8) & 1).all())  # bit 0: the page is resident

    def close(self) -> None:
        if self.map is not None:
            self.map.close()


def start_prefetch(paths: list[Path], available: int | None = None) -> tuple[Prefetch | None, str]:
    """Start reading the files in the background (available: MemAvailable in bytes, read here when None), or
    not; with the load report's line saying which and why."""
    total = sum(p.stat().st_size for p in paths)
    why = prefetch_unfit(total, available_bytes() if available is None else available)
    if why is not None:
        return None, f"gguf_prefetch: not read ahead: {why}"
    files = f"{len(paths)} files" if len(paths) > 1 else paths[0].name
    note = f"gguf_prefetch: reading {files} ({total / 1e9:.2f} GB) into the page cache in the background"
    return Prefetch(paths).start(), note

"""The prefix cache on disk (`prefix_cache_dir`): full pages kept across restarts, keyed by the hash chain.

Notation
  a page's parts  = every layer's paged rows of the page ([page_size / tokens_per_row, width] per state, or
                    per part of an 8-bit state: codes, scales, kept values) and, where kept, its snapshot row
                    of every snapshotted request state ([*per_request, width]); named "<layer>.<state>[.<k>]"
  identity        = sha256 over the model's identity (see `model_identity`), the compute dtype, the cache
                    layout (kv_cache_dtype and every part's name, dtype and shape), the page size and the
                    sparse switch: a page is only ever read by an engine whose cache holds the same rows
  file            = "<identity[:16]>-<chain hash>.page": magic, header length (u32 LE), JSON header
                    (identity, chain hash, the page's token ids, parts, sha256 of the payload), payload (the
                    parts' raw bytes in header order)

Writes happen on one background thread: the step hands over a copy of the new pages' rows (one gather per
cache tensor for all of the step's pages) and never waits on disk. Each file is written to a temp name in
the same directory and renamed into place (atomic on POSIX), so a reader -- this engine or another one sharing
the directory -- sees either no file or a whole one. A read checks the magic, the identity, the chain hash,
the token ids, the parts' names/dtypes/shapes and the payload's sha256; anything else is skipped with a log
line naming the file, never used. Size is capped (`prefix_cache_dir_gib`): after each write the least
recently used files (by mtime, which a read hit refreshes) are removed until the directory fits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger("mlaserve.disk_cache")

MAGIC = b"MLSPAGE1"
SUFFIX = ".page"


def model_identity(config_repr: str, tensors: dict[str, torch.Tensor]) -> str:
    """A digest of what the weights are: the model config, every tensor's name, shape and dtype, and a
    sample of each tensor's bytes (its first and last 256 values). Computed from the loaded tensors, so it
    is the same for a checkpoint, a GGUF file or seeded random weights, and costs O(tensors), not O(bytes);
    the sample tells apart two checkpoints of one architecture (other seeds, other fine-tunes) short of an
    edit confined to the middle of every tensor."""
    h = hashlib.sha256(config_repr.encode())
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        flat = t.reshape(-1)
        for part in (flat[:256], flat[-256:]):
            h.update(part.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class DiskLoad:
    """Plan data: fill `page` from the verified file `path` (its parts, read at planning) before the step."""

    page: int
    path: str
    parts: dict


class DiskTier:
    """The directory of page files: lookups on the scheduling thread, writes on one background thread."""

    def __init__(self, directory: str, max_bytes: int, identity: str, layout: dict[str, tuple[str, tuple]]) -> None:
        """layout: every part's name -> (dtype name, shape) as this engine's cache holds it."""
        self.dir, self.max_bytes, self.layout = directory, max_bytes, layout
        os.makedirs(directory, exist_ok=True)
        self.identity = hashlib.sha256((identity + json.dumps(sorted(layout.items()))).encode()).hexdigest()
        self.stats = {"hits": 0, "skipped": 0, "written": 0, "evicted": 0}
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._writer, name="prefix-cache-writer", daemon=True)
        self._thread.start()

    def path(self, chain_hash: int) -> str:
        return os.path.join(self.dir, f"{self.identity[:16]}-{chain_hash & (2**64 - 1):016x}{SUFFIX}")

    # -- read ----------------------------------------------------------------------------------------
    def read(self, chain_hash: int, token_ids: list[int]) -> dict | None:
        """The page's parts if its file is here and whole; None when absent; None with a log line when
        the file is corrupt or belongs to another model, dtype, layout or page."""
        path = self.path(chain_hash)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        try:
            parts = self._decode(blob, chain_hash, token_ids)
        except ValueError as e:
            self.stats["skipped"] += 1
            log.warning("prefix cache file %s skipped: %s", path, e)
            return None
        try:
            os.utime(path)  # the LRU clock: a hit is a use
        except OSError:
            pass
        self.stats["hits"] += 1
        return parts

    def _decode(self, blob: bytes, chain_hash: int, token_ids: list[int]) -> dict:
        if len(blob) < len(MAGIC) + 4 or blob[: len(MAGIC)] != MAGIC:
            raise ValueError("not a page file (bad magic)")
        (hlen,) = struct.unpack_from("<I", blob, len(MAGIC))
        start = len(MAGIC) + 4
        try:
            header = json.loads(blob[start : start + hlen])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"unreadable header ({e})") from None
        payload = blob[start + hlen :]
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise ValueError(f"checksum mismatch ({len(payload)} payload bytes): truncated or corrupt")
        if header.get("identity") != self.identity:
            raise ValueError("written by another model, dtype, cache layout, page size or sparse switch")
        if header.get("hash") != chain_hash or header.get("tokens") != list(token_ids):
            raise ValueError("holds another page (hash chain or token ids differ)")
        parts, offset = {}, 0
        for name, dtype, shape, nbytes in header["parts"]:
            if self.layout.get(name) != (dtype, tuple(shape)):
                raise ValueError(f"part {name!r} {dtype} {shape} is not this cache's layout")
            raw = bytearray(payload[offset : offset + nbytes])
            parts[name] = torch.frombuffer(raw, dtype=getattr(torch, dtype)).view(shape) if nbytes else None
            offset += nbytes
        if set(parts) != set(self.layout):
            raise ValueError("parts missing")
        return parts

    # -- write ---------------------------------------------------------------------------------------
    def submit(self, pages: list[tuple[int, list[int]]], gathered: dict[str, torch.Tensor]) -> None:
        """Queue pages for writing: (chain hash, token ids) per page, and per part the rows of all these
        pages stacked in the same order ([n, *shape], a copy the step no longer touches). Returns at once."""
        self._queue.put((pages, gathered))

    def flush(self) -> None:
        """Wait until every queued page is on disk (tests, shutdown); the step never calls it."""
        self._queue.join()

    def _writer(self) -> None:
        while True:
            pages, gathered = self._queue.get()
            try:
                for i, (chain_hash, tokens) in enumerate(pages):
                    self._write(chain_hash, tokens, {k: v[i] for k, v in gathered.items()})
                self._evict()
            except Exception as e:  # a full disk or a vanished directory costs the disk tier, not the engine
                log.warning("prefix cache write to %s failed: %s", self.dir, e)
            finally:
                self._queue.task_done()

    def _write(self, chain_hash: int, tokens: list[int], parts: dict[str, torch.Tensor]) -> None:
        path = self.path(chain_hash)
        if os.path.exists(path):
            return
        raws, meta = [], []
        for name, (dtype, shape) in sorted(self.layout.items()):
            raw = parts[name].contiguous().view(torch.uint8).numpy().tobytes()
            raws.append(raw)
            meta.append([name, dtype, list(shape), len(raw)])
        payload = b"".join(raws)
        header = json.dumps(
            {
                "identity": self.identity,
                "hash": chain_hash,
                "tokens": list(tokens),
                "parts": meta,
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
        ).encode()
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
        os.replace(tmp, path)  # atomic: readers see no file or the whole file
        self.stats["written"] += 1

    def _evict(self) -> None:
        files = []
        for e in os.scandir(self.dir):
            if e.name.endswith(SUFFIX):
                try:
                    st = e.stat()
                except FileNotFoundError:  # another engine evicted it meanwhile
                    continue
                files.append((st.st_mtime_ns, st.st_size, e.path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):  # least recently used first
            if total <= self.max_bytes:
                break
            try:
                os.remove(path)
                self.stats["evicted"] += 1
            except FileNotFoundError:
                pass
            total -= size

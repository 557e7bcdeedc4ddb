"""The model's cache tensors: every layer's declared states, allocated from its LayerKind.

Notation
  P pages of page_size tokens; a paged state of tokens_per_row t has S = P * page_size / t rows per layer
  latent row  = [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]  -- nothing bigger is cached
  index_keys  = one DSA indexer key (index_head_dim) per token, in "full" indexer layers of a sparse run
A row of a paged state is addressed by slot = page * (page_size / t) + offset; one block table per
request serves every paged state (config/layer_kinds.py). Each paged state has one more row, the pad row
(slot S, `pad_slot`), zero and never written: the key positions a request pads to the segment's longest
sequence read it, so padding never reads a real row (a stale row of a freed page, another request's). The bookkeeping of pages (free list, prefix
cache) is cache/page_pool.py on the scheduling rank; this module holds only tensors.
Bytes per token = sum over layers and paged states of a row's bytes / tokens_per_row: width * dtype size, or
for a state kept in 8 bits (kv_cache_dtype; StateSpec.quant) its codes, fp32 scales and kept values
(cache/quantized_rows.py QuantizedRows, which stands where the [rows, width] tensor would).

Request-addressed states ("request": a fixed block per running request that does not grow with the
sequence) are [N + 1, *per_request, width] for N state slots (cache/slot_pool.py, one per running
request, N = max_num_seqs); slot N is the pad slot (`state_pad_slot`), zero and never written, for a
batched kernel that pads its sequences to read. Bytes per request = sum over layers and request states
of prod(per_request) * width * its dtype size. A model without request states allocates none (N = 0).
`reset_states(slots)` zeroes slots before a step whose chunks start their sequences (SeqChunk.reset_state).

Page-boundary snapshots (config/layer_kinds.py, StateSpec.snapshot), allocated when the engine keeps them
(snapshots=True: prefix caching on): a snapshotted request state `name` has a companion `name_snapshot`
[P + 1, *per_request, width], one row per page: the state after the page's last token, written by the layer
when a chunk crosses or ends on that boundary (StepContext.snapshots). `restore_states(slots, pages)` starts
a sequence at a prefix hit: every request state of the slot zeroed, then each snapshotted one copied from the
row of the hit's last page. Bytes per token of snapshots = sum of their values per request * size / page_size.

A page's parts (the prefix cache's disk tier, cache/disk_tier.py): every paged state's rows of the page
(each part of an 8-bit state) and, where kept, its snapshot row of every snapshotted state; `gather_pages`
copies them out for the writer (one index_select per tensor, all of a step's new pages), `load_pages` writes
pages read from disk back (one index_copy per tensor).
"""

from __future__ import annotations

import math
import mmap

import torch

from mlaserve.cache.quantized_rows import QuantizedRows
from mlaserve.config.layer_kinds import LayerKind, StateSpec, check_page_size, request_states, snapshot_states
from mlaserve.config.model import ConfigError


class LayerState:
    """One layer's cache tensors by state name ([rows, width] each)."""

    def __init__(self, kind: LayerKind, tensors: dict[str, torch.Tensor]) -> None:
        self.kind = kind
        self.tensors = tensors

    @property
    def latent(self) -> torch.Tensor | QuantizedRows:
        return self.tensors["latent"]

    @property
    def index_keys(self) -> torch.Tensor | QuantizedRows | None:
        return self.tensors.get("index_keys")


class ModelCache:
    """Per layer, the states its kind declares, each [rows, width] in the cache dtype."""

    def __init__(
        self,
        layers: tuple[LayerKind, ...],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        num_slots: int = 0,
        prefault: bool = False,
        snapshots: bool = False,
    ) -> None:
        """num_slots: state slots of the request-addressed states (the engine passes max_num_seqs when the
        stack declares any; 0 otherwise). prefault: write every byte now (the engine option kv_prefault), so
        the pool is resident from the start instead of page by page as rows are first written (see `_zeros`).
        snapshots: keep the page-boundary snapshots of the snapshotted request states (prefix caching on)."""
        check_page_size(layers, page_size)
        check_request_states(layers, num_slots)
        self.page_size, self.num_pages, self.kinds = page_size, num_pages, layers
        self.pad_slot = num_pages * page_size  # the zero row after the pages (tokens_per_row 1 states)
        self.num_slots = num_slots if request_states(layers) else 0
        self.state_pad_slot = self.num_slots  # the zero slot after the request slots
        self.keeps_snapshots = snapshots and bool(snapshot_states(layers))
        self.layers = tuple(
            LayerState(k, {s.name: _allocate(s, num_pages, page_size, num_slots, dtype, device) for s in k.states})
            for k in layers
        )
        if self.keeps_snapshots:  # one row per page, then the zero pad row
            for layer in self.layers:
                for s in layer.kind.per_request:
                    if s.snapshot:
                        layer.tensors[s.name + "_snapshot"] = _allocate_block(s, num_pages + 1, dtype, device)
        if prefault:
            for layer in self.layers:
                for t in layer.tensors.values():
                    t.zero_()  # already zero: the write is what maps the memory

    def state(self, name: str) -> list[torch.Tensor | None]:
        """One state's tensor in every layer (None where a layer does not keep it)."""
        return [layer.tensors.get(name) for layer in self.layers]

    def request_tensors(self) -> list[torch.Tensor]:
        """Every request-addressed state tensor of every layer ([num_slots + 1, ...] each)."""
        return [layer.tensors[s.name] for layer in self.layers for s in layer.kind.per_request]

    def reset_states(self, slots: torch.Tensor) -> None:
        """Zero these slots of every request state (one fill per state tensor, all slots at once): the
        runner calls it before a step whose chunks start their sequences (ForwardBatch.reset_slots)."""
        for t in self.request_tensors():
            t.index_fill_(0, slots, 0)

    def snapshot_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(request state [N + 1, ...], its snapshot rows [P + 1, ...]) of every snapshotted state kept."""
        if not self.keeps_snapshots:
            return []
        return [
            (layer.tensors[s.name], layer.tensors[s.name + "_snapshot"])
            for layer in self.layers
            for s in layer.kind.per_request
            if s.snapshot
        ]

    def restore_states(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Start these slots at prefix hits ending on these pages (ForwardBatch.restores): zero every request
        state (the carries empty at a page boundary stay so), then copy each snapshotted state from its page's
        row. One fill and one gather-copy per state tensor, all slots at once."""
        if not self.keeps_snapshots:
            raise RuntimeError("restore_states: this cache keeps no page-boundary snapshots (prefix caching off)")
        self.reset_states(slots)
        for state, snap in self.snapshot_pairs():
            state.index_copy_(0, slots, take(snap, pages))

    def _page_parts(self) -> list[tuple[str, torch.Tensor, int]]:
        """Every tensor that holds a page's rows (the disk tier's parts): (name, tensor, rows per page). Paged
        states give page_size / tokens_per_row rows per page (each part of an 8-bit state alike); snapshot
        rows give one."""
        out = []
        for i, layer in enumerate(self.layers):
            for s in layer.kind.paged:
                t, per = layer.tensors[s.name], self.page_size // s.tokens_per_row
                if isinstance(t, QuantizedRows):
                    out += [(f"{i}.{s.name}.{k}", part, per) for k, part in enumerate(t.tensors())]
                else:
                    out.append((f"{i}.{s.name}", t, per))
            if self.keeps_snapshots:
                for s in layer.kind.per_request:
                    if not s.snapshot:
                        continue
                    t = layer.tensors[s.name + "_snapshot"]
                    if isinstance(t, QuantizedRows):  # an 8-bit snapshot (V4's ring): each part, as the pools
                        out += [(f"{i}.{s.name}_snapshot.{k}", part, 0) for k, part in enumerate(t.tensors())]
                    else:
                        out.append((f"{i}.{s.name}_snapshot", t, 0))
        return out

    def page_layout(self) -> dict[str, tuple[str, tuple]]:
        """Each part's dtype name and one page's shape of it (part of the disk tier's identity)."""
        return {
            name: (str(t.dtype).removeprefix("torch."), ((per,) if per else ()) + tuple(t.shape[1:]))
            for name, t, per in self._page_parts()
        }

    def _page_index(self, pages: list[int], per: int, device) -> torch.Tensor:
        p = torch.tensor(pages, dtype=torch.long, device=device)
        if not per:  # a snapshot row per page
            return p
        return (p[:, None] * per + torch.arange(per, device=device)).reshape(-1)

    def gather_pages(self, pages: list[int]) -> dict[str, torch.Tensor]:
        """A copy of these pages' rows, per part [n, *page shape]: one index_select per tensor, all pages."""
        out = {}
        for name, t, per in self._page_parts():
            rows = t.index_select(0, self._page_index(pages, per, t.device))
            out[name] = rows.view(len(pages), *(((per,) if per else ()) + tuple(t.shape[1:]))).cpu()
        return out

    def load_pages(self, pages: list[int], parts: list[dict[str, torch.Tensor]]) -> None:
        """Write pages read from disk into these pages' rows: one index_copy per tensor, all pages."""
        if not pages:
            return
        for name, t, per in self._page_parts():
            rows = torch.stack([p[name] for p in parts]).to(t.device)
            t.index_copy_(0, self._page_index(pages, per, t.device), rows.reshape(-1, *t.shape[1:]))

    @staticmethod
    def snapshot_bytes_per_token(layers: tuple[LayerKind, ...], dtype: torch.dtype, page_size: int) -> float:
        """Bytes per token of the page-boundary snapshots (one per page of every snapshotted request state)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(s.request_bytes(size) for _, s in snapshot_states(layers)) / page_size

    @staticmethod
    def bytes_per_token(layers: tuple[LayerKind, ...], dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum(s.bytes_per_row(size) // s.tokens_per_row for k in layers for s in k.paged)

    @staticmethod
    def bytes_per_request(layers: tuple[LayerKind, ...], dtype: torch.dtype) -> int:
        """Bytes of request-addressed state one running request holds (0 for paged-only stacks)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(s.request_bytes(size) for k in layers for s in k.per_request)

    def measured_bytes_per_token(self) -> int:
        """Allocated bytes per cached token of the paged states, the pad rows (a fixed row per state) left out."""
        paged = [layer.tensors[s.name] for layer in self.layers for s in layer.kind.paged]
        paged += [snap for _, snap in self.snapshot_pairs()]  # one row per page, kept per page like the rows
        total = sum((t.shape[0] - 1) * _row_bytes(t) for t in paged)
        return total // (self.num_pages * self.page_size)

    def measured_page_bytes(self) -> tuple[int, int]:
        """(bytes of one page's rows, bytes of its snapshot rows) as allocated, the pad rows left out: the pool
        costs num_pages x their sum (`inspect` and the server's ready line state it)."""
        rows = sum(
            (layer.tensors[s.name].shape[0] - 1) * _row_bytes(layer.tensors[s.name])
            for layer in self.layers
            for s in layer.kind.paged
        )
        snaps = sum((snap.shape[0] - 1) * _row_bytes(snap) for _, snap in self.snapshot_pairs())
        return rows // self.num_pages, snaps // self.num_pages

    def measured_bytes_per_request(self) -> int:
        """Allocated bytes of request state per slot, the pad slot left out (0 without request states)."""
        if not self.num_slots:
            return 0
        return sum(_nbytes(t) * self.num_slots // t.shape[0] for t in self.request_tensors()) // self.num_slots


def check_request_states(layers: tuple[LayerKind, ...], num_slots: int) -> None:
    """A stack with request states needs slots."""
    states = request_states(layers)
    if states and num_slots < 1:
        index, s = states[0]
        raise ConfigError(f"layer {index}'s request state {s.name!r} needs state slots; num_slots={num_slots}")


def _allocate(
    s: StateSpec, num_pages: int, page_size: int, num_slots: int, dtype: torch.dtype, device: str | torch.device
) -> torch.Tensor | QuantizedRows:
    if s.addressing == "request":  # one block per slot, then the zero pad slot
        return _allocate_block(s, num_slots + 1, dtype, device)
    if s.quant is not None:  # 8-bit rows (kv_cache_dtype): codes, scales, kept values
        return QuantizedRows(s.quant, s.rows(num_pages, page_size) + 1, dtype, device, _zeros)
    return _zeros(s.rows(num_pages, page_size) + 1, s.width, dtype, device)


def _allocate_block(
    s: StateSpec, n: int, dtype: torch.dtype, device: str | torch.device
) -> torch.Tensor | QuantizedRows:
    """n blocks of a request state [n, *per_request, width] (slots, or one snapshot row per page): 8-bit rows
    when the state is kept so (DeepSeek-V4's ring under kv_cache_dtype fp8_e4m3), else its dtype. Zero pages
    as the paged rows (`_zeros`): a snapshot row becomes resident when its page's boundary is first reached,
    a slot when a request first runs in it (torch.zeros wrote every byte at start: 12.8 GiB of snapshots for a
    4-layer Kimi-Linear-shaped stack's default pool before a request arrived)."""
    if s.quant is not None:
        return QuantizedRows(s.quant, (n, *s.per_request), dtype, device, _zeros)
    values = math.prod(s.request_shape)  # a block's values, allocated flat: zero pages like the rows (`_zeros`)
    return _zeros(n, values, s.dtype or dtype, device).view(n, *s.request_shape)


def take(t: torch.Tensor | QuantizedRows, index: torch.Tensor) -> torch.Tensor | QuantizedRows:
    """A copy of t's rows at index as stored (8-bit rows keep their codes: copied back, nothing is quantized
    twice)."""
    return t.take(index) if isinstance(t, QuantizedRows) else t.index_select(0, index)


def _nbytes(t: torch.Tensor | QuantizedRows) -> int:
    return t.nbytes() if isinstance(t, QuantizedRows) else t.numel() * t.element_size()


def _row_bytes(t: torch.Tensor | QuantizedRows) -> int:
    """Bytes one row of a paged state holds, measured from what was allocated."""
    if isinstance(t, QuantizedRows):
        return sum(part[0].numel() * part.element_size() for part in t.tensors())
    return t[0].numel() * t.element_size()


def _zeros(rows: int, width: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed [rows, width] tensor. On the CPU a block of more than a few pages is its own anonymous memory
    map: zero pages that become resident only when first written, so the cache sized for every page costs
    memory as requests fill it, not at startup (torch.zeros writes every byte). Not calloc: glibc serves a
    block below its mmap threshold from the heap and clears reused memory by writing it, and the threshold
    moves (it grows to the largest block freed, up to 32 MiB; malloc_tuning sets 32 MiB), so calloc left
    smaller snapshot and slot blocks resident. The map is unmapped when the tensor is freed."""
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = rows * width * size
    if torch.device(device).type != "cpu" or nbytes < _MAPPED_FROM:
        return torch.zeros(rows, width, dtype=dtype, device=device)
    # private: counted as the process's anonymous memory (RssAnon) and not shared with a forked child
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapped, dtype=torch.uint8).view(dtype).view(rows, width)


_MAPPED_FROM = 16 * mmap.PAGESIZE  # smaller blocks (the pad rows of tiny models) are written at once

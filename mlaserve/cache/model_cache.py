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
Bytes per token = sum over layers and states of width / tokens_per_row * dtype size.
"""

from __future__ import annotations

import numpy as np
import torch

from mlaserve.config.layer_kinds import LayerKind, StateSpec, check_page_size


class LayerState:
    """One layer's cache tensors by state name ([rows, width] each)."""

    def __init__(self, kind: LayerKind, tensors: dict[str, torch.Tensor]) -> None:
        self.kind = kind
        self.tensors = tensors

    @property
    def latent(self) -> torch.Tensor:
        return self.tensors["latent"]

    @property
    def index_keys(self) -> torch.Tensor | None:
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
        prefault: bool = False,
    ) -> None:
        """prefault: write every byte now (the engine option kv_prefault), so the pool is resident from the
        start instead of page by page as rows are first written (see `_zeros`)."""
        check_page_size(layers, page_size)
        self.page_size, self.num_pages, self.kinds = page_size, num_pages, layers
        self.pad_slot = num_pages * page_size  # the zero row after the pages (tokens_per_row 1 states)
        self.layers = tuple(
            LayerState(k, {s.name: _zeros(s.rows(num_pages, page_size) + 1, s.width, dtype, device) for s in k.states})
            for k in layers
        )
        if prefault:
            for layer in self.layers:
                for t in layer.tensors.values():
                    t.zero_()  # already zero: the write is what maps the memory

    def state(self, name: str) -> list[torch.Tensor | None]:
        """One state's tensor in every layer (None where a layer does not keep it)."""
        return [layer.tensors.get(name) for layer in self.layers]

    @staticmethod
    def bytes_per_token(layers: tuple[LayerKind, ...], dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum(_state_bytes(s, size) for k in layers for s in k.states)

    def measured_bytes_per_token(self) -> int:
        """Allocated bytes per cached token, the pad rows (a fixed row per state) left out."""
        total = sum((t.shape[0] - 1) * t[0].numel() * t.element_size() for s in self.layers for t in s.tensors.values())
        return total // (self.num_pages * self.page_size)


def _state_bytes(s: StateSpec, size: int) -> int:
    return s.width * size // s.tokens_per_row


def _zeros(rows: int, width: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed [rows, width] tensor. On the CPU its memory comes from calloc (numpy.zeros), which for a
    large block maps zero pages that become resident only when a row is first written: the cache sized
    for every page costs memory as requests fill it, not at startup (torch.zeros writes every byte)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(rows, width, dtype=dtype, device=device)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(rows * width * size, dtype=np.uint8)).view(dtype).view(rows, width)

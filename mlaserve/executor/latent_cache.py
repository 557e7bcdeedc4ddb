"""The paged latent cache: per layer, rows addressed by slot = page * page_size + offset.

Notation
  P pages of page_size rows; S = P * page_size rows per layer
  row = [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]  -- nothing bigger is cached
  DSA layers add one indexer key row (index_head_dim) per token in a parallel tensor.
Bytes per token = (kv_lora_rank + qk_rope_head_dim) * num_layers * dtype size (+ indexer keys).
"""

from __future__ import annotations

import numpy as np
import torch

from mlaserve.config.model import ModelConfig


class LatentCache:
    """Per-layer rows [S, kv_lora_rank + qk_rope_head_dim], addressed by slot = page * page_size + offset."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        with_indexer: bool = True,
        device: str | torch.device = "cpu",
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        rows = num_pages * page_size
        self.layers = [_zeros(rows, cfg.latent_dim, dtype, device) for _ in range(cfg.num_layers)]
        full = indexer_layers(cfg) if with_indexer else set()
        self.index_keys = [
            _zeros(rows, cfg.indexer.head_dim, dtype, device) if i in full else None for i in range(cfg.num_layers)
        ]

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, with_indexer: bool = True) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        index = cfg.indexer.head_dim * len(indexer_layers(cfg)) if with_indexer else 0
        return (cfg.latent_dim * cfg.num_layers + index) * size

    def measured_bytes_per_token(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.layers)
        total += sum(t.numel() * t.element_size() for t in self.index_keys if t is not None)
        return total // (self.num_pages * self.page_size)


def _zeros(rows: int, width: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed [rows, width] tensor. On the CPU its memory comes from calloc (numpy.zeros), which for a
    large block maps zero pages that become resident only when a row is first written: the cache sized
    for every page costs memory as requests fill it, not at startup (torch.zeros writes every byte)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(rows, width, dtype=dtype, device=device)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(rows * width * size, dtype=np.uint8)).view(dtype).view(rows, width)


def indexer_layers(cfg: ModelConfig) -> set[int]:
    """Layers that run their own indexer (and so cache indexer keys); "shared" layers reuse one."""
    if cfg.indexer is None:
        return set()
    return {i for i, t in enumerate(cfg.indexer.layer_types) if t == "full"}

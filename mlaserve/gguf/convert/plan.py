"""What a conversion writes, shared by the MLA converter (convert.py) and DeepSeek-V4's (deepseek_v4.py): a
tensor's plan (GGUF name, torch shape, a lazy producer of its values in whole rows) and the report.

Shapes are torch order (outermost first; GGUF's ne is the reverse)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

CHUNK_VALUES = 1 << 22  # floats per chunk handed to the writer


@dataclass
class ConvertReport:
    path: Path
    arch: str
    outtype: str
    tensors: dict[str, str] = field(default_factory=dict)  # GGUF name -> ggml type name
    skipped: list[str] = field(default_factory=list)  # source tensors not written (MTP layers, tied lm_head)
    notes: list[str] = field(default_factory=list)

    def type_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t] = out.get(t, 0) + 1
        return out


@dataclass
class Plan:
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # torch order
    chunks: Callable[[], Iterator[torch.Tensor]]  # its values: whole rows, storage order (float32, or the raw form)


def rows(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """A tensor as float32 chunks of whole rows: a bf16 embedding is never copied whole to f32."""
    t2 = t.reshape(-1, t.shape[-1])
    step = max(1, CHUNK_VALUES // t2.shape[1])
    for i in range(0, t2.shape[0], step):
        yield t2[i : i + step].to(torch.float32)

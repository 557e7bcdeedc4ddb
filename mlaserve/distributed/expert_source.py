"""An expert-parallel rank's view of a checkpoint: every tensor but the other ranks' routed experts, so the
rank reads only its own experts' bytes from the file.

Notation
  E routed experts of a MoE layer, N ranks, r this rank, [e0, e1) its experts (expert_parallel.expert_range)
  global name   model.layers.L.mlp.experts.e.<proj>.<suffix> as the checkpoint names it (any stored form:
                weight, weight_scale_inv, weight_packed / weight_scale / weight_shape, weight_global_scale)
  local name    the same with e - e0: the rank's experts module holds experts [0, e1 - e0) (cut before it is
                allocated, expert_parallel.cut_experts), so the strict loader fills it as one process fills
                its whole stack
A GGUF's stacked ffn_{gate,up,down}_exps are served per expert already (GGUFTensors: expert e is a byte range
of the stack), so a hidden expert's bytes are never touched; a safetensors folder stores one tensor per
expert, read only when asked for. Expert ids e >= E stay listed, renamed to (e1 - e0) + (e - E): after the
rank's own, where they sit after one process's E, so the experts module judges them as in one process
(LongCat-Flash's identity experts, whose unused gate/up rows transformers saves, are skipped and reported; an
id past those is an unexpected tensor). `where` names the checkpoint's own tensor.
"""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(.+)$")


class ExpertRangeSource:
    """source seen by rank r of N: routed experts [start, stop) of every layer (listed as [0, stop - start)),
    the other ranks' experts absent, everything else as stored."""

    def __init__(self, source, n_experts: int, start: int, stop: int) -> None:
        self.source, self.start, self.stop, self.n_experts = source, start, stop, n_experts
        self._stored: dict[str, str] = {}  # the name the loader sees -> the checkpoint's name
        self.hidden = 0  # expert tensors of other ranks, never read
        for name in source.names():
            m = _EXPERT.match(name)
            if m is None:
                self._stored[name] = name
                continue
            e = int(m.group(2))
            if e < start or stop <= e < n_experts:
                self.hidden += 1
                continue
            self._stored[f"{m.group(1)}.{self._local(e)}.{m.group(3)}"] = name

    def _local(self, e: int) -> int:
        """A checkpoint expert id -> the rank's: its own from 0, ids >= E after them (the docstring)."""
        return e - self.start if e < self.n_experts else self.stop - self.start + e - self.n_experts

    @property
    def bytes_read(self) -> int:
        return getattr(self.source, "bytes_read", 0)

    def names(self) -> list[str]:
        return list(self._stored)

    def where(self, name: str) -> str:
        """The checkpoint's file and, for one of the rank's experts, its own name (messages name that id)."""
        stored = self._stored[name]
        return self.source.where(stored) + (f" ({stored})" if stored != name else "")

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of a local one, listed or not (the loader names a missing expert tensor by it)."""
        m = _EXPERT.match(name)
        if m is None:
            return name
        local, held = int(m.group(2)), self.stop - self.start
        e = local + self.start if local < held else self.n_experts + local - held
        return f"{m.group(1)}.{e}.{m.group(3)}"

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(self._stored[name])

    def get(self, name: str) -> torch.Tensor:
        return self.source.get(self._stored[name])

    def release(self, name: str) -> None:
        if hasattr(self.source, "release"):
            self.source.release(self._stored[name])

    # what a GGUF source also answers (plan_gguf, BlockSource, attach_heads)
    def get_blocks(self, name: str, mapped: bool = False) -> torch.Tensor:
        return self.source.get_blocks(self._stored[name], mapped)

    def ggml_type(self, name: str) -> int:
        return self.source.ggml_type(self._stored[name])

    def gguf_type(self, name: str) -> str:
        return self.source.gguf_type(self._stored[name])

    def rebuilt(self, name: str) -> bool:
        return self.source.rebuilt(self._stored[name])

    def block_split_problem(self, name: str) -> str | None:
        """Under TP x EP the inner source is the rank's ShardedSource (its slices): asked through."""
        problem = getattr(self.source, "block_split_problem", None)
        return problem(self._stored[name]) if problem is not None else None

    @property
    def spans(self) -> dict:
        return getattr(self.source, "spans", {})

    def mla_split_blocks(self, layer: int, mapped: bool = False):
        return self.source.mla_split_blocks(layer, mapped)

    def stored_type(self, name: str) -> str:
        return self.source.stored_type(self._stored[name])

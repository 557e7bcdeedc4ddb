"""ExpertRangeSource: an expert-parallel rank's view of a checkpoint lists its own experts (renamed from 0) and
everything that is not a routed expert; the other ranks' expert tensors are neither listed nor read."""

from __future__ import annotations

import torch

from mlaserve.distributed.expert_source import ExpertRangeSource


class _Source:
    """A dict of tensors with the source protocol; counts what is read."""

    def __init__(self, names: list[str]) -> None:
        self.tensors = {n: torch.full((2,), float(i)) for i, n in enumerate(names)}
        self.read: list[str] = []

    def names(self) -> list[str]:
        return list(self.tensors)

    def where(self, name: str) -> str:
        return "model.safetensors"

    def get(self, name: str) -> torch.Tensor:
        self.read.append(name)
        return self.tensors[name]


def _expert(layer: int, e: int, proj: str = "gate_proj", suffix: str = "weight") -> str:
    return f"model.layers.{layer}.mlp.experts.{e}.{proj}.{suffix}"


def test_lists_the_rank_s_experts_from_zero_and_reads_only_them():
    names = ["model.embed_tokens.weight", "model.layers.1.mlp.gate.weight"]
    names += [_expert(1, e, p, s) for e in range(5) for p in ("gate_proj", "down_proj") for s in ("weight", "scale")]
    names += [_expert(1, 7)]  # past E: kept, so the loader names it as one process would
    inner = _Source(names)
    src = ExpertRangeSource(inner, n_experts=5, start=3, stop=5)
    listed = src.names()
    assert listed[:2] == names[:2]
    assert [n for n in listed if ".experts." in n] == [
        _expert(1, e, p, s) for e in (0, 1) for p in ("gate_proj", "down_proj") for s in ("weight", "scale")
    ] + [_expert(1, 4)]
    assert src.hidden == 12  # experts 0-2: 3 experts x 2 projections x 2 tensors
    for name in listed:
        src.get(name)
    assert sorted(inner.read) == sorted(n for n in names if not any(f".experts.{e}." in n for e in (0, 1, 2)))
    assert torch.equal(src.get(_expert(1, 0, "down_proj", "scale")), inner.tensors[_expert(1, 3, "down_proj", "scale")])
    # messages name the checkpoint's tensor
    assert src.where(_expert(1, 1)) == f"model.safetensors ({_expert(1, 4)})"
    assert src.where("model.embed_tokens.weight") == "model.safetensors"
    assert src.checkpoint_name(_expert(1, 1, "up_proj")) == _expert(1, 4, "up_proj")

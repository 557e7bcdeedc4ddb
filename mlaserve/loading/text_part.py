"""The text model of a multimodal wrapper checkpoint (kimi_k25), as a tensor source under the text
model's own names, and the tie decision taken from the weights present.

Names, stored -> served:
  language_model.model.layers.N.*   -> model.layers.N.*   (the released checkpoints)
  language_model.model.blocks.N.*   -> model.layers.N.*   (transformers' save_pretrained renames layers to blocks)
  language_model.model.{embed_tokens,norm}.*, language_model.lm_head.weight -> without the prefix
  model.language_model.X -> model.X, lm_head.weight as is (glm5_next: text_served_prefix, text_top_level)
  the family's skipped prefixes (vision tower, projector) -> skipped, listed with their bytes
Any other name is an error naming the tensor and its file: nothing is dropped silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from mlaserve.config.families import Family
from mlaserve.config.model import ModelConfig
from mlaserve.config.provenance import Setting
from mlaserve.loading.safetensors_source import _DTYPE_BYTES, WeightError

_BLOCKS = re.compile(r"^model\.blocks\.(\d+)\.")


@dataclass(frozen=True)
class Skipped:
    names: tuple[str, ...]
    nbytes: int

    def note(self, family: str) -> str:
        mib = self.nbytes / 2**20
        return (
            f"{family}: skipped {len(self.names)} vision tower / projector tensor(s), {self.nbytes} bytes "
            f"({mib:.2f} MiB), not served (text only): {', '.join(self.names[:4])}"
            + (" ..." if len(self.names) > 4 else "")
        )


class TextPartSource:
    """A source (names, get, where, shape, stored_type, get_slice, release) over the wrapper's text tensors."""

    def __init__(self, source, family: Family) -> None:
        self.source, self.family = source, family
        self._stored: dict[str, str] = {}
        skipped: list[str] = []
        for name in source.names():
            if name.startswith(family.skipped_prefixes):
                skipped.append(name)
                continue
            if name in family.text_top_level:  # the wrapper's own tensor of the text model (GLM's lm_head)
                self._stored[name] = name
                continue
            if not name.startswith(family.text_prefix):
                raise WeightError(
                    f"{source.where(name)}: tensor {name!r} is neither under {family.text_prefix!r} (the text model) "
                    f"nor under {', '.join(family.skipped_prefixes)} (skipped parts) of a {family.name} checkpoint"
                )
            served = _BLOCKS.sub(r"model.layers.\1.", family.text_served_prefix + name[len(family.text_prefix) :])
            if served in self._stored:
                raise WeightError(f"{source.where(name)}: {name!r} and {self._stored[served]!r} are both {served!r}")
            self._stored[served] = name
        nbytes = sum(_nbytes(source, n) for n in skipped)
        self.skipped = Skipped(tuple(skipped), nbytes)

    def names(self) -> list[str]:
        return list(self._stored)

    @property
    def bytes_read(self) -> int:
        return getattr(self.source, "bytes_read", 0)

    def has(self, name: str) -> bool:
        return name in self._stored

    def stored_name(self, name: str) -> str:
        return self._stored[name]

    def where(self, name: str) -> str:
        return f"{self.source.where(self._stored[name])} ({self._stored[name]})"

    def get(self, name: str) -> torch.Tensor:
        return self.source.get(self._stored[name])

    def release(self, name: str) -> None:
        if hasattr(self.source, "release"):
            self.source.release(self._stored[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(self._stored[name])

    def stored_type(self, name: str) -> str:
        return self.source.stored_type(self._stored[name])

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.source.get_slice(self._stored[name], dim, start, stop)


def _nbytes(source, name: str) -> int:
    n = 1
    for d in source.shape(name):
        n *= d
    return n * _DTYPE_BYTES.get(source.stored_type(name), 0)


def decide_tie(cfg: ModelConfig, source: TextPartSource) -> ModelConfig:
    """Tie lm_head to the embeddings exactly when the checkpoint ships no lm_head.weight, whatever the
    wrapper's flag says (its class default is True; Kimi-K2.x ships a separate lm_head), recorded with why."""
    has_head = source.has("lm_head.weight")
    tie = not has_head
    flag = next(s for s in cfg.provenance if s.name == "tie_word_embeddings")
    family = source.family
    stored = "lm_head.weight" if "lm_head.weight" in family.text_top_level else f"{family.text_prefix}lm_head.weight"
    why = (
        f"loader: {stored} is {'present' if has_head else 'absent'}, so "
        f"{'a separate lm_head' if has_head else 'lm_head tied to the embeddings'} (the config said {flag.value}: "
        f"{flag.source})"
    )
    provenance = tuple(s for s in cfg.provenance if s.name != "tie_word_embeddings")
    return replace(cfg, tie_word_embeddings=tie, provenance=provenance + (Setting("tie_word_embeddings", tie, why),))

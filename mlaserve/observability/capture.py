"""Per-layer activations of a forward pass, taken with forward hooks registered from outside the model.

Notation
  T tokens of the step, D hidden size, V vocabulary
  embed           [T, D]  embed_tokens output (the first layer's input)
  layer i input   [T, D]  residual stream entering decoder layer i
  attn i          [T, D]  self_attn output (the attention sub-block: input_layernorm + MLA + o_proj)
  mlp i input     [T, D]  residual stream entering post_attention_layernorm (x + attn)
  mlp i           [T, D]  mlp output (the MoE / dense-MLP sub-block: post_attention_layernorm + experts)
  layer i         [T, D]  decoder layer output hidden state
  logits          [T, V]  lm_head output at the rows the runner asked for

`Capture(model)` records these on every forward while it is open. `Capture(model, force=other)`
additionally *replaces* each sub-block's input by the one recorded in `other` (teacher forcing): each
attention and MLP sub-block then sees exactly the input the other model's did, so its output differs
only by what that sub-block's own weights do, and a divergence is pinned to the layer that causes it
instead of every layer after it. The model code knows nothing of this (hooks only).

DSA layers: the indexer's top-k (a discrete choice) is recorded as "layer.i.topk" (positions [B, Q, k]
and their validity, one entry per segment); under `force` the layer attends over the *other* model's
selection, while its own is kept as "layer.i.topk_own" for comparison. Without this, a quantized
indexer that swaps one key near the top-k boundary would make the attention differ by far more than
its weights' error, and the attention weights could not be judged on their own. The selection is
wrapped on the indexer instance (not a forward hook: `select` is not the module's forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Activations:
    """Captured tensors by name ("embed", "layer.3.attn", ...), float32 on the CPU."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    selections: dict = field(default_factory=dict)  # "layer.i.topk.j" -> Selection (DSA, segment j)

    def put(self, name: str, t: torch.Tensor) -> None:
        self.tensors[name] = t.detach().float().cpu().clone()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors


def _first(out):
    return out[0] if isinstance(out, tuple) else out


class Capture:
    """Context manager: hooks on embed_tokens, every decoder layer, its self_attn,
    post_attention_layernorm and mlp, the final norm and lm_head (Hugging Face module names)."""

    def __init__(self, model: nn.Module, force: Activations | None = None) -> None:
        self.model, self.force = model, force
        self.acts = Activations()
        self._handles: list = []
        self._patched: list[nn.Module] = []

    def __enter__(self) -> Activations:
        inner = self.model.model
        self._out(inner.embed_tokens, "embed")
        for i, layer in enumerate(inner.layers):
            self._in(layer, f"layer.{i}.input")
            self._out(layer.self_attn, f"layer.{i}.attn")
            self._in(layer.post_attention_layernorm, f"layer.{i}.mlp_input")
            self._out(layer.mlp, f"layer.{i}.mlp")
            self._out(layer, f"layer.{i}")
            if getattr(layer.self_attn, "indexer", None) is not None:
                self._selection(layer.self_attn.indexer, f"layer.{i}.topk")
        self._in(inner.norm, "final_input")
        self._out(self.model.lm_head, "logits")
        return self.acts

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for indexer in self._patched:
            del indexer.select  # the class's method again
        self._patched.clear()

    def _selection(self, indexer: nn.Module, name: str) -> None:
        original, calls = indexer.select, [0]

        def select(*args, **kwargs):
            own = original(*args, **kwargs)
            key = f"{name}.{calls[0]}"
            calls[0] += 1
            if self.force is None or key not in self.force.selections:
                self.acts.selections[key] = own
                return own
            self.acts.selections[f"{name}_own.{calls[0] - 1}"] = own
            return self.force.selections[key]

        indexer.select = select
        self._patched.append(indexer)

    def _out(self, module: nn.Module, name: str) -> None:
        self._handles.append(module.register_forward_hook(lambda m, args, out: self.acts.put(name, _first(out))))

    def _in(self, module: nn.Module, name: str) -> None:
        """Records the module's first positional input; under `force`, swaps it for the recorded one."""

        def hook(m, args):
            x = args[0]
            if self.force is not None and name in self.force:
                forced = self.force[name]
                if forced.shape != x.shape:
                    raise ValueError(f"cannot force {name}: shapes {tuple(forced.shape)} vs {tuple(x.shape)}")
                x = forced.to(device=x.device, dtype=x.dtype)
                args = (x, *args[1:])
            self.acts.put(name, x)
            return args

        self._handles.append(module.register_forward_pre_hook(hook))

"""Multi-token prediction (MTP): the extra decoder layer DeepSeek-V3/V3.2 and GLM-5 ship after the
last one, used as a built-in draft model.

Notation (DeepSeek-V3 report, section 2.2; i = position, t = token, k = MTP depth)
  h_i       [T, D]  the trunk's final hidden state at position i (after model.norm, as vLLM/SGLang feed it)
  Emb       the shared token embedding (model.embed_tokens, or the layer's own copy when the checkpoint has one)
  x_i       = eh_proj([enorm(Emb(t_{i+1})) ; hnorm(h_i)])        [T, 2D] -> [T, D]
  g_i       = Block(x_i)                                          a full decoder layer (MLA, MoE, DSA indexer)
  logits_i  = shared_head.head(shared_head.norm(g_i))            predicts t_{i+2}
The report writes the concatenation as [RMSNorm(h); RMSNorm(Emb)]; the released eh_proj weights (and
vLLM's and SGLang's MTP layers) take the embedding half first, so this module does too.
Deeper drafts (k > 1) reuse the layer on its own output: x_{i+1} = eh_proj([enorm(Emb(d_1)); hnorm(g_i)]).
The block keeps its own latent cache rows: the row at position i is computed from (h_i, t_{i+1}).

Tensor parallel: cfg is the rank's config, so the block's heads and MLP / expert units are the rank's, its
partial sums go through `all_reduce` as a decoder layer's do; its own embed_tokens and shared_head.head hold
the rank's vocabulary rows (the embedding looked up vocabulary-parallel, the logits the rank's columns,
gathered by the runner); eh_proj, enorm, hnorm and shared_head.norm are replicated
(distributed/sharding.py).

Checkpoint layout (layer N = num_hidden_layers): model.layers.N.{enorm,hnorm,eh_proj,shared_head.norm,
shared_head.head,embed_tokens (optional)} + the decoder layer's own self_attn.*, mlp.*, *_layernorm.
GLM-5.3-Flash (glm5_next; model.language_model.layers.45.* read as model.layers.45.*, loading/text_part.py): the
same module on the trunk's final hidden state norm(mean of the mHC streams), with no hc_* tensors (the block's
residual is plain, as vLLM's and SGLang's GLM-5.3 MTP run it), no shared_head.head (lm_head shared), an MLA+DSA
block (NoPE, its own pooled indexer: "full") and swiglu_limit's clamps on its MoE (models/deepseek.py DecoderLayer).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from mlaserve.config.model import ModelConfig
from mlaserve.models.deepseek import AllReduce, DecoderLayer, single_process, vocab_parallel_embed
from mlaserve.models.layers import RMSNorm, RotaryEmbedding, embedding

if TYPE_CHECKING:
    from mlaserve.cache.model_cache import LayerState
    from mlaserve.executor.step_context import StepContext

_MTP_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class MTPLayout:
    """What one MTP layer of a checkpoint carries, read from its tensor names (decided before building)."""

    layer_idx: int  # checkpoint index (num_hidden_layers + j)
    moe: bool  # mlp.gate present: routed experts
    indexer: bool  # self_attn.indexer.* present: a DSA layer with its own indexer
    own_embed: bool  # model.layers.N.embed_tokens.weight present (else the trunk's is shared)
    own_head: bool  # shared_head.head.weight present (else lm_head is shared)


def mtp_layouts(names: list[str], cfg: ModelConfig) -> tuple[MTPLayout, ...]:
    """The MTP layers present in a checkpoint (layers >= num_hidden_layers), in order."""
    by_layer: dict[int, set[str]] = {}
    for name in names:
        m = _MTP_LAYER.match(name)
        if m and int(m.group(1)) >= cfg.num_layers:
            by_layer.setdefault(int(m.group(1)), set()).add(m.group(2))
    out = []
    for idx in sorted(by_layer):
        rest = by_layer[idx]
        if "eh_proj.weight" not in rest:
            continue  # not an MTP layer (nothing else lives past the last decoder layer in these families)
        out.append(
            MTPLayout(
                layer_idx=idx,
                moe="mlp.gate.weight" in rest,
                indexer=any(r.startswith("self_attn.indexer.") for r in rest),
                own_embed="embed_tokens.weight" in rest,
                own_head="shared_head.head.weight" in rest,
            )
        )
    return tuple(out)


def mtp_param_name(name: str, cfg: ModelConfig) -> str | None:
    """Checkpoint name of an MTP tensor -> parameter name in MLAForCausalLM (`mtp.{j}.*`), or None."""
    m = _MTP_LAYER.match(name)
    if not m or int(m.group(1)) < cfg.num_layers:
        return None
    return f"mtp.{int(m.group(1)) - cfg.num_layers}.{m.group(2)}"


def block_config(cfg: ModelConfig, layout: MTPLayout) -> ModelConfig:
    """The trunk's config extended by one layer shaped like the MTP block (its MLP kind, its indexer)."""
    n = cfg.num_layers
    indexer = cfg.indexer
    if indexer is not None:
        indexer = replace(indexer, layer_types=indexer.layer_types + ("full" if layout.indexer else "none",))
    return replace(
        cfg,
        num_layers=n + 1,
        mlp_layer_types=cfg.mlp_layer_types + ("moe" if layout.moe else "dense",),
        indexer=indexer,
    )


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_head else None


class MTPLayer(DecoderLayer):
    """One MTP module: the decoder layer's parameters keep their checkpoint names (self_attn.*, mlp.*)."""

    def __init__(
        self, cfg: ModelConfig, layout: MTPLayout, vocab_start: int = 0, all_reduce: AllReduce = single_process
    ) -> None:
        """vocab_start, all_reduce: the tensor-parallel rank's, as MLAForCausalLM takes them."""
        block_cfg = block_config(cfg, layout)
        super().__init__(block_cfg, cfg.num_layers, all_reduce)
        self.layout, self.vocab_start = layout, vocab_start
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(cfg, layout.own_head)
        self.embed_tokens = embedding(cfg.vocab_size, d) if layout.own_embed else None
        # The trunk's embedding (its lookup, vocabulary-parallel under TP) and lm_head, when the checkpoint
        # shares them (set by share_trunk; not registered as submodules, so they are neither loaded twice
        # nor listed as MTP parameters).
        self._trunk: tuple[Callable[[torch.Tensor], torch.Tensor], nn.Module] | None = None

    def share_trunk(self, embed: Callable[[torch.Tensor], torch.Tensor], lm_head: nn.Module) -> None:
        self._trunk = (embed, lm_head)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            return self._trunk[0](ids)
        return vocab_parallel_embed(self.embed_tokens, ids, self.vocab_start, self.all_reduce)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        step: StepContext,
        rope: RotaryEmbedding,
        state: LayerState,
    ) -> torch.Tensor:
        """input_ids [T]: t_{i+1} (or the previous draft); hidden [T, D]: h_i (or g_{i-1}). -> g [T, D]."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed(input_ids)), self.hnorm(hidden)], dim=-1))
        g, _ = super().forward(x, step, rope, state, None)
        return g

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        head = self.shared_head.head if self.shared_head.head is not None else self._trunk[1]
        return head(self.shared_head.norm(g)).float()


def cache_config(cfg: ModelConfig, layout: MTPLayout) -> ModelConfig:
    """A one-layer config for the MTP layer's own latent cache (and its indexer keys when it has an indexer; GLM-5.3-
    Flash's pooled indexer keeps its per-token rows and pools). The block is MLA whatever the trunk's layer 0 is
    (GLM-5.3-Flash's is KDA): no KDA layer, so no request state and no state slot in the drafter's cache."""
    indexer = replace(cfg.indexer, layer_types=("full",)) if cfg.indexer is not None and layout.indexer else None
    return replace(cfg, num_layers=1, mlp_layer_types=("moe" if layout.moe else "dense",), indexer=indexer, kda=None)

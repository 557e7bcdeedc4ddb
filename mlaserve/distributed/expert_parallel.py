"""Expert parallelism: each of N ranks holds a contiguous range of every MoE layer's routed experts;
everything else (attention, the shared expert, the router, norms, dense MLPs, embedding, lm_head) is
replicated, so every rank computes the same router top-k for every token (same weights, same input
bits, same ops) and only the routed experts' sum needs the other ranks.

Notation
  T tokens, D hidden, E routed experts, k experts per token, N ranks, r this rank
  [e0, e1)   rank r's experts (expert_range: E // N each, the first E mod N ranks one more)
  topk_idx   [T, k] global expert ids from the replicated gate; topk_w [T, k] their weights
  mine       [T, k] bool: the pair's expert is one of this rank's
  rows       [T_r] the tokens with at least one pair on this rank (T_r <= T)
  partial    [T, D] sum over this rank's pairs of w * expert(x) (zero rows elsewhere)
  routed     [T, D] = all_reduce(partial): the sum over every rank's pairs, the one-process value up
             to the order of the fp32 additions
A step: the gate (replicated) -> this rank's experts on the rows routed to them, the other pairs of
those rows weighted 0 (a holder runs [T_r, k] pairs; weight 0 times a finite value adds exactly 0)
-> one all-reduce per MoE layer (distributed/collectives.py) -> + the shared expert (replicated,
added once after the sum). Every rank sees every token, so no dispatch is needed; an all-to-all that
sends each rank only its pairs' hidden states (and runs no zero-weight pairs) is the later
optimisation.
Identity experts (LongCat-Flash's zero-computation experts, ids [E, E + Z): y = w x, no weights) are held by no
rank: every rank already has every token's x and routing (replicated), so each adds the identity share
sum_{identity pairs} w x AFTER the all-reduce, to the reduced sum. Exact and counted once: the all-reduce
carries the real experts' pairs only (no rank puts an identity pair into its partial, whose experts are
[e0, e1) within [0, E)), and every rank adds the same identity share once to the same reduced sum (adding it
to each partial instead would count it N times).
Hash-routed layers (DeepSeek-V4's first layers: idx = tid2eid[token_id]) need nothing more: every rank runs
the step's whole batch, token ids included, through the replicated router.
Load: cut_experts cuts every experts module to [e0, e1) on the meta device (before the stored-form holders
are made: float stacks, GGUFExperts, FP8 / FP4 / INT4 experts), the loader fills it from the rank's
ExpertRangeSource (expert_source.py: the other ranks' expert tensors are never read), then shard_experts
routes the layer through ExpertParallelRouted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mlaserve.config.model import ConfigError, MoEConfig
from mlaserve.models.deepseek_v4.moe import V4MoEBlock
from mlaserve.models.moe import Experts, MoE
from mlaserve.models.zero_experts import ZeroExpertMoE, identity_share


def expert_range(n_experts: int, rank: int, n: int) -> tuple[int, int]:
    """Rank r's experts [start, stop): contiguous, the first E mod N ranks one more."""
    if n_experts < n:
        raise ConfigError(f"expert_parallel_size={n} exceeds n_routed_experts={n_experts}: a rank would hold none")
    base, extra = divmod(n_experts, n)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class ExpertShard:
    """This rank's experts of one MoE layer, decided at load (plain data)."""

    rank: int
    n: int
    start: int
    stop: int
    # TP x EP over whole experts (distributed/mesh.py): the reduced routed sum is added by TP rank 0 only (the
    # decoder's TP all-reduce then counts it once); the others return zeros
    adds: bool = True
    # the first identity expert's id (E: LongCat-Flash's zero-computation experts are ids >= E), None: none
    identity_from: int | None = None


class ReceivedPairs:
    """Running total of the (token, expert) pairs this rank's experts received (like CommStats: the
    ledger takes the difference over a step), for load balance."""

    def __init__(self, pairs: int = 0, tokens: int = 0, identity: int = 0) -> None:
        self.pairs, self.tokens, self.identity = pairs, tokens, identity

    def snapshot(self) -> ReceivedPairs:
        return ReceivedPairs(self.pairs, self.tokens, self.identity)

    def since(self, before: ReceivedPairs) -> dict:
        """The step's (token, expert) pairs this rank's experts ran, summed over the MoE layers, and the token
        rows they came in (a token with two pairs on this rank counts once per layer); `identity`: the pairs
        routed to identity experts (every rank adds them, so every rank reports the same count)."""
        return {
            "pairs": self.pairs - before.pairs,
            "tokens": self.tokens - before.tokens,
            "identity": self.identity - before.identity,
        }


class ExpertParallelRouted(nn.Module):
    """The routed experts of one MoE layer on one rank: holds the layer's experts module cut to this
    rank's range, computes the partial sum and all-reduces it."""

    def __init__(self, experts: nn.Module, shard: ExpertShard, all_reduce, received: ReceivedPairs) -> None:
        super().__init__()
        self.experts, self.shard, self.all_reduce, self.received = experts, shard, all_reduce, received

    def forward(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        s = self.shard
        mine = (topk_idx >= s.start) & (topk_idx < s.stop)
        rows = mine.any(dim=1).nonzero().squeeze(1)
        partial = torch.zeros_like(x)
        if rows.numel():  # a rank none of whose experts is chosen adds zeros (it still joins the all-reduce)
            local_idx = (topk_idx[rows] - s.start).clamp_(0, s.stop - s.start - 1)
            local_w = torch.where(mine[rows], topk_w[rows], torch.zeros((), dtype=topk_w.dtype))
            partial[rows] = self.experts(x[rows], local_w, local_idx)
        self.received.pairs += int(mine.sum())
        self.received.tokens += int(rows.numel())
        routed = self.all_reduce(partial)
        if s.identity_from is not None:  # after the sum, on every rank, once (the module docstring: why exact)
            routed = routed + identity_share(x, topk_w, topk_idx, s.identity_from)
            self.received.identity += int((topk_idx >= s.identity_from).sum())
        return routed if s.adds else torch.zeros_like(routed)


def _cut(module: nn.Module, n_experts: int, start: int, stop: int) -> None:
    """Keep experts [start, stop) of every parameter / buffer stacked by expert (dim 0 == E): on the meta
    device, before anything is allocated (cut_experts), so the rank never holds the others' stacks."""
    for name, p in list(module.named_parameters(recurse=False)):
        if p.dim() and p.shape[0] == n_experts:
            setattr(module, name, nn.Parameter(p.data[start:stop].clone(), requires_grad=False))
    for name, b in list(module.named_buffers(recurse=False)):
        if b is not None and b.dim() and b.shape[0] == n_experts:
            module.register_buffer(name, b[start:stop].clone())
    for child in module.children():
        _cut(child, n_experts, start, stop)


def expert_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _moe_layers(model: nn.Module):
    """Every MoE layer: the MLA families' MoE, LongCat-Flash's ZeroExpertMoE, DeepSeek-V4's V4MoEBlock (an MTP
    layer's too: model.mtp is a submodule)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (MoE, ZeroExpertMoE, V4MoEBlock))]


def routed_layout(module: nn.Module) -> tuple[int, int | None]:
    """A MoE layer's (E experts with weights, the first identity expert's id or None): read from its router's
    weight (rows = E) or LongCat's config (its classifier scores E + Z)."""
    if isinstance(module, ZeroExpertMoE):
        cfg = module.router.cfg
        return cfg.n_routed_experts, (cfg.n_routed_experts if cfg.zero_experts else None)
    return module.gate.weight.shape[0], None


def cut_experts(model: nn.Module, rank: int, n: int, whole: MoEConfig | None = None) -> None:
    """On the meta-device model (build_model's prepare, before the stored-form holders are swapped in and
    anything is allocated): every MoE layer's routed experts module cut to rank r's range, so the holders
    (GGUFExperts, FP8Experts, FP4Experts, INT4Experts, float stacks) are made for its experts only and the
    loader fills them from the rank's ExpertRangeSource (distributed/expert_source.py)."""
    layers = _moe_layers(model)
    if not layers:
        raise ConfigError(f"expert_parallel_size={n}: the model has no MoE layer to spread")
    for _, module in layers:
        e, _ = routed_layout(module)
        if whole is not None:  # TP x EP over whole experts: the checkpoint's width, not the TP rank's slice
            # (no swiglu_limit: its clamps come with no quantized checkpoint, refused at open)
            module.experts = Experts(module.gate.weight.shape[1], whole)
        _cut(module.experts, e, *expert_range(e, rank, n))


def cut_range(model: nn.Module, start: int, stop: int) -> None:
    """Every MoE layer's routed experts cut to [start, stop) on the meta-device model (DeepSeek-V4's loader: its
    FP8 / FP4 holders are made after this, for those experts only)."""
    for _, module in _moe_layers(model):
        _cut(module.experts, routed_layout(module)[0], start, stop)


def shard_experts(
    model: nn.Module, rank: int, n: int, all_reduce, who: str | None = None, adds: bool = True
) -> tuple[ReceivedPairs, list[str]]:
    """After the fill: route every MoE layer's routed experts (already rank r's range, cut_experts) through
    the partial sum and all_reduce (the EP group's under TP x EP). -> (the rank's received-pairs counter, load
    notes naming its experts, headed by `who`: the process's world rank, default "rank r")."""
    who = who or f"rank {rank}"
    received, notes = ReceivedPairs(), []
    for name, module in _moe_layers(model):
        e, identity_from = routed_layout(module)
        start, stop = expert_range(e, rank, n)
        held = next(p.shape[0] for p in module.experts.parameters())
        if held != stop - start:  # the loader's contract with cut_experts, checked rather than assumed
            raise RuntimeError(f"{name}.experts holds {held} experts, rank {rank} of {n} should hold [{start}, {stop})")
        module.experts.first_expert = start  # for messages naming an expert by its checkpoint id
        # the one-call block (and the decode layer holding it) computes the whole routed sum in C: the kernel plan,
        # made after this, keeps this layer per op (GGUFMoEBlock.unfit names expert parallelism)
        module.expert_shard = ExpertParallelRouted(
            module.experts, ExpertShard(rank, n, start, stop, adds, identity_from), all_reduce, received
        )
        ident = (
            f" (+ {module.router.cfg.zero_experts} identity experts, added by every rank)"
            if identity_from is not None
            # DeepSeek-V4's hash layers: the table is replicated, every rank looks the step's token ids up
            else " (hash-routed: tid2eid[token id] on every rank)"
            if getattr(module.gate, "hashed", False)
            else ""
        )
        notes.append(
            f"{who}: {name} experts [{start}, {stop}) of {e}{ident}, {expert_bytes(module.experts)} bytes held"
        )
    return received, notes

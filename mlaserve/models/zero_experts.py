"""Zero-computation identity experts (LongCat-Flash's MoE): a softmax router over the real experts and the
identity experts, and the routed-experts op that runs both kinds in one batched pass.

Notation
  T tokens, D hidden, E real experts, Z identity experts, k experts per token, I moe_intermediate_size
  logits   [T, E + Z]  x @ classifier^T in fp32 (the router weight stays fp32, as transformers keeps it)
  scores   [T, E + Z]  softmax(logits)
  topk_idx [T, k]      top-k of scores + e_score_correction_bias (the bias steers the choice only)
  topk_w   [T, k]      scores at topk_idx x routed_scaling_factor (no renormalisation)
  expert e < E:  y = down_e(silu(gate_e(x)) * up_e(x)) * w        (gate_up [E, 2I, D], down [E, D, I])
  expert e >= E: y = x * w                                           (identity: no weights, no products)
The (token, expert) pairs are sorted by expert once: the real experts' pairs come first and go through one
grouped GEMM per projection over exactly those rows, the identity experts' pairs are one elementwise product;
a step whose tokens pick only identity experts multiplies no expert weight (the grouped GEMMs get 0 rows).
transformers' LongcatFlashExperts is the reference (a loop over the experts hit, identity ones by nn.Identity).
Under expert parallelism (distributed/expert_parallel.py) a rank holds a range of the real experts; the identity
pairs are added by every rank after the real experts' all-reduce (identity_share), once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config.model import MoEConfig
from mlaserve.models.moe import Experts


def identity_share(x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor, first: int) -> torch.Tensor:
    """The identity experts' part of the routed sum: per token, sum over its pairs with id >= first of w * x
    -> [T, D]. Each pair's product is formed as one process forms it (w in x's dtype, times x); the other pairs
    are weighted 0 and add exactly 0 (a [T, k, D] product: k is a handful)."""
    w = torch.where(topk_idx >= first, topk_w, torch.zeros((), dtype=topk_w.dtype)).to(x.dtype)
    return (x.unsqueeze(1) * w.unsqueeze(-1)).sum(dim=1)


class ZeroExpertRouter(nn.Module):
    """LongcatFlashTopkRouter: parameter names as the checkpoint's (router.classifier.weight,
    router.e_score_correction_bias; the bias may be absent from a checkpoint: zeros, as transformers starts it)."""

    OPTIONAL_TENSORS = ("e_score_correction_bias",)  # the loader fills these when present, reports when absent

    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.classifier = nn.Linear(hidden, cfg.scored_experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.scored_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (topk_w [T, k] fp32, topk_idx [T, k]); indices >= n_routed_experts are identity experts."""
        cfg = self.cfg
        scores = F.linear(x.float(), self.classifier.weight.float()).softmax(dim=-1)
        choice = scores + self.e_score_correction_bias.float()
        topk_idx = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        return scores.gather(1, topk_idx) * cfg.routed_scaling_factor, topk_idx


class ZeroExpertExperts(Experts):
    """The real experts stacked as Experts holds them, plus `zero_experts` identity experts after them."""

    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__(hidden, cfg)
        self.zero_experts = cfg.zero_experts

    def unused_checkpoint_tensor(self, proj: str, expert: int) -> str | None:
        """Why a checkpoint's expert tensor is not used, or None. transformers allocates gate_up_proj for the
        identity experts too (never read) and its save writes their gate_proj / up_proj rows; they carry nothing."""
        n = self.gate_up_proj.shape[0]
        if n <= expert < n + self.zero_experts and proj in ("gate_proj", "up_proj"):
            return f"identity expert {expert} (>= n_routed_experts={n}): transformers saves unused gate/up rows for it"
        return None

    def _forward_grouped(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        k = topk_idx.shape[1]
        e = self.gate_up_proj.shape[0]
        flat_idx = topk_idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)  # real experts' pairs first (ids < E), identity pairs after
        token_of = order // k
        w = topk_w.reshape(-1)[order, None].to(x.dtype)
        counts = torch.bincount(flat_idx, minlength=e)[:e]
        offs = torch.cumsum(counts, 0).to(torch.int32)
        n_real = int(offs[-1])  # the grouped GEMMs read exactly these rows (rows past the last offset are not defined)
        xs = x[token_of[:n_real]]
        gate, up = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        h = F.silu(gate) * up
        del xs, gate, up  # the pairs' inputs and [P, 2I] freed before the down product
        ys = torch._grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs) * w[:n_real]
        identity = x[token_of[n_real:]] * w[n_real:]
        # one scatter in expert order: a token's terms are summed in the order the reference's loop adds them
        return torch.zeros_like(x).index_add_(0, token_of, torch.cat([ys, identity]))

    def _forward_loop(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        """The plain reference (experts_impl="loop"): one step per expert hit, as transformers' loop."""
        out, n = torch.zeros_like(x), self.gate_up_proj.shape[0]
        for e in torch.unique(topk_idx).tolist():
            tok, slot = torch.where(topk_idx == e)
            w = topk_w[tok, slot, None].to(x.dtype)
            if e >= n:
                out.index_add_(0, tok, x[tok] * w)
                continue
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, F.linear(F.silu(gate) * up, self.down_proj[e]) * w)
        return out


class ZeroExpertMoE(nn.Module):
    """The router, then the real and identity experts (no shared expert)."""

    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.router = ZeroExpertRouter(hidden, cfg)
        self.experts = ZeroExpertExperts(hidden, cfg)
        # expert parallelism (distributed/expert_parallel.py): this rank's real experts, their partial sum
        # all-reduced, then the identity share; set at load, None in one process
        self.expert_shard = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_w, topk_idx = self.router(x)
        routed = self.experts if self.expert_shard is None else self.expert_shard
        return routed(x, topk_w, topk_idx)

"""Mixture of experts: the gate (softmax | sigmoid + correction bias, group-limited top-k) and
the routed experts, computed for the whole batch at once.

Notation
  T tokens, D hidden, E routed experts, k experts per token, I moe_intermediate_size
  scores   [T, E]  gate probabilities (softmax or sigmoid of x @ W_gate^T, fp32)
  topk_idx [T, k]  chosen experts, topk_w [T, k] their weights
  gate_up  [E, 2I, D] (gate rows first), down [E, D, I]
Fast path: tokens sorted by expert, one grouped GEMM per projection (torch._grouped_mm).
Reference path ("loop"): one F.linear per active expert; the tests hold the fast path to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config.model import MoEConfig
from mlaserve.kernels import native
from mlaserve.kernels.registry import BlockSwitch, KernelSwitch
from mlaserve.models.layers import SwiGLU, activation, swiglu

# steps of up to this many tokens take the native router (kernel "native"; its top-k is a plain O(k E) scan per
# token, one thread); more tokens take the torch router (Gate._route_native's contract)
ROUTE_TOKENS = 16


class Gate(KernelSwitch, nn.Module):
    KERNEL_OP = "router"  # kernels/registry.py chooses `kernel` at load (the KernelPlan)
    KERNELS = ("native", "torch")  # native: scoring and group-limited top-k in one call (kernels/native.py)
    KERNEL_CALLS = {"route": {"native": "_route_native", "torch": "_route_torch"}}
    NATIVE_ROWS = ROUTE_TOKENS

    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, hidden))
        self.kernel = "torch"  # the reference; the loader sets the engine's kernels (binds self.route)
        if cfg.scoring_func == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        else:
            self.e_score_correction_bias = None

    def native_unfit(self) -> str | None:
        """Why the native router cannot run this gate's settings (the KernelPlan then keeps the torch router,
        saying why), or None: weights off the CPU, a scoring or top-k rule it lacks, or more experts / groups than
        it sizes for."""
        cfg = self.cfg
        if self.weight.device.type != "cpu":
            return "gate weight not on the CPU"
        if cfg.scoring_func not in native.SCORING or cfg.topk_method not in native.TOPK_METHOD:
            return f"router {cfg.scoring_func} / {cfg.topk_method} not in the native router"
        e = cfg.n_routed_experts
        grouped = cfg.topk_method != "greedy"
        if e > 1024 or (
            grouped and not (1 <= cfg.n_group <= 64 and e % cfg.n_group == 0 and 1 <= cfg.topk_group <= cfg.n_group)
        ):
            return "router settings beyond the native router's (1024 experts, 64 groups)"
        return None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (topk_w [T, k] fp32, topk_idx [T, k])."""
        return self.route(F.linear(x.float(), self.weight.float()))

    def _route_native(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One C call for a step of up to NATIVE_ROWS tokens (its top-k is a plain O(k E) scan per token, one
        thread); a larger step takes the torch router."""
        if logits.shape[0] > self.NATIVE_ROWS:
            return self._route_torch(logits)
        cfg, bias = self.cfg, self.e_score_correction_bias
        return native.moe_route(
            logits,
            bias.float().contiguous() if bias is not None else None,
            cfg.scoring_func,
            cfg.topk_method,
            cfg.n_group,
            cfg.topk_group,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )

    def _route_torch(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference: logits [T, E] fp32 -> (topk_w [T, k] fp32, topk_idx [T, k])."""
        cfg = self.cfg
        if cfg.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
            choice = scores
        else:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
        if cfg.topk_method in ("group_limited_greedy", "noaux_tc"):
            choice = self._mask_groups(choice)
        topk_idx = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        # Weights come from the unbiased scores; the bias only steers the choice.
        topk_w = scores.gather(1, topk_idx)
        if cfg.norm_topk_prob:
            topk_w = topk_w / (topk_w.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_w * cfg.routed_scaling_factor, topk_idx

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Keep the experts of the topk_group best groups (V2: group max, V3: sum of the top-2)."""
        cfg = self.cfg
        grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            fill = float("-inf")
        else:
            group_scores = grouped.max(dim=-1).values
            fill = 0.0  # V2 zeroes the softmax scores of dropped groups
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        return grouped.masked_fill(~keep[..., None], fill).view_as(choice)


class Experts(nn.Module):
    """Routed experts stored stacked: gate_up [E, 2I, D], down [E, D, I]."""

    # the plain SwiGLU product unless __init__ is given swiglu_limit's clamps (an Experts made without __init__,
    # as the holders' tests make their dense references, computes the plain product too)
    act = staticmethod(swiglu)

    def __init__(self, hidden: int, cfg: MoEConfig, limit: float | None = None) -> None:
        """limit: swiglu_limit's clamps on every expert (GLM-5.3-Flash), None: the plain product."""
        super().__init__()
        e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, i))
        self.impl = "grouped_mm"
        self.act = activation(limit)

    def checkpoint_slots(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Where each expert's checkpoint tensors go (the loader stacks them): tensor suffix ->
        (gate_proj, up_proj, down_proj) destinations [E, ...]; gate rows first in gate_up_proj."""
        i = self.gate_up_proj.shape[1] // 2
        return {"weight": (self.gate_up_proj[:, :i], self.gate_up_proj[:, i:], self.down_proj)}

    def forward(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        if self.impl == "loop":
            return self._forward_loop(x, topk_w, topk_idx)
        return self._forward_grouped(x, topk_w, topk_idx)

    def _forward_grouped(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        t, k = topk_idx.shape
        flat_idx = topk_idx.reshape(-1)
        sorted_idx, order = torch.sort(flat_idx, stable=True)
        token_of = order // k  # which token each sorted (token, expert) pair came from
        # each expert's end row in the sorted pairs (= the cumulative pair counts) by a search, not bincount:
        # bincount sizes its output from the largest index, a host read on CUDA that a CUDA graph cannot capture
        # (executor/host_sync.py); the same integers, and fewer ops
        experts = torch.arange(self.gate_up_proj.shape[0], device=flat_idx.device)
        offs = torch.searchsorted(sorted_idx, experts, right=True, out_int32=True)
        gate, up = torch._grouped_mm(x[token_of], self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        h = self.act(gate, up)
        del gate, up  # the pairs' [P, 2I] freed before the down product (as the inputs' gather already is)
        ys = torch._grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs)
        ys = ys * topk_w.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, ys)

    def _forward_loop(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(topk_idx).tolist():
            tok, slot = torch.where(topk_idx == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate, up), self.down_proj[e]) * topk_w[tok, slot, None].to(x.dtype)
            out.index_add_(0, tok, y)
        return out


class MoE(BlockSwitch, nn.Module):
    KERNEL_OP = "moe_block"  # native: the decode step in one C call (quant/ggml_moe_block.py GGUFMoEBlock)

    def __init__(self, hidden: int, cfg: MoEConfig, limit: float | None = None) -> None:
        """limit: swiglu_limit (GLM-5.3-Flash's clamps, on the routed and the shared experts), None: none."""
        super().__init__()
        self.gate = Gate(hidden, cfg)
        self.experts = Experts(hidden, cfg, limit)
        n_shared = cfg.n_shared_experts
        self.shared_experts = SwiGLU(hidden, cfg.moe_intermediate_size * n_shared, limit) if n_shared else None
        # the whole block as one native call for decode steps (quant.ggml_moe_block.GGUFMoEBlock), set by the KernelPlan
        # where every expert weight is a ggml-block holder with the native kernels; per_op below is its reference
        # and its declared fallback for steps outside its contract
        self.native_block = None
        # expert parallelism (distributed/expert_parallel.py): this rank's experts, their partial sum all-reduced;
        # set at load, None in one process
        self.expert_shard = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.step(x)

    def per_op(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: the gate, the routed experts and the shared expert as separate ops."""
        topk_w, topk_idx = self.gate(x)
        routed = self.experts if self.expert_shard is None else self.expert_shard
        out = routed(x, topk_w, topk_idx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

"""DeepSeek-V4's MoE: every layer routed, sqrt-softplus scores, always renormalised, scaled; the first layers
route by a frozen token-id table (hash routing), so token ids reach the MoE.

Notation
  S tokens, D hidden, E routed experts, k experts per token, I moe_intermediate_size, L swiglu_limit
  scores [S, E]   sqrt(softplus(x @ W_gate^T))
  learned (moe)       idx = topk(scores + e_score_correction_bias, k)   (no group limit)
  hash (hash_moe)     idx = tid2eid[token_id]                          [vocab, k] int table
  weights [S, k]  scores[idx] / (sum + 1e-20) * routed_scaling_factor    (norm_topk_prob is not read)
  expert(x) = down(silu(min(gate(x), L)) * clamp(up(x), -L, L)); the shared expert clamps the same way
  y = sum_k weights_k expert_idx_k(x) + shared(x)
Experts are stacked as the reference's module: gate_up_proj [E, 2I, D] (gate rows first), down_proj [E, D, I];
the batch runs as one grouped GEMM per projection where rows align, else (and as the reference) per expert.
Under expert parallelism each rank holds a range of the experts (expert_shard); the router is replicated, so a
hash layer's tid2eid[token_id] is looked up on every rank from the step's own token ids.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config.deepseek_v4_parts import V4MoE
from mlaserve.kernels.registry import BlockSwitch


def sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x).sqrt()


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Router(nn.Module):
    def __init__(self, hidden: int, cfg: V4MoE, vocab: int, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.top_k, self.scaling = hashed, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, hidden))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(vocab, cfg.num_experts_per_tok, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, D], token_ids [S] -> weights [S, k], idx [S, k]."""
        scores = sqrt_softplus(F.linear(x, self.weight))
        if self.hashed:
            idx = self.tid2eid[token_ids].long()
        else:
            idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, idx)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, idx


class Experts(nn.Module):
    """impl "grouped_mm": tokens sorted by expert, one grouped GEMM per projection (as models/moe.py); "loop": the
    plain reference, one pass per expert with tokens. Chosen at construction from the shapes: the grouped GEMM
    needs 16-byte-aligned rows (hidden and moe_intermediate_size multiples of 8 in any dtype here)."""

    def __init__(self, hidden: int, cfg: V4MoE) -> None:
        super().__init__()
        e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, hidden))
        self.down_proj = nn.Parameter(torch.zeros(e, hidden, i))
        self.impl = "grouped_mm" if hidden % 8 == 0 and i % 8 == 0 else "loop"

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.impl == "loop":
            return self._forward_loop(x, weights, idx)
        k = idx.shape[1]
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        token_of = order // k
        offs = torch.cumsum(torch.bincount(flat, minlength=self.gate_up_proj.shape[0]), 0).to(torch.int32)
        gate, up = torch._grouped_mm(x[token_of], self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        h = clamped_swiglu(gate, up, self.limit)
        del gate, up  # the pairs' [P, 2I] freed before the down product
        ys = torch._grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs)
        ys = ys * weights.flatten()[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, ys)

    def _forward_loop(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return experts_loop(x, weights, idx, lambda e: (self.gate_up_proj[e], self.down_proj[e]), self.limit)


def experts_loop(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    limit: float,
) -> torch.Tensor:
    """The plain reference: per routed expert e (in id order), its tokens' clamped SwiGLU through
    expert(e) = (gate_up [2I, D], down [D, I]), weighted and summed into [T, D]. Shared with the quantized
    holders (quant/deepseek_v4.py), whose expert(e) dequantizes expert e once."""
    out = torch.zeros_like(x)
    flat = idx.flatten()
    n_experts = int(flat.max()) + 1 if flat.numel() else 0
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    token_of, slot_of = order // idx.shape[1], order % idx.shape[1]
    begin = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok, slot = token_of[begin : begin + n], slot_of[begin : begin + n]
        begin += n
        gate_up, down = expert(e)
        gate, up = F.linear(x[tok].to(gate_up.dtype), gate_up).chunk(2, dim=-1)
        y = F.linear(clamped_swiglu(gate, up, limit), down) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class V4MoEBlock(BlockSwitch, nn.Module):
    KERNEL_OP = "moe_block"  # native: the decode step in one C call (quant/ggml_moe_block.py GGUFMoEBlock)

    def __init__(self, hidden: int, cfg: V4MoE, vocab: int, hashed: bool) -> None:
        super().__init__()
        self.gate = Router(hidden, cfg, vocab, hashed)
        self.experts = Experts(hidden, cfg)
        # transformers builds one shared MLP of moe_intermediate_size (n_shared_experts 0 or 1 is checked)
        self.shared_experts = SharedExpert(hidden, cfg.moe_intermediate_size, cfg.swiglu_limit)
        # expert parallelism (distributed/expert_parallel.py): this rank's experts, their partial sum all-reduced;
        # set at load, None in one process. The router (hash or learned) runs on every rank over the step's tokens
        self.expert_shard = None
        # the whole block as one native call for decode steps where the plan attaches it (GGUF experts and shared
        # expert with the native kernels); per_op is its reference and its fallback outside the call's contract
        self.native_block = None

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        return self.step(x, token_ids)

    def per_op(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The reference: the router, the routed experts and the shared expert as separate ops."""
        weights, idx = self.gate(x, token_ids)
        routed = self.experts if self.expert_shard is None else self.expert_shard
        return routed(x, weights, idx) + self.shared_experts(x)

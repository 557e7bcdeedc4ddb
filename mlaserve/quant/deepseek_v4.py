"""DeepSeek-V4's quantized weight holders: the FP8 (e4m3, block-scaled) forms of the two V4 modules that are
not plain linears. Plain projections use FP8Linear (quant/linear.py) as they are.

Notation (fp8_block.py: W ~= Q * S[n // bn, k // bk])
  FP8GroupedLinear   Q [G*o, H/G*D] e4m3 + weight_scale_inv [ceil(G*o/bn), ceil(H/G*D/bk)]: o_a_proj, the
                     grouped output projection; dequantized per call, then the G block products
  FP8V4Experts       gate_up_proj [E, 2I, D] e4m3 (gate rows first) + gate_up_scale [E, 2, ceil(I/bn), ceil(D/bk)]
                     (gate and up keep their own scales: I need not be a multiple of bn);
                     down_proj [E, D, I] e4m3 + down_scale [E, ceil(D/bn), ceil(I/bk)]
                     forward dequantizes only the experts a step routes to, with V4's clamped SwiGLU
  FP4V4Experts       the release's routed experts (expert_dtype "fp4", fp4_group.py): int8 codes, two per
                     byte, gate_up_proj [E, 2I, D/2], down_proj [E, D, I/2]; fp32 scales per row and 32
                     columns gate_up_scale [E, 2, I, ceil(D/32)], down_scale [E, D, ceil(I/32)]
Like every holder: the stored bytes are copied at load, never converted; dequantize() is the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.models.deepseek_v4.moe import experts_loop
from mlaserve.quant import fp4_group, fp8_block
from mlaserve.quant.config import QuantScheme
from mlaserve.quant.linear import FP8Linear


class FP8GroupedLinear(FP8Linear):
    """o_a_proj with e4m3 blocks: y[:, g] = x[:, g] @ W_g^T for the G row blocks W_g of the weight."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, scheme: QuantScheme, device) -> None:
        super().__init__(in_per_group, out_features, scheme, bias=False, dtype=torch.float32, device=device)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, G, H/G*D] -> [S, G*o], in fp32 (as FP8Linear), rounded to x's dtype."""
        w = fp8_block.dequantize(self.weight, self.scale, self.block)
        w = w.view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        return torch.bmm(x.float().transpose(0, 1), w).transpose(0, 1).flatten(1).to(x.dtype)


def _frozen(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class FP8V4Experts(nn.Module):
    def __init__(self, hidden: int, n_experts: int, inter: int, limit: float, scheme: QuantScheme, device) -> None:
        super().__init__()
        self.scheme, self.limit, self.inter = scheme, limit, inter
        self.block = scheme.block_of(inter, hidden)  # both projections use the scheme's (bn, bk)
        bn, bk = self.block
        self.gate_up_proj = _frozen((n_experts, 2 * inter, hidden), fp8_block.FP8, device)
        self.gate_up_scale = _frozen((n_experts, 2, -(-inter // bn), -(-hidden // bk)), torch.float32, device)
        self.down_proj = _frozen((n_experts, hidden, inter), fp8_block.FP8, device)
        self.down_scale = _frozen((n_experts, -(-hidden // bn), -(-inter // bk)), torch.float32, device)

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's dense (gate_up [2I, D], down [D, I]) in fp32."""
        i, b = self.inter, self.block
        gate = fp8_block.dequantize(self.gate_up_proj[e, :i], self.gate_up_scale[e, 0], b)
        up = fp8_block.dequantize(self.gate_up_proj[e, i:], self.gate_up_scale[e, 1], b)
        return torch.cat([gate, up]), fp8_block.dequantize(self.down_proj[e], self.down_scale[e], b)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.expert(e) for e in range(self.gate_up_proj.shape[0])]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """As models/deepseek_v4/moe.Experts (its plain reference loop), each routed expert dequantized once."""
        return experts_loop(x, weights, idx, self.expert, self.limit)


class FP4V4Experts(FP8V4Experts):
    def __init__(self, hidden: int, n_experts: int, inter: int, limit: float, scheme: QuantScheme, device) -> None:
        nn.Module.__init__(self)
        self.scheme, self.limit, self.inter = scheme, limit, inter
        g = fp4_group.scale_groups
        self.gate_up_proj = _frozen((n_experts, 2 * inter, hidden // 2), torch.int8, device)
        self.gate_up_scale = _frozen((n_experts, 2, inter, g(hidden)), torch.float32, device)
        self.down_proj = _frozen((n_experts, hidden, inter // 2), torch.int8, device)
        self.down_scale = _frozen((n_experts, hidden, g(inter)), torch.float32, device)

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.inter
        gate = fp4_group.dequantize(self.gate_up_proj[e, :i], self.gate_up_scale[e, 0])
        up = fp4_group.dequantize(self.gate_up_proj[e, i:], self.gate_up_scale[e, 1])
        return torch.cat([gate, up]), fp4_group.dequantize(self.down_proj[e], self.down_scale[e])


def swap_in_fp8(model: nn.Module, modules: set[str], expert_layers: set[str], scheme: QuantScheme) -> None:
    """Replace the named modules of a V4 model (built on any device) with their FP8 holders: nn.Linear ->
    FP8Linear, the grouped o_a_proj -> FP8GroupedLinear, a layer's routed experts -> FP8V4Experts (FP4V4Experts
    when the scheme's expert_dtype is "fp4")."""
    from mlaserve.models.deepseek_v4.attention import GroupedLinear

    for name in sorted(modules | expert_layers):
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, leaf)
        device = next(old.parameters()).device
        if name in expert_layers:
            e, two_i, d = old.gate_up_proj.shape
            holder = FP4V4Experts if scheme.expert_dtype == "fp4" else FP8V4Experts
            new = holder(d, e, two_i // 2, old.limit, scheme, device)
        elif isinstance(old, GroupedLinear):
            new = FP8GroupedLinear(old.weight.shape[1], old.weight.shape[0], old.groups, scheme, device)
        elif isinstance(old, nn.Linear) and old.bias is None:
            new = FP8Linear(old.in_features, old.out_features, scheme, False, torch.float32, device)
        else:
            raise TypeError(f"{name}: no FP8 holder for {type(old).__name__}")
        setattr(parent, leaf, new)

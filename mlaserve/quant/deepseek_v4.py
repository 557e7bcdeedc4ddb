"""DeepSeek-V4's quantized weight holders: the FP8 (e4m3, block-scaled) forms of the two V4 modules that are
not plain linears. Plain projections use FP8Linear (quant/linear.py) as they are.

Notation (fp8_block.py: W ~= Q * S[n // bn, k // bk]); G o_groups, o o_lora_rank, S rows (tokens)
  FP8GroupedLinear   Q [G*o, H/G*D] e4m3 + weight_scale_inv [ceil(G*o/bn), ceil(H/G*D/bk)]: o_a_proj, the
                     grouped output projection y[:, g] = x[:, g] @ W_g^T, W_g = rows g*o .. (g+1)*o - 1
  FP8V4Experts       gate_up_proj [E, 2I, D] e4m3 (gate rows first) + gate_up_scale [E, 2, ceil(I/bn), ceil(D/bk)]
                     (gate and up keep their own scales: I need not be a multiple of bn);
                     down_proj [E, D, I] e4m3 + down_scale [E, ceil(D/bn), ceil(I/bk)]
  FP4V4Experts       the release's routed experts (expert_dtype "fp4", fp4_group.py): int8 codes, two per
                     byte, gate_up_proj [E, 2I, D/2], down_proj [E, D, I/2]; fp32 scales per row and 32
                     columns gate_up_scale [E, 2, I, ceil(D/32)], down_scale [E, D, ceil(I/32)]
The experts are FP8Experts / FP4Experts (quant/linear.py) with V4's clamped SwiGLU between the two products
(models/deepseek_v4/moe.py clamped_swiglu) and V4's names for the scales: the same step (pairs sorted by expert,
the native grouped decode-and-dot at few rows per expert, else the routed experts decoded and grouped GEMMs, one
index_add), bound at load by the KernelPlan (kernels/registry.py). `reference` is the plain loop over experts
(models/deepseek_v4/moe.experts_loop over `expert(e)`, each dequantized by torch) the fast paths are tested against.
Like every holder: the stored bytes are copied at load, never converted; dequantize() is the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.kernels import native
from mlaserve.models.deepseek_v4.moe import clamped_swiglu, experts_loop
from mlaserve.quant import fp4_group, fp8_block
from mlaserve.quant.config import QuantScheme
from mlaserve.quant.linear import FP4Experts, FP8Experts, FP8Linear


class FP8GroupedLinear(FP8Linear):
    """o_a_proj with e4m3 blocks: y[:, g] = x[:, g] @ W_g^T for the G row blocks W_g of the weight. Kernels as
    FP8Linear's: native up to NATIVE_ROWS rows the C grouped decode-and-dot, the groups as the "experts" of one
    call (when o is a multiple of bn, so a group's rows own whole rows of scale blocks), else the weight decoded by
    the C decoder, then G block products; torch: decoded by torch, then the block products."""

    NATIVE_FALLBACK = "native decode, then the G block products"
    # no Triton kernel for the grouped products yet (the plan says so): FP8Linear's would multiply the whole weight
    KERNELS = ("native", "torch")
    KERNEL_CALLS = {"matmul": {"native": "_matmul_native", "torch": "_matmul_torch"}}

    def __init__(self, in_per_group: int, out_features: int, groups: int, scheme: QuantScheme, device) -> None:
        super().__init__(in_per_group, out_features, scheme, bias=False, dtype=torch.float32, device=device)
        self.groups = groups
        self.group_rows = out_features // groups  # o
        self.grouped_dot = self.group_rows % self.block[0] == 0  # a group's rows start on a scale block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, G, H/G*D] -> [S, G*o], in fp32 (as FP8Linear), rounded to x's dtype."""
        return self.matmul(x)

    def _products(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [S, G, K], the dense weight w [G*o, K] fp32 -> [S, G*o] in x's dtype."""
        w = w.view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        return torch.bmm(x.float().transpose(0, 1), w).transpose(0, 1).flatten(1).to(x.dtype)

    def _matmul_torch(self, x: torch.Tensor) -> torch.Tensor:
        return self._products(x, fp8_block.dequantize(self.weight, self.scale, self.block))

    def _matmul_native(self, x: torch.Tensor) -> torch.Tensor:
        q = self.weight.view(torch.uint8)
        s, g, o = x.shape[0], self.groups, self.group_rows
        if not self.grouped_dot or s > self.NATIVE_ROWS:
            grid = native.ScaleGrid(self.scale.contiguous(), self.block[0], self.scale.shape[1], self.block[1], g * o)
            return self._products(x, native.dequantize(native.FP8_E4M3, q, self.in_features, grid))
        # group a's rows are expert a's of a grouped call; its S rows of x are rows a*S .. (a+1)*S - 1 of xs
        xs = x.float().transpose(0, 1).reshape(g * s, -1).contiguous()
        experts = torch.arange(g, dtype=torch.int64)
        starts = torch.arange(0, g * s + 1, s, dtype=torch.int64)
        scale = self.scale.reshape(g, -1, self.scale.shape[1]).contiguous()  # [G, o/bn, kb]
        grid = native.ScaleGrid(scale, self.block[0], scale.shape[-1], self.block[1], o)
        y = native.grouped_gemm(native.FP8_E4M3, xs, q.view(g, o, -1), self.in_features, experts, starts, grid)
        return y.view(g, s, o).transpose(0, 1).reshape(s, g * o).to(x.dtype)

    def native_detail(self) -> str:
        how = "the groups in one grouped decode-and-dot" if self.grouped_dot else "decoded, then the block products"
        why = "" if self.grouped_dot else f" (o {self.group_rows} not a multiple of the block's {self.block[0]} rows)"
        return f"{native.isa()} e4m3 {self.groups} groups: {how}{why}"


def _frozen(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _V4Experts:
    """What V4's routed experts change in FP8Experts / FP4Experts: the clamped SwiGLU, the scales' names
    (gate_up_scale, down_scale: the loader's, loading/deepseek_v4_names.py) and the reference loop."""

    limit: float
    inter: int

    def _swiglu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(g, u, self.limit)

    @property
    def gate_up_proj_scale(self) -> torch.Tensor:  # FP8Experts' name of the same grid
        return self.gate_up_scale

    @property
    def down_proj_scale(self) -> torch.Tensor:
        return self.down_scale

    def _init_v4(self, scheme: QuantScheme, hidden: int, inter: int, limit: float) -> None:
        self.scheme, self.limit, self.inter = scheme, limit, inter
        # torch._grouped_mm needs 16-byte-aligned rows of the decoded fp32 weights (models/deepseek_v4/moe.Experts)
        self.impl = "grouped_mm" if hidden % 8 == 0 and inter % 8 == 0 else "loop"
        self.kernel = "torch"  # the reference until the KernelPlan binds the engine's kernels (load)

    def reference(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The plain reference: one pass per routed expert, each dequantized by torch (experts_loop)."""
        return experts_loop(x, weights, idx, self.expert, self.limit)


class FP8V4Experts(_V4Experts, FP8Experts):
    """V4's routed experts in e4m3 blocks: FP8Experts' step with the clamped SwiGLU (both projections one block)."""

    def __init__(self, hidden: int, n_experts: int, inter: int, limit: float, scheme: QuantScheme, device) -> None:
        nn.Module.__init__(self)
        self._init_v4(scheme, hidden, inter, limit)
        self.block = self.block_gu = self.block_down = scheme.block_of(inter, hidden)  # both projections
        bn, bk = self.block
        self.gate_up_proj = _frozen((n_experts, 2 * inter, hidden), fp8_block.FP8, device)
        self.gate_up_scale = _frozen((n_experts, 2, -(-inter // bn), -(-hidden // bk)), torch.float32, device)
        self.down_proj = _frozen((n_experts, hidden, inter), fp8_block.FP8, device)
        self.down_scale = _frozen((n_experts, -(-hidden // bn), -(-inter // bk)), torch.float32, device)

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's dense (gate_up [2I, D], down [D, I]) in fp32, by torch."""
        i, b = self.inter, self.block
        gate = fp8_block.dequantize(self.gate_up_proj[e, :i], self.gate_up_scale[e, 0], b)
        up = fp8_block.dequantize(self.gate_up_proj[e, i:], self.gate_up_scale[e, 1], b)
        return torch.cat([gate, up]), fp8_block.dequantize(self.down_proj[e], self.down_scale[e], b)


class FP4V4Experts(_V4Experts, FP4Experts):
    """The release's FP4 routed experts: FP4Experts' "fp4" variant (int8 codes, fp32 group-32 scales) with the
    clamped SwiGLU."""

    def __init__(self, hidden: int, n_experts: int, inter: int, limit: float, scheme: QuantScheme, device) -> None:
        nn.Module.__init__(self)
        self._init_v4(scheme, hidden, inter, limit)
        self.variant, self.group = "fp4", fp4_group.GROUP
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

"""Modules that hold quantized weights in their stored form: THE seam for quantized weights.

The interface every quantized weight holder implements (a linear layer or a stack of experts):
  parameters named as the checkpoint names them (`weight` + its scale tensor), filled by the
      strict loader like any parameter -- the stored bytes are copied, never converted;
  dequantize(dtype) -> the dense weight: the reference the fast path is tested against;
  forward(x)        -> the layer's output in x's dtype (--dtype is the activation precision), which
      dequantizes on the fly (only the experts a step routes to) and drops the dense copy;
      the product runs in fp32 (exact dequantized weights, fp32 accumulation) and is rounded to
      x's dtype: on CPU, fp32 -> bf16 conversion of a whole weight costs more than the fp32 GEMM
      saves (measured), and bf16 GEMMs are slower than fp32 ones without native bf16 units;
  describe()        -> (scheme, block) for provenance and `mlaserve inspect`.
A GGUF block format kept quantized (Q8_0: [N, K/32] blocks of 32 int8 + one fp16 scale; Q4_K:
256-value super-blocks) plugs in as another holder class: `weight` holds the raw ggml bytes
[N, K/32 * 34] uint8, `dequantize` calls gguf.quants' torch dequantizer (bit-exact with gguf-py),
and `forward` is the same "dequantize, then F.linear / grouped GEMM" until a packed kernel beats it;
`swap_in` (quant/plan.py) picks the holder class per module from the checkpoint's tensors.
Holders here: FP8Linear, FP8Experts (e4m3 blocks, fp8_block.py), FP4Experts (e2m1 groups, fp4_group.py).

Shapes: Linear weight [N, K] (N out, K in); experts gate_up [E, 2I, D] (gate rows first),
down [E, D, I]; block scales as in fp8_block.py. gate and up keep their own scales
[E, 2, ceil(I/bn), ceil(D/bk)], since I need not be a multiple of bn.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.kernels import native, triton_linear
from mlaserve.kernels.ggml import GEMV_ROWS, decoded_linear
from mlaserve.kernels.registry import KernelSwitch
from mlaserve.models.moe import Experts
from mlaserve.quant import fp4_group, fp8_block
from mlaserve.quant.config import QuantScheme


def _frozen(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class FP8Linear(KernelSwitch, nn.Module):
    """y = x W^T (+ b), W stored as e4m3 Q [N, K] and its scale tensor (named as the checkpoint)."""

    KERNEL_OP = "linear"  # kernels/registry.py chooses `kernel` at load (the KernelPlan)
    KERNELS = ("triton", "native", "torch")  # what `kernel` may be set to
    KERNEL_CALLS = {"matmul": {"triton": "_matmul_triton", "native": "_matmul_native", "torch": "_matmul_torch"}}
    NATIVE_ROWS, NATIVE_FALLBACK = GEMV_ROWS, "native decode, then BLAS"

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool, dtype, device) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.block = scheme.block_of(out_features, in_features)
        self.scale_name = scheme.scale_name
        self.weight = _frozen((out_features, in_features), fp8_block.FP8, device)
        self.register_parameter(
            scheme.scale_name, _frozen(scheme.scale_shape(out_features, in_features), torch.float32, device)
        )
        self.bias = _frozen((out_features,), dtype, device) if bias else None
        self.kernel = "torch"  # "native": the C kernels decode each row and dot it (set by the KernelPlan)

    @property
    def scale(self) -> torch.Tensor:
        """The scale as [nb, kb] (a tensor-strategy [1] scale is one block)."""
        s = getattr(self, self.scale_name)
        return s.view(fp8_block.scale_blocks(self.out_features, self.in_features, self.block))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return fp8_block.dequantize_reference(self.weight, self.scale, self.block).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def _matmul_native(self, x: torch.Tensor) -> torch.Tensor:
        """Up to NATIVE_ROWS rows the C kernels decode each weight row and dot it; more: the weight decoded by
        them (the reference's values), then the BLAS GEMM."""
        bias = self.bias.float() if self.bias is not None else None
        grid = native.ScaleGrid(
            self.scale.contiguous(), *self.block[:1], self.scale.shape[1], self.block[1], self.out_features
        )
        q, xf = self.weight.view(torch.uint8), x.float().contiguous()
        if xf.shape[0] <= self.NATIVE_ROWS:
            y = native.gemm(native.FP8_E4M3, xf, q, self.in_features, grid)
            return (y if bias is None else y + bias).to(x.dtype)
        bn, k = self.block[0], self.in_features

        def rows(n0: int, n1: int, out: torch.Tensor | None) -> torch.Tensor:  # n0: a multiple of bn
            part = native.ScaleGrid(grid.scale[n0 // bn : -(-n1 // bn)], bn, grid.kb, grid.bk, n1 - n0)
            return native.dequantize(native.FP8_E4M3, q[n0:n1], k, part, out=out)

        # decoded in parts: a DeepSeek-V3 dense matrix is 528 MB in fp32 at once (kernels/ggml.DENSE_BYTES)
        return decoded_linear(xf, self.out_features, k, rows, bias=bias, multiple=bn).to(x.dtype)

    def _matmul_torch(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.float() if self.bias is not None else None
        w = fp8_block.dequantize(self.weight, self.scale, self.block)
        return F.linear(x.float(), w, bias).to(x.dtype)

    def _matmul_triton(self, x: torch.Tensor) -> torch.Tensor:
        """The Triton kernels (kernels/triton_linear.py): the blocks decoded tile by tile, fp32 products."""
        y = triton_linear.fp8_linear(x.reshape(-1, self.in_features), self.weight, self.scale, self.block)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def triton_unfit(self) -> str | None:
        """Every block shape (channel, tensor and (bn, bk) blocks, partial edge blocks) has the Triton kernel."""
        return None

    def triton_format(self) -> str:
        return f"fp8 e4m3 {self.block}"

    def describe(self) -> tuple[str, tuple[int, int]]:
        return f"{self.scheme.method} {self.scheme.fmt}", self.block

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


class FP8Experts(KernelSwitch, Experts):
    """Routed experts kept in e4m3: gate_up_proj [E, 2I, D] and down_proj [E, D, I] with their
    scales; a step dequantizes only the experts it routes tokens to, then one grouped GEMM."""

    KERNEL_OP = "grouped_experts"
    KERNELS = ("native", "torch")
    KERNEL_CALLS = {
        "routed": {"native": "_routed_native", "torch": "_routed_torch"},
        "decode_experts": {"native": "_native_weights", "torch": "_torch_weights"},
    }
    # grouped: up to GEMV_ROWS rows per active expert the C kernels' grouped GEMV, more: decoded, then GEMMs
    NATIVE_ROWS, NATIVE_UNIT, NATIVE_FALLBACK = GEMV_ROWS, "rows per expert", "native decode, then grouped GEMMs"

    def __init__(self, hidden: int, n_experts: int, inter: int, scheme: QuantScheme, device) -> None:
        nn.Module.__init__(self)
        self.impl, self.scheme, self.kernel = "grouped_mm", scheme, "torch"
        self.block_gu = scheme.block_of(inter, hidden)
        self.block_down = scheme.block_of(hidden, inter)
        self.gate_up_proj = _frozen((n_experts, 2 * inter, hidden), fp8_block.FP8, device)
        self.down_proj = _frozen((n_experts, hidden, inter), fp8_block.FP8, device)
        self.gate_up_proj_scale = _frozen(
            (n_experts, 2, *fp8_block.scale_blocks(inter, hidden, self.block_gu)), torch.float32, device
        )
        self.down_proj_scale = _frozen(
            (n_experts, *fp8_block.scale_blocks(hidden, inter, self.block_down)), torch.float32, device
        )

    def checkpoint_slots(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The values like Experts; each expert's scale tensor into its stack (gate, up kept apart)."""
        s = self.gate_up_proj_scale
        return super().checkpoint_slots() | {self.scheme.scale_name: (s[:, 0], s[:, 1], self.down_proj_scale)}

    def expert_weights(self, experts: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense gate_up [A, 2I, D] and down [A, D, I] of the listed experts, in dtype (native kernels: many
        tokens per expert, prefill, decode natively, then the GEMMs)."""
        return self.decode_experts(experts, dtype)

    def _torch_weights(self, experts: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.gate_up_proj[experts]
        gu = fp8_block.dequantize(q.unflatten(1, (2, -1)), self.gate_up_proj_scale[experts], self.block_gu, dtype)
        down = fp8_block.dequantize(self.down_proj[experts], self.down_proj_scale[experts], self.block_down, dtype)
        return gu.flatten(1, 2), down

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference: every expert, torch's cast."""
        gu = fp8_block.dequantize_reference(
            self.gate_up_proj.unflatten(1, (2, -1)), self.gate_up_proj_scale, self.block_gu
        ).flatten(1, 2)
        down = fp8_block.dequantize_reference(self.down_proj, self.down_proj_scale, self.block_down)
        return gu.to(dtype), down.to(dtype)

    def describe(self) -> tuple[str, tuple[int, int]]:
        return f"{self.scheme.method} {self.scheme.fmt}", self.block_gu

    def forward(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        return self.routed(x, topk_w, topk_idx)

    def _routed_native(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        active = torch.unique(topk_idx)  # sorted: the grouped GEMM's groups, in expert order
        if self.impl == "grouped_mm" and topk_idx.numel() <= self.NATIVE_ROWS * len(active):
            return self._native(x, topk_w, topk_idx, active)
        return self._dense(x, topk_w, topk_idx, active)

    def _routed_torch(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        return self._dense(x, topk_w, topk_idx, torch.unique(topk_idx))

    def _dense(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor, active: torch.Tensor):
        """The active experts dequantized (expert_weights), then grouped GEMMs (or the per-expert loop)."""
        gate_up, down = self.expert_weights(active, torch.float32)
        local = torch.searchsorted(active, topk_idx)  # expert id -> its row in the active stack
        run = self._loop if self.impl == "loop" else self._grouped
        return run(x.float(), topk_w, local, gate_up, down).to(x.dtype)

    def _native(self, x, topk_w, topk_idx, active) -> torch.Tensor:
        """Few tokens per expert (decode): the C kernels decode each routed expert's rows once and dot
        them with that expert's tokens; no dense copy of any expert is made."""
        k = topk_idx.shape[1]
        flat = torch.searchsorted(active, topk_idx).reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // k
        starts = F.pad(torch.cumsum(torch.bincount(flat, minlength=active.shape[0]), 0), (1, 0))
        experts = active.to(torch.int64).contiguous()
        xs = x.float()[token_of].contiguous()
        t, (gu, k_gu, gu_grid), (down, k_down, down_grid) = self._native_operands()
        g, u = native.grouped_gemm(t, xs, gu, k_gu, experts, starts, gu_grid).chunk(2, dim=-1)
        h = self._swiglu(g, u).contiguous()
        del xs, g, u  # the pairs' inputs and [P, 2I] freed before the down product
        ys = native.grouped_gemm(t, h, down, k_down, experts, starts, down_grid)
        ys = ys * topk_w.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x, dtype=torch.float32).index_add_(0, token_of, ys).to(x.dtype)

    def _native_operands(self) -> tuple[int, tuple, tuple]:
        """-> (the C kernels' type id, (gate_up bytes [E, 2I, R], K, grid), (down bytes [E, D, R'], K', grid))."""
        i, d = self.down_proj.shape[2], self.down_proj.shape[1]
        return (
            native.FP8_E4M3,
            (self.gate_up_proj.view(torch.uint8), d, self._grid(self.gate_up_proj_scale, self.block_gu, i)),
            (self.down_proj.view(torch.uint8), i, self._grid(self.down_proj_scale, self.block_down, d)),
        )

    def _native_weights(self, experts: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The same values as the torch dequantizer (bit for bit), decoded by the C kernels (kernels/csrc): the listed
        experts' rows flattened, their scale grids gathered alongside (parts continue in order)."""
        t, gate_up, down = self._native_operands()

        def decode(q: torch.Tensor, k: int, grid: native.ScaleGrid) -> torch.Tensor:
            sub = replace(grid, scale=grid.scale[experts].contiguous())
            rows = q[experts].reshape(-1, q.shape[-1])
            return native.dequantize(t, rows, k, sub).view(experts.shape[0], q.shape[1], k)

        return decode(*gate_up).to(dtype), decode(*down).to(dtype)

    @staticmethod
    def _swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The activation between the two products (DeepSeek-V4's holders clamp it: quant/deepseek_v4.py)."""
        return F.silu(g) * u

    @staticmethod
    def _grid(scale: torch.Tensor, block: tuple[int, int], part_rows: int) -> native.ScaleGrid:
        """scale [E, (parts,) nb, kb]: rows come in parts of part_rows (gate, up) with a grid each."""
        return native.ScaleGrid(scale.contiguous(), block[0], scale.shape[-1], block[1], part_rows)

    def _grouped(self, x, topk_w, local, gate_up, down) -> torch.Tensor:
        k = local.shape[1]
        flat = local.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // k
        offs = torch.cumsum(torch.bincount(flat, minlength=gate_up.shape[0]), 0).to(torch.int32)
        g, u = torch._grouped_mm(x[token_of], gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        h = self._swiglu(g, u)
        del g, u  # the pairs' [P, 2I] freed before the down product
        ys = torch._grouped_mm(h, down.transpose(1, 2), offs=offs)
        ys = ys * topk_w.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, ys)

    def _loop(self, x, topk_w, local, gate_up, down) -> torch.Tensor:
        out = torch.zeros_like(x)
        for a in range(gate_up.shape[0]):
            tok, slot = torch.where(local == a)
            g, u = F.linear(x[tok], gate_up[a]).chunk(2, dim=-1)
            out.index_add_(0, tok, F.linear(self._swiglu(g, u), down[a]) * topk_w[tok, slot, None].to(x.dtype))
        return out


class FP4Experts(FP8Experts):
    """Routed experts kept as packed e2m1 (fp4_group.py), two codes per byte: gate_up_proj
    [E, 2I, D/2], down_proj [E, D, I/2], and per row and g columns the scales gate_up_proj_scale
    [E, 2, I, D/g], down_proj_scale [E, D, I/g], each in its stored dtype:
      "fp4"    int8 codes, fp32 scales (`weight_scale_inv`), g = 32         (DeepSeek-V4 style)
      "mxfp4"  uint8 codes (`weight_packed`), e8m0 bytes: S = 2^(b - 127), g = 32
      "nvfp4"  uint8 codes, e4m3 scales over a per-tensor `weight_global_scale`: S = s / global, g = 16
    Same step as FP8Experts (only the routed experts are dequantized)."""

    KERNEL_OP = "grouped_experts"
    KERNELS = ("native", "torch")  # native for the "fp4" variant (fp32 scales); see __init__

    def __init__(self, hidden: int, n_experts: int, inter: int, scheme: QuantScheme, device) -> None:
        nn.Module.__init__(self)
        self.impl, self.scheme, self.variant, self.kernel = "grouped_mm", scheme, scheme.expert_dtype, "torch"
        if self.variant != "fp4":  # e8m0 / e4m3-over-global scales: the C kernels read fp32 scales only
            self.KERNELS = ("torch",)
        self.group = 16 if self.variant == "nvfp4" else fp4_group.GROUP
        codes = torch.int8 if self.variant == "fp4" else torch.uint8
        scales = {"fp4": torch.float32, "mxfp4": torch.uint8, "nvfp4": fp8_block.FP8}[self.variant]
        g = lambda k: fp4_group.scale_groups(k, self.group)  # noqa: E731
        self.gate_up_proj = _frozen((n_experts, 2 * inter, hidden // 2), codes, device)
        self.down_proj = _frozen((n_experts, hidden, inter // 2), codes, device)
        self.gate_up_proj_scale = _frozen((n_experts, 2, inter, g(hidden)), scales, device)
        self.down_proj_scale = _frozen((n_experts, hidden, g(inter)), scales, device)
        if self.variant == "nvfp4":
            self.gate_up_proj_global_scale = _frozen((n_experts, 2, 1), torch.float32, device)
            self.down_proj_global_scale = _frozen((n_experts, 1), torch.float32, device)

    def checkpoint_slots(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        gu, s = self.gate_up_proj, self.gate_up_proj_scale
        i = gu.shape[1] // 2
        if self.variant == "fp4":
            return {
                "weight": (gu[:, :i], gu[:, i:], self.down_proj),
                "weight_scale_inv": (s[:, 0], s[:, 1], self.down_proj_scale),
            }
        slots = {
            "weight_packed": (gu[:, :i], gu[:, i:], self.down_proj),
            "weight_scale": (s[:, 0], s[:, 1], self.down_proj_scale),
        }
        if self.variant == "nvfp4":
            g = self.gate_up_proj_global_scale
            slots["weight_global_scale"] = (g[:, 0], g[:, 1], self.down_proj_global_scale)
        return slots

    def _scales(self, experts: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 S of gate_up [A, 2, I, D/g] and down [A, D, I/g]."""
        gu, down = self.gate_up_proj_scale[experts], self.down_proj_scale[experts]
        if self.variant == "mxfp4":
            return torch.exp2(gu.float() - 127), torch.exp2(down.float() - 127)
        if self.variant == "nvfp4":
            g_gu, g_down = self.gate_up_proj_global_scale[experts], self.down_proj_global_scale[experts]
            return gu.float() / g_gu[..., None], down.float() / g_down[..., None]
        return gu, down

    def _native_operands(self) -> tuple[int, tuple, tuple]:
        """Codes as bytes, fp32 group scales as grids of one row by `group` columns."""
        d, i = self.down_proj.shape[1], self.gate_up_proj.shape[1] // 2
        s_gu, s_down = self.gate_up_proj_scale, self.down_proj_scale
        return (
            native.FP4_E2M1,
            (self.gate_up_proj.view(torch.uint8), d, native.ScaleGrid(s_gu, 1, s_gu.shape[-1], self.group, 2 * i)),
            (self.down_proj.view(torch.uint8), i, native.ScaleGrid(s_down, 1, s_down.shape[-1], self.group, d)),
        )

    def _torch_weights(self, experts: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        s_gu, s_down = self._scales(experts)
        gu = fp4_group.dequantize(self.gate_up_proj[experts].unflatten(1, (2, -1)), s_gu, self.group)
        down = fp4_group.dequantize(self.down_proj[experts], s_down, self.group)
        return gu.flatten(1, 2).to(dtype), down.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        s_gu, s_down = self._scales(slice(None))
        gu = fp4_group.dequantize_reference(self.gate_up_proj.unflatten(1, (2, -1)), s_gu, self.group)
        down = fp4_group.dequantize_reference(self.down_proj, s_down, self.group)
        return gu.flatten(1, 2).to(dtype), down.to(dtype)

    def describe(self) -> tuple[str, tuple[int, int]]:
        return f"{self.variant} e2m1", (1, self.group)

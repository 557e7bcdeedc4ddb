"""INT4Experts: routed experts kept packed as compressed-tensors W4A16 `pack-quantized` (int4_group.py),
the quantized-holder interface of quant/linear.py (stored parameters named as the checkpoint names
them, dequantize(), forward(), describe()).

Notation (E experts, D hidden, I expert width, g = 32)
  gate_up_proj        [E, 2I, D/8] int32   gate rows, then up rows (each expert's gate_proj / up_proj weight_packed)
  down_proj           [E, D, I/8]  int32
  gate_up_proj_scale  [E, 2, I, D/g] fp32  weight_scale (bf16 in the release: widened exactly at load)
  down_proj_scale     [E, D, I/g]
  gate_up_proj_shape  [E, 2, 2] int64      weight_shape (N, K) of gate and up; down_proj_shape [E, 2]
The kernel plan binds one of two implementations (FP8Experts' KERNEL_CALLS):
  torch   the reference: a step unpacks only the experts it routes tokens to, in fp32 (exact: q * S), then
          the grouped GEMM of FP8Experts;
  native  (kernels/csrc, MLS_INT4_PACKED) up to NATIVE_ROWS rows per routed expert the words are decoded in
          registers and dotted with that expert's rows, the group's scale applied to each 32-column partial
          sum (the Q4_0 scheme with the pack's nibble order and a float scale apart); more rows: the routed
          experts decoded natively (the reference's values bit for bit), then the grouped GEMMs. A decode
          step of up to 16 tokens runs the whole MoE layer as one C call instead (quant/ggml_moe_block.py
          GGUFMoEBlock, the same decode-and-dot with the scales beside the words).
Both equal "dequantize every expert, then run" within fp32 summation order. The int32 words are read as their
bytes, so the native kernel needs a little-endian host and groups of whole 32-column chunks (native_unfit).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from mlaserve.kernels import native
from mlaserve.loading.safetensors_source import WeightError
from mlaserve.quant import int4_group
from mlaserve.quant.config import QuantScheme
from mlaserve.quant.linear import FP8Experts, _frozen


class INT4Experts(FP8Experts):
    KERNEL_OP = "grouped_experts"
    KERNELS = ("native", "torch")

    def __init__(self, hidden: int, n_experts: int, inter: int, scheme: QuantScheme, device) -> None:
        nn.Module.__init__(self)
        self.impl, self.scheme, self.kernel, self.group = "grouped_mm", scheme, "torch", scheme.group_size
        for k, what in ((hidden, "hidden_size"), (inter, "moe_intermediate_size")):
            if k % self.group:
                raise WeightError(
                    f"INT4 routed experts: {what}={k} is not a multiple of the group size {self.group} "
                    "(pack-quantized groups must tile each row)"
                )
        p, g = int4_group.PACK, self.group
        self.gate_up_proj = _frozen((n_experts, 2 * inter, hidden // p), torch.int32, device)
        self.down_proj = _frozen((n_experts, hidden, inter // p), torch.int32, device)
        self.gate_up_proj_scale = _frozen((n_experts, 2, inter, hidden // g), torch.float32, device)
        self.down_proj_scale = _frozen((n_experts, hidden, inter // g), torch.float32, device)
        self.gate_up_proj_shape = _frozen((n_experts, 2, 2), torch.int64, device)
        self.down_proj_shape = _frozen((n_experts, 2), torch.int64, device)

    def checkpoint_slots(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        gu, s, shp = self.gate_up_proj, self.gate_up_proj_scale, self.gate_up_proj_shape
        i = gu.shape[1] // 2
        return {
            "weight_packed": (gu[:, :i], gu[:, i:], self.down_proj),
            "weight_scale": (s[:, 0], s[:, 1], self.down_proj_scale),
            "weight_shape": (shp[:, 0], shp[:, 1], self.down_proj_shape),
        }

    def check_loaded(self, name: str) -> None:
        """Every expert's weight_shape is the (N, K) the config implies (it is what the packing hides)."""
        e, two_i, packed = self.gate_up_proj.shape
        i, d = two_i // 2, packed * int4_group.PACK
        for proj, got, want in (
            ("gate_proj", self.gate_up_proj_shape[:, 0], (i, d)),
            ("up_proj", self.gate_up_proj_shape[:, 1], (i, d)),
            ("down_proj", self.down_proj_shape, (d, i)),
        ):
            bad = (got != torch.tensor(want)).any(dim=-1).nonzero().flatten().tolist()
            if bad:
                # first_expert: an expert-parallel rank holds experts [first, ...) of the checkpoint's
                e = bad[0] + getattr(self, "first_expert", 0)
                raise WeightError(
                    f"{name}.{e}.{proj}.weight_shape is {got[bad[0]].tolist()}, the config implies {list(want)}"
                )

    def native_unfit(self) -> str | None:
        """What the native kernel cannot take, known at load."""
        if self.group % 32:
            return f"INT4 group {self.group} is not whole 32-column chunks (the native kernel's unit)"
        if sys.byteorder != "little":
            return "the native kernel reads the int32 words as little-endian bytes"
        if self.gate_up_proj.device.type != "cpu":
            return f"the native kernel runs on the CPU, the experts are on {self.gate_up_proj.device}"
        return None

    def native_detail(self) -> str:
        """The plan's note: which build of the kernel runs (csrc/common.h picks it from the CPU's features)."""
        return f"{native.isa()} INT4 decode-and-dot"

    def _native_operands(self) -> tuple[int, tuple, tuple]:
        """The words as bytes (two columns per byte, in order), fp32 group scales as grids of one row by `group`
        columns (gate and up: parts of I rows with a grid each)."""
        d, i = self.down_proj.shape[1], self.gate_up_proj.shape[1] // 2
        s_gu, s_down = self.gate_up_proj_scale, self.down_proj_scale
        return (
            native.INT4_PACKED,
            (self.gate_up_proj.view(torch.uint8), d, native.ScaleGrid(s_gu, 1, s_gu.shape[-1], self.group, i)),
            (self.down_proj.view(torch.uint8), i, native.ScaleGrid(s_down, 1, s_down.shape[-1], self.group, d)),
        )

    def _torch_weights(self, experts: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.group
        gu = int4_group.dequantize(
            self.gate_up_proj[experts].unflatten(1, (2, -1)), self.gate_up_proj_scale[experts], g
        )
        down = int4_group.dequantize(self.down_proj[experts], self.down_proj_scale[experts], g)
        return gu.flatten(1, 2).to(dtype), down.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.group
        gu = int4_group.dequantize_reference(self.gate_up_proj.unflatten(1, (2, -1)), self.gate_up_proj_scale, g)
        down = int4_group.dequantize_reference(self.down_proj, self.down_proj_scale, g)
        return gu.flatten(1, 2).to(dtype), down.to(dtype)

    def describe(self) -> tuple[str, tuple[int, int]]:
        return "int4 pack-quantized", (1, self.group)

"""The `triton` implementation of the op "linear": weights kept in a stored format multiplied by the Triton
kernels of kernels/triton/ (FP8 e4m3 blocks, GGUF Q8_0 and Q4_K blocks), on a CUDA GPU.

Notation: x [M, K] activations, W [N, K] the weight as its format decodes it, y [M, N] fp32 = x @ W^T.
Up to TRITON_ROWS rows of x (decode steps) one kernel reads the stored blocks, decodes each tile into registers
and multiplies in fp32: the weight is never expanded in memory. More rows (prefill) are compute-bound: the
weight is decoded once per call by the same tile decoder (the reference's values bit for bit), then one fp32
GEMM (cuBLAS on a GPU). Both agree with the reference (dequantize, then F.linear) up to fp32 summation order.

Where it runs (`supports`, the registry's check, recorded in the KernelPlan): the holder's format has a kernel
(`triton_unfit`), Triton can run on the weight's device (platform/triton_runtime.py: compiled on CUDA; the
interpreter only where TRITON_INTERPRET=1, tests), and the engine's kernels resolved to "triton". The kernel
modules are imported at the first product, never at package import (Triton reads TRITON_INTERPRET when a
kernel is defined).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.platform.triton_runtime import triton_mode

# Rows of x per weight up to which the fused decode-and-multiply kernel runs; more: decode, then GEMM. The same
# small-batch limit as the native kernels' (ggml.GEMV_ROWS); not yet measured on a GPU.
TRITON_ROWS = 16
# a holder's format -> its kernel module (kernels/triton/<name>.py)
MODULES = {"fp8": "fp8_block_gemm", "Q8_0": "gguf_q8_0", "Q4_K": "gguf_q4_k"}


def kernel_module(fmt: str):
    """The kernel module of a format, imported now (the first product; Python keeps it)."""
    return importlib.import_module(f"mlaserve.kernels.triton.{MODULES[fmt]}")


def supports(module: nn.Module, kernels: str) -> str | None:
    """Why the triton implementation cannot take this module (None: it can)."""
    if "triton" not in getattr(module, "KERNELS", ()):
        return f"{type(module).__name__} has no Triton kernel"
    unfit = module.triton_unfit()
    if unfit is not None:
        return unfit
    mode = triton_mode(module.weight.device.type)
    if mode.mode is None:
        return mode.reason
    if kernels != "triton":
        return f"engine kernels={kernels} ({mode.mode} Triton not asked for)"
    return None


def detail(module: nn.Module) -> str:
    """What the plan says about a module the triton implementation takes."""
    mode = triton_mode(module.weight.device.type).mode
    return (
        f"triton {module.triton_format()} decode-and-multiply ({mode}) up to {TRITON_ROWS} rows per step, "
        "else the Triton decode, then the fp32 GEMM"
    )


def fp8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] @ (e4m3 Q [N, K] * S [nb, kb] per block)^T."""
    k = kernel_module("fp8")
    if x.shape[0] <= TRITON_ROWS:
        return k.linear(x, q, s, block)
    return F.linear(x.float(), k.dequantize(q, s, block))


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] @ dequantize(raw [N, R] of ggml type `fmt`)^T."""
    mod = kernel_module(fmt)
    if x.shape[0] <= TRITON_ROWS:
        return mod.linear(x, raw, k)
    return F.linear(x.float(), mod.dequantize(raw, k))

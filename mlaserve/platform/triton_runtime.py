"""Whether Triton kernels can run on a device, and how: compiled for a CUDA GPU, or executed by Triton's
interpreter (`TRITON_INTERPRET=1`) on CPU tensors. The interpreter is how every Triton kernel is tested
without a GPU (CI runs them against the reference backends on CPU); it is far too slow to serve with.

Triton reads TRITON_INTERPRET when a kernel is defined (`@triton.jit` returns an interpreted function),
so modules that define kernels are imported only after this check, never at package import.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TritonMode:
    mode: str | None  # "compiled", "interpreter" or None (Triton kernels cannot run here)
    reason: str  # why: recorded in provenance / the kernel plan, shown in the refusal


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_mode(device_type: str) -> TritonMode:
    """How Triton kernels would run on tensors of `device_type` ("cpu" or "cuda")."""
    if importlib.util.find_spec("triton") is None:
        return TritonMode(None, "the triton package is not installed (pip install triton)")
    if interpreter_enabled():
        return TritonMode("interpreter", "TRITON_INTERPRET=1: Triton's interpreter runs the kernels (for tests)")
    if device_type == "cuda":
        return TritonMode("compiled", "CUDA device: Triton compiles the kernels")
    return TritonMode(
        None, f"Triton compiles for GPUs only; on {device_type} set TRITON_INTERPRET=1 (the interpreter, for tests)"
    )

"""The two RMSNorms of DeepSeek-V4.

Notation
  x [..., n] rows normalised over their last dim
Weighted (q_a_norm, kv_norm, the compressors' kv_norm, the layer norms, the final norm): weight kept in fp32,
normalised and scaled in fp32, cast once at the end (transformers' DeepseekV4RMSNorm). Unweighted: the
per-head query norm and mHC's input norm, x * rsqrt(mean(x^2) + eps) in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlaserve.models import layers


class RMSNorm(layers.RMSNorm):
    """The weighted form. The MLA models' RMSNorm (models/layers.py: op "norm" of the KernelPlan, native one C call
    for fp32 rows on the CPU) with V4's torch form: the weight applied in fp32 before the cast, where theirs scales in
    the model dtype (the same operations in fp32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.weight.data = self.weight.data.float()

    def _norm_torch(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)

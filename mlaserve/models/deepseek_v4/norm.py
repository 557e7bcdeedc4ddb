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
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)

"""mHC (manifold-constrained hyper-connections): the residual is N = hc_mult streams, mixed around every
sublayer by weights computed from the streams themselves. Kept in fp32, as the reference keeps it.

Notation
  S tokens, N hc_mult, D hidden
  h     [S, N, D]  the streams (the embedding copied into all N at the start)
  f     [S, N*D]   rms(flatten(h)) (unweighted)
  a     [S, (2+N)N] f @ fn^T, split into pre [N], post [N], comb [N, N]
  pre   sigmoid(a_pre * scale_0 + base_pre) + eps              block input  x = sum_j pre_j h_j
  post  2 sigmoid(a_post * scale_1 + base_post)                 block output spread: post_k * block(x)
  comb  softmax_row(a_comb * scale_2 + base_comb) + eps, then Sinkhorn: columns, then (iters-1) times rows
        and columns, each divided by (sum + eps)                new streams h'_k = post_k y + sum_j comb_jk h_j
The final collapse before the last norm (make_head, from V4HyperConnections.learned_head): HyperHead, its own
sigmoid weights (DeepSeek-V4), or MeanHead, the streams' unweighted mean (GLM-5.3-Flash). One module for both
families: the blocks' mixing is the same, only the head differs.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config.deepseek_v4_parts import V4HyperConnections
from mlaserve.kernels import native_v4
from mlaserve.kernels.registry import KernelSwitch
from mlaserve.models.deepseek_v4.norm import unweighted_rms_norm


class HyperConnection(KernelSwitch, nn.Module):
    KERNEL_OP = "hyper_connection"  # kernels/registry.py chooses `kernel` at load (the KernelPlan)
    KERNELS = ("native", "torch")  # native: the whole mixing in one C call (csrc/hyper.c), fp32 CPU
    KERNEL_CALLS = {
        "mix": {"native": "_mix_native", "torch": "_mix_torch"},
        "expand": {"native": "_expand_native", "torch": "_expand_torch"},
    }

    def __init__(self, hidden: int, hc: V4HyperConnections, norm_eps: float) -> None:
        super().__init__()
        n = hc.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = n, hc.sinkhorn_iters, hc.eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.kernel = "torch"  # the reference; the loader's KernelPlan sets the engine's (binds self.mix)

    def native_unfit(self) -> str | None:
        """The native mixing's load-time check: fp32 weights on the CPU, at most 16 streams (the step's streams
        are checked per call: fp32 there, else the reference)."""
        if self.fn.dtype != torch.float32 or self.fn.device.type != "cpu":
            return "hyper-connection weights not fp32 on the CPU"
        return None if self.n <= 16 else f"{self.n} streams (the C call takes up to 16)"

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [S, N, D] -> post [S, N], comb [S, N, N] (fp32), block input [S, D] (h's dtype)."""
        return self.mix(h)

    def _mix_native(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """_mix_torch in one C call (csrc/hyper.c mls_hc_pre): at one token torch's ~20 ops and the Sinkhorn's
        2 x iters steps were ~0.3 ms a call (2-core AMX Xeon, 2 threads), 8 calls per decode step of a 4-layer model. Equal up to fp32 summation
        order (the squares and the dot products; the N-value sums in torch's order). Its contract on the step's
        input: fp32 CPU streams (else the reference)."""
        if h.dtype != torch.float32 or h.device.type != "cpu":
            return self._mix_torch(h)
        return native_v4.hc_pre(h.contiguous(), self.fn, self.base, self.scale, self.eps, self.norm_eps, self.iters)

    @staticmethod
    def _expand_torch(post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The new streams after the sublayer (module function `expand`, the reference)."""
        return expand(post, comb, y, h)

    @staticmethod
    def _expand_native(post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """expand in one C call (csrc/hyper.c mls_hc_post) where torch ran ~8 ops (a step's 8 calls on a 4-layer
        model). Equal up to fp32 summation order. Its contract on the step's input: fp32 CPU tensors (else the
        reference)."""
        if not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (post, comb, y, h)):
            return expand(post, comb, y, h)
        return native_v4.hc_post(post.contiguous(), comb.contiguous(), y.contiguous(), h.contiguous())

    def _mix_torch(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference (transformers' operations, the Sinkhorn by `sinkhorn`)."""
        n = self.n
        mixes = F.linear(unweighted_rms_norm(h.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = sinkhorn(comb, self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
        return post, comb, collapsed


def sinkhorn_reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [S, N, N] fp32 -> doubly stochastic (approx.): columns, then (iters-1) times rows and columns, each
    divided by (sum + eps). The plain torch path (any device, autograd) that `sinkhorn` is tested against."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """sinkhorn_reference, on CPU by numpy: the same fp32 operations in the same order (bit for bit, over N = 4's
    sums), but each of the 2 x iters tiny [S, N, N] steps costs ~1 us instead of torch's ~4 us dispatch: at decode
    the 20-iteration loop was ~0.7 ms per call, 8 calls per step on a 4-layer model. Other devices and tensors
    that need gradients take the reference."""
    if comb.device.type != "cpu" or comb.requires_grad or comb.dtype != torch.float32:
        return sinkhorn_reference(comb, iters, eps)
    m, e = comb.numpy(), np.float32(eps)
    m = m / (m.sum(axis=-2, keepdims=True) + e)  # a new array: the caller's comb stays as it was
    for _ in range(iters - 1):
        m /= m.sum(axis=-1, keepdims=True) + e
        m /= m.sum(axis=-2, keepdims=True) + e
    return torch.from_numpy(m)


def expand(post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """New streams: post_k * y + sum_j comb[j, k] h_j (comb used transposed, as the reference). [S, N, D]."""
    return post.to(h.dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(h.dtype).transpose(-1, -2), h)


class HyperHead(nn.Module):
    def __init__(self, hidden: int, hc: V4HyperConnections, norm_eps: float) -> None:
        super().__init__()
        n = hc.hc_mult
        self.eps, self.norm_eps = hc.eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [S, N, D] -> [S, D]."""
        mixes = F.linear(unweighted_rms_norm(h.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)


class MeanHead(nn.Module):
    """GLM-5.3-Flash's final collapse: the N streams' unweighted mean (no weights in the checkpoint)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [S, N, D] -> [S, D]."""
        return h.mean(dim=1)


def make_head(hidden: int, hc: V4HyperConnections, norm_eps: float) -> nn.Module:
    """The final collapse the config names (learned_head), built once at construction."""
    return HyperHead(hidden, hc, norm_eps) if hc.learned_head else MeanHead()

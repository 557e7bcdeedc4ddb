"""The causal depthwise short convolution of KDA over q, k and v, with its per-request state.

Notation
  C channels (3 H d: q, k, v side by side), K kernel width (linear_conv_kernel_dim, 4)
  w [C, K]        depthwise taps; output t reads inputs t-K+1 .. t (tap K-1 on input t)
  state [K-1, C]  the last K-1 inputs of the sequence so far (zeros before its first token)
  y_t = silu(sum_j w[:, j] x_{t-K+1+j})
A chunk continues its sequence exactly: its inputs are convolved after the state's K-1 rows, and the new state
is the last K-1 rows of [state; x] (a chunk shorter than K-1 keeps part of the old state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk. x [n, C], state [K-1, C], w [C, K] -> (y [n, C], new state [K-1, C])."""
    full = torch.cat([state.to(x.dtype), x])  # [K-1+n, C]
    y = F.conv1d(full.t()[None], w[:, None, :].to(x.dtype), groups=w.shape[0])[0].t()  # [n, C]
    return F.silu(y), full[-(w.shape[1] - 1) :]


def state_after(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The state after a chunk's first tokens x [k, C] (k may be < K-1), from the state before it [K-1, C]: the
    last K-1 rows of [state; x], what prefill returns for x alone (a page boundary's snapshot)."""
    return torch.cat([state.to(x.dtype), x])[-state.shape[0] :]


def step(x: torch.Tensor, states: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences (decode), batched. x [B, C], states [B, K-1, C] -> (y [B, C], new states)."""
    window = torch.cat([states.to(x.dtype), x[:, None]], dim=1)  # [B, K, C]
    y = (window * w.t().to(x.dtype)[None]).sum(1)
    return F.silu(y), window[:, 1:]

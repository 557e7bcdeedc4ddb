"""Memory for a model built on the meta device, without initialising it: the fill writes every parameter."""

from __future__ import annotations

import torch
from torch import nn


def allocate(model: nn.Module, device: str) -> nn.Module:
    """Module.to_empty(device) without torch.empty_like on meta tensors, whose first call imports sympy and
    torch's symbolic shapes (0.5-0.8 s of a start on an idle 2-core Xeon; tests/models/test_start_path.py);
    empty_strided keeps each tensor's size, strides and dtype, and, like to_empty, writes nothing."""
    return model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))

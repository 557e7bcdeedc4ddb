"""A step's greedy tokens and its NaN check in one pass over the logits.

A step whose rows are all plain greedy (sampler.plain_greedy: the argmax of the raw logits) needs from its logits
[B, V] only each row's first maximum and whether the row is finite (a row with NaN / Inf fails its request). On the
CPU with the native kernels that is one C pass (csrc/glue.c mls_argmax_rows); elsewhere (a GPU, no compiler)
torch's ops give the same tokens and flags.
"""

from __future__ import annotations

import numpy as np
import torch

from mlaserve.kernels import native


def argmax_finite(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """logits [B, V] -> (each row's argmax, the first index of its largest value; whether every value of the row is
    finite). Where a row is not finite its token is meaningless (the caller fails that request)."""
    lib = native.library() if logits.device.type == "cpu" else None
    if lib is not None and logits.dtype == torch.float32 and logits.is_contiguous() and logits.shape[-1] > 0:
        b, v = logits.shape
        idx, ok = np.empty(b, dtype=np.int64), np.empty(b, dtype=np.uint8)
        threads = torch.get_num_threads()
        if lib.mls_argmax_rows(logits.data_ptr(), b, v, v, idx.ctypes.data, ok.ctypes.data, threads) == 0:
            return idx.tolist(), ok.astype(bool).tolist()
    # a NaN or Inf makes the row's sum non-finite (finite logits are far too small to overflow fp32)
    return logits.float().argmax(dim=-1).tolist(), torch.isfinite(logits.float().sum(-1)).tolist()

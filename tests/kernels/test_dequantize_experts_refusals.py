"""native.dequantize_experts refuses what its kernels cannot write, with a message naming the argument at fault:
an output dtype other than float32 / bfloat16 (the two C entry points), an out buffer of the wrong shape or rows."""

from __future__ import annotations

import pytest
import torch
from test_kernels import random_blocks

from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import native

pytestmark = pytest.mark.skipif(not native.status().available, reason="native kernels unavailable")
K = 256


def _stack():
    return random_blocks("Q8_0", 8, K, torch.Generator().manual_seed(5), lead=(3,))


def test_an_unsupported_dtype_is_named():
    with pytest.raises(ValueError, match=r"dtype torch\.float16.*float32 or bfloat16"):
        native.dequantize_experts(GGML_TYPE_IDS["Q8_0"], _stack(), torch.tensor([0, 2]), K, torch.float16)


def test_an_out_of_the_wrong_shape_is_named():
    out = torch.empty(2, 7, K)
    with pytest.raises(ValueError, match=r"out \(2, 7, 256\).*not \[2, 8, 256\]"):
        native.dequantize_experts(GGML_TYPE_IDS["Q8_0"], _stack(), torch.tensor([0, 2]), K, out=out)

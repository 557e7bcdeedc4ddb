"""The DSA indexer's top-k on the native kernels, on its own (csrc/indexer.c mls_index_topk, mls_index_topk8,
mls_index_topk16): what the fused decode layer does inside its call, for the sparse backend's steps outside that call
and for the tests that hold it to the torch indexer (tests/kernels/test_decode_layer_sparse.py,
tests/kernels/test_index_scores_bf16.py, tests/kernels/test_kv8_native.py, tests/kernels/test_rows16_native.py).
"""

from __future__ import annotations

import torch

from mlaserve.kernels.native import library
from mlaserve.kernels.native_layers import HALF_KINDS


def index_topk(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    kv_slots: torch.Tensor,
    mask: torch.Tensor,
    k: int,
    bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused decode layer's DSA top-k (csrc/indexer.c mls_index_topk) on its own: q [T, Hi, Di], w [T, Hi]
    (Di^-0.5 folded in), keys [S, Di], kv_slots [T, L] int64, mask [T, L] bool, all contiguous fp32 / int64 on the
    CPU -> (positions [T, k] int64 in position order, valid [T, k] bool). bf16: the scores of q and the keys rounded
    to bf16 (the route's index_scoring "bf16"), else fp32."""
    if not keys.is_contiguous() or keys.device.type != "cpu" or keys.dtype != torch.float32:
        raise ValueError("index_topk: contiguous fp32 CPU keys")
    return _topk_call("index_topk", q, w, (keys.data_ptr(),), kv_slots, mask, k, bf16)


def index_topk8(
    q: torch.Tensor, w: torch.Tensor, keys, kv_slots: torch.Tensor, mask: torch.Tensor, k: int, bf16: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """index_topk over index keys kept as FP8 e4m3 with a scale per key (keys: a cache/quantized_rows.QuantizedRows
    of one block per row), decoded where they lie (csrc/indexer.c mls_index_topk8): the result equals index_topk
    over the dequantized keys. Same shapes and contracts as index_topk (bf16 too)."""
    fmt, di = keys.fmt, q.shape[2]
    if fmt.codes != "fp8_e4m3" or fmt.scales != 1 or fmt.quantized != di or fmt.kept:
        raise ValueError(f"index_topk8: FP8 keys of {di} values with one scale each, got {fmt}")
    return _topk_call("index_topk8", q, w, (keys.codes.data_ptr(), keys.scales.data_ptr()), kv_slots, mask, k, bf16)


def index_topk16(
    q: torch.Tensor, w: torch.Tensor, keys, kv_slots: torch.Tensor, mask: torch.Tensor, k: int, bf16: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """index_topk over index keys kept in 16 bits (keys: a cache/quantized_rows.QuantizedRows of a 16-bit format),
    widened where they lie (csrc/indexer.c mls_index_topk16): the result equals index_topk over the widened keys.
    Same shapes and contracts as index_topk (bf16 too)."""
    fmt, di = keys.fmt, q.shape[2]
    if not fmt.half or fmt.quantized != di or not keys.codes.is_contiguous():
        raise ValueError(f"index_topk16: contiguous 16-bit keys of {di} values, got {fmt}")
    return _topk_call("index_topk16", q, w, (keys.codes.data_ptr(), HALF_KINDS[fmt.codes]), kv_slots, mask, k, bf16)


def _topk_call(name: str, q, w, key_args: tuple, kv_slots, mask, k: int, bf16: bool):
    """The three top-k entries' call (csrc/mls.h: q, w, T, Hi, Di, the keys' arguments, kv_slots, mask, L, k, the
    outputs, bf16, threads), the tensors checked alike."""
    t, hi, di = q.shape
    tensors = (q, w, kv_slots, mask)
    if not all(x.is_contiguous() and x.device.type == "cpu" for x in tensors) or q.dtype != torch.float32:
        raise ValueError(f"{name}: contiguous CPU tensors, q / w fp32")
    index = torch.empty(t, k, dtype=torch.int64)
    valid = torch.empty(t, k, dtype=torch.bool)
    rc = getattr(library(), f"mls_{name}")(
        q.data_ptr(), w.data_ptr(), t, hi, di, *key_args, kv_slots.data_ptr(), mask.data_ptr(), kv_slots.shape[1], k,
        index.data_ptr(), valid.data_ptr(), int(bf16), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native {name} refused k={k} over {kv_slots.shape[1]} positions (rc {rc})")
    return index, valid

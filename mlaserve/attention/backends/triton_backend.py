"""The `triton` attention backend: the absorbed path's latent MQA (dense and DSA-sparse), the DSA indexer's scores
and the decompressed path's MHA as Triton kernels over the paged cache (attention/backends/triton_kernels/);
tested against `reference`.

Compiled on a CUDA device; on the CPU, Triton's interpreter (TRITON_INTERPRET=1) runs the same kernels on CPU
tensors, which is how the tests check them without a GPU (far too slow to serve with: the engine accepts the
backend only where platform/triton_runtime.py says the kernels can run, and `auto` never picks it on a CPU).

Notation as torch_backend.py: q_nope [N, H, dn], q_pe [N, H, dr], cache [S, r + dr], W_UK [H, dn, r],
W_UV [H, dv, r]; the segment's q_index [B, Q], kv_slots [B, L], q_pos [B, Q].
Per operation
  absorbed         q = [q_nope W_UK | q_pe] (torch, or GGUFHeads.absorb), gathered per (request, query);
                   latent_mqa: one Triton kernel over the cache rows through kv_slots (causal from q_pos,
                   `allowed` honoured), split over the key axis, a reduce kernel; then W_UV (torch).
  sparse_absorbed  the same kernel over each query's selected rows (index / valid [B, Q, k]).
  index_topk       index_scores: sum_h w_h ReLU(q_h . key) in a Triton kernel, then torch.topk (a set).
  decompressed     [k_nope | v] = c_kv kv_b^T (torch, one GEMM over the gathered rows); latent_mha: one Triton
                   kernel, each head's queries over its keys (k_pe read from the cache rows), causal from q_pos,
                   `allowed` honoured.
An 8-bit cache (kv_cache_dtype, cache/quantized_rows.py) is refused at config time (config/machine.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mlaserve.attention.backends.blocks import gather_rows
from mlaserve.attention.backends.torch_backend import expand_latent, latent_queries

if TYPE_CHECKING:
    from mlaserve.attention.metadata import SegmentTensors
    from mlaserve.quant.ggml_heads import GGUFHeads


def absorbed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    seg: SegmentTensors,
    scale: float,
    allowed: torch.Tensor | None = None,
    heads: GGUFHeads | None = None,
) -> torch.Tensor:
    """Returns [B, Q, H, dv] (padding rows included; the caller keeps q_valid ones)."""
    from mlaserve.attention.backends.triton_kernels.latent_mqa import latent_mqa

    q = gather_rows(latent_queries(q_nope, q_pe, w_uk, heads), seg.q_index)  # [B, Q, H, r + dr]
    o_lat = latent_mqa(q, _rows(cache), seg.kv_slots, scale, w_uk.shape[-1], q_pos=seg.q_pos, allowed=allowed)
    return expand_latent(o_lat.to(q_nope.dtype), w_uv, heads)


def sparse_absorbed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    seg: SegmentTensors,
    scale: float,
    index: torch.Tensor,
    valid: torch.Tensor,
    heads: GGUFHeads | None = None,
) -> torch.Tensor:
    """MQA over only each query's selected rows, index / valid [B, Q, k] (positions on the segment's key axis)."""
    from mlaserve.attention.backends.triton_kernels.latent_mqa import latent_mqa

    q = gather_rows(latent_queries(q_nope, q_pe, w_uk, heads), seg.q_index)
    o_lat = latent_mqa(q, _rows(cache), seg.kv_slots, scale, w_uk.shape[-1], index=index, valid=valid)
    return expand_latent(o_lat.to(q_nope.dtype), w_uv, heads)


def decompressed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    kv_b: torch.Tensor,
    seg: SegmentTensors,
    scale: float,
    dn: int,
    allowed: torch.Tensor | None = None,
    tiles: bool = False,
) -> torch.Tensor:
    """kv_b: kv_b_proj weight [H * (dn + dv), r]. The up-projection is one torch GEMM over the gathered c_kv rows,
    the attention one Triton kernel (k_pe read from the cache rows through kv_slots). Returns [B, Q, H, dv]."""
    from mlaserve.attention.backends.triton_kernels.latent_mha import latent_mha

    if tiles:
        raise ValueError("the triton attention has no bf16-tile products (decompressed_tiles is False)")
    r, h = kv_b.shape[1], q_nope.shape[1]
    cache = _rows(cache)
    kv = torch.nn.functional.linear(gather_rows(cache, seg.kv_slots)[..., :r], kv_b).unflatten(-1, (h, -1))
    q = gather_rows(torch.cat([q_nope, q_pe], dim=-1), seg.q_index)  # [B, Q, H, dn + dr]
    out = latent_mha(q, kv, cache, seg.kv_slots, seg.q_pos, scale, dn, allowed)
    return out.to(q_nope.dtype)


def index_topk(q: torch.Tensor, w: torch.Tensor, keys, seg: SegmentTensors, topk: int) -> torch.Tensor:
    """q [N, Hi, Di], w [N, Hi], keys [S, Di] -> positions [B, Q, min(topk, L)] (a set, unsorted)."""
    from mlaserve.attention.backends.triton_kernels.index_scores import index_scores

    scores = index_scores(
        gather_rows(q, seg.q_index), gather_rows(w, seg.q_index), _rows(keys), seg.kv_slots, seg.q_pos
    )
    return scores.topk(min(topk, scores.shape[-1]), dim=-1, sorted=False).indices


def _rows(cache) -> torch.Tensor:
    """The kernels read a plain row table [S, C] with unit column stride; an 8-bit cache never gets here (the
    engine refuses kv_cache_dtype with this backend), a caller that passes one is told so."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(
            f"the triton attention backend reads plain cache rows, got {type(cache).__name__} (an 8-bit cache: "
            "kv_cache_dtype is not supported with attention_backend='triton')"
        )
    return cache if cache.stride(-1) == 1 else cache.contiguous()


class TritonBackend:
    """Triton kernels: compiled on CUDA, interpreted on CPU tensors (tests only)."""

    name = "triton"
    reads_dense_heads = False  # the latent queries and W_UV through a GGUF's kept heads when given
    decompressed_tiles = False  # CUDA's own units; the AMX tiles are a CPU's

    def index_scoring(self, key_dtype: torch.dtype) -> str:
        return "fp32"  # every key upcast to fp32 in the kernel, as the reference scores

    absorbed = staticmethod(absorbed_attention)
    decompressed = staticmethod(decompressed_attention)
    sparse_absorbed = staticmethod(sparse_absorbed_attention)
    index_topk = staticmethod(index_topk)

"""The `native` attention backend: the torch backend, with the absorbed path's latent MQA (scores,
softmax, P c over the cache rows) in one C call (kernels/csrc/attention.c mls_latent_mqa) that reads each
query's rows where the paged cache holds them, instead of gathering a copy and running ~15 tensor
ops per layer: dense, or sparse (DSA) over each query's selected rows, taken in position order as the one-call
decode layer takes them (csrc/decode_layer.c), so that the per-op path and that layer sum the same rows in the
same order and agree to fp32 rounding even where int8 activations quantize the result (W_UV). For fp32 caches on the CPU (the engine picks it with the native kernels and fp32), and 8-bit caches (kv_cache_dtype) with fp32 kept
values, whose codes the kernel decodes a tile at a time (mls_latent_mqa8: a quarter of the bytes read), and
16-bit caches (float16 / bfloat16), whose rows it widens a tile at a time (mls_latent_mqa16: half the bytes);
every other product is the torch backend's. Tested against `reference` like every backend
(tests/identities/test_attention_backends.py runs every registered backend).

Notation as torch_backend.py: q_lat = q_nope W_UK [N, H, r] and q_pe [N, H, dr] (read by the kernel where
they lie, through q_index [B, Q]), cache [S, r + dr], kv_slots [B, L], mask [B, Q, L].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mlaserve.attention.backends import torch_index
from mlaserve.attention.backends.torch_backend import TorchBackend, _mask, expand_latent
from mlaserve.attention.backends.torch_backend import absorbed_attention as torch_absorbed
from mlaserve.attention.backends.torch_backend import sparse_absorbed_attention as torch_sparse_absorbed
from mlaserve.kernels import native, native_indexer, native_layers

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
    """Returns [B, Q, H, dv] like the torch backend's, whose code runs where the kernel cannot: caches not fp32 or
    not on the CPU (8-bit rows: fp32 kept values), or no native library (the engine routes those to `torch` anyway).
    Every segment, a prompt's too (an absorbed prefill: a DSA prompt's first index_topk tokens, mla_path="absorbed"):
    the torch code's BLAS GEMM over gathered rows measured slower than this kernel at 512 and 2048 queries on the
    2-core AMD EPYC, with its AVX-512 build and with an AVX2 build beside torch held to AVX2
    (benchmarks/absorbed_prefill.py), so no query count switches the kernel (it was 16 per request)."""
    if not _native_rows(cache) or native.library() is None:
        return torch_absorbed(q_nope, q_pe, cache, w_uk, w_uv, seg, scale, allowed, heads)
    q_lat = heads.absorb(q_nope) if heads is not None else torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
    mask = _mask(seg, allowed).contiguous()
    # the kernel reads each query's q_lat and q_pe where they are (token q_index), no concatenated copy
    o_lat = _mqa(cache)(q_lat, q_pe, seg.q_index, cache, seg.kv_slots.contiguous(), mask, scale)
    return expand_latent(o_lat, w_uv, heads)


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
    """MQA over each query's selected rows, index / valid [B, Q, k] (positions on the segment's key axis) ->
    [B, Q, H, dv], like the torch backend's, whose code runs where the kernel cannot: caches not on the CPU or not
    in an fp32 compute dtype, or no native library. Each query is its own request of the kernel (slots [B * Q, k],
    its rows in position order, read where they lie), a prompt's queries too: no query shares another's rows, so the
    torch code's gathered copy of each query's rows for a batched GEMM bought nothing (a 4096-token prompt of the DSA
    benchmark model's Q4_K_M file on the 2-core AMD EPYC: this MQA 49.8 s there, 11.2 s here)."""
    if not _native_rows(cache) or native.library() is None:
        return torch_sparse_absorbed(q_nope, q_pe, cache, w_uk, w_uv, seg, scale, index, valid, heads)
    b, qn, k = index.shape
    q_lat = heads.absorb(q_nope) if heads is not None else torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
    pos, order = index.sort(dim=-1)
    slots = seg.kv_slots.gather(1, pos.reshape(b, qn * k)).view(b * qn, k)
    mask = valid.gather(2, order).reshape(b * qn, 1, k)
    q_index = seg.q_index.reshape(b * qn, 1).contiguous()
    o_lat = _mqa(cache)(q_lat, q_pe, q_index, cache, slots.contiguous(), mask.contiguous(), scale)
    return expand_latent(o_lat.view(b, qn, *o_lat.shape[2:]), w_uv, heads)


def _native_rows(cache) -> bool:
    """The kernels read rows on the CPU where they lie: fp32 rows, or 8-bit rows (kv_cache_dtype,
    cache/quantized_rows.py) with fp32 kept values (mls_latent_mqa8 decodes their codes a tile at a time), or
    16-bit rows read in an fp32 compute dtype (mls_latent_mqa16 widens them a tile at a time)."""
    return cache.dtype == torch.float32 and cache.device.type == "cpu"  # coded rows: `dtype` is the compute dtype


def _mqa(cache):
    """The C latent MQA for this cache's rows: fp32 rows, 8-bit codes or 16-bit rows (the cache's layout, decided
    at allocation)."""
    if isinstance(cache, torch.Tensor):
        return native_layers.latent_mqa
    return native_layers.latent_mqa16 if cache.fmt.half else native_layers.latent_mqa8


# a prompt's queries scored per block of at most this many (query, key position) slots: each query's row of key
# slots is handed to the C top-k, so a block holds queries x positions int64s (32 MB)
PROMPT_SLOTS = 1 << 22


def index_topk(q: torch.Tensor, w: torch.Tensor, keys, seg: SegmentTensors, topk: int) -> torch.Tensor:
    """The C top-k (csrc/indexer.c mls_index_topk / mls_index_topk8 / mls_index_topk16, the fused decode layer's
    scoring) over keys kept in fp32, FP8 or 16 bits (kv_cache_dtype), read where they lie, scored as the segment's
    index_scoring says (fp32, or "bf16": index_scores): a decode segment's requests in one call, a prompt's queries
    per request in blocks of PROMPT_SLOTS (each query scores its own allowed positions; no gathered copy of the keys,
    no [Q, Hi, L] score tensor). The torch backend's scoring runs for keys in another dtype (a bf16 cache scored
    bf16_then_fp32), off the CPU, or without the native library. Positions [B, Q, k], each query's a set as torch's
    (in position order; a query with fewer than k allowed positions gets disallowed ones after them, which its
    mask marks invalid)."""
    plain = isinstance(keys, torch.Tensor)
    on_cpu = q.device.type == "cpu" and keys.device.type == "cpu"
    if (plain and keys.dtype != torch.float32) or not on_cpu or native.library() is None:
        return torch_index.index_topk(q, w, keys, seg, topk)
    if plain:
        topk_c, keys = native_indexer.index_topk, keys.contiguous()
    else:
        topk_c = native_indexer.index_topk16 if keys.fmt.half else native_indexer.index_topk8
    bf16 = seg.segment.index_scoring == "bf16"
    b, nq = seg.q_index.shape
    length = seg.kv_slots.shape[1]
    k = min(topk, length)
    qf, wf = q.float(), w.float()

    def select(rows: torch.Tensor, kv_slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        qs, ws = qf.index_select(0, rows).contiguous(), wf.index_select(0, rows).contiguous()
        return topk_c(qs, ws, keys, kv_slots.contiguous(), mask.contiguous(), k, bf16)[0]

    if nq == 1:  # a decode segment: request b's query is row b of one call
        return select(seg.q_index[:, 0], seg.kv_slots, seg.mask[:, 0]).view(b, 1, k)
    out = torch.empty(b, nq, k, dtype=torch.int64)
    block = max(1, PROMPT_SLOTS // length)
    for r in range(b):  # a prompt step's requests: few; each block one C call
        for s in range(0, nq, block):
            rows = seg.q_index[r, s : s + block]
            n = rows.shape[0]
            out[r, s : s + n] = select(rows, seg.kv_slots[r].expand(n, length), seg.mask[r, s : s + n])
    return out


class NativeBackend(TorchBackend):
    name = "native"
    absorbed = staticmethod(absorbed_attention)
    sparse_absorbed = staticmethod(sparse_absorbed_attention)
    index_topk = staticmethod(index_topk)

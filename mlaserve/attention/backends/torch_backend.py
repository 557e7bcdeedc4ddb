"""The `torch` attention backend: MLA over the paged latent cache in torch ops laid out for speed
(query blocks, BLAS-friendly orientation, bf16 two-stage index scoring); tested against `reference`.

Notation (per layer)
  H heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, r = kv_lora_rank
  q_nope [N, H, dn], q_pe [N, H, dr]    this step's queries (flat, N = all tokens)
  cache  [S, r + dr]                     rows [c_kv | k_pe] (c_kv normalised, k_pe rotated)
  W_UK   [H, dn, r], W_UV [H, dv, r]     the two halves of kv_b_proj, per head
  B, Q, L                                segment's requests, max query length, max seq length
Absorbed (MQA):      score = (q_nope W_UK) . c_kv + q_pe . k_pe;  out = (P c_kv) W_UV^T
                     (one product per step over rows [c_kv | k_pe]: q = [q_nope W_UK | q_pe], [N, H, r + dr])
Decompressed (MHA):  [k_nope | v] = kv_b(c_kv);  score = q_nope . k_nope + q_pe . k_pe;  out = P v
Both read the same cache rows and the same mask; `allowed` may narrow the mask further (DSA top-k).
Long prompts: score-sized temporaries ([Q, H, L] per segment, [Q, k, r + dr] for sparse) are built
for one block of queries at a time, and the decompressed path's K / V ([L, H, dn + dv]) for one group
of heads at a time, so that they stay within WORKSPACE_BYTES; every query's and head's result is the
same as in one block (queries and heads are independent), only peak memory changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mlaserve.attention.backends import torch_index
from mlaserve.attention.backends.blocks import (
    CAUSAL_BLOCK,
    drop_unread_rows,
    finite_values,
    gather_rows,
    head_blocks,
    query_blocks,
    score_bytes,
)
from mlaserve.kernels import bf16_attention

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
    """Returns [B, Q, H, dv] (padding rows included; the caller keeps q_valid ones). heads: W_UK / W_UV
    kept as GGUF blocks (then the products read those; w_uk / w_uv give only shapes)."""
    q = gather_rows(latent_queries(q_nope, q_pe, w_uk, heads), seg.q_index)  # [B, Q, H, r + dr]
    mask, r = _mask(seg, allowed), w_uk.shape[-1]
    rows = gather_rows(cache, seg.kv_slots)  # [B, L, r + dr]
    b, nq, h, _ = q.shape
    values = finite_values(rows, nq > 1)
    blocks = query_blocks(nq, score_bytes(b * h, rows.shape[1]))
    o_lat = torch.cat([_latent_mqa(q[:, s], rows, mask[:, s], scale, r, values) for s in blocks], dim=1)
    return expand_latent(o_lat, w_uv, heads)


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
    """kv_b: kv_b_proj weight [H * (dn + dv), r]. Returns [B, Q, H, dv]. K and V are expanded for one group of
    heads at a time (head_blocks): their size is the context's times the heads', not the step's. tiles: the
    scores and P V as bf16 products on the AMX-BF16 tiles or AVX512-BF16 dot products (kernels/bf16_attention.py
    unit; the layer's plan decides:
    MLAAttention.attention_bf16), else fp32."""
    h = q_nope.shape[1]
    rows = gather_rows(cache, seg.kv_slots)  # [B, L, r + dr]
    w = kv_b.unflatten(0, (h, -1))  # [H, dn + dv, r], head-major as kv_b's rows
    mask, causal = _mask(seg, allowed), seg.q_index.shape[1] > 1
    groups = head_blocks(h, expansion_bytes(rows, w.shape[1], q_nope.shape[-1] + q_pe.shape[-1]))
    if tiles:
        return _tile_attention(q_nope, q_pe, rows, w, seg, mask, scale, dn, causal, groups)
    q = gather_rows(torch.cat([q_nope, q_pe], dim=-1), seg.q_index).transpose(1, 2)  # [B, H, Q, dn + dr]
    parts = [_decompressed_heads(q[:, g], rows, w[g], mask, scale, dn, causal, seg.key_ends) for g in groups]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def expansion_bytes(rows: torch.Tensor, dn_dv: int, dn_dr: int) -> int:
    """Temporaries per head of _decompressed_heads' K / V: [k_nope | v] (dn + dv), K concatenated then made
    contiguous (2 x (dn + dr)), V contiguous (dv <= dn + dv) per row of every request."""
    return rows.shape[0] * rows.shape[1] * rows.element_size() * (2 * dn_dv + 2 * dn_dr)


def _decompressed_heads(
    q: torch.Tensor,
    rows: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    dn: int,
    causal: bool,
    key_ends: tuple[int, ...],
) -> torch.Tensor:
    """One group of G heads: q [B, G, Q, dn + dr], rows [B, L, r + dr], w [G, dn + dv, r] -> [B, Q, G, dv].
    Each block of queries reads the keys below its key_ends only: the rest are masked for all of its queries
    (probability 0, and V's later rows are finite), so the outputs are those of the whole key range up to the
    products' rounding."""
    g, r = w.shape[0], w.shape[2]
    blocks = query_blocks(q.shape[2], score_bytes(q.shape[0] * g, rows.shape[1]), CAUSAL_BLOCK if causal else None)
    # [B, L, G, dn + dv] in the rows' dtype; a bf16 w beside fp32 rows (the plan's bf16 expansion:
    # MLAAttention.expansion_bf16) multiplies the rows rounded to bf16 on the matrix units, the product widened back
    # (both conversions are no-ops where w and the rows share a dtype)
    kv = torch.nn.functional.linear(rows[..., :r].to(w.dtype), w.flatten(0, 1)).to(rows.dtype).unflatten(-1, (g, -1))
    # Heads-major, contiguous K = [k_nope | k_pe] and V, so that scores come out as contiguous
    # [B, G, Q, L] and the elementwise passes over them run at memory speed (the [B, Q, H, L] layout
    # of a per-part einsum made each pass ~5x slower on CPU).
    k_pe = rows[:, :, None, r:].expand(-1, -1, g, -1)
    k = torch.cat([kv[..., :dn], k_pe], dim=-1).transpose(1, 2).contiguous()  # [B, G, L, dn + dr]
    # V is a fresh copy (K was concatenated from kv before): its non-finite values are zeroed in place
    v = finite_values(kv[..., dn:].transpose(1, 2).contiguous(), causal, inplace=True)  # [B, G, L, dv]
    del kv  # not read again: freed before the scores are made
    parts = []
    for s in blocks:
        n = key_ends[s.stop - 1]
        parts.append(_mha(q[:, :, s], k[:, :, :n], v[:, :, :n], mask[:, s, :n], scale))
    return torch.cat(parts, dim=1)


def _tile_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    rows: torch.Tensor,
    w: torch.Tensor,
    seg: SegmentTensors,
    mask: torch.Tensor,
    scale: float,
    dn: int,
    causal: bool,
    groups: list[slice],
) -> torch.Tensor:
    """decompressed_attention's products on the bf16 tiles (q_nope [N, H, dn], q_pe [N, H, dr], w [H, dn + dv, r]) ->
    [B, Q, H, dv]: per group of heads K and V packed once, per block of queries (as _decompressed_heads blocks them)
    the queries packed from the layer's halves where they lie (bf16_attention.pack_queries: no concatenated,
    gathered or scaled fp32 copy) and the block's output written into its place in the result."""
    b, nq = seg.q_index.shape
    out = q_nope.new_empty(b, nq, w.shape[0], w.shape[1] - dn)
    for g in groups:
        keys, values = _tile_operands(rows, w[g], dn, causal)
        per_block = score_bytes(b * (g.stop - g.start), rows.shape[1])
        for s in query_blocks(nq, per_block, CAUSAL_BLOCK if causal else None):
            n = seg.key_ends[s.stop - 1]
            qb = bf16_attention.pack_queries(q_nope[:, g], q_pe[:, g], seg.q_index[:, s], scale)
            out[:, s, g] = bf16_attention.attention(
                qb, b, s.stop - s.start, keys, values, mask[:, s, :n], n, out.shape[-1]
            )
    return out


def _tile_operands(rows: torch.Tensor, w: torch.Tensor, dn: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a group of heads packed for the bf16 tiles (kernels/bf16_attention.py): the expansion's bf16
    product stays bf16 (the tiles' operand: no fp32 round trip); rows [B, L, r + dr], w [G, dn + dv, r]."""
    g, r = w.shape[0], w.shape[2]
    kv = torch.nn.functional.linear(rows[..., :r].to(torch.bfloat16), w.flatten(0, 1).to(torch.bfloat16))
    kv = kv.unflatten(-1, (g, -1)).transpose(1, 2)  # [B, G, L, dn + dv] bf16, a view
    keys = bf16_attention.pack_keys(kv[..., :dn], rows[:, None, :, r:])
    return keys, bf16_attention.pack_values(kv[..., dn:], finite=causal)  # as finite_values: 0 x NaN = NaN


def _mha(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, Q, dn + dr], k [B, H, L, dn + dr], v [B, H, L, dv], mask [B, Q, L] -> [B, Q, H, dv]."""
    scores = torch.matmul(q, k.transpose(2, 3))  # [B, H, Q, L]
    scores.mul_(scale).masked_fill_(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(1, 2)


def _mask(seg: SegmentTensors, allowed: torch.Tensor | None) -> torch.Tensor:
    return seg.mask if allowed is None else seg.mask & allowed


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
    """MQA over only the selected rows. index/valid [B, Q, k] (positions on the segment's key axis).
    Gathers k rows per query instead of scoring all L: the point of DSA at long context."""
    b, qn, k = index.shape
    q = gather_rows(latent_queries(q_nope, q_pe, w_uk, heads), seg.q_index)  # [B, Q, H, r + dr]
    per_query = b * (k * cache.shape[1] * cache.element_size() + score_bytes(q.shape[2], k))
    o_lat = torch.cat(
        [
            _sparse_block(q[:, s], cache, seg.kv_slots, index[:, s], valid[:, s], scale, w_uk.shape[-1])
            for s in query_blocks(qn, per_query)
        ],
        dim=1,
    )
    return expand_latent(o_lat, w_uv, heads)


def _sparse_block(
    q: torch.Tensor,
    cache: torch.Tensor,
    kv_slots: torch.Tensor,
    index: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    r: int,
) -> torch.Tensor:
    """q [B, Q, H, r + dr] over each query's own k rows -> [B, Q, H, r]."""
    b, qn, k = index.shape
    slots = kv_slots.gather(1, index.reshape(b, qn * k))
    keep = valid.reshape(b * qn, 1, k)
    rows = drop_unread_rows(gather_rows(cache, slots).view(b * qn, k, -1), keep)  # each query's own k rows
    o_lat = _latent_mqa(q.flatten(0, 1).unsqueeze(1), rows, keep, scale, r)
    return o_lat.view(b, qn, *o_lat.shape[2:])


def latent_queries(
    q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, heads: GGUFHeads | None
) -> torch.Tensor:
    """[q_nope W_UK | q_pe]: [N, H, r + dr], the query that scores a cache row [c_kv | k_pe] in one product."""
    q_lat = heads.absorb(q_nope) if heads is not None else torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
    return torch.cat([q_lat, q_pe], dim=-1)


def expand_latent(o_lat: torch.Tensor, w_uv: torch.Tensor, heads: GGUFHeads | None) -> torch.Tensor:
    """o_lat [B, Q, H, r] -> o_lat W_UV^T [B, Q, H, dv]."""
    return heads.expand(o_lat) if heads is not None else torch.einsum("bqhr,hvr->bqhv", o_lat, w_uv)


def _latent_mqa(
    q: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    r: int,
    values: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of queries q [N, G, H, r + dr] over shared rows [N, L, r + dr], mask [N, G, L].
    Returns the latent output P c_kv: [N, G, H, r]. values: the rows for P @ rows (finite_values), else rows.
    Both products keep the long operand (rows) untransposed and whole: rows @ q^T, then P @ rows with the
    k_pe columns dropped afterwards. On CPU BLAS this is up to 5x faster in bf16 than q @ rows^T and
    P @ rows[..., :r] (which make strided copies of all L rows), and no slower in fp32."""
    n, g, h, c = q.shape
    s = torch.matmul(rows, q.reshape(n, g * h, c).transpose(1, 2))  # [N, L, G*H]
    s = s.transpose(1, 2).contiguous().view(n, g, h, -1)
    s.mul_(scale).masked_fill_(~mask[:, :, None, :], float("-inf"))
    probs = torch.softmax(s.float(), dim=-1).to(rows.dtype)
    o = torch.matmul(probs.view(n, g * h, -1), rows if values is None else values)  # [N, G*H, r + dr]
    return o[..., :r].unflatten(1, (g, h))


class TorchBackend:
    """The default backend (CPU and CUDA: plain torch ops, no custom kernels)."""

    name = "torch"
    reads_dense_heads = False  # the absorbed path multiplies a GGUF's kept heads when given (`heads`)
    decompressed_tiles = True  # a prompt's scores and P V in bf16 (tiles or dot products) when the plan asks (`tiles`)

    def index_scoring(self, key_dtype: torch.dtype) -> str:
        # bf16 products are exact, so a bf16 pass with a rounding bound finds the fp32 top-k (measured on
        # a 2048-token prompt chunk at 8K context: 21 s instead of 36 s per chunk; decode ~1.6x faster
        # scoring). fp32 keys are scored directly; fp16 GEMMs are slow on CPU.
        return "bf16_then_fp32" if key_dtype == torch.bfloat16 else "fp32"

    absorbed = staticmethod(absorbed_attention)
    decompressed = staticmethod(decompressed_attention)
    sparse_absorbed = staticmethod(sparse_absorbed_attention)
    index_topk = staticmethod(torch_index.index_topk)

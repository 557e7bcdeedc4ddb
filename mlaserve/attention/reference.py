"""The reference attention backend: plain, obviously-correct torch, the oracle every backend is tested against.

Notation (per layer; as in the model)
  H heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, r = kv_lora_rank
  q_nope [N, H, dn], q_pe [N, H, dr]    this step's queries (flat)
  cache  [S, r + dr]                     rows [c_kv | k_pe]
  W_UK   [H, dn, r], W_UV [H, dv, r]     the halves of kv_b_proj, per head
  B, Q, L                                the segment's requests, max query length, max sequence length
  c_kv, k_pe = cache rows gathered per (request, key position): [B, L, r], [B, L, dr]
Absorbed:      score = (q_nope W_UK) . c_kv + q_pe . k_pe;  out = (P c_kv) W_UV^T
Decompressed:  k_nope = c_kv W_UK^T, v = c_kv W_UV^T;  score = q_nope . k_nope + q_pe . k_pe;  out = P v
Sparse:        absorbed with the mask narrowed to each query's selected positions
Index top-k:   score(t, s) = sum_h w[t, h] ReLU(q_idx[t, h] . k_idx[s]), top-k of the allowed keys

Everything is computed in float32 in one piece: no query blocks, no layout choices, no reduced-
precision shortcuts. It is slow and memory-hungry on purpose; it exists to be read and trusted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mlaserve.attention.metadata import SegmentTensors


def _rows(cache, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] as fp32; a cache kept in 8 bits (kv_cache_dtype) dequantizes the rows it gathers
    (cache/quantized_rows.py, the one dequantizer)."""
    return (cache[slots] if isinstance(cache, torch.Tensor) else cache.rows(slots)).float()


def _mask(seg: SegmentTensors, allowed: torch.Tensor | None) -> torch.Tensor:
    return seg.mask if allowed is None else seg.mask & allowed


def _values(x: torch.Tensor) -> torch.Tensor:
    """The operand of P @ x: a masked row has probability 0, and 0 x NaN = NaN, so a non-finite value must not
    be there; a row a query reads reaches it through its score instead (a NaN or inf score makes the
    query's softmax NaN). So non-finite values are zeroed for the product, never for the scores."""
    return x.nan_to_num(0.0, 0.0, 0.0)


def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scores [B, Q, H, L], mask [B, Q, L] -> probabilities over L."""
    return torch.softmax(scores.masked_fill(~mask[:, :, None, :], float("-inf")), dim=-1)


class ReferenceBackend:
    name = "reference"
    # the oracle reads the dense kv_b_proj (W_UK / W_UV views), never a GGUF's kept attn_k_b / attn_v_b blocks
    reads_dense_heads = True
    decompressed_tiles = False  # the oracle's products are fp32

    def index_scoring(self, key_dtype: torch.dtype) -> str:
        return "fp32"

    def absorbed(self, q_nope, q_pe, cache, w_uk, w_uv, seg, scale, allowed=None, heads=None) -> torch.Tensor:
        # heads (W_UK / W_UV kept as GGUF blocks) is ignored: the oracle multiplies the dense views
        r, mask = w_uk.shape[-1], _mask(seg, allowed)
        rows = _rows(cache, seg.kv_slots)  # [B, L, r + dr]
        c_kv, k_pe = rows[..., :r], rows[..., r:]
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope.float(), w_uk.float())[seg.q_index]  # [B, Q, H, r]
        q_rot = q_pe.float()[seg.q_index]  # [B, Q, H, dr]
        scores = torch.einsum("bqhr,blr->bqhl", q_lat, c_kv) + torch.einsum("bqhd,bld->bqhl", q_rot, k_pe)
        probs = _softmax(scores * scale, mask)
        o_lat = torch.einsum("bqhl,blr->bqhr", probs, _values(c_kv))
        return torch.einsum("bqhr,hvr->bqhv", o_lat, w_uv.float()).to(q_nope.dtype)

    def decompressed(self, q_nope, q_pe, cache, kv_b, seg, scale, dn, allowed=None, tiles=False) -> torch.Tensor:
        if tiles:
            raise ValueError("the reference attention has no bf16-tile products (decompressed_tiles is False)")
        h, r, mask = q_nope.shape[1], kv_b.shape[1], _mask(seg, allowed)
        rows = _rows(cache, seg.kv_slots)
        c_kv, k_pe = rows[..., :r], rows[..., r:]
        kv = (c_kv @ kv_b.float().T).unflatten(-1, (h, -1))  # [B, L, H, dn + dv]
        k_nope, v = kv[..., :dn], kv[..., dn:]
        q_n, q_r = q_nope.float()[seg.q_index], q_pe.float()[seg.q_index]  # [B, Q, H, *]
        scores = torch.einsum("bqhd,blhd->bqhl", q_n, k_nope) + torch.einsum("bqhd,bld->bqhl", q_r, k_pe)
        probs = _softmax(scores * scale, mask)
        return torch.einsum("bqhl,blhv->bqhv", probs, _values(v)).to(q_nope.dtype)

    def sparse_absorbed(self, q_nope, q_pe, cache, w_uk, w_uv, seg, scale, index, valid, heads=None) -> torch.Tensor:
        # entries not valid go to a spare column L, dropped: a pooled selection (models/pooled_indexer.py) parks its
        # unused entries at position 0, which a valid entry may also name (a scatter of both there has no winner)
        b, nq, _ = index.shape
        length = seg.mask.shape[-1]
        selected = torch.zeros(b, nq, length + 1, dtype=torch.bool, device=index.device)
        selected.scatter_(2, index.masked_fill(~valid, length), True)
        return self.absorbed(q_nope, q_pe, cache, w_uk, w_uv, seg, scale, allowed=selected[..., :length])

    def index_topk(self, q_idx, w, keys, seg, topk: int) -> torch.Tensor:
        """q_idx [N, Hi, Di], w [N, Hi] (Di^-0.5 folded in), keys [S, Di] -> positions [B, Q, k]. A segment whose
        index_scoring is "bf16" scores q and the keys rounded to bf16 (config/index_scores.py)."""
        q = q_idx.float()[seg.q_index]  # [B, Q, Hi, Di]
        k = _rows(keys, seg.kv_slots)  # [B, L, Di]
        if seg.segment.index_scoring == "bf16":
            q, k = q.bfloat16().float(), k.bfloat16().float()
        per_head = torch.einsum("bqhd,bld->bqhl", q, k).relu()
        scores = torch.einsum("bqh,bqhl->bql", w.float()[seg.q_index], per_head)
        scores = scores.masked_fill(~seg.mask, float("-inf"))
        return scores.topk(min(topk, scores.shape[-1]), dim=-1).indices

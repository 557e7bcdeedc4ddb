"""How far attention over 8-bit or 16-bit cache rows (kv_cache_dtype) may be from attention over the full rows: a
bound derived from the stored scales (16-bit: from the stored values and the unit roundoff), for the tests and
`mlaserve verify` (nothing on the serving path calls it).
MLA's latent rows (attention_error_bound) and DeepSeek-V4's shared K=V rows with sinks (shared_kv_error_bound).

Notation (one segment, as attention/reference.py)
  c_l [r], k_l [dr]   a key position's exact row [c_kv | k_pe]; the 8-bit row is [c_l + e_l | k_l] (k_pe is kept)
  delta_l [r]         |e_l| <= delta_l per value (cache/quantized_rows.py error_bound, from codes and scales)
  q_lat = q_nope W_UK [H, r], tau = the softmax scale, p_l the exact probabilities over the allowed positions
  16-bit rows round k_pe too: [c_l + e_l | k_l + f_l], |f_l| <= phi_l [dr] (delta then spans the row, r + dr)
Score:   s~_l - s_l = tau q_lat . e_l, so |ds_l| <= eps_l = tau sum_j |q_lat_j| delta_lj
         (16-bit: + tau q_pe . f_l, so eps_l += tau sum_i |q_pe_i| phi_li; the value part below is c_l alone)
Softmax: p~_l = p_l exp(ds_l) / Z with Z = sum_m p_m exp(ds_m) in [e^-G, e^G], G = log sum_m p_m exp(eps_m)
         (each exp(ds_m) lies in [e^-eps_m, e^eps_m]; 1 / Z <= sum_m p_m exp(eps_m) since 1/x is convex),
         so p~_l <= p_l exp(eps_l + G) and |p~_l - p_l| <= p_l (exp(eps_l + G) - 1)
Latent:  o~ - o = sum_l p~_l e_l + sum_l (p~_l - p_l) c_l
         |o~_j - o_j| <= sum_l p_l exp(eps_l + G) delta_lj + sum_l p_l (exp(eps_l + G) - 1) |c_lj|
         (l over the allowed positions)
Output:  out = o W_UV^T, so |out~_v - out_v| <= sum_j |W_UV[v, j]| |o~_j - o_j|
The decompressed path computes the same function (q_nope . (W_UK c_l) = q_lat . c_l, P (W_UV c) = W_UV (P c)),
so one bound serves both paths; a DSA selection narrows the allowed positions (the same selection both ways).
A first-order bound it is not: it holds for any error within delta, in exact arithmetic; the callers add the
fp32 rounding of the two computations they compare.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mlaserve.attention.metadata import SegmentTensors


def attention_error_bound(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    rows: torch.Tensor,
    delta: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    seg: SegmentTensors,
    scale: float,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """rows [B, L, r + dr] the exact rows of the segment's key positions, delta [B, L, r] their 8-bit error
    bounds (k_pe kept exactly), or [B, L, r + dr] the 16-bit rows' (k_pe rounded too) -> [B, Q, H, dv]:
    |attention over the stored rows - attention over rows| per output value."""
    r = w_uk.shape[-1]
    mask = seg.mask if allowed is None else seg.mask & allowed  # [B, Q, L]
    rows, delta = rows.double(), delta.double()
    c, k = rows[..., :r], rows[..., r:]
    delta, phi = delta[..., :r], delta[..., r:]  # phi: the rope part's bounds (empty when k_pe is kept)
    q_lat = torch.einsum("nhd,hdr->nhr", q_nope.double(), w_uk.double())[seg.q_index]  # [B, Q, H, r]
    q_rot = q_pe.double()[seg.q_index]
    scores = (torch.einsum("bqhr,blr->bqhl", q_lat, c) + torch.einsum("bqhd,bld->bqhl", q_rot, k)) * scale
    probs = torch.softmax(scores.masked_fill(~mask[:, :, None], float("-inf")), dim=-1)
    eps = torch.einsum("bqhr,blr->bqhl", q_lat.abs(), delta) * scale  # [B, Q, H, L]
    if phi.shape[-1]:
        eps = eps + torch.einsum("bqhd,bld->bqhl", q_rot.abs(), phi) * scale
    eps = eps.masked_fill(~mask[:, :, None], 0.0)
    g = torch.log((probs * eps.exp()).sum(dim=-1, keepdim=True))  # [B, Q, H, 1]
    grow = torch.exp(eps + g)  # p~_l <= p_l grow_l
    latent = torch.einsum("bqhl,blr->bqhr", probs * grow, delta) + torch.einsum(
        "bqhl,blr->bqhr", probs * (grow - 1), c.abs()
    )
    return torch.einsum("bqhr,hvr->bqhv", latent, w_uv.double().abs()).float()


def shared_kv_error_bound(
    q: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """DeepSeek-V4's attention (one K=V head shared by every query head, a per-head sink logit with a zero value)
    over 8-bit K=V rows: the bound above with W_UK = W_UV = identity and the sink joining the softmax.
    q [S, H, D] the queries, rows [K, D] the exact rows the keys were made from, delta [K, D] their per-value
    error bounds (0 on the rope part the cache keeps), visible [S, K], sinks [H] -> [S, H, D]:
    |attention over the 8-bit rows - attention over rows| per output value (before the output's de-rotation).
    The sink is a softmax entry without error and without value: Z = sum_m p_m exp(ds_m) + p_sink, so
    G = log(sum_m p_m exp(eps_m) + p_sink), and it adds nothing to the output sums."""
    q, rows, delta = q.double(), rows.double(), delta.double()
    mask = visible[:, None, :]  # [S, 1, K]
    scores = torch.einsum("shd,kd->shk", q, rows) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.double().view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)
    p, p_sink = probs[..., :-1], probs[..., -1:]
    eps = (torch.einsum("shd,kd->shk", q.abs(), delta) * scale).masked_fill(~mask, 0.0)
    g = torch.log((p * eps.exp()).sum(dim=-1, keepdim=True) + p_sink)
    grow = torch.exp(eps + g)
    return (
        torch.einsum("shk,kd->shd", p * grow, delta) + torch.einsum("shk,kd->shd", p * (grow - 1), rows.abs())
    ).float()

"""The MLA latent write in Triton: kv_a norm, rope of k_pe and q_pe, the cache row write, one kernel per step.

Notation
  T tokens, H heads, r = kv_lora_rank, dr = rope head dim (even), dn = nope head dim, h = dr / 2
  kv     [T, r + dr]      kv_a_proj_with_mqa's output rows [c_kv | k_pe] (unit stride along a row)
  q      [T, H, dn + dr]  the query heads [q_nope | q_pe] (read only)
  w      [r]              kv_a_layernorm's weight;  eps its epsilon
  cos, sin [T, h]         RotaryEmbedding.cos_sin
Every tensor fp32 (the Triton interpreter, which tests run, casts to bf16 by truncation where a GPU rounds to
nearest, so a bf16 variant could not be checked against the reference on CPU; the model's method hands other
dtypes to the torch reference, and the plan says so).
  cache  [S, r + dr]      the layer's latent rows;  slots [T] int64: cache row of each token (padding: the pad slot)
  q_pe   [T, H, dr]       out: the rotated query rope columns
Per token t (one program): cache[slots[t]] = [rmsnorm(c_kv) * w | rope(k_pe)], q_pe[t] = rope(q[t, :, dn:]).
rope (models/layers.apply_rope): x1, x2 = the even / odd columns (interleaved) or the two halves, and the output is
[x1 cos - x2 sin | x2 cos + x1 sin] in both styles (the interleaved style's output is de-interleaved, as the
reference's torch.cat). Fp fusion is off at launch (no FMA skips a rounding): the rope equals the reference bit
for bit. The norm's sum of squares is a tree sum (tl.sum), the reference's another order: equal up
to that sum's rounding (tests/kernels/test_triton_latent_write.py derives the bound).
Rows of one slot (padding rows, all writing the pad slot from the same token 0 at position 0) write the same
values, as index_copy_ does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.kernels.triton import tiles

HEADS_PER_TILE = 16  # query heads rotated per loop iteration


@triton.jit
def _rope_pair(x1, x2, c, s):
    """(x1 cos - x2 sin, x2 cos + x1 sin), in the reference's order of operations."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _latent_write(
    kv_ptr,
    q_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    cache_ptr,
    qpe_ptr,
    eps,
    R,
    H,
    DN,
    HALF,
    stride_kv,
    stride_qt,
    stride_qh,
    stride_cache,
    stride_cs,
    INTERLEAVED: tl.constexpr,
    BR: tl.constexpr,
    BHALF: tl.constexpr,
    BH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    row = cache_ptr + slot * stride_cache
    # the latent: rmsnorm (F.rms_norm's x * rstd * w; its sum of squares in another order)
    offs_r = tl.arange(0, BR)
    mr = offs_r < R
    x = tl.load(kv_ptr + t * stride_kv + offs_r, mask=mr, other=0.0)
    w = tl.load(w_ptr + offs_r, mask=mr, other=0.0)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / R + eps)
    tl.store(row + offs_r, x * rstd * w, mask=mr)
    # the rope pairs: column i of the first / second half of the rotated output
    offs_p = tl.arange(0, BHALF)
    mp = offs_p < HALF
    if INTERLEAVED:
        first, second = 2 * offs_p, 2 * offs_p + 1
    else:
        first, second = offs_p, offs_p + HALF
    c = tl.load(cos_ptr + t * stride_cs + offs_p, mask=mp, other=0.0)
    s = tl.load(sin_ptr + t * stride_cs + offs_p, mask=mp, other=0.0)
    kpe = kv_ptr + t * stride_kv + R
    k1 = tl.load(kpe + first, mask=mp, other=0.0)
    k2 = tl.load(kpe + second, mask=mp, other=0.0)
    a, b = _rope_pair(k1, k2, c, s)
    tl.store(row + R + offs_p, a, mask=mp)
    tl.store(row + R + HALF + offs_p, b, mask=mp)
    # the query heads' rope columns, BH heads at a time -> q_pe [T, H, 2 HALF] (contiguous)
    for h0 in range(0, H, BH):
        heads = h0 + tl.arange(0, BH)
        m = (heads[:, None] < H) & mp[None, :]
        src = q_ptr + t * stride_qt + heads[:, None].to(tl.int64) * stride_qh + DN
        q1 = tl.load(src + first[None, :], mask=m, other=0.0)
        q2 = tl.load(src + second[None, :], mask=m, other=0.0)
        qa, qb = _rope_pair(q1, q2, c[None, :], s[None, :])  # names of their own: a, b are [BHALF]
        dst = qpe_ptr + (t * H + heads[:, None].to(tl.int64)) * (2 * HALF)
        tl.store(dst + offs_p[None, :], qa, mask=m)
        tl.store(dst + HALF + offs_p[None, :], qb, mask=m)


def latent_write(
    kv: torch.Tensor,
    q: torch.Tensor,
    dn: int,
    w: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Writes cache[slots] = [rmsnorm(c_kv) w | rope(k_pe)] -> q_pe [T, H, dr] = rope(q[..., dn:])."""
    t, h, width = q.shape
    dr = width - dn
    r = kv.shape[1] - dr
    _check(kv, q, dr, r, w, cos, sin, cache, slots)
    q_pe = q.new_empty(t, h, dr)
    if t == 0:
        return q_pe
    half = dr // 2
    _latent_write[(t,)](
        kv,
        q,
        w,
        cos,
        sin,
        slots,
        cache,
        q_pe,
        float(eps),
        r,
        h,
        dn,
        half,
        kv.stride(0),
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cos.stride(0),
        INTERLEAVED=bool(interleaved),
        BR=triton.next_power_of_2(r),
        BHALF=triton.next_power_of_2(half),
        BH=min(HEADS_PER_TILE, triton.next_power_of_2(h)),
        **tiles.LAUNCH,
    )
    return q_pe


def _check(kv, q, dr, r, w, cos, sin, cache, slots) -> None:
    """The kernel's contract on its inputs; a step outside it is a caller's bug, named here."""
    t = q.shape[0]
    if dr <= 0 or dr % 2 or r <= 0 or kv.dim() != 2 or kv.shape[0] != t or kv.stride(1) != 1:
        raise ValueError(f"latent write: kv {tuple(kv.shape)} is not [T={t}, r + dr] rows of unit stride (dr={dr})")
    if q.stride(2) != 1:
        raise ValueError(f"latent write: q {tuple(q.shape)} stride {q.stride()} is not of unit stride per head")
    if w.shape != (r,) or not w.is_contiguous():
        raise ValueError(f"latent write: kv_a_layernorm weight {tuple(w.shape)} is not [{r}] contiguous")
    for name, cs in (("cos", cos), ("sin", sin)):
        if cs.shape != (t, dr // 2) or cs.stride(1) != 1 or cs.dtype != kv.dtype:
            raise ValueError(f"latent write: {name} {tuple(cs.shape)} {cs.dtype} is not [{t}, {dr // 2}] {kv.dtype}")
    if cache.dim() != 2 or cache.shape[1] != r + dr or cache.stride(1) != 1:
        raise ValueError(f"latent write: cache {tuple(cache.shape)} is not [S, {r + dr}] rows of unit stride")
    if slots.shape != (t,) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"latent write: slot_mapping {tuple(slots.shape)} {slots.dtype} is not [{t}] int64")
    dtypes = {x.dtype for x in (kv, q, w, cos, sin, cache)}
    if dtypes != {torch.float32}:
        raise ValueError(f"latent write: the Triton kernel takes fp32 tensors, not {sorted(map(str, dtypes))}")
    devices = {x.device for x in (kv, q, w, cos, sin, cache, slots)}
    if len(devices) != 1:
        raise ValueError(f"latent write: inputs on several devices {sorted(map(str, devices))}")

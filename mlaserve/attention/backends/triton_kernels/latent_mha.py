"""The decompressed path's attention in Triton (MHA): each head's queries over its own up-projected keys and values,
flash-attention style (a block of one request's queries per program, an online softmax over tiles of keys).

Notation (per layer)
  B, Q, L    the segment's requests, max query length, max sequence length (keys)
  H, dn, dr, dv, r   heads, qk_nope / qk_rope / v head dims, kv_lora_rank
  q        [B, Q, H, dn + dr]  [q_nope | q_pe]
  kv       [B, L, H, dn + dv]  [k_nope | v] = c_kv kv_b^T (up-projected in torch, one GEMM over the gathered rows)
  cache    [S, r + dr]         k_pe is read from the cache rows (columns r ..) through kv_slots [B, L]
  q_pos    [B, Q]              a query reads keys 0 .. q_pos; allowed [B, Q, L] optional narrower mask
Math: score = scale * (q_nope . k_nope + q_pe . k_pe); out = softmax(score) @ v  ->  [B, Q, H, dv] fp32

Non-finite rows: a key no query of the block reads is not loaded; a key some query of the block reads is loaded,
and the queries that may not read it get score -inf by selection (tl.where, never a product) and the P @ v operand
is zeroed where non-finite (the reference's nan_to_num), so 0 x NaN never happens. fp32 products
(input_precision="ieee").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # queries per program (one request's)
BLOCK_N = 32  # keys per tile


@triton.jit
def _mha_kernel(
    q_ptr,
    kv_ptr,
    cache_ptr,
    stride_cs,
    slots_ptr,
    stride_sb,
    qpos_ptr,
    mask_ptr,
    out_ptr,
    n_q,
    n_heads,
    n_keys,
    scale,
    R: tl.constexpr,
    DN: tl.constexpr,
    DR: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DN: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """One (block of queries of request b, head h). q, kv, mask and out are contiguous."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    qs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qmask = qs < n_q
    qpos = tl.load(qpos_ptr + b * n_q + qs, mask=qmask, other=-1)
    d_n, d_r, d_v = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    q_row = q_ptr + ((b * n_q + qs) * n_heads + h)[:, None] * (DN + DR)
    q_n = tl.load(q_row + d_n[None, :], mask=qmask[:, None] & (d_n < DN)[None, :], other=0.0).to(tl.float32)
    q_r = tl.load(q_row + DN + d_r[None, :], mask=qmask[:, None] & (d_r < DR)[None, :], other=0.0).to(tl.float32)

    end = tl.minimum(n_keys, tl.max(qpos, 0) + 1)  # causal: no key after the block's last position
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        read = (offs_n[None, :] <= qpos[:, None]) & (offs_n < n_keys)[None, :] & qmask[:, None]  # [M, N]
        if HAS_MASK:
            allowed = tl.load(mask_ptr + (b * n_q + qs)[:, None] * n_keys + offs_n[None, :], mask=read, other=0)
            read = read & (allowed != 0)
        loaded = tl.max(read.to(tl.int32), 0) > 0  # keys some query of the block reads
        kv_row = kv_ptr + ((b * n_keys + offs_n) * n_heads + h)[:, None] * (DN + DV)
        k_n = tl.load(kv_row + d_n[None, :], mask=loaded[:, None] & (d_n < DN)[None, :], other=0.0).to(tl.float32)
        v = tl.load(kv_row + DN + d_v[None, :], mask=loaded[:, None] & (d_v < DV)[None, :], other=0.0).to(tl.float32)
        slot = tl.load(slots_ptr + b * stride_sb + offs_n, mask=loaded, other=0)
        k_r = tl.load(
            cache_ptr + slot[:, None] * stride_cs + R + d_r[None, :],
            mask=loaded[:, None] & (d_r < DR)[None, :],
            other=0.0,
        ).to(tl.float32)
        s = tl.dot(q_n, tl.trans(k_n), input_precision="ieee") + tl.dot(q_r, tl.trans(k_r), input_precision="ieee")
        s = tl.where(read, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.where((v == v) & (tl.abs(v) != float("inf")), v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(qmask, l_i, 1.0)[:, None]  # padding rows of the block (not stored) divide by 1
    out_row = out_ptr + ((b * n_q + qs) * n_heads + h)[:, None] * DV
    tl.store(out_row + d_v[None, :], out, mask=qmask[:, None] & (d_v < DV)[None, :])


def latent_mha(
    q: torch.Tensor,
    kv: torch.Tensor,
    cache: torch.Tensor,
    kv_slots: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    dn: int,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Q, H, dn + dr], kv [B, L, H, dn + dv], cache [S, r + dr] -> [B, Q, H, dv] fp32."""
    b, n_q, h, dq = q.shape
    n_keys, dv, dr = kv.shape[1], kv.shape[-1] - dn, dq - dn
    r = cache.shape[-1] - dr
    q, kv, pos = q.contiguous(), kv.contiguous(), q_pos.contiguous()
    mask = None if allowed is None else allowed.contiguous().view(torch.uint8)
    out = torch.empty(b, n_q, h, dv, dtype=torch.float32, device=q.device)
    _mha_kernel[(triton.cdiv(n_q, BLOCK_M), b * h)](
        q, kv, cache, cache.stride(0), kv_slots, kv_slots.stride(0), pos, mask if mask is not None else pos, out,
        n_q, h, n_keys, scale,
        R=r, DN=dn, DR=dr, DV=dv, BLOCK_DN=_pow2(dn), BLOCK_DR=_pow2(dr), BLOCK_DV=_pow2(dv),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_MASK=mask is not None, num_stages=1,
    )  # fmt: skip
    return out


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))

"""Latent MQA over the paged cache in Triton: every head of a query attends the same cache rows [c_kv | k_pe],
read where the page table puts them (kv_slots), with an online softmax, split over the key axis (split-K).

Notation (per layer)
  B, Q, L    the segment's requests, max query length, max sequence length (keys)
  H, r, dr   heads, kv_lora_rank, qk_rope_head_dim; C = r + dr
  q        [B, Q, H, C]   latent queries [q_nope W_UK | q_pe] (fp32)
  cache    [S, C]         rows [c_kv | k_pe] (fp32, bf16 or fp16: read, then computed in fp32)
  kv_slots [B, L]         cache row of each key position
  q_pos    [B, Q]         each query's position: it reads keys 0 .. q_pos (causal)
  allowed  [B, Q, L]      optional narrower mask (dense path), e.g. a DSA selection as a mask
  index, valid [B, Q, k]  sparse path: each query's selected key positions (the key axis is then k)
  S splits of the key axis, each KEYS_PER_SPLIT-ish keys; partials per (query, split, head):
  m [.., S, H] running max, l [.., S, H] sum of exp, acc [.., S, H, r] sum of exp x c_kv
Math: score = scale * (q[:r] . c_kv + q[r:] . k_pe); out = softmax(score) @ c_kv  ->  [B, Q, H, r]
The reduce kernel merges the splits: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max_s m_s.

Non-finite rows (attention/backends/blocks.py): a key a query may not read is never loaded (its row is masked at
the load, so a NaN there cannot reach the product); a row it reads reaches it through its score; the P @ c_kv
operand is zeroed where non-finite (the reference's nan_to_num), so a -inf score times an inf value is 0, not NaN.
fp32 products (input_precision="ieee": no TF32 on a GPU), as the reference computes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.attention.backends.triton_kernels.key_split import KEY_TILE, split_plan

BLOCK_N = KEY_TILE  # keys per tile (key_split.py rounds each split to whole tiles)
BLOCK_H = 16  # heads per program (tl.dot needs >= 16 rows; fewer heads are masked)


@triton.jit
def _partial_kernel(
    q_ptr,
    stride_qb,
    stride_qq,
    stride_qh,
    cache_ptr,
    stride_cs,
    slots_ptr,
    stride_sb,
    qpos_ptr,
    stride_pb,
    mask_ptr,
    stride_mb,
    stride_mq,
    index_ptr,
    stride_ib,
    stride_iq,
    part_o_ptr,
    part_ml_ptr,
    n_q,
    n_heads,
    n_keys,
    keys_per_split,
    n_splits,
    scale,
    R: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPARSE: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """One (query, head block, split): its keys' online softmax, unnormalised, into the partials.
    Dense: keys are positions start .. min(end, q_pos + 1) (causal), narrowed by mask (allowed) if given.
    Sparse: keys are entries start .. end of the query's index, read where mask (valid) is set."""
    pid_q, pid_h, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = pid_q // n_q
    qi = pid_q % n_q
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_DR)
    rmask = offs_r < R
    dmask = offs_d < DR
    q_row = q_ptr + b * stride_qb + qi * stride_qq + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
    q_pe = tl.load(q_row + R + offs_d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)

    start = pid_s * keys_per_split
    end = tl.minimum(start + keys_per_split, n_keys)
    if not SPARSE:  # causal: no key after the query's own position
        end = tl.minimum(end, tl.load(qpos_ptr + b * stride_pb + qi).to(tl.int32) + 1)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        read = offs_n < end
        if HAS_MASK:
            read = read & (tl.load(mask_ptr + b * stride_mb + qi * stride_mq + offs_n, mask=read, other=0) != 0)
        if SPARSE:
            pos = tl.load(index_ptr + b * stride_ib + qi * stride_iq + offs_n, mask=read, other=0)
        else:
            pos = offs_n
        slot = tl.load(slots_ptr + b * stride_sb + pos, mask=read, other=0)
        row = cache_ptr + slot[:, None] * stride_cs
        # only rows the query reads are loaded (a row it may not read can hold NaN: it must not be touched)
        c = tl.load(row + offs_r[None, :], mask=read[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        k_pe = tl.load(row + R + offs_d[None, :], mask=read[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c), input_precision="ieee") + tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        s = tl.where(read[None, :], s * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key read yet: exp(-inf - 0) = 0, not NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        values = tl.where((c == c) & (tl.abs(c) != float("inf")), c, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
        m_i = m_new
    part = (pid_q * n_splits + pid_s) * n_heads + heads  # [BLOCK_H] rows of the partials
    tl.store(part_o_ptr + part[:, None] * R + offs_r[None, :], acc, mask=hmask[:, None] & rmask[None, :])
    tl.store(part_ml_ptr + part * 2, m_i, mask=hmask)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=hmask)


@triton.jit
def _reduce_kernel(
    part_o_ptr,
    part_ml_ptr,
    out_ptr,
    n_heads,
    n_splits,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One (query, head block): the splits' partials merged (rescaled to their common max) and normalised."""
    pid_q, pid_h = tl.program_id(0), tl.program_id(1)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    offs_r = tl.arange(0, BLOCK_R)
    omask = hmask[:, None] & (offs_r[None, :] < R)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for s in range(0, n_splits):
        part = (pid_q * n_splits + s) * n_heads + heads
        m_s = tl.load(part_ml_ptr + part * 2, mask=hmask, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=hmask, other=0.0)
        o_s = tl.load(part_o_ptr + part[:, None] * R + offs_r[None, :], mask=omask, other=0.0)
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split with no key read adds nothing
        alpha = tl.exp(m - m_safe)
        beta = tl.exp(m_s - m_safe)
        l_sum = l_sum * alpha + l_s * beta
        acc = acc * alpha[:, None] + o_s * beta[:, None]
        m = m_new
    out = acc / tl.where(hmask, l_sum, 1.0)[:, None]  # padding heads (not stored) divide by 1, not 0
    tl.store(out_ptr + (pid_q * n_heads + heads)[:, None] * R + offs_r[None, :], out, mask=omask)


def latent_mqa(
    q: torch.Tensor,
    cache: torch.Tensor,
    kv_slots: torch.Tensor,
    scale: float,
    r: int,
    q_pos: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Q, H, r + dr] over the cache rows -> the latent output [B, Q, H, r] in fp32.
    Dense: q_pos [B, Q] (and optionally allowed [B, Q, L]). Sparse: index / valid [B, Q, k]."""
    sparse = index is not None
    b, n_q, h, c = q.shape
    dr = c - r
    q = q.float().contiguous()
    n_keys = index.shape[-1] if sparse else kv_slots.shape[1]
    plan = split_plan(n_keys)  # from the key axis' shape: a graph's padded length fixes it (key_split.py)
    mask = valid if sparse else allowed
    mask = None if mask is None else mask.contiguous().view(torch.uint8)
    dummy = kv_slots  # pointer arguments a variant does not read
    part_o = torch.empty(b * n_q, plan.splits, h, r, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(b * n_q, plan.splits, h, 2, dtype=torch.float32, device=q.device)
    head_blocks = triton.cdiv(h, BLOCK_H)
    idx = index.contiguous() if sparse else dummy
    pos = q_pos.contiguous() if q_pos is not None else dummy
    _partial_kernel[(b * n_q, head_blocks, plan.splits)](
        q, q.stride(0), q.stride(1), q.stride(2),
        cache, cache.stride(0),
        kv_slots, kv_slots.stride(0),
        pos, pos.stride(0),
        mask if mask is not None else dummy,
        mask.stride(0) if mask is not None else 0,
        mask.stride(1) if mask is not None else 0,
        idx, idx.stride(0), idx.stride(1) if sparse else 0,
        part_o, part_ml,
        n_q, h, n_keys, plan.keys_per_split, plan.splits, scale,
        R=r, DR=dr, BLOCK_R=_pow2(r), BLOCK_DR=_pow2(dr), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        SPARSE=sparse, HAS_MASK=mask is not None, num_warps=_warps(r), num_stages=1,
    )  # fmt: skip
    out = torch.empty(b, n_q, h, r, dtype=torch.float32, device=q.device)
    _reduce_kernel[(b * n_q, head_blocks)](part_o, part_ml, out, h, plan.splits, R=r, BLOCK_R=_pow2(r), BLOCK_H=BLOCK_H)
    return out


def _warps(r: int) -> int:
    """Warps per program: the [BLOCK_H, r] accumulator and a [BLOCK_N, r] tile of rows live in registers, so wide
    latent rows take more threads (a guess to be measured on a GPU; the interpreter ignores it). One pipeline
    stage (num_stages=1) keeps the shared memory to one tile of rows."""
    return 8 if r > 256 else 4


def _pow2(n: int) -> int:
    """The tile width for n columns: a power of two, >= 16 (tl.dot's smallest inner dimension)."""
    return max(16, triton.next_power_of_2(n))

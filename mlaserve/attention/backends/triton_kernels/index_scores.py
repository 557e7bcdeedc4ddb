"""The DSA indexer's scores in Triton: sum_h w_h ReLU(q_h . key) for every key a query may read, over the paged
index-key cache (read where kv_slots puts each key). The top-k over these scores is torch.topk (the backend's).

Notation
  B, Q, L    the segment's requests, max query length, max sequence length
  Hi, Di     index heads, index head dim
  q    [B, Q, Hi, Di]  index queries;  w [B, Q, Hi] head weights (Di^-0.5 folded in)
  keys [S, Di]         the index-key cache;  kv_slots [B, L];  q_pos [B, Q] (a query reads keys 0 .. q_pos)
  out  [B, Q, L]       fp32 scores, -inf where the query may not read the key
fp32 products (input_precision="ieee"), as the reference scores. ReLU keeps NaN (torch's relu does): a NaN in a
key the query reads gives a NaN score there, as in the reference; a key it may not read is never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # keys per program
BLOCK_H = 16  # index heads per inner step (tl.dot needs >= 16 rows)


@triton.jit
def _scores_kernel(
    q_ptr,
    w_ptr,
    keys_ptr,
    stride_ks,
    slots_ptr,
    stride_sb,
    qpos_ptr,
    out_ptr,
    n_q,
    n_heads,
    n_keys,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (query, tile of keys): q [B*Q, Hi, D], w [B*Q, Hi] and out [B*Q, L] contiguous."""
    pid_q, pid_n = tl.program_id(0), tl.program_id(1)
    b = pid_q // n_q
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    read = (offs_n < n_keys) & (offs_n <= tl.load(qpos_ptr + pid_q))
    slot = tl.load(slots_ptr + b * stride_sb + offs_n, mask=read, other=0)
    k = tl.load(keys_ptr + slot[:, None] * stride_ks + offs_d[None, :], mask=read[:, None] & dmask[None, :], other=0.0)
    k = k.to(tl.float32)
    total = tl.zeros([BLOCK_N], tl.float32)
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        hmask = heads < n_heads
        q_rows = q_ptr + (pid_q * n_heads + heads)[:, None] * D + offs_d[None, :]
        q = tl.load(q_rows, mask=hmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + pid_q * n_heads + heads, mask=hmask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_N]
        s = tl.where(s < 0, 0.0, s)  # ReLU that keeps NaN
        total += tl.sum(w[:, None] * s, 0)
    total = tl.where(read, total, float("-inf"))
    tl.store(out_ptr + pid_q * n_keys + offs_n, total, mask=offs_n < n_keys)


def index_scores(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, kv_slots: torch.Tensor, q_pos: torch.Tensor
) -> torch.Tensor:
    """q [B, Q, Hi, Di], w [B, Q, Hi], keys [S, Di], kv_slots [B, L], q_pos [B, Q] -> scores [B, Q, L] fp32."""
    b, n_q, hi, di = q.shape
    n_keys = kv_slots.shape[1]
    q, w, pos = q.contiguous(), w.float().contiguous(), q_pos.contiguous()
    out = torch.empty(b, n_q, n_keys, dtype=torch.float32, device=q.device)
    _scores_kernel[(b * n_q, triton.cdiv(n_keys, BLOCK_N))](
        q, w, keys, keys.stride(0), kv_slots, kv_slots.stride(0), pos, out,
        n_q, hi, n_keys, D=di, BLOCK_D=max(16, triton.next_power_of_2(di)), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return out

"""The gated delta rule of Kimi Delta Attention (KDA), per head with a per-channel forget gate.

Notation (one head; every function runs all H heads at once)
  n tokens, d = dk = dv head width
  q_t, k_t [d]   L2-normalised (sqrt(sum x^2 + 1e-6), as fla / transformers), q_t also scaled by d^-1/2
  v_t [d]        value
  g_t [d]        forget gate in log space (<= 0): the state's key rows decay by a_t = exp(g_t) per channel
  b_t            beta in (0, 1): the delta rule's step size
  S [d, d]       the recurrent state (keys x values), fp32
Recurrence (per token t):
  S~  = diag(a_t) S_{t-1}                     decay
  u_t = b_t (v_t - S~^T k_t)                   the delta: what S~ mispredicts for k_t
  S_t = S~ + k_t u_t^T                         write
  o_t = S_t^T q_t                              read
Chunked form (a chunk of c <= C tokens, G_i = sum_{t <= i} g_t within the chunk, S0 the state before it):
  L[i, j] = b_i sum_ch k_i k_j exp(G_i - G_j)   for j < i (exponents <= 0: no overflow)
  U  = (I + L)^-1 (b v - b (k * exp(G)) S0)     every u_t of the chunk at once (a unit lower-triangular solve)
  O  = (q * exp(G)) S0 + (A * causal) U         A[i, j] = sum_ch q_i k_j exp(G_i - G_j), j <= i
  S_c = diag(exp(G_c)) S0 + (k * exp(G_c - G))^T U
This is transformers' chunk_kimi_delta_attention (chunk 64) without its zero padding of the last chunk: a padded
token has b = 0 and g = 0, so it changes nothing, and the last chunk simply has c < C tokens. The pair sums L and
A are built by pair_scores: transformers materialises exp(G_i - G_j) for every pair, [c, c, d] per head (16.7M
values per 64-token chunk at H 32, d 128, ~2 s a chunk here); pair_scores does that only inside 16-token blocks and
uses matrix products between them, with factors that are all <= 1.
Everything here runs in fp32 (as fla and transformers do).
"""

from __future__ import annotations

import torch

CHUNK = 64  # transformers' / fla's chunk length for prefill (the engine passes its route's, attention/router.py)
SUB = 16  # pair_scores' block: the [b, b, d] decay tensor only inside a block (fla's sub-chunk), products elsewhere


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim: fla's form (eps added, not a max), as transformers."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., d] -> fp32, L2-normalised, q scaled by d^-1/2."""
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences at once. q, k (prepared), v, g [B, H, d]; beta [B, H]; state [B, H, d, d]
    fp32 -> (o [B, H, d], the new state [B, H, d, d]). The decode path: one batched op per step, no loop."""
    s = state * g.float().exp()[..., None]
    u = beta.float()[..., None] * (v.float() - torch.einsum("bhkv,bhk->bhv", s, k))
    s = s + k[..., :, None] * u[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def recurrent_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain reference, token by token over one sequence. q, k (prepared), v, g [n, H, d]; beta [n, H];
    state [H, d, d] -> (o [n, H, d], final state). Written out, not through step(), so the two check each other."""
    s = state.float().clone()
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].float().exp()[..., None]  # [H, d, d] decayed along the key channels
        kv_mem = (s * k[t][..., None]).sum(-2)  # [H, d]: S~^T k
        u = (v[t].float() - kv_mem) * beta[t].float()[..., None]
        s = s + k[t][..., None] * u[..., None, :]
        out.append((s * q[t][..., None]).sum(-2))
    return torch.stack(out) if out else v.new_zeros(v.shape, dtype=torch.float32), s


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form over one sequence (prefill). Same arguments and result as recurrent_reference."""
    n, h, d = v.shape
    qh, kh, vh, gh = (x.float().transpose(0, 1) for x in (q, k, v, g))  # [H, n, d]
    bh = beta.float().transpose(0, 1)  # [H, n]
    s = state.float()
    out = torch.empty(h, n, d, dtype=torch.float32, device=v.device)
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        c = hi - lo
        qc, kc, vc, bc = qh[:, lo:hi], kh[:, lo:hi], vh[:, lo:hi], bh[:, lo:hi, None]
        G = gh[:, lo:hi].cumsum(1)  # [H, c, d]
        L = (bc * pair_scores(kc, kc, G)).tril(-1)  # b_i sum_ch k_i k_j exp(G_i - G_j), j < i
        eye = torch.eye(c, dtype=torch.float32, device=v.device)
        rhs = bc * vc - bc * ((kc * G.exp()) @ s)  # [H, c, d]
        u = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
        out[:, lo:hi] = (qc * G.exp()) @ s + pair_scores(qc, kc, G) @ u
        last = G[:, -1:]  # [H, 1, d]
        s = s * last.transpose(1, 2).exp() + (kc * (last - G).exp()).transpose(1, 2) @ u
    return out.transpose(0, 1), s


def pair_scores(a: torch.Tensor, k: torch.Tensor, G: torch.Tensor, block: int = SUB) -> torch.Tensor:
    """P[i, j] = sum_ch a_i k_j exp(G_i - G_j) for j <= i, 0 above: a, k, G [H, c, d] -> [H, c, c].
    Per block of `block` columns j (ending at e): the rows after the block are one product of
    a_i exp(G_i - G_e) and k_j exp(G_e - G_j), both factors <= 1 (G falls along the chunk), so nothing overflows
    however strong the decay; the block's own rows take the [block, block, d] form, masked above the diagonal."""
    h, c, _ = G.shape
    out = G.new_zeros(h, c, c)
    for lo in range(0, c, block):
        hi = min(lo + block, c)
        e = G[:, hi - 1 : hi]  # [H, 1, d]
        if hi < c:
            later = a[:, hi:] * (G[:, hi:] - e).exp()
            out[:, hi:, lo:hi] = later @ (k[:, lo:hi] * (e - G[:, lo:hi]).exp()).transpose(1, 2)
        diff = G[:, lo:hi, None, :] - G[:, None, lo:hi, :]  # [H, b(i), b(j), d]: G_i - G_j
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=G.device).tril()
        decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()  # 0 above the diagonal
        out[:, lo:hi, lo:hi] = torch.einsum("hik,hjk,hijk->hij", a[:, lo:hi], k[:, lo:hi], decay)
    return out

"""DeepSeek's official-code numerics of V4, re-derived here in plain torch from their description
(docs/DEEPSEEK_V4.md, config/v4_numerics.py), independently of mlaserve's implementation, and attached to
transformers' DeepseekV4ForCausalLM with hooks: the reference the `v4_kv_rounding` / `v4_indexer` options and
the fp8_e4m3 V4 cache are compared against.

Independent of mlaserve/models/deepseek_v4/official.py by construction:
  FP8 KV   scale 2 ** ceil(log2(amax / 448)) in float64 (the code under test: frexp on the fp32 product),
           codes by torch's float8_e4m3fn cast, per block of 64 of the row's non-rope part
  Hadamard an explicit matrix by Sylvester's construction, x @ H / sqrt(c) (the code under test: butterflies)
  FP4      the nearest of the 15 e2m1 values by table, ties to the value with the even mantissa (the code
           under test: rounding multiples of the grid step)
Where the hooks sit in transformers' forward (one pass, use_cache=False):
  the attention's and the compressors' kv_norm output: the official code rounds the non-rope part after
  rope; rope touches only the trailing rope dims, so rounding the non-rope part of kv_norm's output is the
  same thing. The indexer's scorer: its queries (after rope) and its compressed keys (after kv_norm and rope)
  arrive as its arguments, and the official code rotates and rounds exactly those.
"""

from __future__ import annotations

import torch

# the test configs: head_dim 136 = 128 non-rope (two FP8 blocks of 64) + 8 rope; index_head_dim 64 (two FP4
# blocks of 32, a power of two for the Hadamard matrix). Everything else as tests/v4_models.py's configs.
OFFICIAL_SHAPES = dict(head_dim=136, partial_rotary_factor=8 / 136, index_head_dim=64)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E2M1_EVEN = torch.tensor([True, False, True, False, True, False, True, False])  # mantissa bit 0


def fp8_rows(x: torch.Tensor, nope: int, block: int = 64) -> torch.Tensor:
    """x [..., D] -> x with [..., :nope] through e4m3 in blocks of `block`, power-of-two scales."""
    head = x[..., :nope].double().unflatten(-1, (-1, block))
    amax = head.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
    scale = 2.0 ** torch.ceil(torch.log2(amax / 448.0))
    codes = (head / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    out = (codes.double() * scale).flatten(-2).to(x.dtype)
    return torch.cat([out, x[..., nope:]], dim=-1)


def pinned_fp8_rows(x: torch.Tensor, nope: int, other: torch.Tensor, pins: list, delta: float = 1e-5):
    """fp8_rows(x) taking `other`'s decisions (the engine's rows entering its rounding at the same places)
    where the two rows' non-rope parts lie within `delta` (fp32 noise) and a rounding boundary lies between
    them: a value within fp32 noise of a midpoint, or a block amax at a power of two, rounds by the summation
    order (mlaserve/entrypoints/verify_v4_pins.py says why). Both sides through this file's fp8_rows; appends
    the number of values so decided to `pins`."""
    a, b = x.reshape(-1, x.shape[-1]), other.reshape(-1, other.shape[-1]).to(x.dtype)
    ra, rb = fp8_rows(a, nope), fp8_rows(b, nope)
    near = (a[:, :nope] - b[:, :nope]).abs().amax(dim=-1, keepdim=True) <= delta
    flip = near & (ra[:, :nope] != rb[:, :nope])
    pins.append(int(flip.sum()))
    out = torch.cat([torch.where(flip, rb[:, :nope], ra[:, :nope]), ra[:, nope:]], dim=-1)  # x's rope part
    return out.view(x.shape)


def sylvester(c: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < c:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def fp4_nearest(y: torch.Tensor) -> torch.Tensor:
    """|y| <= 6 (float64) -> the nearest e2m1 value, ties to the even mantissa, sign kept."""
    dist = (y.abs()[..., None] - E2M1).abs()
    best = dist.min(dim=-1, keepdim=True).values
    ties = dist == best
    even_tie = ties & E2M1_EVEN
    pick = torch.where(ties.sum(-1, keepdim=True) > 1, even_tie, ties).to(torch.int64).argmax(-1)
    return torch.sign(y) * E2M1[pick]


def hadamard_fp4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., c] -> (x @ H / sqrt(c)) through FP4 e2m1 in blocks of 32 with power-of-two scales."""
    c = x.shape[-1]
    r = (x.double() @ sylvester(c)) / c**0.5
    r = r.to(x.dtype).double().unflatten(-1, (-1, block))  # the rotation's output in x's dtype, as the official
    amax = r.abs().amax(dim=-1, keepdim=True).clamp(min=6 * 2.0**-126)
    scale = 2.0 ** torch.ceil(torch.log2(amax / 6.0))
    return (fp4_nearest((r / scale).clamp(-6, 6)) * scale).flatten(-2).to(x.dtype)


def official_hooks(hf_model, kv: bool, indexer: bool, engine_rows: dict | None = None, pins: list | None = None):
    """Attach the official roundings to a transformers V4 model; returns the hook handles (remove() them).
    engine_rows: {transformers' kv_norm module name: the engine's rows entering the FP8 rounding there, one
    pass}: the FP8 rounding takes the engine's decision where the two lie within fp32 noise of a boundary
    (pinned_fp8_rows; the count of such values appended to `pins`)."""
    cfg = hf_model.config
    nope = cfg.head_dim - int(cfg.head_dim * cfg.partial_rotary_factor)
    handles = []

    def fp8_hook(name: str):
        if engine_rows is None:
            return lambda m, args, out: fp8_rows(out, nope)
        return lambda m, args, out: pinned_fp8_rows(out, nope, engine_rows[name], pins)

    for i, layer in enumerate(hf_model.model.layers):
        attn = layer.self_attn
        if kv:
            handles.append(attn.kv_norm.register_forward_hook(fp8_hook(f"model.layers.{i}.self_attn.kv_norm")))
            if attn.compressor is not None:
                name = f"model.layers.{i}.self_attn.compressor.kv_norm"
                handles.append(attn.compressor.kv_norm.register_forward_hook(fp8_hook(name)))
        if indexer and attn.compressor is not None and hasattr(attn.compressor, "indexer"):

            def pre(m, args):
                q, keys, hidden = args
                return hadamard_fp4(q), hadamard_fp4(keys), hidden

            handles.append(attn.compressor.indexer.scorer.register_forward_pre_hook(pre))
    return handles

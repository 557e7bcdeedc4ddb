"""The native decode-step glue (blocks.c "decode-step glue") against the torch code it replaces.

RMSNorm: native_layers.rms_norm vs torch's fp32 rms_norm. Both compute x * (1 / sqrt(mean(x^2) + eps)) * w; only
the sum of squares is added in another order, so each output is within (d + 4) u of the reference,
relatively (u = 2^-24: the sum's bound d u, the division, root and two products a few u more).
The latent row: MLAAttention.write_latent with the native kernel (one C call: kv_a_layernorm, rope of k_pe
and of every head's q_pe, the cache write) vs its torch code: the rotated queries and k_pe bit for bit
(the rope is the same products and differences), c_kv within the RMSNorm bound, other cache rows untouched.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mlaserve.config.model import ModelConfig
from mlaserve.kernels import native, native_layers
from mlaserve.models.deepseek import MLAAttention
from mlaserve.models.layers import RMSNorm, RotaryEmbedding
from tests.hf_models import make_config

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
U = 2.0**-24


def assert_norm_close(y: torch.Tensor, ref: torch.Tensor, d: int) -> None:
    excess = (y - ref).abs() - (d + 4) * U * ref.abs()
    assert (excess <= 0).all(), f"max excess over the RMSNorm bound {excess.max().item():.3g}"


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 9, 40])
@pytest.mark.parametrize("d", [7, 33, 1024])
@pytest.mark.parametrize("scale", [1.0, 1e-3])  # 1e-3: mean(x^2) ~ eps, so eps must be where torch puts it
def test_native_rms_norm_equals_torch(rows, d, scale):
    g = torch.Generator().manual_seed(rows * 1000 + d)
    wide = torch.randn(rows, d + 5, generator=g) * scale
    w = 1 + 0.1 * torch.randn(d, generator=g)
    for x in (wide[:, :d].contiguous(), wide[:, 2 : d + 2]):  # contiguous rows, and a strided view
        ref = F.rms_norm(x, (d,), w, 1e-6)
        assert_norm_close(native_layers.rms_norm(x, w, 1e-6), ref, d)


def _counting(monkeypatch, name: str) -> list:
    calls, real = [], getattr(native_layers, name)
    monkeypatch.setattr(native_layers, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@needs_native
def test_rms_norm_module_uses_the_native_kernel_only_where_it_fits(monkeypatch):
    calls = _counting(monkeypatch, "rms_norm")
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64))
    x = torch.randn(2, 3, 64)
    ref = norm(x)
    assert not calls
    norm.kernel = "native"
    assert_norm_close(norm(x), ref, 64)
    assert norm(x).shape == x.shape and len(calls) == 2
    xb = x.bfloat16()  # not fp32: the torch code, bit for bit
    norm.kernel = "torch"
    want = norm(xb)
    norm.kernel = "native"
    assert torch.equal(norm(xb), want) and len(calls) == 2


def _attention(kind: str) -> tuple[MLAAttention, RotaryEmbedding]:
    cfg = ModelConfig.from_hf(make_config(kind).to_dict())
    attn = MLAAttention(cfg, 0)
    with torch.no_grad():
        attn.kv_a_layernorm.weight.copy_(1 + 0.1 * torch.randn(cfg.kv_lora_rank))
    return attn, RotaryEmbedding(cfg.rope)


@needs_native
@pytest.mark.parametrize("kind", ["v3_yarn", "v3_tied", "glm_lite"])  # interleaved, half-split, GLM
@pytest.mark.parametrize("tokens", [1, 3, 12])
def test_native_write_latent_equals_torch(kind, tokens, monkeypatch):
    calls = _counting(monkeypatch, "latent_rope_write")
    torch.manual_seed(tokens)
    attn, rope = _attention(kind)
    cfg = attn.cfg
    positions = torch.randint(0, 4000, (tokens,))
    cos, sin = rope.cos_sin(positions, torch.float32)
    step = SimpleNamespace(cos=cos, sin=sin, slot_mapping=torch.randperm(40)[:tokens])
    q = torch.randn(tokens, cfg.num_heads, cfg.qk_head_dim)
    kv = torch.randn(tokens, cfg.kv_lora_rank + cfg.qk_rope_head_dim + 3)[:, : cfg.latent_dim]  # strided rows
    start = torch.randn(40, cfg.latent_dim)
    want_cache, got_cache = start.clone(), start.clone()
    want_nope, want_pe = (t.clone() for t in attn.write_latent(q.clone(), kv, step, rope, want_cache))
    attn.kernel = "native"
    got_nope, got_pe = attn.write_latent(q.clone(), kv, step, rope, got_cache)
    assert torch.equal(got_nope, want_nope) and torch.equal(got_pe, want_pe)
    assert len(calls) == 1  # the torch code ran first, then the C call once
    attn.write_latent(q.clone().transpose(0, 1).contiguous().transpose(0, 1), kv, step, rope, start.clone())
    assert len(calls) == 1 + (tokens == 1)  # a non-contiguous q (tokens > 1) takes the torch code
    r = cfg.kv_lora_rank
    assert torch.equal(got_cache[:, r:], want_cache[:, r:])  # k_pe rows, and every row not written
    assert_norm_close(got_cache[:, :r], want_cache[:, :r], r)
    untouched = torch.ones(40, dtype=torch.bool).index_fill_(0, step.slot_mapping, False)
    assert torch.equal(got_cache[untouched], start[untouched])


@needs_native
def test_native_write_latent_refuses_a_slot_outside_the_cache():
    attn, rope = _attention("v3_yarn")
    cfg = attn.cfg
    cos, sin = rope.cos_sin(torch.tensor([0, 1]), torch.float32)
    cache = torch.zeros(8, cfg.latent_dim)
    q = torch.randn(2, cfg.num_heads, cfg.qk_head_dim)
    kv = torch.randn(2, cfg.latent_dim)
    attn.kernel = "native"
    for bad in (8, -1):
        with pytest.raises(IndexError, match="outside the cache of 8 rows"):
            attn.write_latent(
                q, kv, SimpleNamespace(cos=cos, sin=sin, slot_mapping=torch.tensor([0, bad])), rope, cache
            )
    assert not cache.any()  # refused before anything was written


@needs_native
def test_gather_rows_copies_each_row_from_its_part_and_refuses_outside_ones():
    """csrc/glue.c mls_gather_rows (DeepSeek-V4's keys of a step): out[i] = row r of part p for (p, r) pairs, the
    rows of every part where they lie; a pair outside the parts or a row outside its part is refused, nothing read."""
    from mlaserve.kernels import native_v4

    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, 40, generator=g) for n in (7, 3, 1)]
    pairs = torch.tensor([[[0, 6], [2, 0], [1, 1]], [[0, 0], [1, 2], [0, 3]]])
    want = torch.stack([torch.stack([parts[p][r] for p, r in row.tolist()]) for row in pairs])
    assert torch.equal(native_v4.gather_rows(parts, pairs), want)
    for bad, what in (([[3, 0]], "part"), ([[1, 3]], "row"), ([[0, -1]], "row")):
        with pytest.raises(RuntimeError, match=f"a {what} outside"):
            native_v4.gather_rows(parts, torch.tensor(bad))

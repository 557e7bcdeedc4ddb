"""A prompt's decompressed attention in bf16 (kernels/bf16_attention.py) on the AMX-BF16 tiles
(csrc/x86/amx_bf16_bmm.c) or, where the process has none, by AVX512-BF16 dot products (csrc/x86/avx512_bf16.c):
the tests run on whichever unit this process has.

- The product against fp64 on the same bf16 operands, within its unit's bound (products exact, fp32 sums): the tiles
  (k / 2 + 1) 2^-24 sum |a| |b| (a rounding per pair), the dot products gamma_k sum |a| |b| (a rounding per product);
  a row's bits do not depend on the other rows.
- The softmax pass against fp64's softmax rounded to bf16 (exp within 2 ulp, one bf16 rounding: within 2^-8 of each
  probability), masked and padded keys 0, and a NaN or a row with no key NaN, not silently finite.
- The torch backend with tiles=True against the reference's fp32 attention on a routed batch (prefill chunks after
  cached context, decodes): within test_attention_backends' BF16_TOL, and not the fp32 path's values.
- The layer's plan: attention_bf16 follows expansion_bf16 (never with the reference backend in the step).
Each was broken once to see it fail (a dropped tile step, the mask ignored, the pairs of V not interleaved).
"""

from __future__ import annotations

import pytest
import torch
from test_attention_backends import BF16_TOL

from mlaserve.attention.backends import BACKENDS
from mlaserve.attention.metadata import build_segment_tensors
from mlaserve.attention.router import route
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.kernels import bf16_attention

pytestmark = pytest.mark.skipif(not bf16_attention.granted(), reason=bf16_attention.unit_detail())
ON = bf16_attention.unit_detail()  # what the kernel plan names


def _bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The unit's bound on |C - A B| per output: the tiles round once per pair of products (k / 2 + 1 roundings, to
    first order), vdpbf16ps once per product (gamma_k)."""
    k = a.shape[-1]
    c = (k / 2 + 1) * 2.0**-24 if bf16_attention.unit() == 2 else k * 2.0**-24 / (1 - k * 2.0**-24)
    return c * (a.double().abs() @ b.double().abs())


def test_bmm_within_its_bound_and_row_independent():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 64, 192, generator=g).bfloat16()
    k = torch.randn(3, 1, 90, 192, generator=g)  # keys of one group: 90 rows, padded to 96 by the packer
    packed = bf16_attention.pack_keys(k[..., :160], k[..., 160:])
    assert packed.shape == (3, 6, 96, 16) and packed.dtype == torch.int32  # 96 keys in 6 blocks, 192 values
    c = bf16_attention.bmm(a, packed, 96)
    kb = k[:, 0].bfloat16().double().transpose(1, 2)
    exact = a.double() @ kb
    assert ((c[..., :90].double() - exact).abs() <= _bound(a, kb)).all()
    assert torch.equal(c[..., 90:], torch.zeros_like(c[..., 90:]))  # zero keys
    # a row's bits: the same rows in another batch and row position
    again = bf16_attention.bmm(torch.cat([a[1:2, 32:], a[1:2, :32]], dim=1), packed[1:2], 96)
    assert torch.equal(again[0, :32], c[1, 32:]) and torch.equal(again[0, 32:], c[1, :32])
    # P V: values interleaved by pairs of keys, P's padded columns zero
    v = torch.randn(3, 1, 90, 64, generator=g)
    p = torch.rand(3, 64, 96, generator=g).bfloat16()
    p[..., 90:] = 0
    out = bf16_attention.bmm(p, bf16_attention.pack_values(v, finite=False), 64)
    vb = v[:, 0].bfloat16().double()
    want = p[..., :90].double() @ vb
    assert ((out.double() - want).abs() <= _bound(p[..., :90], vb)).all()
    assert (out.double() - want).abs().max() > 0  # fp32 sums, not fp64 (the test sees the unit's rounding)


def test_queries_packed_are_the_scaled_gathered_bf16_copy():
    """pack_queries against torch's composition (concatenate, gather the token rows, scale, round, pad): the same
    bits, from strided halves of a head group, with ties to even, a subnormal and a NaN among the values."""
    g = torch.Generator().manual_seed(3)
    t, heads, dn, dr = 11, 5, 40, 12
    q = torch.randn(t, heads, dn + dr, generator=g) * 3
    q[3, 2, 5], q[3, 2, 6] = 2 * (1 + 2.0**-8), 2 * (1 + 3 * 2.0**-8)  # halved: ties, to 1 and to 1 + 2^-6
    q[9, 1, 44], q[4, 3, 7] = 2.0**-130, float("nan")
    rows = torch.tensor([[3, 4, 0], [10, 9, 2]])
    sub = slice(1, 4)
    qb = bf16_attention.pack_queries(q[:, sub, :dn], q[:, sub, dn:], rows, 0.5)
    want = torch.zeros(2, 3, 32, 64, dtype=torch.bfloat16)
    want[:, :, :3, : dn + dr] = (q[rows][:, :, sub] * 0.5).bfloat16().transpose(1, 2)
    want = want.view(6, 32, 64)
    assert qb.shape == (6, 32, 64)
    nan = want.isnan()  # a NaN stays a NaN (its bits are the cast's own: torch's vector cast writes 0xFFFF)
    assert int(nan.sum()) == 1 and torch.equal(qb.isnan(), nan)
    assert torch.equal(qb.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert qb.view(2, 3, 32, 64)[0, 1, 0, 5].item() == 1.0 and qb.view(2, 3, 32, 64)[0, 1, 0, 6].item() == 1 + 2.0**-6


def _torch_pairs(k: torch.Tensor, lp: int, dp: int) -> torch.Tensor:
    """[E, L, D] values -> [E, lp / 16, dp / 2, 16] int32 pairs (K^T's layout) by torch's padded copy and transpose"""
    kb = k.new_zeros(k.shape[0], lp, dp, dtype=torch.bfloat16)
    kb[:, : k.shape[1], : k.shape[2]] = k
    return kb.view(torch.int32).view(k.shape[0], lp // 16, 16, dp // 2).transpose(2, 3)


def test_keys_and_values_packed_are_torchs_padded_pairs():
    """pack_keys / pack_values against torch's composition on strided views of a bf16 expansion (the layer's K / V),
    a k_pe shared by the heads, 37 keys (padded to 64), non-finite values zeroed only where asked: the same bits."""
    g = torch.Generator().manual_seed(4)
    b, heads, n, dn, dr, dv = 2, 3, 37, 40, 12, 20
    kv = torch.randn(b, n, heads, dn + dv, generator=g).bfloat16().transpose(1, 2)  # [B, G, L, dn + dv], strided
    k_pe = torch.randn(b, 1, n, dr, generator=g)
    kv[1, 2, 5, dn + 3], kv[0, 1, 36, dn], kv[0, 0, 0, dn + 19] = float("nan"), float("inf"), float("-inf")
    keys = bf16_attention.pack_keys(kv[..., :dn], k_pe)
    want = _torch_pairs(torch.cat([kv[..., :dn].float(), k_pe.expand(-1, heads, -1, -1)], -1).flatten(0, 1), 64, 64)
    assert keys.shape == (b * heads, 4, 32, 16) and torch.equal(keys, want)
    for finite in (False, True):
        values = bf16_attention.pack_values(kv[..., dn:], finite=finite)
        v = kv[..., dn:].flatten(0, 1)
        v = v.nan_to_num(0.0, 0.0, 0.0) if finite else v
        pairs = torch.zeros(b * heads, 64, 32, dtype=torch.bfloat16)
        pairs[:, :n, :dv] = v
        ref = pairs.view(b * heads, 32, 2, 32).transpose(2, 3).contiguous().view(torch.int32)
        assert torch.equal(values, ref.view(b * heads, 32, 2, 16).transpose(1, 2))
    assert not torch.equal(
        bf16_attention.pack_values(kv[..., dn:], True), bf16_attention.pack_values(kv[..., dn:], False)
    )


def test_softmax_pass_masks_pads_and_reports_nan():
    g = torch.Generator().manual_seed(1)
    b, heads, nq, n = 2, 3, 40, 70
    q = torch.randn(b, heads, nq, 32, generator=g)
    k_nope, k_pe = torch.randn(b, heads, n, 24, generator=g), torch.randn(b, 1, n, 8, generator=g)
    v = torch.randn(b, heads, n, 32, generator=g)
    mask = torch.rand(b, nq, n, generator=g) > 0.4
    mask[:, :, 0] = True
    keys, values = bf16_attention.pack_keys(k_nope, k_pe), bf16_attention.pack_values(v, finite=True)

    def attend(q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [b, heads, nq, 32] as token rows [b nq, heads, 32], packed in two halves as the layer's q_nope / q_pe"""
        flat = q.transpose(1, 2).reshape(b * nq, heads, 32)
        qb = bf16_attention.pack_queries(flat[..., :24], flat[..., 24:], torch.arange(b * nq).view(b, nq), 0.3)
        return bf16_attention.attention(qb, b, nq, keys, values, mask, n, 32)

    out = attend(q, mask)
    assert out.shape == (b, nq, heads, 32)
    # fp64 on the same rounded operands: q scaled then rounded, K and V rounded, P rounded once
    qb = (q * 0.3).bfloat16().double()
    kb = torch.cat([k_nope, k_pe.expand(-1, heads, -1, -1)], -1).bfloat16().double()
    s = (qb @ kb.transpose(2, 3)).masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    pb = p.bfloat16().double()
    want = (pb @ v.bfloat16().double()).transpose(1, 2)
    # each probability within 2^-8 of its own value (one rounding) plus the exp's 2 ulp: outputs within that times
    # sum |p| |v| (+ the fp32 sums)
    bound = (2.0**-8 + 2.0**-20) * (p @ v.bfloat16().double().abs()).transpose(1, 2) + 1e-6
    assert ((out.double() - want).abs() <= bound).all()
    # the mask is read: dropping it moves the outputs
    free = attend(q, torch.ones_like(mask))
    assert (free - out).abs().max() > 0.1
    # a NaN query makes its own row NaN, no other; a row that allows no key is NaN, not zero
    q2 = q.clone()
    q2[1, 2, 5, 0] = float("nan")
    m2 = mask.clone()
    m2[0, 7] = False
    got = attend(q2, m2)
    bad = got.isnan().any(-1)
    assert bad[1, 5, 2] and bad[0, 7].all() and int(bad.sum()) == 1 + heads


DN, DR, DV, R, HEADS = 16, 8, 12, 32, 4  # padded to whole tile blocks (32) by the packers
PS, PAGES = 4, 60
SEQS = [(1, 9), (37, 6), (45, 0), (1, 20)]  # decodes, a prompt chunk after cached context, a fresh prompt


def test_backend_tiles_within_the_bf16_bound_of_the_reference():
    g = torch.Generator().manual_seed(2)
    pages = torch.randperm(PAGES, generator=g).tolist()
    chunks, used = [], 0
    for i, (nq, ctx) in enumerate(SEQS):
        k = -(-(nq + ctx) // PS)
        chunks.append(SeqChunk(f"r{i}", tuple(range(nq)), ctx, tuple(pages[used : used + k])))
        used += k
    batch = ForwardBatch.build(chunks, PS, 1, "cpu")
    t = batch.num_tokens
    q = torch.randn(t, HEADS, DN + DR, generator=g)
    cache = torch.randn(PAGES * PS, R + DR, generator=g)
    # a bf16 kv_b: the plan's bf16 expansion, which the tiles go with (MLAAttention.attention_bf16)
    kv_b = (torch.randn(HEADS * (DN + DV), R, generator=g) * R**-0.5).bfloat16()
    torch_backend, ref = BACKENDS["torch"], BACKENDS["reference"]
    plan = route(batch, "decompressed", False, None, torch.float32, "torch")
    for segment in plan.segments:
        seg = build_segment_tensors(batch, segment)
        args = (q[..., :DN], q[..., DN:], cache, kv_b, seg, (DN + DR) ** -0.5, DN)
        got = torch_backend.decompressed(*args, tiles=True)
        want = ref.decompressed(*args)
        plain = torch_backend.decompressed(*args)
        assert got.dtype == torch.float32
        got, want, plain = got[seg.q_valid], want[seg.q_valid], plain[seg.q_valid]
        assert (got - want).abs().max() <= BF16_TOL * want.abs().max()
        assert not torch.equal(got, plain)
    with pytest.raises(ValueError, match="no bf16-tile products"):
        ref.decompressed(*args, tiles=True)


def test_engine_runs_the_tiles_within_the_files_own_error(monkeypatch):
    """ds3's Q4_K_M file (attn_k_b / attn_v_b kept: Q5_0 / Q4_K; heads 48 / 32, padded to the tiles' 64 / 32) under auto on a CPU with fast bf16 (forced), every
    prompt on the decompressed path: the layer's plan takes the tiles (not with the reference backend in the step),
    the prompt's logits move by what bf16 adds, within half the file's own error (the rule of docs/FORMATS.md), and
    the tiles are part of that move (the same engine with the tiles refused gives other logits)."""
    from conftest import fixture_dir
    from safetensors.torch import load_file

    from mlaserve import LLM

    monkeypatch.setenv("MLASERVE_FAST_BF16", "1")
    folder = fixture_dir("ds3")
    exp = load_file(str(folder / "expected.safetensors"))
    ids = exp["input_ids"].tolist()
    path = str(folder / "model-q4_k_m.gguf")
    fast = LLM(path, mla_path="decompressed")
    exact = LLM(path, mla_path="decompressed", prefill_matmul="float")
    attn = fast.runner.model.model.layers[0].self_attn
    assert attn.attention_bf16([BACKENDS["torch"]]) and not attn.attention_bf16(
        [BACKENDS["torch"], BACKENDS["reference"]]
    )
    assert not exact.runner.model.model.layers[0].self_attn.attention_bf16([BACKENDS["torch"]])
    heads = [c.reason for c in fast.loaded.kernel_plan.choices if c.op == "heads"]
    assert heads and all(f"the decompressed K / V expansion in bf16, its attention on the {ON}" in r for r in heads)
    assert not any("expansion" in c.reason for c in exact.loaded.kernel_plan.choices)
    a, b = fast.prompt_logits(ids), exact.prompt_logits(ids)
    act = ((a - b).norm() / b.norm()).item()
    file = ((b - exp["hf_logits"]).norm() / exp["hf_logits"].norm()).item()
    print(
        f"\nds3 q4_k_m, decompressed: bf16 prefill with the attention on the tiles adds {act:.4f}; the file's {file:.4f}"
    )
    assert 0 < act <= file / 2, (act, file)
    monkeypatch.setattr(bf16_attention, "granted", lambda: False)
    assert not torch.equal(fast.prompt_logits(ids), a)


def _q8_0_heads_file(dst):
    """ds3's Q4_K_M file with attn_k_b / attn_v_b stored as Q8_0 (gguf-py's quantizer on the f32 file's tensors),
    the layout llama.cpp's Q6_K files have (Q8_0 heads beside a 6-bit attn_kv_a_mqa)."""
    import gguf
    import numpy as np
    from conftest import fixture_dir
    from gguf_helpers import copy_kv

    folder = fixture_dir("ds3")
    heads = ("attn_k_b", "attn_v_b")
    f32 = {t.name: t.data for t in gguf.GGUFReader(folder / "model-f32.gguf").tensors if t.name.split(".")[-2] in heads}
    reader = gguf.GGUFReader(folder / "model-q4_k_m.gguf")
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    copy_kv(reader, writer)
    float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    for t in reader.tensors:
        if t.name in f32:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(t.name, gguf.quants.quantize(np.ascontiguousarray(f32[t.name]), q8), raw_dtype=q8)
        else:
            raw = None if t.tensor_type in float_types else t.tensor_type
            writer.add_tensor(t.name, np.ascontiguousarray(t.data), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder, dst


def _median_move(x: torch.Tensor, y: torch.Tensor) -> float:
    """The median over prompt positions of |x - y| / |y| (per position's logits): one flipped expert choice of the
    fixture's random router (near-ties) moves one position by ~50% whatever rounding flips it, which a norm over all
    positions would report as the rounding's own effect."""
    return ((x - y).norm(dim=-1) / y.norm(dim=-1)).median().item()


def test_tiles_where_only_the_latent_is_6_bits(monkeypatch, tmp_path):
    """Q8_0 heads (their expansion stays fp32 grade: the bf16 pairs) beside a Q4_K attn_kv_a_mqa: the plan takes the
    tiles for the attention all the same (GGUFHeads.attention_tiles: every K and V value carries the Q4_K weight's
    own error), the plan says why, and what the tiles add to the prompt's logits (against the same engine with the
    tiles refused) is of the grade they add where the expansion is bf16 and stays well within the file's own error.
    Measured per position (median): the tiles add 0.78% here (0.75% on ds3's own Q4_K_M file, whose heads are
    Q5_0) against the file's own 22%. A Q8_0 file (its latent weight Q8_0 too) takes no tiles."""
    from safetensors.torch import load_file

    from mlaserve import LLM

    monkeypatch.setenv("MLASERVE_FAST_BF16", "1")
    folder, path = _q8_0_heads_file(tmp_path / "ds3-q8_0-heads.gguf")
    exp = load_file(str(folder / "expected.safetensors"))
    ids = exp["input_ids"].tolist()
    fast = LLM(str(path), mla_path="decompressed")
    exact = LLM(str(path), mla_path="decompressed", prefill_matmul="float")
    attn = fast.runner.model.model.layers[0].self_attn
    assert attn.attention_bf16([BACKENDS["torch"]]) and not attn.expansion_bf16([BACKENDS["torch"]])
    assert not attn.attention_bf16([BACKENDS["torch"], BACKENDS["reference"]])
    heads = [c.reason for c in fast.loaded.kernel_plan.choices if c.op == "heads"]
    assert heads and all(f"attention on the {ON} (its latent rows from a Q4_K weight" in r for r in heads)
    assert not exact.runner.model.model.layers[0].self_attn.attention_bf16([BACKENDS["torch"]])
    q8 = LLM(str(folder / "model-q8_0.gguf"), mla_path="decompressed")
    assert not q8.runner.model.model.layers[0].self_attn.attention_bf16([BACKENDS["torch"]])
    tiled, want = fast.prompt_logits(ids), exact.prompt_logits(ids)
    monkeypatch.setattr(bf16_attention, "granted", lambda: False)
    untiled = fast.prompt_logits(ids)
    monkeypatch.undo()
    tiles, file = _median_move(tiled, untiled), _median_move(want, exp["hf_logits"])
    print(f"\nds3 q4_k_m with Q8_0 heads: the tiles add {tiles:.4f} per position (median), the file's own {file:.4f}")
    assert 0 < tiles <= file / 8, (tiles, file)  # the rule's half, made an eighth: ~3.5x the measured move

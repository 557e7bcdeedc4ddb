"""The engine over a 16-bit cache (kv_cache_dtype float16 / bfloat16: every latent row [c_kv | k_pe] and index key
stored as one 16-bit float each, compute in fp32), against transformers on the same random weights.

- The independent reference: transformers with the latent rows its attention reads (expand_kv's c_kv and roped
  k_pe) rounded to the same 16 bits. The engine's stored rows equal transformers' rounded rows except where a
  value lies within fp32 noise of a rounding midpoint (it then takes the neighbouring 16-bit value: counted, at
  most 1 in 1,000), and where none does the logits agree to fp32 rounding (TOL, as tests/identities/); absorbed
  and decompressed, chunked prefill and token-by-token decode.
- Against plain transformers (rows in fp32) the 16-bit cache really moves the logits (the option is live), by
  a distance printed next to the per-attention-call bound's check (test_kv8_attention.py, `mlaserve verify`).
- A prefix-cache hit keeps greedy output; `inspect` and the measured bytes per token count 2 bytes a value.
- What it does not cover is refused by name: DeepSeek-V4's pools, attention_backend='triton'.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_logits, random_ids

from mlaserve import LLM
from mlaserve.cache.quantized_rows import QuantizedRows
from mlaserve.config.model import ConfigError
from mlaserve.sampling.params import SamplingParams

TOL = 1e-5  # fp32 reassociation noise between two computations of the same sums (as test_identities.py)
DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _rounded_hf(model, codes: str) -> list[torch.Tensor]:
    """transformers' model with every attention layer's rows (kv_nope [B, 1, T, r], roped k_rot [B, 1, T, dr]) rounded
    to `codes` before its attention expands them; -> a list that collects [T, r + dr] rows per layer per call."""
    seen: list[torch.Tensor] = []
    for layer in model.model.layers:
        attn = layer.self_attn
        original = attn.expand_kv

        def expand(kv_nope, k_rot, original=original):
            kv_nope, k_rot = (t.to(DTYPE[codes]).float() for t in (kv_nope, k_rot))
            seen.append(torch.cat([kv_nope[0, 0], k_rot[0, 0]], dim=-1))
            return original(kv_nope, k_rot)

        attn.expand_kv = expand
    return seen


def _stored_rows(llm: LLM, n: int) -> list[torch.Tensor]:
    """Every layer's stored latent rows at slots 0..n-1 (a fresh pool hands one prompt pages 0, 1, ... in order)."""
    return [layer.latent.rows(torch.arange(n)) for layer in llm.runner.cache.layers]


@pytest.mark.parametrize("codes", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["v3_yarn", "v2_qlora"])
@pytest.mark.parametrize("route", [dict(), dict(mla_path="decompressed"), dict(max_num_batched_tokens=5)])
def test_logits_equal_transformers_over_the_same_16bit_rows(hf_model_dir, kind, codes, route):
    folder, hf = hf_model_dir(kind)
    ids = random_ids(29, seed=5)
    plain = hf_logits(hf, ids)
    seen = _rounded_hf(hf, codes)
    try:
        want = hf_logits(hf, ids)
    finally:
        for layer in hf.model.layers:
            vars(layer.self_attn).pop("expand_kv", None)
    llm = LLM(str(folder), kv_cache_dtype=codes, page_size=4, **route)
    got = llm.prompt_logits(ids)
    stored = _stored_rows(llm, len(ids))
    assert all(isinstance(layer.latent, QuantizedRows) and layer.latent.fmt.half for layer in llm.runner.cache.layers)
    assert len(seen) == len(stored)
    # c_kv value by value; k_pe as each row's multiset of values: the engine keeps the roped pairs in the order its
    # weights lay them out, which for DeepSeek-V2's interleaved rope is not transformers' (its apply_rotary_pos_emb
    # de-interleaves): the same values, in another column order
    r = hf.config.kv_lora_rank
    flips = sum(int((a[:, :r] != b[:, :r]).sum()) for a, b in zip(stored, seen))
    flips += sum(int((a[:, r:].sort(-1).values != b[:, r:].sort(-1).values).sum()) for a, b in zip(stored, seen))
    values = sum(a.numel() for a in stored)
    diff = (got - want).abs().max().item()
    spread = (got - plain).abs().max().item()
    print(f"{kind} {codes} {route}: {flips} of {values} stored values differ; vs rounded transformers {diff:.2e}, "
          f"vs fp32 transformers {spread:.2e}")  # fmt: skip
    assert flips <= max(2, 1e-3 * values), flips  # a value at a midpoint only: a wrong row differs everywhere
    if not flips:
        assert diff <= TOL, diff
    assert spread > 10 * TOL  # the rows really are 16-bit


@pytest.mark.parametrize("codes", ["float16", "bfloat16"])
def test_prefix_cache_hit_keeps_greedy_output(hf_model_dir, codes):
    folder, _ = hf_model_dir("v32")
    prefix = random_ids(24, seed=7)
    a, b = prefix + random_ids(5, seed=8), prefix + random_ids(6, seed=9)
    fresh = LLM(str(folder), kv_cache_dtype=codes, enable_prefix_caching=False).generate([b], GREEDY)
    llm = LLM(str(folder), kv_cache_dtype=codes, page_size=4, trace="memory")
    llm.generate([a], GREEDY)
    assert llm.generate([b], GREEDY)[0].outputs[0].token_ids == fresh[0].outputs[0].token_ids
    cached = [q["cached_tokens"] for r in llm.runner.tracer.records for q in r["requests"]]
    assert max(cached) == 24 and {r["kv_cache"] for r in llm.runner.tracer.records} == {codes}


def test_inspect_lines_and_bytes_count_two_bytes_a_value(hf_model_dir):
    from mlaserve.config.layer_kinds import describe

    folder, _ = hf_model_dir("v32")
    llm = LLM(str(folder), kv_cache_dtype="float16")
    lines = describe(llm.runner.layer_kinds, 4)
    assert any("latent [48] as float16 [48]" in line and "index_keys [32] as float16 [32]" in line for line in lines)
    layer = llm.runner.cache.layers[0]
    assert layer.latent.codes.dtype == torch.float16 and layer.latent.scales is None and layer.latent.kept is None
    # r 32 + dr 16 and Di 32, three layers: 2 bytes a value, half the fp32 cache's
    full = LLM(str(folder)).runner.cache.measured_bytes_per_token()
    assert (llm.runner.cache.measured_bytes_per_token(), full) == ((48 + 32) * 2 * 3, (48 + 32) * 4 * 3)
    (setting,) = [s for s in llm.config.provenance if s.name == "kv_cache_dtype"]
    assert (setting.value, setting.source) == ("float16", "user option")


def test_what_it_does_not_cover_is_refused_by_name(hf_model_dir):
    from mlaserve.config.kv_cache import quantize_states
    from mlaserve.config.layer_kinds import LayerKind, StateSpec

    v4 = (LayerKind(0, "v4_sliding", None, (StateSpec("window", 64, addressing="request", per_request=(8,)),)),)
    with pytest.raises(ConfigError, match="kv_cache_dtype='float16': DeepSeek-V4's compressed pools .* 16 bits"):
        quantize_states(v4, "float16", None)
    folder, _ = hf_model_dir("v3_yarn")
    with pytest.raises(ConfigError, match="attention_backend='triton'.*kv_cache_dtype='bfloat16'"):
        LLM(str(folder), kv_cache_dtype="bfloat16", attention_backend="triton")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of .*'float16', 'bfloat16'\\), got 'half'"):
        LLM(str(folder), kv_cache_dtype="half")

"""DeepSeek-V4's official-code numerics and its 8-bit cache through the engine (LLM), on save_pretrained folders
of a tiny config whose shapes the roundings take (tests/official_v4.py OFFICIAL_SHAPES: 128 non-rope values per
K=V row, index_head_dim 64).

- The options resolve with their provenance, and the engine (batched state update, paged pools) equals
  transformers with the official roundings re-derived in the test (tests/official_v4.py) in one pass
  (bound 1e-5, the V4 bound against transformers; measured <= 1.5e-6 on an AMD EPYC). An FP8 value within fp32
  noise of a rounding boundary takes the engine's decision in the reference (pinned_fp8_rows, counted: on an
  Intel Xeon with AVX-512/AMX one value, which unpinned moved the logits 1.13e-5).
- kv_cache_dtype=fp8_e4m3 == the full-precision cache with v4_kv_rounding=fp8_ue8m0: the pools hold the FP8
  codes and power-of-two scales of the rows the rounding makes (the same quantizer), so every read returns
  the value the rounding gave (a power-of-two scale makes code x scale exact, and the rounding's output
  re-quantizes to itself). Held within the fp32 bound 1e-5 (measured: 0, bit for bit) on chunked prefills
  whose later chunks read the earlier ones' rows from the 8-bit pools, greedy decoding of two requests in
  flight, and a prefix hit that reads a cached page's 8-bit rows. Without the rounding the 8-bit cache would
  be several 1e-2 away (test_the_rounding_is_what_the_cache_keeps), so the equality is not vacuous.
- Bytes: the 8-bit pools' rows hold nope + nope / 64 + rope x 4 bytes instead of head_dim x 4 (fp32), counted
  by hand == the layer kinds' count (`inspect`) == the allocation; kv_cache_memory fits that many more pages.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from official_v4 import OFFICIAL_SHAPES, official_hooks  # noqa: E402
from v4_models import build_hf_v4, hf_v4_logits  # noqa: E402

from mlaserve.config.model_parts import ConfigError  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.entrypoints.verify_v4_pins import recorded  # noqa: E402
from mlaserve.models.deepseek_v4.official import FP8KVRows  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

BOUND = 1e-5
PAGE = 8  # a multiple of the CSA (4) and HCA (8) ratios: prefix hits land inside a CSA window's successor


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    hf = build_hf_v4("all_kinds", seed=2, **OFFICIAL_SHAPES)
    path = tmp_path_factory.mktemp("v4_official")
    hf.save_pretrained(path)
    return hf, path


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def _official(hf, ids, kv: bool, indexer: bool, engine_rows: dict | None = None, pins: list | None = None):
    handles = official_hooks(hf, kv, indexer, engine_rows, pins)
    try:
        return hf_v4_logits(hf, ids)
    finally:
        for h in handles:
            h.remove()


def _engine_prompt_logits(llm, ids) -> tuple[torch.Tensor, dict]:
    """The engine's prompt logits in one pass, and the rows entering its FP8 KV roundings, named by the
    transformers module whose output the reference rounds (kv_norm: the non-rope part is the same before and
    after rope)."""
    with recorded(llm.loaded.model) as log:
        got = llm.prompt_logits(ids)
    names = {m: n for n, m in llm.loaded.model.named_modules()}
    rows = {}
    for m, calls in log.items():
        if isinstance(m, FP8KVRows):
            name = names[m].removeprefix("inner.").replace("kv_round", "kv_norm").replace("round_rows", "kv_norm")
            rows[name] = torch.cat(calls)
    return got, rows


def _settings(llm) -> dict:
    return {s.name: (s.value, s.source) for s in llm.config.all_provenance()}


def test_options_resolve_with_provenance_and_equal_the_official_computation(folder):
    hf, path = folder
    ids = _ids(37, hf.config.vocab_size, 0)
    plain = LLM(str(path), page_size=PAGE)
    assert _settings(plain)["v4_kv_rounding"][0] == "none" and _settings(plain)["v4_indexer"][0] == "exact"
    for kv, indexer in ((True, False), (False, True), (True, True)):
        llm = LLM(
            str(path),
            page_size=PAGE,
            v4_kv_rounding="fp8_ue8m0" if kv else "none",
            v4_indexer="hadamard_fp4" if indexer else "exact",
        )
        settings = _settings(llm)
        assert settings["v4_kv_rounding"] == ("fp8_ue8m0" if kv else "none", "user option")
        assert settings["v4_indexer"][0] == ("hadamard_fp4" if indexer else "exact")
        assert any("DeepSeek's own inference code" in n for n in llm.loaded.report.notes)
        # the reference takes the engine's FP8 decision on a value within fp32 noise of a rounding boundary
        # (measured here, Intel Xeon AVX-512/AMX: one value, -0.00415068 vs -0.00415028 about the midpoint
        # -0.00415039, moved the logits 1.13e-5; pinned, 1.9e-6); counted, and few
        got, rows = _engine_prompt_logits(llm, ids)
        pins: list[int] = []
        ref = _official(hf, ids, kv, indexer, rows if kv else None, pins)
        assert sum(pins) <= 4, f"kv {kv} indexer {indexer}: {sum(pins)} FP8 decisions pinned (fp32 noise: a few)"
        err = (got - ref).abs().max().item()
        assert err <= BOUND, f"kv {kv} indexer {indexer}: max abs {err:.3g} > {BOUND} ({sum(pins)} pinned)"
        assert (got - hf_v4_logits(hf, ids)).abs().max() > 1e-2  # the option is not the identity here


def test_the_options_are_refused_where_they_do_not_apply(folder, tmp_path):
    _, path = folder
    with pytest.raises(ConfigError, match="v4_kv_rounding must be one of"):
        LLM(str(path), v4_kv_rounding="fp8")
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8_e4m3' keeps DeepSeek-V4's compressed rows"):
        LLM(str(path), kv_cache_dtype="fp8_e4m3", v4_kv_rounding="none")
    with pytest.raises(ConfigError, match="DeepSeek-V4 with kv_cache_dtype='int8'.*FP8 only"):
        LLM(str(path), kv_cache_dtype="int8")
    small = tmp_path / "small"
    build_hf_v4("all_kinds", seed=2).save_pretrained(small)  # 16 non-rope values per row
    with pytest.raises(ConfigError, match="16 non-rope values .* blocks of 64"):
        LLM(str(small), kv_cache_dtype="fp8_e4m3")
    from hf_models import save_hf_model

    mla = tmp_path / "mla"
    save_hf_model("v3_tied", mla)
    with pytest.raises(ConfigError, match="DeepSeek-V4's official-code numerics; this model is"):
        LLM(str(mla), v4_indexer="hadamard_fp4")


def _pair(path, **kw) -> tuple[LLM, LLM]:
    """The same model with the FP8 rounding on a full-precision cache, and with the 8-bit cache."""
    kw = dict(page_size=PAGE, v4_indexer="hadamard_fp4", max_num_seqs=4, **kw)
    return LLM(str(path), v4_kv_rounding="fp8_ue8m0", **kw), LLM(str(path), kv_cache_dtype="fp8_e4m3", **kw)


@pytest.fixture(scope="module")
def pair(folder):
    return _pair(folder[1], max_num_batched_tokens=5, trace="memory")


def test_the_8bit_cache_is_what_the_pools_hold(pair):
    full, eight = pair
    assert _settings(eight)["v4_kv_rounding"][0] == "fp8_ue8m0"
    assert "kv_cache_dtype=fp8_e4m3" in _settings(eight)["v4_kv_rounding"][1]
    pools = [layer.tensors["kv_pool"] for layer in eight.runner.cache.layers if "kv_pool" in layer.tensors]
    assert pools and all(type(p).__name__ == "QuantizedRows" for p in pools)
    assert all(p.codes.dtype == torch.uint8 and p.fmt.block == 64 and p.fmt.scale == "ue8m0" for p in pools)
    assert all(p.scales.dtype == torch.uint8 for p in pools)  # one e8m0 byte per scale
    # the rings and their snapshots are 8-bit too (tests/identities/test_deepseek_v4_ring8.py); what stays in the
    # compute dtype (config/kv_cache.py _quantize_v4): the indexer pool, the carries, the overlap halves
    for layer in eight.runner.cache.layers:
        for name, t in layer.tensors.items():
            if name in ("kv_pool", "window", "window_snapshot"):
                assert type(t).__name__ == "QuantizedRows", name
            else:
                assert isinstance(t, torch.Tensor) and t.dtype == torch.float32, name


@pytest.mark.parametrize("budget", [3, 7])
def test_fp8_cache_equals_full_cache_with_the_rounding(folder, budget):
    """Chunked prefill (later chunks read the earlier chunks' rows from the pools) at lengths around the ratios."""
    hf, path = folder
    full, eight = _pair(path, max_num_batched_tokens=budget)
    for n in (4, 9, 16, 17, 29, 33):
        ids = _ids(n, hf.config.vocab_size, n)
        a, b = full.prompt_logits(ids), eight.prompt_logits(ids)
        err = (a - b).abs().max().item()
        assert err <= BOUND, f"length {n} budget {budget}: 8-bit cache {err:.3g} from the rounding on full rows"
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_greedy_and_prefix_hits_equal_with_the_8bit_cache(folder, pair):
    """Two requests in flight (decodes beside a prefill), then one that shares 19 tokens with the first: its
    hit reads two cached pages' 8-bit rows. Tokens equal the full cache with the rounding."""
    hf, _ = folder
    vocab = hf.config.vocab_size
    first, second = _ids(19, vocab, 5), _ids(6, vocab, 6)
    third = first + _ids(4, vocab, 7)[1:]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for llm in pair:
        outs = llm.generate([first, second], params)
        hit = llm.generate([third], params)[0]
        assert hit.metrics["num_cached_prompt_tokens"] == 16  # two full pages of 8, read from the 8-bit pools
        tokens.append([list(o.outputs[0].token_ids) for o in [*outs, hit]])
    assert tokens[0] == tokens[1]
    assert {r["kv_cache"] for r in pair[1].runner.tracer.records} == {"fp8_e4m3"}  # the ledger says the layout
    assert {r["kv_cache"] for r in pair[0].runner.tracer.records} == {"float32"}


def test_the_rounding_is_what_the_cache_keeps(folder, pair):
    """The 8-bit pools without the rounding on the other rows would not equal anything exact: the 8-bit run
    stands far from transformers' (the rounding matters at these sizes), and equal to the rounded run."""
    hf, _ = folder
    full, eight = pair
    ids = _ids(29, hf.config.vocab_size, 3)
    a, b = full.prompt_logits(ids), eight.prompt_logits(ids)
    assert (a - b).abs().max() <= BOUND
    assert (b - hf_v4_logits(hf, ids)).abs().max() > 1e-2


def test_bytes_per_token_of_the_8bit_pools(folder):
    from mlaserve.config.layer_kinds import describe

    hf, path = folder
    full = LLM(str(path), page_size=PAGE, enable_prefix_caching=False, num_pages=16)
    eight = LLM(str(path), page_size=PAGE, enable_prefix_caching=False, num_pages=16, kv_cache_dtype="fp8_e4m3")
    d, rope, c = 136, 8, 64  # head_dim, rope dims, index_head_dim; all_kinds: sliding, CSA 4, HCA 8, CSA 4
    nope = d - rope
    row8 = nope + nope // 64 + 4 * rope  # codes + e8m0 scales (1 byte each) + kept rope values
    # per page of PAGE tokens (a whole number of rows of each pool); per token it need not be whole (162-byte rows)
    page_full = 2 * (d * 4 + c * 4) * (PAGE // 4) + d * 4 * (PAGE // 8)
    page_eight = 2 * (row8 + c * 4) * (PAGE // 4) + row8 * (PAGE // 8)
    by_hand_full, by_hand_eight = page_full // PAGE, page_eight // PAGE  # what the allocation measures (floored)
    assert full.runner.cache.measured_bytes_per_token() == by_hand_full
    assert eight.runner.cache.measured_bytes_per_token() == by_hand_eight
    lines = describe(eight.runner.layer_kinds, 4)
    assert any(f"kv_pool [{d}] as fp8_e4m3 [{nope}] / 64 per scale (ue8m0" in line for line in lines)
    counted = sum(float(line.split(" bytes/token")[0].rsplit("(", 1)[1]) for line in lines)
    assert counted == page_eight / PAGE
    # kv_cache_memory: pages sized by the bytes a token takes in the 8-bit layout
    gib = 2**20 / 2**30
    pages = {
        kv: LLM(
            str(path), page_size=PAGE, enable_prefix_caching=False, kv_cache_memory=gib, kv_cache_dtype=kv
        ).config.cache.num_pages
        for kv in ("auto", "fp8_e4m3")
    }
    assert pages == {"auto": 2**20 // page_full, "fp8_e4m3": 2**20 // page_eight}


def test_verify_checks_the_8bit_cache_as_an_identity(folder):
    """`mlaserve verify` on a V4 model with the 8-bit cache: the pools vs the full cache with the rounding, an
    identity judged at verify's fp32 tolerance (1e-4; measured 0), beside V4's own identities over the rounded
    rows (a value within fp32 noise of a rounding boundary takes the one pass's decision: verify_v4_pins.py;
    measured on an Intel Xeon with AVX-512/AMX: one value pinned per chunked / decode check, else 6.4e-3)."""
    from mlaserve.entrypoints.verify import run_checks

    hf, path = folder
    checks = run_checks(LLM(str(path), kv_cache_dtype="fp8_e4m3", page_size=PAGE), _ids(30, hf.config.vocab_size, 1))
    by_name = {c.name: c for c in checks}
    eight = by_name["8-bit cache (fp8_e4m3) vs full cache + official FP8 rounding"]
    assert eight.passed and eight.max_abs_diff <= BOUND and eight.top1_agreement == 1.0
    # against the exact rows (verify_v4_kv8.py): every attention call within the bound derived from the scales
    bound = by_name["8-bit cache (fp8_e4m3) vs exact rows: attention, every layer"]
    assert bound.tolerance == 1.0 and 0 < bound.max_abs_diff <= 1.0 and "attention calls" in bound.note
    assert int(bound.note.split(" over ")[1].split()[0]) >= 4  # every layer
    assert by_name["8-bit cache (fp8_e4m3) vs exact rows: logits"].max_abs_diff > 1e-2  # the rounding moves them
    assert all(c.passed for c in checks), [(c.name, c.max_abs_diff) for c in checks if not c.passed]


def test_bf16_and_the_disk_tier_with_the_8bit_cache(folder, tmp_path):
    """bfloat16: the 8-bit pools (codes, scales; the rope part kept in bf16) == the bf16 cache with the rounding,
    bit for bit (the rounded values are e4m3 codes times powers of two, exact in bf16). The disk tier: a
    restarted engine reads the 8-bit pages back (the hit counted as disk-cached) and decodes the same tokens."""
    hf, path = folder
    ids = _ids(26, hf.config.vocab_size, 11)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(dtype="bfloat16", page_size=PAGE, max_num_batched_tokens=5)
    full = LLM(str(path), v4_kv_rounding="fp8_ue8m0", **kw)
    eight = LLM(str(path), kv_cache_dtype="fp8_e4m3", **kw)
    assert torch.equal(full.prompt_logits(ids), eight.prompt_logits(ids))
    disk = tmp_path / "pages"
    first = LLM(str(path), kv_cache_dtype="fp8_e4m3", page_size=PAGE, prefix_cache_dir=str(disk))
    before = first.generate([ids], params)[0]
    first.runner.disk_tier.flush()
    again = LLM(str(path), kv_cache_dtype="fp8_e4m3", page_size=PAGE, prefix_cache_dir=str(disk))
    after = again.generate([ids], params)[0]
    assert after.metrics["num_disk_cached_tokens"] == 24  # three full pages of 8, read back from disk
    assert list(after.outputs[0].token_ids) == list(before.outputs[0].token_ids)
    # the rounding is part of the pages' identity: pages of a rounded run on a full cache are never read by a
    # run without it (same kv_cache_dtype, same weights: only the rows differ)
    rounded = LLM(str(path), v4_kv_rounding="fp8_ue8m0", page_size=PAGE, prefix_cache_dir=str(tmp_path / "full"))
    rounded.generate([ids], params)
    rounded.runner.disk_tier.flush()
    plain = LLM(str(path), page_size=PAGE, prefix_cache_dir=str(tmp_path / "full"))
    assert plain.generate([ids], params)[0].metrics["num_disk_cached_tokens"] == 0

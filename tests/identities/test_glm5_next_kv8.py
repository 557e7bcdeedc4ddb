"""GLM-5.3-Flash's pooled indexer under kv_cache_dtype fp8_e4m3 (tests/glm5_next_models.py SPARSE: queries keep 4 of
up to 25 complete pools), and its pooled top-k in bf16 vs fp32.

What the 8-bit layout keeps (config/kv_cache.py INDEX_KEY_STATES): the pooled keys `index_pools`, the rows every
selecting step scores, in FP8 e4m3 with one fp32 scale per row (index_key_format, as a DSA layer's `index_keys`);
the per-token [k | gate] rows stay in the compute dtype (read once, when their pool completes).

1. The cache holds, for each written pool, the plain FP8 encoding (a numpy reference written here from the format's
   definition, config/row_format.py) of the exact pooled key the full-cache engine writes: codes and scales equal
   bit for bit, and the rows every reader gets back equal the reference's dequantized values bit for bit.
2. The selection from the FP8 pooled keys vs the exact keys, on the queries the engine's layers score (captured
   from a full-cache run): score(t, p) = sum_h w_h ReLU(q_h . pooled_p Di^-0.5), ReLU 1-Lipschitz, so a key error
   |e_d| <= delta_d (cache/quantized_rows.py error_bound, from the stored codes and scales) moves a score by at most
   E_p = Di^-0.5 sum_h |w_h| sum_d |q_hd| delta_pd (+ FP32 of the score's own magnitude for the two fp32 runs).
   The rule (as the DSA top-k checks state it): where the exact top set is decided, min over kept (s - E) >
   max over the rest (s + E), the 8-bit selection is the same set; elsewhere a near-tie may swap, and those
   queries are counted and reported, never excused by a looser tolerance.
3. bf16 near-ties: the same queries' pooled top-k from q, w and the pooled keys rounded to bf16 (what a bf16 run
   keeps; the scores are fp32 either way) vs fp32. Each rounding is relative u = 2^-8, so a score moves by at most
   ((1 + u)^3 - 1) Di^-0.5 sum_h |w_h| |q_h| . |pooled_p| (+ FP32); the same rule. Upstream bf16 arithmetic (the
   projections themselves in bf16) is not this check's subject: it is the rounding of what the scores read.
   Both checks also hold every swap to the bound pair by pair (a pool j taken for i: s_j + E_j >= s_i - E_i).
   Measured (selecting queries / decided by the bound / near-ties whose kept pools differ), kpool 4, kpool 2,
   shared layer: FP8 139/7/7, 318/7/19, 147/4/6 (the FP8 bound, half a step of 3 mantissa bits taken with the
   worst signs, decides few); bf16 139/65/1, 318/120/0, 147/83/2. Broken on purpose: each row read with its
   neighbour's scale makes a decided FP8 query differ; the quantizer's scale amax / 440 breaks the bit-exact
   check. Rounding the pooled keys further (e5m2) in the bf16 run raised its differing near-ties 1 -> 12 with every
   swap still inside the bf16 bound: the bound scales with |q| . |pooled|, well above the score gaps, so these
   checks pin the rule and the counts, not the size of a rounding.
4. Through the engine: the layout's bytes per token; `mlaserve verify`'s 8-bit-vs-full attention check (every
   attention call of the pooled route within the bound derived from the latent rows' scales, attention/
   cache_error.py: the MLA part's bound; no bound through the KDA and MoE stack is claimed, so the logits'
   difference is reported) and its pooled selection agreement; a prefix-cache hit and preemption over the 8-bit
   cache give the greedy tokens of a fresh engine over the same 8-bit cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers.models.glm5_next")

from glm5_next_models import SPARSE, random_ids, save_hf_glm5_next  # noqa: E402
from state_engine import greedy  # noqa: E402

from mlaserve.cache.quantized_rows import QuantizedRows  # noqa: E402
from mlaserve.config.row_format import index_key_format  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.models.pooled_indexer import PooledIndexer  # noqa: E402

PAGE = 16
FP32 = 2.0**-20  # relative: two fp32 score computations (Di + Hi <= 16 terms, 2^-24 each, with room)
BF16_U = 2.0**-8  # bf16's unit roundoff (8 significant bits, round to nearest)


@pytest.fixture(scope="module", params=list(SPARSE))
def glm(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"glmkv8_{request.param}")
    save_hf_glm5_next(request.param, folder, seed=5)
    return request.param, folder


def _e4m3_values() -> np.ndarray:
    """Every e4m3fn bit pattern's value from the format's definition (bias 7, 3 mantissa bits, exponent 0
    subnormal, 0x7F / 0xFF NaN)."""
    out = np.empty(256)
    for c in range(256):
        sign, exp, man = (-1.0 if c & 0x80 else 1.0), (c >> 3) & 0xF, c & 0x7
        if exp == 0xF and man == 0x7:
            out[c] = np.nan
        else:
            out[c] = sign * (man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return out


E4M3 = _e4m3_values()
FINITE = np.array([c for c in range(256) if not np.isnan(E4M3[c]) and c != 0x80])


def _plain_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [N, Di] fp32 -> (codes uint8, scales [N, 1] fp32, dequantized fp32): scale = max(amax, 1e-4) / 448 in fp32,
    code = the nearest finite e4m3 value to x / scale (ties to the even mantissa; a zero keeps its sign)."""
    amax = np.maximum(np.abs(x).max(axis=1, keepdims=True), np.float32(1e-4)).astype(np.float32)
    scale = (amax / np.float32(448.0)).astype(np.float32)
    y = (x / scale).astype(np.float32).astype(np.float64)
    dist = np.abs(E4M3[FINITE][None, None, :] - y[..., None])
    best = dist == dist.min(axis=-1, keepdims=True)
    rank = np.where(best, (FINITE & 1) * 1000 + FINITE, 10**6)  # among ties: even mantissa, then the lower code
    codes = FINITE[rank.argmin(axis=-1)].astype(np.uint8)
    codes = np.where((codes == 0) & np.signbit(y), np.uint8(0x80), codes)
    deq = (E4M3[codes].astype(np.float32) * scale).astype(np.float32)
    return codes, scale, deq


def _first_pooled_layer(llm: LLM) -> int:
    """The first layer with its own pooled indexer: its input does not depend on an earlier MLA layer, so a full
    cache and an 8-bit one write the same exact pooled keys there (later layers read 8-bit latent rows first)."""
    return next(k.index for k in llm.runner.layer_kinds if k.state("index_pools") is not None)


def test_the_cache_holds_the_plain_fp8_of_the_exact_pooled_keys(glm):
    spec, folder = glm
    ids = random_ids(97, 96, 11)
    full, eight = (LLM(str(folder), page_size=PAGE, kv_cache_dtype=d) for d in ("auto", "fp8_e4m3"))
    for llm in (full, eight):  # fresh pools hand the prompt the same pages; one token: the prefill writes the pools
        llm.generate([ids], greedy(1))
    layer = _first_pooled_layer(eight)
    exact = full.runner.cache.layers[layer].tensors["index_pools"]
    stored = eight.runner.cache.layers[layer].tensors["index_pools"]
    assert isinstance(stored, QuantizedRows) and not isinstance(exact, QuantizedRows)
    written = torch.nonzero(stored.scales[:, 0]).flatten()  # rows a pool was written to (never-written: scale 0)
    assert len(written) == 97 // SPARSE[spec]["index_kpool"], spec
    codes, scales, deq = _plain_fp8(exact[written].numpy())
    assert np.array_equal(stored.codes[written].numpy(), codes), spec
    assert np.array_equal(stored.scales[written].numpy(), scales), spec
    assert np.array_equal(stored.index_select(0, written).numpy(), deq), spec  # the read every path makes


def _captured(folder) -> list[tuple]:
    """(q, w, exact pooled keys, positions, the original select) of every selection the pooled layers make on a
    full fp32 cache over two prompts past index_topk (prefill in chunks, then decodes)."""
    llm = LLM(str(folder), page_size=PAGE, max_num_batched_tokens=40)
    seen = []
    indexers = [m for m in llm.loaded.model.modules() if isinstance(m, PooledIndexer)]
    for ix in indexers:
        original = ix.select

        def select(q, w, pooled, positions, original=original):
            seen.append((q.clone(), w.clone(), pooled.clone(), positions.clone(), original))
            return original(q, w, pooled, positions)

        ix.select = select
    llm.generate([random_ids(97, 96, 21), random_ids(70, 96, 22)], greedy(6))
    for ix in indexers:
        del ix.select
    assert seen
    return seen


@pytest.fixture(scope="module")
def captured(glm):
    return glm[0], _captured(glm[1])


def _scores(q, w, pooled) -> torch.Tensor:
    """Plain fp32 scores [.., Q, N]: sum_h w_h ReLU(q_h . pooled Di^-0.5) (models/pooled_indexer.py's definition)."""
    s = torch.relu(torch.einsum("...qhd,...nd->...qhn", q.float(), pooled.float()) * q.shape[-1] ** -0.5)
    return torch.einsum("...qh,...qhn->...qn", w.float(), s)


def _magnitude(q, w, pooled) -> torch.Tensor:
    """Di^-0.5 sum_h |w_h| |q_h| . |pooled_p| [.., Q, N]: what a relative error of every factor scales with."""
    m = torch.einsum("...qhd,...nd->...qhn", q.float().abs(), pooled.float().abs()) * q.shape[-1] ** -0.5
    return torch.einsum("...qh,...qhn->...qn", w.float().abs(), m)


def _kept_pools(sel, p: int) -> list[set[int]]:
    """Per query, the pools a PooledSelection keeps (its valid entries before the tail, divided by kpool)."""
    k = sel.index.shape[-1] - (p - 1)
    index, valid = sel.index[..., :k].reshape(-1, k), sel.valid[..., :k].reshape(-1, k)
    return [set((i[v] // p).tolist()) for i, v in zip(index, valid)]


def _compare(captures, p: int, keep: int, other_inputs, bound) -> tuple[int, int, int, int]:
    """Selections from other_inputs(q, w, pooled) vs the exact ones. -> (selecting queries, decided ones, decided
    ones that differ, undecided ones that differ). A query is decided when min over its exact top set of
    (s - E) > max over the other complete pools of (s + E). Asserted here: every swap is one the bound allows."""
    selecting = decided = decided_diff = near_diff = 0
    for q, w, pooled, positions, original in captures:
        exact = original(q, w, pooled, positions)
        oq, ow, opooled = other_inputs(q, w, pooled)
        other = original(oq, ow, opooled, positions)
        s, e = _scores(q, w, pooled), bound(q, w, pooled)
        s, e = s.reshape(-1, s.shape[-1]), e.reshape(-1, e.shape[-1])
        complete = ((positions + 1) // p).reshape(-1)
        for i, (a, b) in enumerate(zip(_kept_pools(exact, p), _kept_pools(other, p))):
            n = int(complete[i])
            if n <= keep:
                assert a == b == set(range(n))  # every complete pool kept: nothing to choose
                continue
            selecting += 1
            rest = [j for j in range(n) if j not in a]
            top = torch.tensor(sorted(a))
            is_decided = (s[i, top] - e[i, top]).min() > (s[i, rest] + e[i, rest]).max()
            decided += int(is_decided)
            decided_diff += int(is_decided and a != b)
            near_diff += int(not is_decided and a != b)
            # a pool j taken in place of i needs a rounded score >= i's: s_j + E_j >= s_i - E_i, pair by pair
            for j in b - a:
                for k in a - b:
                    assert s[i, j] + e[i, j] >= s[i, k] - e[i, k], (i, j, k, (s[i, k] - s[i, j]).item())
    return selecting, decided, decided_diff, near_diff


def test_the_selection_from_fp8_pooled_keys_equals_the_exact_wherever_decided(captured):
    spec, captures = captured
    p, keep = SPARSE[spec]["index_kpool"], SPARSE[spec]["index_topk"] // SPARSE[spec]["index_kpool"]
    fmt = index_key_format(captures[0][2].shape[-1])

    def fp8(q, w, pooled):
        flat = pooled.reshape(-1, pooled.shape[-1])
        return q, w, QuantizedRows.of(flat, fmt).rows(torch.arange(flat.shape[0])).view(pooled.shape)

    def bound(q, w, pooled):
        flat = pooled.reshape(-1, pooled.shape[-1])
        delta = QuantizedRows.of(flat, fmt).error(torch.arange(flat.shape[0])).view(pooled.shape)
        move = torch.einsum("...qhd,...nd->...qhn", q.float().abs(), delta) * q.shape[-1] ** -0.5
        return torch.einsum("...qh,...qhn->...qn", w.float().abs(), move) + FP32 * _magnitude(q, w, pooled)

    selecting, decided, decided_diff, near_diff = _compare(captures, p, keep, fp8, bound)
    print(f"{spec}: FP8 pooled keys: {selecting} selecting queries, {decided} decided by the bound, ")
    print(f"  {near_diff} near-tie queries whose kept pools differ from the exact keys'")
    assert decided_diff == 0
    assert selecting > 50 and decided > 0, (selecting, decided)  # the rule has something to hold


def test_bf16_near_ties_are_the_only_differences_from_fp32(captured):
    spec, captures = captured
    p, keep = SPARSE[spec]["index_kpool"], SPARSE[spec]["index_topk"] // SPARSE[spec]["index_kpool"]

    def bf16(q, w, pooled):
        return q.bfloat16(), w.bfloat16().float(), pooled.bfloat16()

    def bound(q, w, pooled):
        return ((1 + BF16_U) ** 3 - 1 + FP32) * _magnitude(q, w, pooled)

    selecting, decided, decided_diff, near_diff = _compare(captures, p, keep, bf16, bound)
    print(f"{spec}: bf16 vs fp32: {selecting} selecting queries, {decided} decided by the bound, ")
    print(f"  {near_diff} near-tie queries whose kept pools differ ({near_diff / selecting:.1%})")
    assert decided_diff == 0
    assert selecting > 50 and decided > 0, (selecting, decided)


# bytes per token of each SPARSE model's paged states (kv_lora_rank 16, rope 0, Di 8; fp32 4 bytes):
# latent 16 x 4 = 64 -> 16 codes + one fp32 scale = 20; [k | gate] 2 x 8 x 4 = 64 in both;
# a pooled key 8 x 4 = 32 -> 8 codes + 4 = 12 per kpool tokens. A "shared" layer keeps its latent rows only.
# (measured_bytes_per_token rounds down to whole bytes: every figure here is whole)
BYTES = {
    "sparse_kda3_kpool4": ((64 + 64 + 32 / 4), (20 + 64 + 12 / 4)),
    "sparse_mla_first_kpool2": (2 * (64 + 64 + 32 / 2), 2 * (20 + 64 + 12 / 2)),
    "sparse_shared_after_full": ((64 + 64 + 32 / 4) + 64, (20 + 64 + 12 / 4) + 20),
}


def test_the_layout_counts_the_fp8_pooled_keys_bytes(glm):
    from mlaserve.config.kv_cache import describe_layout
    from mlaserve.config.layer_kinds import describe

    spec, folder = glm
    # prefix caching off: the KDA layers' page snapshots (counted per token, unchanged by the option) are not kept
    opts = dict(page_size=PAGE, enable_prefix_caching=False)
    llm = LLM(str(folder), kv_cache_dtype="fp8_e4m3", trace="memory", **opts)
    full = LLM(str(folder), **opts).runner.cache.measured_bytes_per_token()
    assert (full, llm.runner.cache.measured_bytes_per_token()) == BYTES[spec]
    lines = describe(llm.runner.layer_kinds, 4)
    # [k | gate] rows as they are, the pooled keys in FP8
    assert any("index_rows [16] + index_pools [8] as fp8_e4m3 [8] / 8 per scale per" in line for line in lines), lines
    layout = describe_layout(llm.runner.layer_kinds, "fp8_e4m3", "float32")  # inspect's kv cache layout line
    assert "index_pools fp8_e4m3 [8] / 8 per scale" in layout and "index_rows" not in layout, layout


def test_verify_bounds_every_attention_call_and_reports_the_pooled_agreement(glm):
    from mlaserve.entrypoints.verify import format_checks, run_checks

    spec, folder = glm
    checks = run_checks(LLM(str(folder), page_size=PAGE, kv_cache_dtype="fp8_e4m3"), random_ids(60, 96, 3))
    print(format_checks(checks))
    by_name = {c.name: c for c in checks}
    attention = by_name["8-bit cache (fp8_e4m3) vs full: attention, every layer"]
    assert attention.passed and 0 < attention.max_abs_diff <= 1.0, attention
    assert by_name["8-bit cache (fp8_e4m3) vs full: logits"].max_abs_diff > 1e-5  # the cache really is 8-bit
    topk = by_name["top-k from FP8 index keys vs exact keys"]
    assert "selecting queries" in topk.note and 0.5 < topk.top1_agreement <= 1.0, topk
    assert "FAIL" not in format_checks(checks)


@pytest.mark.parametrize("codes", ["fp8_e4m3", "float16"])
def test_prefix_hit_and_preemption_over_the_8bit_cache_keep_greedy_output(glm, codes):
    """A hit of 48 cached tokens (latent rows, [k | gate] rows and FP8 pooled keys read from the cached pages) and a
    pool small enough to preempt (pools recomputed into new pages) give a fresh engine's greedy tokens over the
    same 8-bit layout (and over float16 rows and pooled keys)."""
    spec, folder = glm
    a = random_ids(60, 96, 31)
    b = a[:53] + random_ids(12, 96, 32)[1:]
    prompts = [random_ids(n, 96, 40 + n) for n in (37, 21, 43)]
    fresh = LLM(str(folder), page_size=PAGE, kv_cache_dtype=codes, enable_prefix_caching=False)
    want_b = fresh.generate([b], greedy(6))[0].outputs[0].token_ids
    want = [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy(6))]

    llm = LLM(str(folder), page_size=PAGE, kv_cache_dtype=codes, trace="memory")
    llm.generate([a], greedy(4))
    assert llm.generate([b], greedy(6))[0].outputs[0].token_ids == want_b, spec
    assert max(q["cached_tokens"] for r in llm.runner.tracer.records for q in r["requests"]) == 48

    small = LLM(str(folder), page_size=4, num_pages=20, max_num_seqs=3, max_num_batched_tokens=16, kv_cache_dtype=codes)
    outs = small.generate(prompts, greedy(6))
    assert [o.outputs[0].token_ids for o in outs] == want, spec
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0

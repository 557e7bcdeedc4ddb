"""The DSA indexer's bf16 scores (index_scores="bf16", config/index_scores.py): q and every key rounded to bf16,
fp32 sums. The C top-k (csrc/indexer.c: vdpbf16ps pairs on AVX512-BF16, else the fp32 kernels over the rounded
values) against the per-op torch scoring of the same rounded values (attention/backends/torch_index.py), for keys
kept in fp32, bf16, float16 and FP8, on every build this CPU runs; then whole engines: the one-call decode layers
against the per-op torch backend under bf16 scores, and the route and provenance that record the choice.

Both sides score the same bf16 values with exact products; they differ only in the fp32 summation order (~1e-6 of
a score), so their top-k sets agree unless two scores tie at the k-th place to that rounding, which these random
cases do not produce (asserted equal). Rounding does move the selection: the cases are checked to select another
set than fp32 scoring for some request, so a kernel that ignored the flag fails.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_decode_layer_sparse import BOUND, _prompts, dsa_gguf  # noqa: F401, F811 (dsa_gguf: a fixture)

from mlaserve import LLM
from mlaserve.attention.backends import torch_index
from mlaserve.attention.backends.torch_backend import TorchBackend
from mlaserve.cache.quantized_rows import QuantizedRows
from mlaserve.config.cpu import cpu_flags
from mlaserve.config.row_format import half_format, index_key_format
from mlaserve.kernels import native, native_build, native_indexer, native_layers
from mlaserve.sampling.params import SamplingParams

NATIVE = native.status()
pytestmark = pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")


def _case(t: int, hi: int, di: int, length: int, seed: int) -> tuple:
    """q [T, Hi, Di], w [T, Hi], keys [S, Di], kv_slots [T, L], mask [T, L]: request b allows its first L - 7b keys."""
    g = torch.Generator().manual_seed(seed)
    s = length + 40
    q = torch.randn(t, hi, di, generator=g)
    w = torch.randn(t, hi, generator=g) * 0.3
    keys = torch.randn(s, di, generator=g)
    kv_slots = torch.stack([torch.randperm(s, generator=g)[:length] for _ in range(t)])
    mask = torch.zeros(t, length, dtype=torch.bool)
    for b in range(t):
        mask[b, : length - 7 * b] = True
    return q, w, keys, kv_slots, mask


def _torch_sets(q, w, keys, kv_slots, mask, k: int, scoring: str) -> list[set]:
    """The per-op torch scoring's kept positions per request, over keys given as fp32 rows."""
    t = q.shape[0]
    seg = SimpleNamespace(
        q_index=torch.arange(t).view(t, 1),
        kv_slots=kv_slots,
        mask=mask.view(t, 1, -1),
        segment=SimpleNamespace(index_scoring=scoring, phase="decode"),
    )
    index = torch_index.index_topk(q, w, keys, seg, k)[:, 0]
    return [set(index[b][mask[b, index[b]]].tolist()) for b in range(t)]


def _c_sets(topk, q, w, keys, kv_slots, mask, k: int, bf16: bool) -> list[set]:
    index, valid = topk(q, w, keys, kv_slots, mask, k, bf16)
    return [set(index[b][valid[b]].tolist()) for b in range(q.shape[0])]


KEY_FORMS = {  # name -> (the keys as the C call takes them, the same keys as fp32 rows, the C call)
    "fp32": lambda k: (k, k, native_indexer.index_topk),
    "bfloat16": lambda k: _coded(k, half_format("bfloat16", k.shape[1]), native_indexer.index_topk16),
    "float16": lambda k: _coded(k, half_format("float16", k.shape[1]), native_indexer.index_topk16),
    "fp8": lambda k: _coded(k, index_key_format(k.shape[1]), native_indexer.index_topk8),
}


def _coded(keys: torch.Tensor, fmt, topk) -> tuple:
    rows = QuantizedRows.of(keys, fmt)
    return rows, rows.rows(torch.arange(keys.shape[0])).float(), topk


# (Hi, Di, L, k): 32 heads x 128 (the DSA benchmark model's indexer), 8 x 32 (one lane group), 20 x 64 (padding
# heads in the second group): eight keys per pass; 40 x 32 and 64 x 64 (DeepSeek-V3.2's 64 heads): three and four
# groups, four keys per pass; 72 heads (over the lane scorers' 64: the row scorer). Lengths leave short last passes.
SHAPES = [
    (32, 128, 700, 64),
    (8, 32, 300, 16),
    (20, 64, 523, 40),
    (40, 32, 261, 20),
    (64, 64, 302, 32),
    (72, 32, 200, 24),
]


def _check_build() -> int:
    """Every shape and key form on the current library: the bf16 sets equal torch's over the rounded values, and
    the fp32 sets torch's fp32 ones. -> how many requests' bf16 sets differ from their fp32 sets."""
    moved = 0
    for n, (hi, di, length, k) in enumerate(SHAPES):
        q, w, keys, kv_slots, mask = _case(4, hi, di, length, seed=n)
        for form, make in KEY_FORMS.items():
            given, rows, topk = make(keys)
            for bf16 in (True, False):
                got = _c_sets(topk, q, w, given, kv_slots, mask, k, bf16)
                want = _torch_sets(q, w, rows, kv_slots, mask, k, "bf16" if bf16 else "fp32")
                assert got == want, (hi, di, form, bf16)
            bf16_sets = _c_sets(topk, q, w, given, kv_slots, mask, k, True)
            moved += sum(a != b for a, b in zip(bf16_sets, _torch_sets(q, w, rows, kv_slots, mask, k, "fp32")))
    return moved


def _builds() -> list[tuple[tuple[str, ...], str]]:
    """The machine's build, then the narrower ones this CPU runs: AVX-512 without AVX512-BF16 (the fp32 lane scorer
    over rounded values), AVX2 (the row scorer)."""
    out = [((), "this build")]
    flags = cpu_flags()
    if "avx512_bf16" in flags:
        out.append((("-mno-avx512bf16",), "avx512 without bf16 dot products"))
    if "avx512f" in flags:
        out.append((("-mno-avx512f",), "avx2"))
    return out


@pytest.mark.parametrize("flags,what", _builds())
def test_bf16_top_k_is_torchs_over_the_rounded_values(flags, what, monkeypatch):
    if flags:
        lib, detail = native_build._build(flags)
        assert lib is not None, detail
        monkeypatch.setitem(native_build._state, "lib", lib)
    moved = _check_build()
    print(f"{what}: {moved} of {4 * len(SHAPES) * len(KEY_FORMS)} requests select another set than fp32 scoring")
    assert moved > 0, f"{what}: bf16 scores never moved a selection: the rounding is not applied"


def test_fused_bf16_steps_equal_the_torch_backends(dsa_gguf, monkeypatch):  # noqa: F811
    """A DSA GGUF run sparse with index_scores="bf16": every decode step through the one-call layers (their step
    arguments carry the route's bf16 scoring) against the same file on the torch attention backend, per op (its
    index_topk rounds q and the keys in torch): the same tokens, logprobs within fp32 rounding (BOUND, as the fp32
    comparison of test_decode_layer_sparse.py). Every selecting segment's route says "bf16"."""
    path = dsa_gguf("v32", "q8_0")
    fused = LLM(str(path), kernels="native", enable_prefix_caching=False, attention="sparse", index_scores="bf16")
    assert fused.config.attention.index_scores == "bf16"
    assert "user option" in next(s.source for s in fused.config.provenance if s.name == "index_scores")
    flags: list[int] = []
    real = native_layers.decode_layers
    monkeypatch.setattr(
        native_layers, "decode_layers", lambda s, step, *a: flags.append(step.index_bf16) or real(s, step, *a)
    )
    prompts = _prompts(LONG_PROMPTS)
    tok_a, lp_a = _generate(fused, prompts)
    assert flags and all(f == 1 for f in flags)  # every decode step selects (the longest prompt is past index_topk)
    scorings: list[str] = []
    real_topk = torch_index.index_topk

    def topk(q, w, keys, seg, n):
        scorings.append(seg.segment.index_scoring)
        return real_topk(q, w, keys, seg, n)

    monkeypatch.setattr(TorchBackend, "index_topk", staticmethod(topk))
    per_op = LLM(
        str(path), kernels="native", enable_prefix_caching=False, attention="sparse", index_scores="bf16",
        attention_backend="torch",
    )  # fmt: skip
    tok_b, lp_b = _generate(per_op, prompts)
    assert scorings and set(scorings) == {"bf16"}
    assert tok_a == tok_b
    worst = max(abs(a - b) for ra, rb in zip(lp_a, lp_b) for sa, sb in zip(ra, rb) for a, b in zip(sa, sb))
    assert worst <= BOUND, worst


# prompts far past index_topk (16): each selecting step keeps 16 of ~200-300 keys, so that rounding moves some
# selection, and a path that scores in fp32 fails the comparison (the one-call layers with their flag ignored
# part from the torch backend's tokens at the second request's second token)
LONG_PROMPTS = [300, 260, 230, 200]


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list, list]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [o.token_ids for o in outs], [[sorted(s.values()) for s in o.logprobs] for o in outs]


def test_verify_reports_bf16_against_fp32_scores(dsa_gguf):  # noqa: F811
    """`mlaserve verify` on an engine with bf16 index scores: its identities pass with the bf16 scores on both routes
    (the sparse backend-vs-reference one included: the reference rounds alike), and it reports the kept positions'
    overlap with fp32 scoring and the logits through both, over a prompt long enough to select."""
    from mlaserve.entrypoints.verify import run_checks

    llm = LLM(str(dsa_gguf("v32", "q8_0")), kernels="native", attention="sparse", index_scores="bf16")
    checks = {c.name: c for c in run_checks(llm, _prompts([120])[0])}
    assert all(c.passed for c in checks.values()), [c for c in checks.values() if not c.passed]
    overlap = checks["top-16, bf16 vs fp32 index scores"]
    assert 0.9 <= overlap.top1_agreement <= 1.0 and "selecting queries" in overlap.note
    assert "logits, bf16 vs fp32 index scores" in checks
    assert any("sparse top-16" in name for name in checks)


def test_auto_reads_the_indexer_projections_stored_width(dsa_gguf, monkeypatch):  # noqa: F811
    """index_scores="auto" on a CPU with fast bf16 (forced here): bf16 for the Q4_0 file (its indexer key projection
    requantized to 4 bits; the query projection's rows of 48 stay F16, passed over), fp32 for the Q8_0 one (8 bits:
    over the rule, config/index_scores.py), each reason naming the type the loader read from the file's header
    (loading/probes.py indexer_bits)."""
    from mlaserve.config.cpu import OVERRIDE

    monkeypatch.setenv(OVERRIDE, "1")
    for gtype, want, named in (("q4_0", "bf16", "(Q4_0)"), ("q8_0", "fp32", "stored as Q8_0")):
        llm = LLM(str(dsa_gguf("v32", gtype)), kernels="native", attention="sparse")
        why = next(s.source for s in llm.config.provenance if s.name == "index_scores")
        assert llm.config.attention.index_scores == want and named in why, why


@pytest.mark.parametrize("bf16", [False, True])
def test_a_nan_score_keeps_the_selection_in_range(bf16):
    """A NaN in a query (or a key) makes its scores NaN: the C top-k still returns k distinct allowed positions in
    range (a NaN ranks first, as torch's topk ranks it), so the NaN reaches the attention's output and the engine's
    non-finite check names the request, instead of an index out of range (seen before: a prompt's top-k moved to C)."""
    q, w, keys, kv_slots, mask = _case(2, 32, 128, 600, seed=9)
    q[0, 3, 5] = float("nan")
    keys[kv_slots[1, 17]] = float("nan")
    index, valid = native_indexer.index_topk(q, w, keys, kv_slots, mask, 64, bf16)
    for b in range(2):
        kept = index[b][valid[b]]
        assert len(kept) == 64 and len(set(kept.tolist())) == 64
        assert ((kept >= 0) & (kept < kv_slots.shape[1])).all() and mask[b, kept].all()
    assert int((kv_slots[1] == kv_slots[1, 17]).nonzero()[0]) in index[1].tolist()  # the NaN key ranks first

"""The `triton` attention backend against `reference` at MLA dims other than the backend harness's
(tests/identities/test_attention_backends.py runs it at its small dims too), under Triton's interpreter on CPU
tensors (tests/conftest.py sets TRITON_INTERPRET=1 where torch sees no GPU) and compiled on CUDA when present.

Cases: kv_lora_rank 256 with 17 heads (odd, two head blocks of the kernel) and 512 with 5 heads, rope 64, page
sizes 16 and 8; one batch of three decodes and two prompt chunks (one after cached context) of different
lengths; the absorbed and the decompressed path, each with and without an `allowed` mask; a long context whose key axis several splits read (split-K, then the reduce kernel); DSA: the sparse
latent MQA over a given selection (with unused entries) and the index scores' top-k; non-finite cache rows a
query does not read (another request's pages, free pages, the pad row, its own later positions, unselected
rows, unread index keys) must not reach it. Then the engine end to end: a tiny dense and a tiny DSA model's
logits with attention_backend="triton" against "reference", and how the option is resolved.

Bounds: fp32 on both sides, sums in another order (the kernel's tiles and online softmax vs one einsum): over
seeds 0-2 of these cases the worst is 1.0e-6 (absorbed, with allowed, sparse, decompressed; 8.6e-8 split-K), on
outputs O(1); the engine's logits 4.3e-6 (ds32): FP32_TOL = 1e-5, as the harness. A wrong row, mask or a merge
without its rescale moves the output by O(0.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import fixture_dir
from hf_models import make_config, random_ids

from mlaserve import LLM
from mlaserve.attention.backends import BACKENDS
from mlaserve.attention.metadata import SegmentTensors, build_segment_tensors
from mlaserve.attention.router import route
from mlaserve.config.engine import EngineOptions, resolve
from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.platform.triton_runtime import TritonMode, triton_mode

# CPU tensors through the interpreter where torch sees no GPU (conftest); a GPU run compiles, for its CUDA cases
DEVICES = [d for d in ("cpu", "cuda") if (d == "cpu" or torch.cuda.is_available()) and triton_mode(d).mode]
on_cpu = pytest.mark.skipif(triton_mode("cpu").mode is None, reason="the interpreter is off (a GPU run compiles)")
TRITON, REF = BACKENDS["triton"], BACKENDS["reference"]
FP32_TOL = 1e-5
DN, DV, DR = 16, 16, 64  # qk_nope, v head dims, qk_rope (the up-projections' widths do not reach the kernel)
HI, DI = 20, 64  # index heads (a block of 16 and a partial one) and index head dim
TOPK = 12
# (query length, context length): three decodes, a chunk after 30 cached tokens, a fresh prompt of 12
SEQS = [(1, 9), (1, 40), (1, 23), (5, 30), (12, 0)]
LONG = [(1, 1100), (3, 1000)]  # 1,103 keys: 3 splits (key_split.KEYS_PER_SPLIT 512)


@dataclass
class Case:
    heads: int
    r: int
    q: torch.Tensor  # [N, H, dn + dr]
    cache: torch.Tensor  # [S, r + dr]
    kv_b: torch.Tensor  # [H * (dn + dv), r]
    q_idx: torch.Tensor  # [N, Hi, Di]
    w: torch.Tensor  # [N, Hi]
    keys: torch.Tensor  # [S, Di]
    batch: ForwardBatch
    pages: set[int]  # the pages the batch's block tables hold

    @property
    def w_uk(self):
        return self.kv_b.view(self.heads, DN + DV, self.r)[:, :DN]

    @property
    def w_uv(self):
        return self.kv_b.view(self.heads, DN + DV, self.r)[:, DN:]

    def segments(self, sparse: bool = False) -> list[SegmentTensors]:
        plan = route(self.batch, "auto", sparse, TOPK if sparse else None, torch.float32, "triton")
        return [build_segment_tensors(self.batch, s) for s in plan.segments]


def _case(heads: int, r: int, ps: int, seqs, device: str, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-(q + c) // ps) for q, c in seqs)
    num_pages = need + 6  # free pages too, and page 0 holds the pad row
    pages = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # scattered, never the pad row's page
    chunks, n = [], 0
    for i, (q, ctx) in enumerate(seqs):
        k = -(-(q + ctx) // ps)
        chunks.append(SeqChunk(f"r{i}", tuple(range(q)), ctx, tuple(pages[n : n + k])))
        n += k
    batch = ForwardBatch.build(chunks, ps, 1, device, pad_slot=0)
    t, s = batch.num_tokens, num_pages * ps

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    cache = randn(s, r + DR)
    cache[0] = 0  # the pad row (ModelCache.pad_slot)
    return Case(
        heads, r, randn(t, heads, DN + DR), cache, randn(heads * (DN + DV), r, scale=r**-0.5),
        randn(t, HI, DI), randn(t, HI), randn(s, DI), batch, set(pages[:n]),
    )  # fmt: skip


def _absorbed(backend, c: Case, seg, allowed=None, cache=None):
    q_nope, q_pe = c.q[..., :DN], c.q[..., DN:]
    cache = c.cache if cache is None else cache
    return backend.absorbed(q_nope, q_pe, cache, c.w_uk, c.w_uv, seg, (DN + DR) ** -0.5, allowed)


def _decompressed(backend, c: Case, seg, allowed=None, cache=None):
    q_nope, q_pe = c.q[..., :DN], c.q[..., DN:]
    cache = c.cache if cache is None else cache
    return backend.decompressed(q_nope, q_pe, cache, c.kv_b, seg, (DN + DR) ** -0.5, DN, allowed)


def _sparse(backend, c: Case, seg, index, valid, cache=None):
    q_nope, q_pe = c.q[..., :DN], c.q[..., DN:]
    cache = c.cache if cache is None else cache
    return backend.sparse_absorbed(q_nope, q_pe, cache, c.w_uk, c.w_uv, seg, (DN + DR) ** -0.5, index, valid)


def _selection(seg: SegmentTensors, seed: int = 0):
    """TOPK random allowed positions per query, valid where allowed (a query with fewer allowed keys has invalid
    entries)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(seg.mask.shape, generator=g).to(seg.mask.device)
    index = noise.masked_fill(~seg.mask, -1.0).topk(min(TOPK, seg.mask.shape[-1]), dim=-1).indices
    return index, seg.mask.gather(2, index)


def _parked(index, valid):
    """Invalid entries parked at position 0, as a pooled selection parks them (a valid entry may name 0 too)."""
    return index.masked_fill(~valid, 0), valid


def _close(got, want, seg, tol=FP32_TOL):
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = got[seg.q_valid], want[seg.q_valid]
    assert torch.isfinite(want).all()
    err = (got - want).abs().max().item()
    assert err <= tol, f"max abs diff {err:.3g} > {tol:.3g}"


DIMS = [(17, 256, 16), (5, 512, 8)]  # (heads, kv_lora_rank, page size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,r,ps", DIMS, ids=["h17_r256_ps16", "h5_r512_ps8"])
def test_both_paths_equal_reference(heads, r, ps, device):
    c = _case(heads, r, ps, SEQS, device)
    segs = c.segments()
    assert [(s.segment.phase, s.q_index.shape[1]) for s in segs] == [("decode", 1), ("prefill", 12)]
    for i, seg in enumerate(segs):
        _close(_absorbed(TRITON, c, seg), _absorbed(REF, c, seg), seg)
        index, valid = _selection(seg, i)
        allowed = torch.zeros_like(seg.mask).scatter_(2, index, valid)  # the dense kernel with a narrower mask
        _close(_absorbed(TRITON, c, seg, allowed), _absorbed(REF, c, seg, allowed), seg)
        _close(_sparse(TRITON, c, seg, *_parked(index, valid)), _sparse(REF, c, seg, index, valid), seg)
        _close(_decompressed(TRITON, c, seg), _decompressed(REF, c, seg), seg)
        _close(_decompressed(TRITON, c, seg, allowed), _decompressed(REF, c, seg, allowed), seg)


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_over_a_long_context(device, monkeypatch):
    from mlaserve.attention.backends.triton_kernels import key_split

    c = _case(5, 256, 16, LONG, device)
    (decode, prefill) = c.segments()
    assert key_split.split_plan(decode.kv_slots.shape[1]) == key_split.SplitPlan(3, 384)
    for seg in (decode, prefill):
        want = _absorbed(REF, c, seg)
        _close(_absorbed(TRITON, c, seg), want, seg)
        with monkeypatch.context() as m:  # one split: the same result through the reduce of a single partial
            m.setattr(key_split, "KEYS_PER_SPLIT", 4096)
            assert key_split.split_plan(seg.kv_slots.shape[1]).splits == 1
            _close(_absorbed(TRITON, c, seg), want, seg)


@pytest.mark.parametrize("device", DEVICES)
def test_index_topk_selects_the_reference_set(device):
    c = _case(5, 256, 16, SEQS, device)
    for seg in c.segments(sparse=True):
        assert seg.segment.index_scoring == "fp32"
        got = TRITON.index_topk(c.q_idx, c.w, c.keys, seg, TOPK)
        want = REF.index_topk(c.q_idx, c.w, c.keys, seg, TOPK)
        assert got.shape == want.shape == (*seg.q_index.shape, min(TOPK, seg.mask.shape[-1]))
        # the chosen keys' exact scores (sorted) agree: equal sets up to exact ties; short rows fill with -inf
        exact = _scores(c, seg)
        chosen = [exact.gather(2, i).sort(dim=-1).values[seg.q_valid] for i in (got, want)]
        torch.testing.assert_close(chosen[0], chosen[1], rtol=1e-6, atol=0)


def _scores(c: Case, seg: SegmentTensors) -> torch.Tensor:
    q, k = c.q_idx[seg.q_index], c.keys[seg.kv_slots]
    s = torch.einsum("bqh,bqhl->bql", c.w[seg.q_index], torch.einsum("bqhd,bld->bqhl", q, k).relu())
    return s.masked_fill(~seg.mask, float("-inf"))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_a_query_does_not_read_never_reach_it(device):
    """NaN / inf in the pad row, free pages and the prompt request's later positions: every output the reference
    leaves finite is finite and equal; those that read a poisoned row are NaN on both sides (the absorbed path,
    and the decompressed one over the prompt chunk, whose kernel loads a key some query of its block reads). A -inf
    in a row a decode reads: the heads whose score there is -inf give it probability 0 and stay finite (the P @ c_kv operand
    is zeroed where non-finite), the others are NaN."""
    c = _case(5, 256, 8, SEQS, device)
    decode, prefill = c.segments()
    ps, poisoned = c.batch.page_size, c.cache.clone()
    free = [p for p in range(1, poisoned.shape[0] // ps) if p not in c.pages]
    for p in free:
        poisoned[p * ps : (p + 1) * ps] = float("nan")
    poisoned[free[0] * ps, 3] = float("inf")
    poisoned[0] = float("nan")  # padding keys and padding queries point here
    victim = prefill.kv_slots[0, 32]  # request r3 (30 cached tokens): its query at offset 2 reads position 32 first
    poisoned[victim] = float("nan")
    poisoned[decode.kv_slots[0, 3], 5] = float("-inf")  # read by the first decode (position 9)
    for seg, path in ((decode, _absorbed), (prefill, _absorbed), (prefill, _decompressed)):
        want = path(REF, c, seg, cache=poisoned)[seg.q_valid]
        got = path(TRITON, c, seg, cache=poisoned)[seg.q_valid]
        assert torch.equal(got.isnan(), want.isnan())
        finite = ~want.isnan()
        assert finite.any() and (got[finite] - want[finite]).abs().max() <= FP32_TOL
        heads_bad = want.isnan().all(dim=-1)  # [V, H]
        if seg is prefill:  # the queries at offsets 2.. of r3 read the NaN row, no other query does
            assert heads_bad.all(dim=-1).sum() == 3 and heads_bad.any(dim=-1).sum() == 3
        else:  # the first decode: some heads finite, some NaN; the other decodes untouched
            assert 0 < heads_bad[0].sum() < c.heads and not heads_bad[1:].any()
    # sparse: the NaN row is visible to r3's later queries but not selected by them
    index, valid = _selection(prefill, 1)
    picked = prefill.kv_slots.gather(1, index.flatten(1)).view_as(index)
    keep = valid & (picked != victim)
    index = index.masked_fill(~keep, 0)
    want = _sparse(REF, c, prefill, index, keep, cache=poisoned)
    got = _sparse(TRITON, c, prefill, index, keep, cache=poisoned)
    _close(got, want, prefill)


@on_cpu
def test_index_keys_a_query_does_not_read_never_reach_it():
    c = _case(5, 256, 8, SEQS, "cpu")
    for seg in c.segments(sparse=True):
        keys = c.keys.clone()
        unread = torch.ones(keys.shape[0], dtype=torch.bool)
        unread[seg.kv_slots[seg.mask.any(dim=1)]] = False
        keys[unread] = float("nan")
        got = TRITON.index_topk(c.q_idx, c.w, keys, seg, TOPK)
        exact = _scores(c, seg)
        chosen = [
            exact.gather(2, i).sort(dim=-1).values[seg.q_valid]
            for i in (got, REF.index_topk(c.q_idx, c.w, keys, seg, TOPK))
        ]
        torch.testing.assert_close(chosen[0], chosen[1], rtol=1e-6, atol=0)


# The engine end to end, and the option.


@on_cpu
@pytest.mark.parametrize("fixture", ["ds3", "ds32"])
def test_engine_logits_equal_the_reference_backend(fixture):
    """Every prompt token down the absorbed path (mla_path="absorbed"; DSA: sparse over the indexer's top-k) in
    chunks of 16, on the latent cache's pages: triton against reference, and the ledger names what ran. (The
    decompressed path's kernel is checked above, and in the engine by the NaN-isolation test's DSA model.)"""
    ids = random_ids(40, seed=5)  # > ds32's index_topk 16: the indexer selects
    runs = {}
    for backend in ("reference", "triton"):
        llm = LLM(
            str(fixture_dir(fixture)), attention_backend=backend, mla_path="absorbed", max_num_batched_tokens=16,
            trace="memory",
        )  # fmt: skip
        runs[backend] = llm.prompt_logits(ids), llm
    (want, _), (got, llm) = runs["reference"], runs["triton"]
    impls = {s["implementation"] for r in llm.runner.tracer.records for s in r["segments"]}
    # ds32: the first chunk (16 tokens) is within index_topk 16, so it attends every row; the later ones select
    sparse = {"triton:sparse_absorbed(all rows within index_topk)", "triton:sparse_absorbed"}
    assert impls == (sparse if fixture == "ds32" else {"triton:absorbed"}), impls
    err = (got - want).abs().max().item()
    assert err <= FP32_TOL and torch.equal(got.argmax(-1), want.argmax(-1)), err
    (setting,) = [s for s in llm.runner.cfg.provenance if s.name == "attention_backend"]
    assert setting.value == "triton" and f"Triton kernels {triton_mode('cpu').mode}" in setting.source


def test_route_names_the_triton_kernels():
    c = _case(5, 256, 16, SEQS, "cpu")
    plan = route(c.batch, "auto", False, None, torch.float32, "triton")
    assert [s.implementation for s in plan.segments] == ["triton:absorbed", "triton:decompressed"]


def test_option_resolution():
    cfg = ModelConfig.from_hf(make_config("v3_yarn").to_dict())

    def opts(**kw):
        return EngineOptions(device="cpu", **kw)

    interpreted = lambda device: TritonMode("interpreter", "TRITON_INTERPRET=1")  # noqa: E731
    refused = lambda device: TritonMode(None, f"Triton compiles for GPUs only; on {device} ...")  # noqa: E731
    eng = resolve(cfg, opts(attention_backend="triton"), False, triton=interpreted)
    assert eng.attention.backend == "triton"
    assert "interpreter" in {s.name: s.source for s in eng.provenance}["attention_backend"]
    with pytest.raises(ConfigError, match="cannot run on device 'cpu': Triton compiles for GPUs only"):
        resolve(cfg, opts(attention_backend="triton"), False, triton=refused)
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8_e4m3'"):
        resolve(cfg, opts(attention_backend="triton", kv_cache_dtype="fp8_e4m3"), False, triton=interpreted)
    with pytest.raises(ConfigError, match="not probed"):
        resolve(cfg, opts(attention_backend="triton"), False)
    # auto never picks triton, even where its kernels could run
    assert resolve(cfg, opts(), False, triton=interpreted).attention.backend == "torch"

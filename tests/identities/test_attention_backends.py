"""Every registered attention backend against `reference`, the plain oracle, on the same inputs.

The harness a new kernel plugs into: register it in `mlaserve.attention.backends.BACKENDS` and these
tests run it (parametrized over the registry's names, and over "cuda" when torch sees one).
Inputs: a random latent cache [S, r + dr] whose pages are scattered over the pool; one batch with two
decodes and two prompt chunks (one after cached context), routed as the engine routes it; random
queries, kv_b, indexer queries, keys and weights. Checked operations: dense absorbed and decompressed,
sparse absorbed over a given selection, the masked-decompressed sparse form, and index_topk with fp32
and bf16 keys (the selected sets compared by their exact fp32 scores, so that exact ties cannot flake).
Then end to end: the engine with attention_backend="reference" gives the default backend's logits on
the ds3 and ds32 fixtures, and the ledger names the backend that ran.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from conftest import fixture_dir, skip_unless_triton_runs
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.attention.backends import BACKENDS, blocks
from mlaserve.attention.metadata import SegmentTensors, build_segment_tensors
from mlaserve.attention.router import route
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk

NAMES = sorted(BACKENDS)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
REF = BACKENDS["reference"]

H, DN, DR, DV, R = 4, 16, 8, 12, 32  # heads, qk_nope, qk_rope, v head dims, kv_lora_rank
HI, DI = 16, 32  # indexer heads and head dim (16 heads: few ReLU-zero score ties)
PS, NUM_PAGES = 4, 40
TOPK = 6  # < every sequence below but one: selection is active, and one query has fewer keys than k
# (query length, context length): decodes at positions 9 and 20, a prompt chunk after 6 cached
# tokens, a fresh prompt of 7 (its first queries see fewer than TOPK keys)
SEQS = [(1, 9), (1, 20), (5, 6), (7, 0)]

# fp32: both sides compute the same sums in fp32, in a different order; the torch backend is within
# 5.1e-7 of the reference over 8 seeds.
FP32_TOL = 1e-5
# bf16: a backend may round each intermediate product to bf16 (u = 2^-9 relative): q W_UK, the
# scores (which the softmax turns into an error of the probabilities of about |score| * 2^-9), P c_kv
# or P V, and the output itself. With O(1) inputs that is a few 2^-9 to 2^-8 of the output's scale:
# the torch backend's worst over 8 seeds and all four operations is 0.0084 (2.2 * 2^-8) of the
# largest |output|. BF16_TOL = 2^-6 of the largest |output| leaves ~2x room over that, and is far
# below the error of a wrong row or a wrong mask (test_harness_sees_a_wrong_row).
BF16_TOL = 2.0**-6


@dataclass
class Case:
    q_nope: torch.Tensor  # [N, H, dn]
    q_pe: torch.Tensor  # [N, H, dr]
    cache: torch.Tensor  # [S, r + dr]
    kv_b: torch.Tensor  # [H * (dn + dv), r]
    q_idx: torch.Tensor  # [N, Hi, Di]
    w: torch.Tensor  # [N, Hi] fp32, as the indexer gives it
    keys: torch.Tensor  # [S, Di]
    batch: ForwardBatch
    scale: float

    @property
    def w_uk(self) -> torch.Tensor:
        return self.kv_b.view(H, DN + DV, R)[:, :DN]

    @property
    def w_uv(self) -> torch.Tensor:
        return self.kv_b.view(H, DN + DV, R)[:, DN:]

    def segments(self, backend: str, key_dtype: torch.dtype | None = None) -> list[SegmentTensors]:
        """The batch routed as the engine routes it (sparse when key_dtype is given)."""
        sparse = key_dtype is not None
        plan = route(self.batch, "auto", sparse, TOPK if sparse else None, key_dtype or torch.float32, backend)
        assert plan.needs_selection is sparse
        return [build_segment_tensors(self.batch, s) for s in plan.segments]


def _case(seed: int, dtype: torch.dtype, device: str, near_ties: bool = False) -> Case:
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(NUM_PAGES, generator=g).tolist()  # scattered over the pool
    chunks, n = [], 0
    for i, (q, ctx) in enumerate(SEQS):
        k = -(-(q + ctx) // PS)
        chunks.append(SeqChunk(f"r{i}", tuple(range(q)), ctx, tuple(pages[n : n + k])))
        n += k
    batch = ForwardBatch.build(chunks, PS, 1, device)
    t = batch.num_tokens

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    keys = randn(NUM_PAGES * PS, DI)
    if near_ties:  # every key a tiny perturbation of one: scores cluster at the top-k boundary
        keys = keys[:1] + 1e-3 * keys
    q = randn(t, H, DN + DR).to(dtype)  # q_nope / q_pe are views of one tensor, as the model splits q_b_proj's
    return Case(
        q_nope=q[..., :DN],
        q_pe=q[..., DN:],
        cache=randn(NUM_PAGES * PS, R + DR).to(dtype),
        kv_b=randn(H * (DN + DV), R, scale=R**-0.5).to(dtype),
        q_idx=randn(t, HI, DI).to(dtype),
        w=randn(t, HI),
        keys=keys.to(dtype),
        batch=batch,
        scale=(DN + DR) ** -0.5,
    )


def _selection(seg: SegmentTensors, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A given top-k: TOPK distinct random positions per query, valid where causal (as Selection)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(seg.mask.shape, generator=g).to(seg.mask.device)
    index = noise.masked_fill(~seg.mask, -1.0).topk(min(TOPK, seg.mask.shape[-1]), dim=-1).indices
    return index, seg.mask.gather(2, index)


def _as_mask(seg: SegmentTensors, index, valid) -> torch.Tensor:
    return torch.zeros_like(seg.mask).scatter_(2, index, valid)


def _check(got: torch.Tensor, want: torch.Tensor, seg: SegmentTensors, dtype: torch.dtype) -> None:
    """Valid query rows only (padding rows are the caller's to drop)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = got[seg.q_valid].float(), want[seg.q_valid].float()
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL * want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= tol, f"max abs diff {err:.3g} > {tol:.3g}"


def _run(op: str, backend, c: Case, seg: SegmentTensors, seed: int = 0) -> torch.Tensor:
    if op == "absorbed":
        return backend.absorbed(c.q_nope, c.q_pe, c.cache, c.w_uk, c.w_uv, seg, c.scale)
    if op == "decompressed":
        return backend.decompressed(c.q_nope, c.q_pe, c.cache, c.kv_b, seg, c.scale, DN)
    index, valid = _selection(seg, seed)
    if op == "sparse_absorbed":
        return backend.sparse_absorbed(c.q_nope, c.q_pe, c.cache, c.w_uk, c.w_uv, seg, c.scale, index, valid)
    assert op == "sparse_decompressed"  # masked MHA: the form mla_path="decompressed" takes on sparse steps
    allowed = _as_mask(seg, index, valid)
    return backend.decompressed(c.q_nope, c.q_pe, c.cache, c.kv_b, seg, c.scale, DN, allowed)


OPS = ["absorbed", "decompressed", "sparse_absorbed", "sparse_decompressed"]


@pytest.fixture(params=[None, 1], ids=["workspace_default", "workspace_1_byte"])
def workspace(request, monkeypatch):
    """A 1-byte workspace makes the torch backend take one query per block (its long-prompt path)."""
    if request.param is not None:
        monkeypatch.setattr(blocks, "WORKSPACE_BYTES", request.param)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", NAMES)
def test_attention_equals_reference(name, op, dtype, device, workspace):
    if name == "triton":
        skip_unless_triton_runs(device)
    c = _case(0, dtype, device)
    segs = c.segments(name)
    assert [s.segment.phase for s in segs] == ["decode", "prefill"]
    for i, seg in enumerate(segs):  # each operation on both segments: the router may send either there
        _check(_run(op, BACKENDS[name], c, seg, seed=i), _run(op, REF, c, seg, seed=i), seg, dtype)


@pytest.mark.parametrize("op", ["decompressed", "sparse_decompressed"])
def test_bf16_expansion_within_the_bf16_bound(op, workspace):
    """An fp32 model whose plan runs the K / V expansion in bf16 (MLAAttention.expansion_bf16 hands the torch backend
    a bf16 kv_b): the latent rows are rounded to bf16 for that one product, K and V come back fp32. The outputs stay
    within BF16_TOL of the fp32 reference's, and differ from an fp32 expansion by the same rounded kv_b (the rows
    were rounded and the product ran in bf16)."""
    c = _case(0, torch.float32, "cpu")
    half, rounded = replace(c, kv_b=c.kv_b.bfloat16()), replace(c, kv_b=c.kv_b.bfloat16().float())
    for i, seg in enumerate(c.segments("torch")):
        got = _run(op, BACKENDS["torch"], half, seg, seed=i)
        assert got.dtype == torch.float32
        want = _run(op, REF, c, seg, seed=i)
        _check(got.bfloat16(), want.bfloat16(), seg, torch.bfloat16)
        assert not torch.equal(got, _run(op, BACKENDS["torch"], rounded, seg, seed=i))


def _exact_scores(c: Case, seg: SegmentTensors) -> torch.Tensor:
    """sum_h w_h ReLU(q_h . key) in fp32 per (request, query, key position), -inf where not allowed."""
    q = c.q_idx.float()[seg.q_index]
    k = c.keys.float()[seg.kv_slots]
    s = torch.einsum("bqh,bqhl->bql", c.w[seg.q_index], torch.einsum("bqhd,bld->bqhl", q, k).relu())
    return s.masked_fill(~seg.mask, float("-inf"))


def _chosen(scores: torch.Tensor, index: torch.Tensor, seg: SegmentTensors) -> torch.Tensor:
    """The selected keys' exact scores, sorted, valid query rows: equal for two selections that differ
    only among exactly tied keys (and -inf for the positions a short row fills up with)."""
    return scores.gather(2, index).sort(dim=-1).values[seg.q_valid]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("keys", ["random", "near_ties"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", NAMES)
def test_index_topk_selects_the_reference_set(name, seed, keys, key_dtype, device, workspace):
    if name == "triton":
        skip_unless_triton_runs(device)
    c = _case(seed, key_dtype, device, near_ties=keys == "near_ties")
    for seg in c.segments(name, key_dtype):
        assert seg.segment.index_scoring == BACKENDS[name].index_scoring(key_dtype)
        got = BACKENDS[name].index_topk(c.q_idx, c.w, c.keys, seg, TOPK)
        want = REF.index_topk(c.q_idx, c.w, c.keys, seg, TOPK)
        assert got.shape == want.shape == (*seg.q_index.shape, TOPK)
        # positions are distinct per query (a set)
        assert (got.sort(dim=-1).values.diff(dim=-1) > 0)[seg.q_valid].all()
        exact = _exact_scores(c, seg)
        torch.testing.assert_close(_chosen(exact, got, seg), _chosen(exact, want, seg), rtol=1e-6, atol=0)


def test_reference_identities():
    """The oracle itself: absorbed == decompressed, and sparse absorbed == masked decompressed."""
    c = _case(3, torch.float32, "cpu")
    for seg in c.segments("reference"):
        dense = [_run(op, REF, c, seg) for op in ("absorbed", "decompressed")]
        sparse = [_run(op, REF, c, seg) for op in ("sparse_absorbed", "sparse_decompressed")]
        _check(dense[0], dense[1], seg, torch.float32)
        _check(sparse[0], sparse[1], seg, torch.float32)


def test_harness_sees_a_wrong_row():
    """The tolerances discriminate: one cache row changed, or the mask widened by one key, moves the
    output by far more than the bf16 bound."""
    c = _case(0, torch.bfloat16, "cpu")
    seg = c.segments("reference")[1]
    want = _run("absorbed", REF, c, seg)[seg.q_valid].float()
    tol = BF16_TOL * want.abs().max().item()
    bad = Case(**{**c.__dict__, "cache": c.cache.clone()})
    bad.cache[seg.kv_slots[0, 0]] += 1.0
    assert (_run("absorbed", REF, bad, seg)[seg.q_valid].float() - want).abs().max() > 8 * tol
    wide = replace(seg, mask=torch.ones_like(seg.mask))
    assert (_run("absorbed", REF, c, wide)[seg.q_valid].float() - want).abs().max() > 8 * tol


# End to end: the engine with the oracle backend against the default one, on the fixtures.


@pytest.mark.parametrize("budget", [4096, 7], ids=["one_chunk", "chunks_of_7"])
@pytest.mark.parametrize("fixture", ["ds3", "ds32"])
def test_engine_reference_backend_equals_default(fixture, budget):
    folder = fixture_dir(fixture)
    ids = random_ids(40, seed=5)  # > ds32's index_topk 16: sparse selection runs
    runs = {}
    for backend in ("reference", "auto"):
        llm = LLM(str(folder), attention_backend=backend, max_num_batched_tokens=budget, trace="memory")
        logits = llm.prompt_logits(ids)
        records = list(llm.runner.tracer.records)
        runs[backend] = logits, {s["backend"] for r in records for s in r["segments"]}, records
    (ref, ref_names, ref_recs), (got, got_names, _) = runs["reference"], runs["auto"]
    assert ref_names == {"reference"} and got_names == {"torch"}  # the ledger names the backend that ran
    assert all(s["implementation"].startswith("reference:") for r in ref_recs for s in r["segments"])
    if fixture == "ds32":
        assert any(r["needs_selection"] for r in ref_recs)
    err = (got - ref).abs().max().item()
    assert err <= 1e-5 and torch.equal(got.argmax(-1), ref.argmax(-1)), err


def test_native_absorbed_runs_every_segment_in_c(monkeypatch):
    """The native backend's dense MQA takes every segment to the C latent MQA, a prompt's too (an absorbed prefill:
    7 queries per request here; no query count switches it to the torch code's GEMM), with the reference's result."""
    from mlaserve.kernels import native, native_layers

    if native.library() is None:
        pytest.skip("no native library: the torch code runs")
    c = _case(0, torch.float32, "cpu")
    decode, prefill = c.segments("native")
    calls = []
    real = native_layers.latent_mqa
    monkeypatch.setattr(native_layers, "latent_mqa", lambda *a, **k: calls.append(a[2].shape) or real(*a, **k))
    for i, seg in enumerate((decode, prefill)):
        _check(
            _run("absorbed", BACKENDS["native"], c, seg, seed=i),
            _run("absorbed", REF, c, seg, seed=i),
            seg,
            torch.float32,
        )
    # q_index [B, Q]: both segments' queries went to the C kernel, the prompt's as they are (Q of its longest)
    assert [s[1] for s in calls] == [1, prefill.q_index.shape[1]] and calls[1][1] > 1, calls


def test_native_sparse_absorbed_runs_every_segment_in_c(monkeypatch):
    """The native backend's sparse MQA takes every segment to the C kernel, a prompt's too (each query its own
    request, its selected rows read in place), with the reference's result."""
    from mlaserve.kernels import native, native_layers

    if native.library() is None:
        pytest.skip("no native library: the torch code runs")
    c = _case(0, torch.float32, "cpu")
    calls = []
    real = native_layers.latent_mqa
    monkeypatch.setattr(native_layers, "latent_mqa", lambda *a, **k: calls.append(a[2].shape) or real(*a, **k))
    for i, seg in enumerate(c.segments("native", torch.float32)):
        _check(
            _run("sparse_absorbed", BACKENDS["native"], c, seg, seed=i),
            _run("sparse_absorbed", REF, c, seg, seed=i),
            seg,
            torch.float32,
        )
    # q_index of the kernel's requests [B * Q, 1]: the decode segment's and the prefill segment's queries
    assert len(calls) == 2 and all(s[1] == 1 for s in calls) and calls[1][0] > calls[0][0], calls

"""`mlaserve verify` on DeepSeek-V4: each identity passes on tiny folders, and a model broken on one path
fails the check that covers that path (and not the others), so no check passes by construction.

Bound: verify judges fp32 at 1e-4 (verify.py); on the three tiny specs every pair measures <= 3.0e-6 (max
|diff| of the logits: fp32 reassociation of the chunked and padded softmaxes), so the tests also hold each
passing pair to 1e-5, the project's fp32 tiny-model bound. The breaks scale one input by 1 + 1e-2; the tests
assert exactly which checks then fail (verify's 1e-4), so a break too small to see would fail them too.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from v4_models import SPECS, build_hf_v4  # noqa: E402

from mlaserve.attention.router import route_step  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.entrypoints.verify import run_checks  # noqa: E402
from mlaserve.entrypoints.verify_v4 import schedule_logits  # noqa: E402
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk  # noqa: E402
from mlaserve.models.deepseek_v4.attention import V4Attention  # noqa: E402
from mlaserve.models.deepseek_v4.compressor import Compressor  # noqa: E402
from mlaserve.models.deepseek_v4.indexer import Indexer  # noqa: E402

BOUND = 1e-5
# 30 tokens: no chunk size used (3, 5, 7, 9) leaves a one-token last chunk, so only the decode checks run
# single-token steps (the decode break below relies on it)
N = 30


def _ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, 96, (n - 1,), generator=g).tolist()


@pytest.fixture(scope="module")
def all_kinds(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4_verify_all_kinds")
    build_hf_v4("all_kinds", seed=3).save_pretrained(folder)
    return folder


def _checks(folder, n: int = N) -> dict:
    return {c.name.split(" (")[0].split(":")[0]: c for c in run_checks(LLM(str(folder)), _ids(n))}


def _names(checks: dict) -> set[str]:
    return set(checks)


EXPECTED = {
    "token-by-token decode vs one pass",
    "chunked prefill",
    "prefill then decode vs one pass",
    "batch of 3 vs each alone",
    "CSA sparse vs dense, rows within index_topk",
}


@pytest.mark.parametrize("spec", list(SPECS))
def test_every_v4_identity_passes(spec, tmp_path):
    build_hf_v4(spec, seed=4).save_pretrained(tmp_path)
    checks = run_checks(LLM(str(tmp_path)), _ids(N))
    names = {c.name.split(" (")[0].split(":")[0] for c in checks}
    has_csa = "compressed_sparse_attention" in str(SPECS[spec].get("layer_types", ""))
    assert names >= (EXPECTED if has_csa else EXPECTED - {"CSA sparse vs dense, rows within index_topk"})
    for c in checks:
        assert c.passed and c.max_abs_diff <= BOUND, c


def test_chunk_ends_reach_every_residue_of_each_ratio(all_kinds):
    """m + 1 = 9 tokens per chunk reach every residue mod 8 once the prompt passes 8 x 9 tokens."""
    checks = run_checks(LLM(str(all_kinds)), _ids(8 * 9 + 2))
    reached = [c.name for c in checks if c.name.startswith("chunked prefill")]
    assert "chunked prefill (3) vs one pass: chunk ends at 4/4 residues mod 4" in reached
    assert "chunked prefill (9) vs one pass: chunk ends at 8/8 residues mod 8" in reached
    assert all(c.passed and c.max_abs_diff <= BOUND for c in checks)


def _failed(folder) -> set[str]:
    return {name for name, c in _checks(folder).items() if not c.passed}


def test_a_break_in_resumed_prefill_chunks_fails_only_the_chunked_checks(all_kinds, monkeypatch):
    """Compressed rows closed by a multi-token chunk that resumes a half-filled window come out scaled: one pass
    (starts empty), token by token (one-token chunks) and the batch (same schedule alone) cannot see it. Broken
    in the engine's batched update (Compressor.close_step): a window whose slots come from the carry and from
    more than one of the step's rows."""
    real = Compressor.close_step

    def close_step(self, kv, gate, plan, *rest):
        rows = real(self, kv, gate, plan, *rest)
        resumed = plan.from_carry.any(1) & ((~plan.from_carry).sum(1) > 1)
        return torch.where(resumed[:, None], rows * 1.01, rows)

    monkeypatch.setattr(Compressor, "close_step", close_step)
    assert _failed(all_kinds) == {"chunked prefill"}


def test_a_break_in_decode_steps_fails_the_decode_checks(all_kinds, monkeypatch):
    """A step of one-token chunks only (a pure decode step) attends a scaled input. The batch check fails too:
    alone, the decoding sequence runs such steps throughout; beside prefills, not."""
    real = V4Attention.forward

    def forward(self, x, positions, spans, tables, csa_dense=False, step=None):
        if all(n == 1 for _, n, _, _ in spans):
            x = x * 1.01
        return real(self, x, positions, spans, tables, csa_dense, step)

    monkeypatch.setattr(V4Attention, "forward", forward)
    assert _failed(all_kinds) == {
        "token-by-token decode vs one pass",
        "prefill then decode vs one pass",
        "batch of 3 vs each alone",
    }


def test_a_break_in_the_padded_batch_fails_only_the_batch_check(all_kinds, monkeypatch):
    real = V4Attention._attend_step_torch  # the engine's padded softmax (a float folder: torch kernels)

    def attend_step(self, q, keys, mask, queries):
        return real(self, q * 1.01 if keys.shape[0] > 1 else q, keys, mask, queries)

    monkeypatch.setattr(V4Attention, "_attend_step_torch", attend_step)  # bound by the LLMs _failed makes
    assert _failed(all_kinds) == {"batch of 3 vs each alone"}


def test_an_indexer_that_drops_a_row_fails_the_schedules_that_choose_differently(all_kinds, monkeypatch):
    """Top-k that loses the first visible row whenever it chooses. It chooses on a step where some sequence has
    more than index_topk rows (LayerKeys.scored: otherwise every visible row is attended, no scores computed), so a
    schedule whose early queries ride in a long chunk (one pass) meets the fault where token-by-token, the resumed
    chunks and the batch do not: those checks fail; the dense comparison, run where every row fits, never chooses."""
    real = Indexer.choose_step  # what the engine's attention calls for the step's sequences

    def choose_step(self, *args):
        mask = real(self, *args).clone()  # [B, S, rows]
        if mask.shape[-1]:
            mask[..., 0] = False
        return mask

    monkeypatch.setattr(Indexer, "choose_step", choose_step)
    schedules = {"chunked prefill", "token-by-token decode vs one pass", "prefill then decode vs one pass"}
    assert _failed(all_kinds) == schedules | {"batch of 3 vs each alone"}


def test_the_dense_switch_is_routed_recorded_and_real(all_kinds):
    """v4_csa_dense is plain data of the runner: the route of a CSA kind says dense (sparse False, path
    window+csa(dense), every visible row counted as selected); beyond index_topk it changes the logits."""
    llm = LLM(str(all_kinds))
    kinds, cfg = llm.runner.layer_kinds, llm.config
    batch = ForwardBatch.build(
        [SeqChunk("r", tuple(_ids(N)), 0, (0, 1, 2), state_slot=0)], 16, cfg.scheduler.decode_threshold
    )
    for dense in (False, True):
        plan = route_step(batch, kinds, cfg.attention.mla_path, v4_csa_dense=dense).plan_of("v4_csa")
        assert plan.sparse is not dense
        assert plan.segments[0].path == ("window+csa(dense)" if dense else "window+csa")
        # 30 tokens, ratio 4: 7 rows visible at the last query; index_topk 3 keeps 3 of them unless dense
        assert plan.rows.requests[0].selected_rows == (7 if dense else 3)
        assert plan.rows.requests[0].compressed_rows == 7
    ids = _ids(N)
    sparse = schedule_logits(llm.loaded.model, cfg, {"r": (ids, [N])})["r"]
    dense = schedule_logits(llm.loaded.model, cfg, {"r": (ids, [N])}, csa_dense=True)["r"]
    assert (sparse[:15] - dense[:15]).abs().max() == 0  # <= 3 rows visible: the same rows attended
    assert (sparse[15:] - dense[15:]).abs().max() > 1e-3  # 4+ rows: top-3 vs all of them


def test_the_indexer_queries_run_only_where_its_top_k_chooses(all_kinds, monkeypatch):
    """A step whose sequences all have at most index_topk compressed rows attends every visible row: the plan
    (LayerKeys.scored) says so before the forward and the CSA layers skip the indexer's queries (their projection,
    rope and head weights); past index_topk rows they run. The logits are the same either way (the identities
    above: every schedule, sparse vs dense within index_topk)."""
    calls = []
    real = Indexer.queries

    def queries(self, *args):
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(Indexer, "queries", queries)
    llm = LLM(str(all_kinds))
    cfg = llm.config
    # ratio 4, index_topk 3: 12 tokens close 3 rows (all fit), 30 tokens close 7
    schedule_logits(llm.loaded.model, cfg, {"r": (_ids(12), [12])})
    assert calls == []
    schedule_logits(llm.loaded.model, cfg, {"r": (_ids(N), [N])})
    csa_layers = sum(1 for k in llm.runner.layer_kinds if k.attention == "v4_csa")
    assert csa_layers and len(calls) == csa_layers

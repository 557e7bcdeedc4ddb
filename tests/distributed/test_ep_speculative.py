"""Speculative decoding (speculative="mtp") under expert parallelism (CPU, gloo, 2 processes): the MTP layer's
routed experts are spread like the trunk's, so every rank runs every draft pass (rank 0 sends each pass's rows,
distributed/group.py TensorParallelDrafter), every verify step, and every rollback of DeepSeek-V4's request states.

Checked per model, one spawn each: (1) the real MTP drafts under EP=2 are the one-process drafts, token for token
at every step (a wrong MTP layer under EP would only lower acceptance, never change the output, so the drafts
themselves are compared); (2) greedy output under EP=2 with speculation == one process without it, with the real
drafts and with oracle drafts (the plain run's next tokens, every third one wrong: acceptance, partial
acceptance and rejection all happen, so V4's rollback runs on both ranks); (3) each rank holds its range of the
MTP layer's experts too (echo and notes); (4) every trunk step and every MTP pass has its expert_load record
(`pass` "trunk" / "mtp"), whose ranks' pairs add up to tokens x k per MoE layer (broken on purpose: rank 0 or the
worker not counting the MTP pass's pairs fails it). Model: DeepSeek-V3 with its MTP layer (tests/mtp_models.py "v3_yarn");
DeepSeek-V4's MTP layer under EP is checked in test_ep_deepseek_v4.py, in that file's one spawn (its hash
layer, CSA / HCA windows closing inside verify chunks, the rollback). Token equality is the check (greedy). Broken on purpose: a worker
that skips the rollback message diverges from the plain tokens; a worker reading zeros for the draft rows makes
the drafts differ from one process."""

from __future__ import annotations

import pytest
from conftest import compare_logits, fp32_logits_tol
from hf_models import random_ids

pytest.importorskip("transformers")

from draft_oracle import capture_mtp_logits, oracle_drafts, record_drafts

import mlaserve.engine.speculative as spec  # noqa: E402
from mlaserve import LLM  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _check(monkeypatch, path: str, prompts: list, vocab: int, mtp_layer: str, **opts) -> None:
    plain = _tokens(LLM(path, **opts).generate(prompts, GREEDY))
    spec_opts = dict(speculative="mtp", num_speculative_tokens=2, **opts)
    one = LLM(path, **spec_opts)
    with monkeypatch.context() as m:
        want_drafts, want_logits = record_drafts(m), capture_mtp_logits(m, one)
        assert _tokens(one.generate(prompts, GREEDY)) == plain
    with LLM(path, expert_parallel_size=2, trace="memory", **spec_opts) as two:
        with monkeypatch.context() as m:
            got_drafts, got_logits = record_drafts(m), capture_mtp_logits(m, two)
            assert _tokens(two.generate(prompts, GREEDY)) == plain
        assert got_drafts == want_drafts and any(d for step in got_drafts for *_, d in step)
        assert len(got_logits) == len(want_logits) > 0
        for got, want in zip(got_logits, want_logits):
            diff, top1 = compare_logits(got, want)
            assert diff <= fp32_logits_tol(want) and top1 == 1.0, diff
        with monkeypatch.context() as m:
            oracle_drafts(m, {tuple(p): t for p, t in zip(prompts, plain)}, vocab)
            before = len(two.runner.tracer.records)
            assert _tokens(two.generate(prompts, GREEDY)) == plain
        records = list(two.runner.tracer.records)[before:]
        summary = spec.acceptance_summary(records)
        assert 0 < summary["num_accepted_tokens"] < summary["num_proposed_tokens"], summary
        _check_expert_load(two, records)
        # the MTP layer's experts: rank 0 the first range, rank 1 the rest, as every trunk layer's
        held = [[h["experts"] for h in e["routed_experts"] if h["layer"] == mtp_layer] for e in two.runner.rank_echoes]
        trunk = [e["routed_experts"][0]["experts"] for e in two.runner.rank_echoes]
        assert held == [[trunk[0]], [trunk[1]]] and trunk[0][0] == 0 and trunk[0][1] == trunk[1][0], held


def _check_expert_load(two: LLM, records: list[dict]) -> None:
    """Every forward pass has one expert_load record, labelled `pass` "trunk" or "mtp": its ranks' pairs add up
    to what one process routes, tokens x k per MoE layer (the trunk's MoE layers; the MTP layer's one MoE), and
    a worker's entry is its own record's `experts_received`."""
    cfg = two.config.model
    k, trunk_moe = cfg.moe.num_experts_per_tok, sum(kind == "moe" for kind in cfg.mlp_layer_types)
    ranked = [r for r in records if "rank" in r and "num_tokens" in r]
    trunk = {r["step"]: r["num_tokens"] for r in ranked if r["rank"] == 0 and r["spec_phase"] != "draft"}
    mtp = {
        (r["step"], r["draft_depth"]): r["num_tokens"] for r in ranked if r["rank"] == 0 and r["spec_phase"] == "draft"
    }
    loads = [r for r in records if "expert_load" in r]
    assert {r["pass"] for r in loads} == {"trunk", "mtp"}, loads
    assert sorted(r["step"] for r in loads if r["pass"] == "trunk") == sorted(trunk)
    assert sorted((r["step"], r["draft_depth"]) for r in loads if r["pass"] == "mtp") == sorted(mtp)
    for rec in loads:
        assert [x["rank"] for x in rec["expert_load"]] == [0, 1]
        pairs = sum(x["pairs"] for x in rec["expert_load"])
        if rec["pass"] == "trunk":
            assert pairs == trunk[rec["step"]] * k * trunk_moe, rec
        else:  # the MTP layer: one MoE layer
            assert pairs == mtp[(rec["step"], rec["draft_depth"])] * k, rec
        phase = {"trunk": ("target", "verify"), "mtp": ("draft",)}[rec["pass"]]
        worker = [
            r
            for r in ranked
            if r["rank"] == 1
            and r["step"] == rec["step"]
            and r["spec_phase"] in phase
            and r.get("draft_depth") == rec.get("draft_depth")
        ]
        assert [{"rank": 1, **r["experts_received"]} for r in worker] == [rec["expert_load"][1]], (rec, worker)


def test_mla_mtp_under_ep2(monkeypatch, tmp_path_factory):
    from mtp_models import BASE, mtp_model_folder

    folder, _ = mtp_model_folder("v3_yarn", tmp_path_factory)
    prompts = [random_ids(n, seed=n) for n in (5, 12, 1, 9)]
    _check(monkeypatch, str(folder), prompts, BASE["vocab_size"], "mtp.0.mlp")

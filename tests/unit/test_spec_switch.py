"""The acceptance switch of speculative decoding (engine/spec_switch.py): a request whose drafts fail
stops drafting after a few verifications and probes again every speculative_probe_interval steps; a
request whose drafts are right keeps drafting; one whose drafts turn good again resumes. Greedy output
is plain greedy throughout, and the route ledger, its summary and /metrics show every decision."""

from __future__ import annotations

import pytest
from hf_models import random_ids
from mtp_models import mtp_model_folder

import mlaserve.engine.speculative as spec
from mlaserve import LLM
from mlaserve.config.model import ConfigError
from mlaserve.sampling.params import SamplingParams

NEW = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
PROMPTS = [random_ids(n, seed=n) for n in (7, 19)]
PROBE = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(folder of a tiny deepseek_v3 with a random MTP layer, plain greedy outputs of PROMPTS)."""
    folder, _ = mtp_model_folder("v3_yarn", tmp_path_factory)
    plain = [o.outputs[0].token_ids for o in LLM(str(folder)).generate(PROMPTS, GREEDY)]
    return folder, plain


def _drafter(monkeypatch, plain: list[list[int]], right) -> dict:
    """After the real MTP pass (which keeps the switch's decisions: no drafts stay no drafts), propose the
    reference's next tokens where right(n) (n = tokens generated so far), a wrong token elsewhere.
    -> prompt tuple -> {n: drafts proposed at n} (what each step proposed, for the test to read)."""
    reference = {tuple(p): o for p, o in zip(PROMPTS, plain)}
    seen: dict = {}
    real = spec.draft

    def draft(engine, plan, batch, hidden, accepted):
        real(engine, plan, batch, hidden, accepted)
        for c in plan.chunks:
            req = c.request
            n, ref = len(req.output_ids), reference[tuple(req.prompt_ids)] + [3] * 8
            truth = ref[n : n + len(req.draft_ids)]
            req.draft_ids = [t if right(n) else (t + 1) % 256 for t in truth]
            if req.draft_ids:
                seen.setdefault(tuple(req.prompt_ids), {})[n] = list(req.draft_ids)

    monkeypatch.setattr(spec, "draft", draft)
    return seen


def _switch(llm) -> list[dict]:
    return [r for r in llm.runner.tracer.records if r.get("spec_phase") == "switch"]


def _decisions(llm, i: int) -> list[dict]:
    """The switch's decisions for the i-th request of the run (ledger ids are the engine's own)."""
    ids = list(dict.fromkeys(e["id"] for r in _switch(llm) for e in r["requests"]))
    return [e for r in _switch(llm) for e in r["requests"] if e["id"] == ids[i]]


def _run(folder, k: int, **opts):
    llm = LLM(str(folder), speculative="mtp", num_speculative_tokens=k, trace="memory", **opts)
    return llm, llm.generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("k", [1, 2])
def test_useless_drafts_pause_and_probe(model, k):
    """The random MTP layer's drafts are (nearly) never accepted: drafting stops after two steps, then
    probes come ever further apart; the output is plain greedy."""
    folder, plain = model
    llm, outs = _run(folder, k, speculative_probe_interval=PROBE)
    assert [o.outputs[0].token_ids for o in outs] == plain
    for i, o in enumerate(outs):
        d = _decisions(llm, i)
        kinds = [e["decision"] for e in d]
        first_pause = kinds.index("paused")
        assert 2 <= first_pause <= 5  # after two failed verifications, or a few when a draft is lucky
        assert d[first_pause].get("change") == "paused"  # this step's verdict flipped it, then it decided
        after = kinds[first_pause:]
        assert after.count("on") == 0 and after.count("probe") >= 3
        # a probe after PROBE steps, then after twice as many each time it fails (up to 8x)
        probes = [i for i, kind in enumerate(kinds) if kind == "probe"]
        gaps = [b - a for a, b in zip([first_pause - 1, *probes], probes)]
        assert gaps == [min(PROBE * 2**j, 8 * PROBE) for j in range(len(gaps))]
        assert "speculation paused: acceptance" in d[first_pause]["reason"]
        assert d[first_pause]["acceptance"] < 0.45
        m = o.metrics
        assert m["num_spec_paused_steps"] == after.count("paused") and m["num_spec_probes"] == after.count("probe")
        # drafts were verified only before the pause and at probes (the last decision's drafts may be
        # cut by max_tokens)
        drafted = kinds.count("on") + kinds.count("probe")
        assert drafted - 1 <= m["num_verify_steps"] <= drafted


def test_switch_rule():
    """The rule itself: a mean-like start, the pause, doubling waits between failed probes, a resume."""
    from mlaserve.engine.spec_switch import SpeculationSwitch

    sw = SpeculationSwitch(min_acceptance=0.45, probe_interval=3, weight=0.2)
    st = sw.new_state()
    assert sw.decide(st).kind == "on"
    assert sw.observe(st, 1, 0) is None and st.acceptance == 0.5  # (1.0 + 0) / 2
    assert sw.observe(st, 1, 0) == "paused" and abs(st.acceptance - 1 / 3) < 1e-12
    kinds = []
    for _ in range(3 + 6 + 12 + 24 + 24):
        d = sw.decide(st)
        kinds.append(d.kind)
        if d.draft:
            assert sw.observe(st, 2, 0) is None  # a failed probe
    probes = [i for i, kind in enumerate(kinds) if kind == "probe"]
    assert probes == [2, 8, 20, 44, 68]  # waits 3, 6, 12, 24, 24 (capped at 8x)
    assert "speculation paused: acceptance 0." in sw.decide(st).reason
    while sw.decide(st).kind != "probe":
        pass
    while sw.observe(st, 2, 2) != "resumed":  # good probes raise the average until it resumes
        while sw.decide(st).kind != "probe":
            pass
    assert st.acceptance >= 0.45 and sw.decide(st).kind == "on" and st.num_resumes == 1
    while sw.observe(st, 2, 0) != "paused":
        pass
    assert st.wait == 3 and st.num_pauses == 2  # a new pause waits the interval again
    off = SpeculationSwitch(min_acceptance=0.0, probe_interval=3, weight=0.2)
    st = off.new_state()
    for _ in range(10):
        assert off.observe(st, 1, 0) is None and off.decide(st).kind == "switch off"


def test_switch_off_drafts_every_step(model):
    folder, plain = model
    llm, outs = _run(folder, 1, speculative_min_acceptance=0)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert {e["decision"] for r in _switch(llm) for e in r["requests"]} == {"switch off"}
    assert all("num_spec_paused_steps" not in o.metrics for o in outs)


def test_perfect_drafter_stays_on(model, monkeypatch):
    folder, plain = model
    _drafter(monkeypatch, plain, right=lambda n: True)
    llm, outs = _run(folder, 2, speculative_probe_interval=PROBE)
    assert [o.outputs[0].token_ids for o in outs] == plain
    entries = [e for r in _switch(llm) for e in r["requests"]]
    assert entries and {e["decision"] for e in entries} == {"on"} and min(e["acceptance"] for e in entries) == 1.0
    assert all(o.metrics["acceptance_rate"] == 1.0 for o in outs)


def test_recovering_drafter_resumes(model, monkeypatch):
    """Wrong for the first 12 tokens, right afterwards: paused, then a probe is accepted and drafting
    comes back on for good."""
    folder, plain = model
    _drafter(monkeypatch, plain, right=lambda n: n >= 12)
    llm, outs = _run(folder, 1, speculative_probe_interval=PROBE)
    assert [o.outputs[0].token_ids for o in outs] == plain
    for i, o in enumerate(outs):
        d = _decisions(llm, i)
        kinds = [e["decision"] for e in d]
        assert "paused" in kinds and "probe" in kinds
        resumed = [i for i, e in enumerate(d) if e.get("change") == "resumed"]
        assert len(resumed) == 1 and d[resumed[0]]["decision"] == "on"
        assert set(kinds[resumed[0] :]) == {"on"}
        assert o.metrics["acceptance_rate"] > 0.5


def test_probe_drafts_from_caught_up_mtp_rows(model, monkeypatch):
    """A paused request's MTP rows are written at its next pass (from the kept hidden states), so a
    probe proposes what uninterrupted speculation proposes at that position."""
    folder, plain = model
    seen = {}
    real = spec.draft

    def record(engine, plan, batch, hidden, accepted):
        real(engine, plan, batch, hidden, accepted)
        for c in plan.chunks:
            if c.request.draft_ids:
                seen[(engine.cfg.speculative.min_acceptance, len(c.request.output_ids))] = list(c.request.draft_ids)

    monkeypatch.setattr(spec, "draft", record)
    llm = LLM(str(folder), speculative="mtp", trace="memory", speculative_probe_interval=PROBE)
    out = llm.generate(PROMPTS[:1], GREEDY)[0]
    always = LLM(str(folder), speculative="mtp", speculative_min_acceptance=0).generate(PROMPTS[:1], GREEDY)[0]
    assert out.outputs[0].token_ids == always.outputs[0].token_ids == plain[0]
    on = {n for t, n in seen if t > 0}
    every = {n for t, n in seen if t == 0}
    probes = {n for n in on if n - 1 not in on and n > min(on)}  # drafting again after a pause
    assert on < every and len(probes) >= 2
    assert all(seen[(0.45, n)] == seen[(0.0, n)] for n in on)


def test_ledger_summary_and_metrics_count_the_switch(model, tmp_path):
    from mlaserve.observability.metrics import ServerMetrics
    from mlaserve.observability.summary import format_summary, read_ledger, summarize

    folder, _ = model
    path = tmp_path / "ledger.jsonl"
    llm = LLM(str(folder), speculative="mtp", speculative_probe_interval=PROBE, trace=str(path))
    llm.generate(PROMPTS, GREEDY)
    llm.runner.tracer.close()
    recs = read_ledger(path)
    entries = [e for r in recs if r["spec_phase"] == "switch" for e in r["requests"]]
    (s,) = summarize(recs).values()
    sw = s.to_json()["speculative"]["switch"]
    assert sw["paused"] == sum(e["decision"] == "paused" for e in entries) > 0
    assert sw["probe"] == sum(e["decision"] == "probe" for e in entries) > 0
    assert sw["pauses"] == len(PROMPTS) and sw["on"] > 0
    assert s.steps == sum(r["spec_phase"] in ("target", "verify") for r in recs)  # decisions are not steps
    assert f"{sw['paused']} paused" in format_summary({None: s})
    metrics = ServerMetrics()
    for rec in recs:
        metrics.on_route(rec)
    text = metrics.render().decode()
    assert f'mlaserve_spec_switch_decisions_total{{decision="paused"}} {float(sw["paused"])}' in text
    assert f"mlaserve_spec_pauses_total {float(len(PROMPTS))}" in text


def test_switch_options_and_provenance(model):
    folder, _ = model
    llm = LLM(str(folder), speculative="mtp", speculative_min_acceptance=0.6)
    why = {s.name: (s.value, s.source) for s in llm.config.provenance}
    assert why["speculative_min_acceptance"] == (0.6, "user option")
    assert why["speculative_probe_interval"] == (16, "engine default (16)")
    assert llm.config.speculative.acceptance_weight == 0.2
    with pytest.raises(ConfigError, match="speculative is None"):
        LLM(str(folder), speculative_probe_interval=3)
    for bad in (
        {"speculative_min_acceptance": 1.5},
        {"speculative_acceptance_weight": 0},
        {"speculative_probe_interval": 0},
    ):
        with pytest.raises(ConfigError):
            LLM(str(folder), speculative="mtp", **bad)


def test_cli_flags_parse_floats():
    import argparse

    from mlaserve.entrypoints.engine_args import add_engine_args, engine_options

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(
        ["--speculative", "mtp", "--speculative-min-acceptance", "0.3", "--speculative-probe-interval", "8"]
    )
    opts = engine_options(args)
    assert opts["speculative_min_acceptance"] == 0.3 and opts["speculative_probe_interval"] == 8

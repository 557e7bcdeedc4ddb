"""The route ledger summary of scripted scenarios has exactly the counts the scenario implies."""

from __future__ import annotations

import json

import pytest
from conftest import fixture_dir
from engine_drain import drain

from mlaserve import LLM
from mlaserve.entrypoints.cli import main
from mlaserve.observability.summary import format_summary, read_ledger, summarize
from mlaserve.sampling.params import SamplingParams

P20 = list(range(100, 120))  # 20 tokens: one full page of 16 (the prefix cache's unit) and 4 more


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(llm: LLM, script: list[list[tuple[list[int], int]]]) -> dict:
    """script: per phase, requests (prompt, max_tokens) added together, run until the engine is idle
    (a phase of None steps once without adding)."""
    engine = llm.engine
    for phase in script:
        for prompt, n in phase:
            engine.add_request(prompt, params(n))
        engine.step()
    drain(engine)
    return summarize(llm.runner.tracer.records)[None].to_json()


def route(s: dict) -> dict:
    return {(r["phase"], r["path"], r["mode"]): r["tokens"] for r in s["tokens_by_route"]}


def test_dense_one_token_multi_token_mixed_and_prefix_hit():
    llm = LLM(str(fixture_dir("ds3")), trace="memory")
    engine = llm.engine
    # step 0: a one-token prompt is a decode (absorbed); it is done after its one token
    engine.add_request([5], params(1))
    engine.step()
    # steps 1-2: a 20-token prompt: prefill (decompressed), then one decode
    engine.add_request(P20, params(2))
    engine.step()
    engine.step()
    # step 3: C's prompt (10); step 4: C decodes while D (P20 again) prefills its last 4 tokens after a
    # prefix-cache hit of 16: a mixed step; step 5: both decode and finish
    engine.add_request(list(range(200, 210)), params(3))
    engine.step()
    engine.add_request(P20, params(2))
    drain(engine)
    s = summarize(llm.runner.tracer.records)[None].to_json()
    assert (s["steps"], s["requests"], s["tokens"], s["decode_tokens"]) == (6, 4, 39, 5)
    assert route(s) == {("decode", "absorbed", "dense"): 5, ("prefill", "decompressed", "dense"): 34}
    assert (s["prefix_cache_hits"], s["prefix_cache_tokens"], s["preemptions"]) == (1, 16, 0)
    assert s["effective_topk"] == {}
    mixed = list(llm.runner.tracer.records)[4]
    assert [seg["phase"] for seg in mixed["segments"]] == ["decode", "prefill"]


def test_dsa_past_index_topk_and_within_it():
    llm = LLM(str(fixture_dir("ds32")), trace="memory")  # index_topk 16
    # steps 0-2: 20 tokens > 16: the prefill and both decodes select their top-16 (all absorbed: DSA)
    # steps 3-4: 5 tokens, then 6: every row fits in index_topk, no selection
    s = run(llm, [[(P20, 3)], [], [], [(list(range(300, 305)), 2)]])
    assert s["steps"] == 5 and s["tokens"] == 28
    assert route(s) == {
        ("decode", "absorbed", "sparse top-k"): 2,
        ("prefill", "absorbed", "sparse top-k"): 20,
        ("decode", "absorbed", "sparse all rows"): 1,
        ("prefill", "absorbed", "sparse all rows"): 5,
    }
    assert s["effective_topk"] == {"16": 3, "5": 1, "6": 1}


def test_dsa_model_with_attention_forced_dense():
    with pytest.warns(UserWarning, match="the indexer is skipped"):
        llm = LLM(str(fixture_dir("ds32")), trace="memory", attention="dense")
    s = run(llm, [[(P20, 2)]])
    assert route(s) == {("prefill", "decompressed", "dense"): 20, ("decode", "absorbed", "dense"): 1}
    assert s["effective_topk"] == {} and s["steps"] == 2


def test_preemption_counted_once_with_its_pages():
    # 4 pages of 4 tokens: two 6-token prompts take 2 pages each; at their 9th token A needs a third page
    # and B (newer) is preempted (2 pages freed); B is recomputed (9 tokens) after A finishes.
    llm = LLM(str(fixture_dir("ds3")), trace="memory", page_size=4, num_pages=4, enable_prefix_caching=False)
    s = run(llm, [[(list(range(10, 16)), 5), (list(range(20, 26)), 5)]])
    assert (s["preemptions"], s["preempted_pages"], s["steps"]) == (1, 2, 7)
    assert route(s) == {("prefill", "decompressed", "dense"): 21, ("decode", "absorbed", "dense"): 7}
    preempting = [r["step"] for r in llm.runner.tracer.records if r["preempted"]]
    assert preempting == [3]


def test_per_rank_and_bad_files(tmp_path):
    rec = {"num_decode_tokens": 1, "sparse": False, "needs_selection": False, "requests": [], "preempted": []}
    seg = {"phase": "decode", "path": "absorbed", "num_tokens": 1, "backend": "torch"}
    path = tmp_path / "ledger.jsonl"
    path.write_text("".join(json.dumps({**rec, "rank": r, "segments": [seg]}) + "\n" for r in (1, 0, 1)))
    by_rank = summarize(read_ledger(path))
    assert list(by_rank) == [0, 1] and by_rank[1].steps == 2
    assert "route ledger, rank 1:" in format_summary(by_rank)
    path.write_text(json.dumps({**rec, "segments": []}) + "\nnot json\n")
    with pytest.raises(ValueError, match="ledger.jsonl: record 2"):
        read_ledger(path)


def test_generate_trace_ends_with_the_summary_and_trace_summarize(tmp_path, capsys):
    ledger = tmp_path / "run.jsonl"
    ledger.write_text("")
    args = ["generate", "Hello there", "--model", str(fixture_dir("ds3")), "--max-tokens", "2"]
    for _ in range(2):  # the file is appended to; each run's table covers its own steps
        assert main([*args, "--trace", str(ledger), "--temperature", "0"]) == 0
        err = capsys.readouterr().err
        assert "route ledger:\n  steps 2, requests 1" in err
    assert main(["trace", "summarize", str(ledger)]) == 0
    assert "steps 4, requests 1" in capsys.readouterr().out  # both runs' request is id "0"
    assert main(["trace", "summarize", str(ledger), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["summary"]
    assert (s["steps"], s["tokens_by_route"][0]["mode"], s["preemptions"]) == (4, "dense", 0)

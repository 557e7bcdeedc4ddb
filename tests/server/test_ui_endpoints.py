"""The web page's server side: the static files at / (engine option ui; off with ui=False), public under an
API key while every data endpoint stays keyed, and the JSON its configuration view reads
(/debug/provenance, /debug/kernels, /debug/verify), each checked against an independent source: the
checkpoint's config.json read here, the kernel plan digest the ledger records carry, verify's own checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from mlaserve.entrypoints.llm import LLM
from mlaserve.entrypoints.openai.server import build_server, route_tap
from mlaserve.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def llm():
    llm = LLM(index_topk=32)  # a user override of a checkpoint key: the provenance view must mark it
    llm.runner.tracer = route_tap(None)
    return llm


def _client(llm, **kw) -> TestClient:
    app, _, _ = build_server(llm, "tiny", 8, **kw)
    return TestClient(app)


def test_the_page_is_served_at_root_and_not_with_ui_off(llm):
    assert llm.config.server.ui is True  # the default
    row = next(s for s in llm.config.all_provenance() if s.name == "ui")
    assert (row.value, row.source) == (True, "engine default (True)")
    client = _client(llm)
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/ui/app.js"' in page.text and 'href="/ui/style.css"' in page.text
    assert client.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/ui/style.css").headers["content-type"].startswith("text/css")
    assert client.get("/ui/../app.py").status_code == 404  # only the listed files
    assert "/" not in client.get("/openapi.json").json()["paths"]  # the page is not part of the API

    off = LLM(ui=False)
    assert next(s for s in off.config.all_provenance() if s.name == "ui").source == "user option"
    assert _client(off).get("/").status_code == 404


def test_the_page_files_are_public_under_a_key_and_the_data_is_not(llm):
    client = _client(llm, api_key="k", debug_endpoints=True)
    for path in ("/", "/ui/app.js", "/ui/style.css", "/ui/server.json"):
        assert client.get(path).status_code == 200, path
    # all the page learns without the key: that it needs one, and whether the debug endpoints are on
    assert client.get("/ui/server.json").json() == {"api_key": True, "debug_endpoints": True}
    assert _client(llm).get("/ui/server.json").json() == {"api_key": False, "debug_endpoints": False}
    for path in ("/v1/models", "/debug/routes", "/debug/provenance", "/debug/kernels", "/debug/verify"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"Authorization": "Bearer k"}).status_code == 200, path
    # without the page, "/" is not an open path: a keyed server answers 401 there, as for any unknown path
    app, _, _ = build_server(llm, "tiny", 8, api_key="k", ui=False)
    assert TestClient(app).get("/").status_code == 401


def test_provenance_lists_every_setting_and_marks_what_differs_from_config_json(llm):
    client = _client(llm, debug_endpoints=True)
    assert client.get("/debug/provenance").status_code == 200
    out = client.get("/debug/provenance").json()
    rows = {r["name"]: r for r in out["settings"]}
    assert list(rows) == [s.name for s in llm.config.all_provenance()]  # every setting, in inspect's order
    assert out["compared_with"] == "config.json"
    # the checkpoint's config.json, read here, is the reference for "differs"
    raw = json.loads((Path(str(llm.loaded.path)) / "config.json").read_text())
    assert raw["index_topk"] == 64
    assert rows["index_topk"] == {
        "name": "index_topk",
        "value": 32,
        "source": "user option",
        "checkpoint": 64,
        "differs": True,
    }
    assert rows["is_sparse"]["value"] is True and "indexer weights" in rows["is_sparse"]["source"]
    assert "checkpoint" not in rows["is_sparse"]  # not a config.json key: nothing to compare
    for name in ("kv_lora_rank", "hidden_size", "num_hidden_layers"):
        assert rows[name]["checkpoint"] == raw[name] == rows[name]["value"] and rows[name]["differs"] is False
    # read from the key itself, in the engine's words ("sparse" MLP layers are "moe"): shown, never marked
    assert rows["mlp_layer_types"]["checkpoint"] == raw["mlp_layer_types"] != rows["mlp_layer_types"]["value"]
    assert rows["mlp_layer_types"]["differs"] is False
    assert [r["name"] for r in out["settings"] if r.get("differs")] == ["index_topk"]


def test_provenance_of_a_checkpoint_without_config_json_says_why_nothing_is_compared(tmp_path):
    from mlaserve.entrypoints.openai.debug_views import checkpoint_config, provenance_rows

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    config, why = checkpoint_config(gguf)
    assert config is None and "m.gguf has no config.json" in why
    (tmp_path / "config.json").write_text("[1, 2]")
    assert checkpoint_config(tmp_path) == (None, "config.json is not a JSON object")
    assert all("differs" not in r for r in provenance_rows(LLM().config.all_provenance(), None))


def test_kernels_are_the_plan_the_ledger_names(llm):
    client = _client(llm, debug_endpoints=True)
    plan = client.get("/debug/kernels").json()
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1))
    record = llm.runner.tracer.ring.records[-1]
    assert plan["digest"] == record["kernels"]["plan"]  # the digest every step record carries
    ops = {c.op for c in llm.loaded.kernel_plan.choices}
    assert {r["op"] for r in plan["rows"]} == ops and all(r["reason"] for r in plan["rows"])


def test_verify_results_are_the_checks_run_before_serving(llm):
    from mlaserve.entrypoints.verify import run_checks

    assert _client(llm, debug_endpoints=True).get("/debug/verify").json() == {
        "ran": False,
        "why": "the server was started without --verify",
        "checks": [],
    }
    checks = run_checks(llm, llm.encode("The quick brown fox jumps over the lazy dog. " * 2))
    out = _client(llm, debug_endpoints=True, verify=checks).get("/debug/verify").json()
    assert out["ran"] is True and out["passed"] is True
    assert [c["name"] for c in out["checks"]] == [c.name for c in checks]
    assert [c["max_abs_diff"] for c in out["checks"]] == [c.max_abs_diff for c in checks]


def test_debug_routes_hands_a_poller_only_the_records_it_has_not_seen(llm):
    client = _client(llm, debug_endpoints=True)
    first = client.get("/debug/routes", params={"last": 500}).json()
    ring = llm.runner.tracer.ring
    assert first["next"] == ring.total and first["records"] == list(ring.records)[-500:]
    llm.generate([[9, 8, 7, 6]], SamplingParams(max_tokens=3, temperature=0))
    new = client.get("/debug/routes", params={"last": 500, "since": first["next"]}).json()
    assert [r["step"] for r in new["records"]] == [r["step"] for r in list(ring.records)[-3:]]  # 1 prefill + 2 decodes
    assert new["next"] == first["next"] + 3
    assert client.get("/debug/routes", params={"since": new["next"]}).json() == {"records": [], "next": new["next"]}


def test_the_memory_ring_numbers_its_records():
    from mlaserve.observability.trace import MemoryTracer

    ring = MemoryTracer(maxlen=3)
    for i in range(5):
        ring.record({"i": i})
    assert ring.since(0) == ([{"i": 2}, {"i": 3}, {"i": 4}], 5)  # 0 and 1 fell out of the ring
    assert ring.since(4) == ([{"i": 4}], 5) and ring.since(5) == ([], 5) and ring.since(9) == ([], 5)


def test_the_ready_line_is_followed_by_where_the_page_is(capsys):
    from mlaserve.entrypoints.openai.server import _with_page_line

    for debug, hint in ((True, False), (False, True)):
        _with_page_line(lambda host, port: print(f"mlaserve: serving tiny on http://{host}:{port}"), debug)(
            "127.0.0.1", 8000
        )
        ready, page = capsys.readouterr().out.splitlines()
        assert ready.startswith("mlaserve: serving tiny") and page.startswith(
            "mlaserve: web page at http://127.0.0.1:8000/"
        )
        assert ("need --enable-debug-endpoints" in page) == hint and "--no-ui" in page


def test_a_tracer_swapped_in_after_load_gets_the_mtp_drafts_too():
    # `serve` replaces the runner's tracer with its RouteTap after the load; the drafter held the old one,
    # so /debug/routes (the page's acceptance view) and the MTP metrics never saw a `draft` record
    spec = LLM(speculative="mtp", num_speculative_tokens=2)
    spec.runner.tracer = route_tap(None)
    app, _, serving = build_server(spec, "tiny", 8, debug_endpoints=True)
    spec.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0))
    records = TestClient(app).get("/debug/routes", params={"last": 100}).json()["records"]
    phases = {r.get("spec_phase") for r in records}
    assert {"target", "verify", "accept", "draft"} <= phases, phases
    mtp = serving.metrics.registry.get_sample_value("mlaserve_spec_mtp_tokens_total")
    assert mtp == sum(r["num_tokens"] for r in records if r.get("spec_phase") == "draft") > 0

"""DeepSeek-V4 through `mlaserve generate`, `mlaserve inspect` and `mlaserve serve` on a folder written by transformers'
save_pretrained (a tiny random model with every layer kind, vocabulary 4096 to take the embedded model's
tokenizer), plus the ledger's per-kind rows and the cache's bytes, each checked against an independent count:
the rows the model's indexer actually selected, the bytes the cache actually allocated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from v4_models import build_hf_v4, hf_v4_logits  # noqa: E402

from mlaserve.cache.model_cache import ModelCache  # noqa: E402
from mlaserve.config.layer_kinds import describe  # noqa: E402
from mlaserve.entrypoints.cli import main  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.models.deepseek_v4.attention import V4Attention  # noqa: E402
from mlaserve.models.deepseek_v4.step_keys import PAD  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

EMBEDDED = Path(__file__).resolve().parents[2] / "mlaserve" / "embedded" / "tiny-dsa"


@pytest.fixture(scope="module")
def v4_folder(tmp_path_factory):
    hf = build_hf_v4("all_kinds", seed=3, vocab_size=4096)
    folder = tmp_path_factory.mktemp("v4_serving")
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, folder / name)
    return hf, folder


def test_generate_and_inspect_cli(v4_folder, tmp_path, capsys):
    hf, folder = v4_folder
    trace = tmp_path / "trace.jsonl"
    assert main(["generate", "--model", str(folder), "--max-tokens", "6", "--trace", str(trace), "Hello"]) == 0
    recs = [json.loads(line) for line in trace.read_text().splitlines()]
    kinds = {k["kind"]: k for r in recs for k in r["kinds"]}
    assert set(kinds) == {"v4_sliding", "v4_csa", "v4_hca"} and all("rows" in k for k in kinds.values())
    capsys.readouterr()
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "layers 0: sliding (sliding window 6; from layer_types)" in out  # the config's kinds and their key
    assert "layers 1, 3: v4_csa; cache: window [6 x 24] per request (snapshots at page boundaries)" in out
    assert "kv_pool [24] per 4 tokens" in out and "kv_carry [2 x 4 x 48] per request (empty at page boundaries)" in out
    # the page size the family chose, and why; prefix caching on (every request state restorable at a page)
    page = next(line for line in out.splitlines() if line.startswith("page_size"))
    assert " 256 " in page and "family default (DeepSeek-V4)" in page
    assert "no page-boundary snapshot" not in out


def test_serve_completions_equal_llm_generate(v4_folder):
    from inproc_server import InProcServer

    hf, folder = v4_folder
    llm = LLM(str(folder))
    ids = llm.encode("The quick brown fox")
    want = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    # and that greedy continuation is transformers' (full recompute), token for token up to where it stopped
    seq = list(ids)
    for _ in want.token_ids:
        seq.append(int(hf_v4_logits(hf, seq)[-1].argmax()))
    assert list(want.token_ids) == seq[len(ids) :]
    server = InProcServer(LLM(str(folder)), served="v4")
    try:
        r = server.post("/v1/completions", json={"model": "v4", "prompt": ids, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == want.text
        assert body["usage"]["completion_tokens"] == len(want.token_ids)
    finally:
        server.stop()


def test_ledger_rows_are_what_the_model_attended(v4_folder, monkeypatch):
    """The ledger's CSA rows (effective top-k per request) == the compressed rows the attention's mask let the
    chunk's last query see, counted inside the model (the indexer's choice where its top-k chooses, every visible
    row where they fit); window rows and carry fill from the positions."""
    hf, folder = v4_folder
    selected: list[int] = []
    real = V4Attention._step_keys  # every sequence's keys and mask for the step (one sequence here)

    def spy(self, step, *args, **kwargs):
        keys, mask = real(self, step, *args, **kwargs)  # [1, S, K]: the chunk's last query is the last row
        if self.kind == "csa":
            pool = step.keys.layers[self.ratio].pool_row[0] != PAD  # the compressed rows' columns
            selected.append(int((mask[0, -1] & pool).sum()))
        return keys, mask

    monkeypatch.setattr(V4Attention, "_step_keys", spy)
    llm = LLM(str(folder), max_num_batched_tokens=7, trace="memory")
    ids = [0] + list(range(5, 23))  # 19 tokens: chunks 7 + 7 + 5, windows close inside every chunk
    llm.prompt_logits(ids)
    recs = list(llm.runner.tracer.records)
    csa_layers = 2  # layers 1 and 3
    assert len(selected) == len(recs) * csa_layers
    for i, rec in enumerate(recs):
        rows = {k["kind"]: k["rows"] for k in rec["kinds"]}
        req = rows["v4_csa"]["requests"][0]
        assert req["selected_rows"] == selected[i * csa_layers] == selected[i * csa_layers + 1]
        seq_len = rec["requests"][0]["context_len"] + rec["requests"][0]["query_len"]
        assert req["carry_fill"] == seq_len % 4 and rows["v4_hca"]["requests"][0]["carry_fill"] == seq_len % 8
        assert rows["v4_sliding"]["requests"][0]["window_rows"] == min(seq_len, 6)
    assert selected[-1] == 3  # 19 tokens: 4 CSA rows visible, index_topk 3 kept


def test_bytes_per_request_are_the_allocated_bytes(v4_folder):
    hf, folder = v4_folder
    llm = LLM(str(folder), max_num_seqs=3)
    cache, kinds, dtype = llm.runner.cache, llm.runner.layer_kinds, llm.config.runtime.dtype
    ps = llm.config.cache.page_size
    declared = ModelCache.bytes_per_request(kinds, dtype)
    assert cache.num_slots == 3 and cache.measured_bytes_per_request() == declared > 0
    lines = describe(kinds, 4, ps)
    shown = sum(int(line.split(", ")[-1].split(" bytes/request")[0]) for line in lines)
    assert shown == declared
    # the compressed pools are paged: one row per m tokens of every page, memory per cached token
    pages = llm.config.cache.num_pages
    assert cache.layers[1].tensors["kv_pool"].shape == (pages * ps // 4 + 1, 24)  # + the pad row
    assert cache.layers[2].tensors["kv_pool"].shape == (pages * ps // 8 + 1, 24)
    assert cache.layers[1].tensors["index_pool"].shape == (pages * ps // 4 + 1, 16)
    # bytes per token: CSA (24 + 16) / 4 x 4 bytes x 2 layers, HCA 24 / 8 x 4 bytes: counted by hand
    assert ModelCache.bytes_per_token(kinds, dtype) == 80 + 12
    # snapshots, one per page: rings [6 x 24] x 4 layers, overlap halves [2 x 4 x (24 + 16)] x 2 CSA layers
    snap = (4 * 6 * 24 + 2 * 2 * 4 * 40) * 4 / ps
    assert ModelCache.snapshot_bytes_per_token(kinds, dtype, ps) == snap
    assert cache.measured_bytes_per_token() == int(92 + snap)  # what was allocated, the pad rows left out
    per_token = [float(line.split("(")[-1].split(" bytes/token")[0]) for line in lines]
    snaps = [float(line.split(" + ")[-1].split(" bytes/token of snapshots")[0]) for line in lines]
    assert sum(per_token) == 92 and sum(snaps) == snap
    assert torch.count_nonzero(cache.layers[0].tensors["window"]) == 0


def test_verify_runs_the_v4_identities_only(v4_folder, capsys):
    """`mlaserve verify` on V4: chunked prefill and token-by-token decode vs one pass (both must hold); the MLA
    path and backend pairs, which cannot differ on a stack without latent rows, are not listed as passes."""
    hf, folder = v4_folder
    assert main(["verify", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "chunked prefill (7) vs one pass" in out and "token-by-token decode vs one pass" in out
    assert "absorbed" not in out and "reference backend" not in out


def test_the_ready_line_reports_v4_state_bytes(v4_folder):
    from mlaserve.entrypoints.openai.server import _ready

    hf, folder = v4_folder
    llm = LLM(str(folder), max_num_seqs=2)
    line = _ready(llm, "v4", "127.0.0.1", 8000)
    per_request = llm.runner.cache.measured_bytes_per_request()
    per_token = llm.runner.cache.measured_bytes_per_token()  # the paged pools and the snapshots
    assert "attention window + compressed (DeepSeek-V4)" in line and f"({per_token} bytes/token)" in line
    assert f"state slots 2 x {per_request} bytes/request" in line and per_request > 0

"""A request the engine fails (finish_reason "error") is a 500 for that request only.

The fault is real, not mocked: a copy of the embedded model with untied output weights whose
input-embedding row of one token is NaN (loaded without check_tensors). A prompt holding that
token gets non-finite logits, which the engine fails (that request alone); every other request,
concurrent ones included, is served as before.
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from safetensors.torch import load_file, save_file
from server_process import ServerProcess

from mlaserve.embedded import default_model_path

POISON = 7  # token id whose embedding row is NaN


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nan-row-model")
    src = default_model_path()
    for f in src.iterdir():
        shutil.copy(f, folder / f.name)
    weights = load_file(str(src / "model.safetensors"))
    emb = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = emb.clone()  # untied, so the NaN row does not reach every logit
    weights["model.embed_tokens.weight"] = emb.clone()
    weights["model.embed_tokens.weight"][POISON] = float("nan")
    save_file(weights, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=False)))
    srv = ServerProcess(str(folder), "--served-model-name", "nan-row")
    yield srv
    assert srv.stop() == 0, srv.logs()


def test_engine_failure_is_a_500_for_that_request_only(server):
    good = {"model": "nan-row", "prompt": [0, 30, 40, 50], "max_tokens": 6, "temperature": 0}
    bad = dict(good, prompt=[0, 30, POISON, 50])
    alone = server.post("/v1/completions", json=good).json()["choices"][0]["text"]
    results: dict[str, object] = {}

    def call(name, body):
        results[name] = server.post("/v1/completions", json=body)

    threads = [threading.Thread(target=call, args=(n, b)) for n, b in (("good", good), ("bad", bad))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["bad"].status_code == 500
    err = results["bad"].json()["error"]
    assert err["type"] == "server_error" and "non-finite logits" in err["message"]
    assert results["good"].status_code == 200 and results["good"].json()["choices"][0]["text"] == alone
    stream = server.post("/v1/completions", json=dict(bad, stream=True))  # headers went out: an error event
    assert stream.status_code == 200 and '"server_error"' in stream.text and stream.text.endswith("data: [DONE]\n\n")
    assert server.get("/health").status_code == 200 and server.wait_idle() == 0
    assert "failed in the engine" in server.logs()

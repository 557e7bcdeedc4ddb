"""Issue item "one request's NaN never reaches another", over HTTP: the embedded model with +inf in token
BAD's embedding row, served. The bad prompt's request fails alone (500 when it was the only choice; a 200
whose failed choice says "error" when it shared a request with good prompts), and the healthy requests
sent after it get 200 with exactly the tokens they got before the model was poisoned (greedy, so their
text and token ids must be equal, not close). The proof that no backend or path lets the NaN through is
tests/identities/test_nan_isolation.py (engine level, every backend and path); this is the HTTP contract
around it, which the issue saw broken as 500s for the healthy requests after the bad one. It fails when a
request with one failed choice is a 500 (checked by breaking `raise_if_all_failed`); breaking the pad row
and the finite-operand guard alone did not make it fail on this small model, so it is not that proof."""

from __future__ import annotations

import pytest
import torch
from inproc_server import InProcServer

from mlaserve.entrypoints.llm import LLM

BAD = 250
HEALTHY = [[7, 3, 9, 4, 5, 6, 1, 2, 8, 3, 4, 5], [42], [5, 6, 7, 8, 9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def server():
    srv = InProcServer(LLM(page_size=4))  # small pages: the bad request's freed pages are reused at once
    yield srv
    srv.stop()


def _greedy(server, prompts) -> list:
    r = server.post(
        "/v1/completions",
        json={"prompt": prompts, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0},
    )
    assert r.status_code == 200, r.text[:300]
    return [(c["text"], c["logprobs"]["tokens"], c["finish_reason"]) for c in sorted(r.json()["choices"], key=lambda c: c["index"])]  # fmt: skip


def test_a_poisoned_request_fails_alone_and_leaves_nothing_behind(server):
    before = [_greedy(server, [p]) for p in HEALTHY] + [_greedy(server, HEALTHY)]
    # The engine is idle between requests, so the weight can change now. The embedded model ties its output
    # head to the embedding: a copy first, or the inf row would be token BAD's logit for every request
    # (a model broken for everyone, not one request's NaN).
    embed = server.serving.llm.runner.model.model.embed_tokens
    embed.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
    embed.weight.data[BAD] = float("inf")
    bad = [3, 1, 4, 1, 5, 9, BAD, 6, 5, 3, 5, 8]
    alone = server.post("/v1/completions", json={"prompt": bad, "max_tokens": 4, "temperature": 0})
    assert alone.status_code == 500 and "non-finite" in alone.json()["error"]["message"], alone.text[:300]
    mixed = server.post("/v1/completions", json={"prompt": [bad, *HEALTHY], "max_tokens": 6, "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert mixed.status_code == 200, mixed.text[:300]
    choices = sorted(mixed.json()["choices"], key=lambda c: c["index"])
    assert choices[0]["finish_reason"] == "error" and "non-finite" in choices[0]["error"]["message"]
    assert [c["text"] for c in choices[1:]] == [b[0][0] for b in before[:-1]]  # the others, as before
    after = [_greedy(server, [p]) for p in HEALTHY] + [_greedy(server, HEALTHY)]
    assert after == before
    assert server.wait_idle() == 0

"""The rollback of GLM-5.3-Flash's KDA states after a verify step (models/kda/rollback.py), state by state: two
requests verify [t, d1, d2, d3] in one step (page boundaries inside the drafts), then each is rolled back to its own
keep = 1 .. 4 tokens, against a plain runner (no speculation) that decoded only the kept tokens, one per step, as
plain generation does: every KDA layer's `recurrent` and `conv` state of both slots, and the page snapshot rows.
Snapshot rows of boundaries past the kept tokens are exactly zero, as in a cache that never saw them.

Bound 2e-6 (values within |2|, state entries O(0.1 .. 1)): the verify step computes positions c .. c+3 as one chunk
where the plain run computes them one by one, so a KDA layer's inputs (the projections of x, itself after earlier
layers' chunked vs one-token math) differ by fp32 rounding: a few ulps. The rollback adds no rounding of its own: it
replays the kept tokens with the decode path's ops (conv.step, recurrence.step) on the tape's inputs, and keep = 4
(nothing cut) leaves the verify step's states untouched. Measured 7.2e-7 .. 1.4e-6 over both configs and every keep
pair, the largest in a conv state (which holds the layer's input projections as they are, so it shows the inputs'
rounding difference undamped). Without the rollback the recurrent states differ by 1.3 .. 2.1
(test_without_rollback_the_states_differ); a replay with beta halved fails by 0.46 (checked when written).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.glm5_next")

from glm5_next_mtp_models import save_glm5_next_with_mtp  # noqa: E402
from state_engine import state_chunk

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.executor.forward_batch import SeqChunk  # noqa: E402

BOUND = 2e-6
PS = 8  # page boundaries at 8, 16: inside the drafts of both requests
PROMPTS = {"a": [0, 17, 44, 9, 61, 23], "b": [0, 12, 54, 40, 33, 71, 5, 88, 31, 70, 19, 26, 45, 30]}  # 6, 14 tokens
DRAFTS = {"a": [33, 8, 91, 27], "b": [3, 63, 14, 50]}  # [t, d1, d2, d3]: positions 6..9 (boundary 8), 14..17 (16)
SLOTS = {"a": 0, "b": 1}


@pytest.fixture(scope="module", params=["kda3_mla_kpool4", "mla_first_kpool2"])
def folder(request, tmp_path_factory):
    f = tmp_path_factory.mktemp(f"glm5mtp_rollback_{request.param}")
    save_glm5_next_with_mtp(request.param, f, seed=3)
    return f


def _chunk(rid: str, ids: list[int], done: int, pages: list[int], drafts: int = 0) -> SeqChunk:
    return state_chunk(rid, ids, done, pages, SLOTS[rid], PS, drafts)


def _verify(llm: LLM, keep: dict[str, int] | None) -> dict[str, list[int]]:
    """Both prompts, then one verify step of both draft chunks, rolled back to `keep` (None: not rolled back)."""
    pages = {rid: llm.engine.pool.allocate(3) for rid in PROMPTS}
    llm.runner.execute([_chunk(rid, ids, 0, pages[rid]) for rid, ids in PROMPTS.items()])
    llm.runner.execute_with_hidden(
        [_chunk(rid, DRAFTS[rid], len(PROMPTS[rid]), pages[rid], drafts=3) for rid in PROMPTS]
    )
    if keep is not None:
        llm.runner.rollback(keep)
    else:
        llm.runner.tape = None
    return pages


def _plain(llm: LLM, keep: dict[str, int]) -> dict[str, list[int]]:
    """Both prompts, then each request's kept tokens decoded one per step."""
    pages = {rid: llm.engine.pool.allocate(3) for rid in PROMPTS}
    llm.runner.execute([_chunk(rid, ids, 0, pages[rid]) for rid, ids in PROMPTS.items()])
    for t in range(max(keep.values())):
        llm.runner.execute(
            [_chunk(rid, [DRAFTS[rid][t]], len(PROMPTS[rid]) + t, pages[rid]) for rid in PROMPTS if keep[rid] > t]
        )
    return pages


def _states(llm: LLM, pages: dict[str, list[int]], keep: dict[str, int]) -> dict[str, torch.Tensor]:
    """Per KDA layer and request: its slot's states; the snapshot rows of the boundaries its kept tokens reached
    and (name "gone/...") those of the boundaries past them."""
    out = {}
    for i, layer in enumerate(llm.runner.cache.layers):
        t = layer.tensors
        if "recurrent" not in t:
            continue
        for rid, slot in SLOTS.items():
            n, full = len(PROMPTS[rid]) + keep[rid], len(PROMPTS[rid]) + len(DRAFTS[rid])
            out[f"{i}/{rid}/recurrent"] = t["recurrent"][slot]
            out[f"{i}/{rid}/conv"] = t["conv"][slot]
            reached = [pages[rid][b // PS - 1] for b in range(PS, n + 1, PS)]
            past = [pages[rid][b // PS - 1] for b in range(PS, full + 1, PS) if b > n]
            for name in ("recurrent_snapshot", "conv_snapshot"):
                out[f"{i}/{rid}/{name}"] = t[name][reached]
                out[f"gone/{i}/{rid}/{name}"] = t[name][past]
    return out


@pytest.mark.parametrize("keep_a,keep_b", [(1, 1), (2, 4), (3, 1), (4, 2), (4, 4)])
def test_rollback_equals_plain_decoding_of_the_kept_tokens(folder, keep_a, keep_b):
    keep = {"a": keep_a, "b": keep_b}
    spec = LLM(str(folder), page_size=PS, speculative="mtp", num_speculative_tokens=3)
    plain = LLM(str(folder), page_size=PS)
    got = _states(spec, _verify(spec, keep), keep)
    want = _states(plain, _plain(plain, keep), keep)
    assert got.keys() == want.keys() and any(k.startswith("0/") or "/recurrent" in k for k in got)
    gone = [k for k in got if k.startswith("gone/")]
    # rows dropped exactly where a kept count stops before a boundary: a at 8, b at 16 (both after 2 tokens)
    assert any(got[k].numel() for k in gone) == (keep_a < 2 or keep_b < 2)
    for name in gone:
        assert torch.equal(got[name], torch.zeros_like(got[name])), f"{keep}: {name} not zero"
        assert torch.equal(got[name], want[name])  # as in a cache that never saw the rejected tokens
    for name in got.keys() - set(gone):
        err = (got[name].float() - want[name].float()).abs().max().item() if got[name].numel() else 0.0
        assert err <= BOUND, f"{keep}: {name} {err:.2e} from plain decoding"


def test_without_rollback_the_states_differ(folder):
    """The check above can fail: a verify step left as it ran (every draft's advance kept) is far off."""
    keep = {"a": 1, "b": 2}
    spec = LLM(str(folder), page_size=PS, speculative="mtp", num_speculative_tokens=3)
    plain = LLM(str(folder), page_size=PS)
    got = _states(spec, _verify(spec, None), keep)
    want = _states(plain, _plain(plain, keep), keep)
    worst = max((got[k] - want[k]).abs().max().item() for k in got if k.endswith("/recurrent"))
    assert worst > 0.05

"""GLM-5.3-Flash with speculative="mtp": greedy output == plain greedy == transformers' greedy (the trunk; transformers
builds no MTP layer), the logprobs of every kept position == plain decoding's, with the KDA states rolled back after
rejected drafts (models/kda/rollback.py; state by state in tests/identities/test_glm5_next_rollback.py).

Folders: tests/glm5_next_mtp_models.py (the trunk as transformers saves it + a random MTP block at layer N) on the
released pattern (KDA x3 + MLA, kpool 4) dense (index_topk 256) and selecting (index_topk 16: past 16 tokens a query
keeps 4 pools + its tail, and the MTP block's own indexer selects too), page 8 so page boundaries (KDA snapshot rows)
and completed pools fall inside verify chunks. Random MTP weights draft almost nothing right (the counts are checked),
so the drafts are also replaced by an oracle (the plain run's next tokens, every third one wrong; the MTP still
runs): full acceptance, partial acceptance and rejection all happen. Several requests in flight (prompts of 1 .. 13
and 21 tokens in one batch), a prefix hit (the KDA slots restored from a page's snapshot, then verified) and
preemption mid-decode.

Bound on logprobs: 1e-5, tests/identities/test_glm5_next_engine.py's: a verify step computes positions c .. c+k as
one chunk where plain decoding runs them one by one (the chunked-vs-one-token rounding of the KDA and MLA layers),
and the log-softmax's normaliser adds its own; measured 1.9e-6 .. 2.4e-6 (k = 1, 3; dense and selecting), 1.4e-6 at the
prefix hit, 1.4e-6 .. 2.4e-6 under preemption. Drafts: the random MTP 139 proposed / 1 accepted (k = 1), 375 / 1
(k = 3); the oracle 84 / 56 and 154 / 98. A KDA state left advanced by rejected drafts changes every later token:
with runner.rollback disabled the greedy tokens differ (test_without_rollback_the_output_differs).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.glm5_next")

from draft_oracle import oracle_drafts, top_logprob_error
from glm5_next_models import float64_copy, hf_logits  # noqa: E402
from glm5_next_mtp_models import save_glm5_next_with_mtp  # noqa: E402
from hf_models import hf_greedy  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

BOUND = 1e-5
PS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=20)
VOCAB = 96


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, VOCAB, (n - 1,), generator=g).tolist()


PROMPTS = [_ids(n, 100 + n) for n in (*range(1, 14), 21)]


@pytest.fixture(scope="module", params=["kda3_mla_kpool4", "sparse_kda3_kpool4"])
def model(request, tmp_path_factory):
    """(spec, folder, plain outputs of PROMPTS in one batch, the float64 transformers trunk)."""
    folder = tmp_path_factory.mktemp(f"glm5mtp_{request.param}")
    trunk, *_ = save_glm5_next_with_mtp(request.param, folder, seed=3)
    plain = LLM(str(folder), page_size=PS, max_num_seqs=16).generate(PROMPTS, GREEDY)
    return request.param, folder, plain, float64_copy(trunk)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _counts(outs) -> tuple[int, int]:
    return sum(o.metrics["num_draft_tokens"] for o in outs), sum(o.metrics["num_accepted_tokens"] for o in outs)


def _llm(folder, k: int, **kw) -> LLM:
    # the acceptance switch off (min acceptance 0): the random MTP's requests keep drafting every step
    kw = {"page_size": PS, "max_num_seqs": 16, **kw}
    return LLM(str(folder), speculative="mtp", num_speculative_tokens=k, speculative_min_acceptance=0.0, **kw)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_plain_and_transformers(model, k, monkeypatch):
    name, folder, plain, ref = model
    if k == 1 and name != "kda3_mla_kpool4":
        pytest.skip("k = 1 on the dense config; the selecting one runs k = 3 (suite time)")
    for prompt, out in zip(PROMPTS[::4], _tokens(plain[::4])):  # the plain run == transformers' greedy (the trunk)
        assert list(out) == hf_greedy(ref, prompt, GREEDY.max_tokens, hf_logits), name
    llm = _llm(folder, k)
    assert not [n for n in llm.loaded.report.skipped if ".layers." in n and "visual" not in n]  # the MTP layer built
    real = llm.generate(PROMPTS, GREEDY)  # the real (random) MTP's drafts: nearly all rejected
    assert _tokens(real) == _tokens(plain)
    proposed, accepted = _counts(real)
    assert proposed > 0 and accepted < proposed / 2, (proposed, accepted)
    oracle_drafts(monkeypatch, {tuple(p): o for p, o in zip(PROMPTS, _tokens(plain))}, VOCAB)
    outs = llm.generate(PROMPTS, GREEDY)
    assert _tokens(outs) == _tokens(plain)
    err = top_logprob_error(outs, plain)
    assert err <= BOUND, f"{name} k={k}: logprobs {err:.2e} from plain decoding"
    proposed, accepted = _counts(outs)
    assert 0 < accepted < proposed, (proposed, accepted)  # accepted and rejected drafts both happened


def test_without_rollback_the_output_differs(model, monkeypatch):
    """The checks above can fail: a verify step's KDA states left as they ran (rejected drafts' advances kept)."""
    name, folder, plain, _ = model
    if name != "kda3_mla_kpool4":
        pytest.skip("one config shows it")
    llm = _llm(folder, 3)
    monkeypatch.setattr(llm.runner, "rollback", lambda kept: setattr(llm.runner, "tape", None))
    oracle_drafts(monkeypatch, {tuple(p): o for p, o in zip(PROMPTS, _tokens(plain))}, VOCAB)
    outs = llm.generate(PROMPTS, GREEDY)
    # every request ran to its length: a failure inside the step would fail the requests (engine isolation) and
    # their outputs would differ for that reason alone
    assert all(o.outputs[0].error is None and o.outputs[0].finish_reason == "length" for o in outs)
    assert _tokens(outs) != _tokens(plain)


def test_prefix_hit_and_preemption_equal_plain(model, monkeypatch):
    """A request at a prefix hit (its KDA slots restored from the hit's last page, then verified) and requests
    preempted mid-decode (drafts never preempt; the preempted recompute or hit) keep plain greedy output."""
    name, folder, plain, _ = model
    shared = _ids(3 * PS + 2, 7)
    prompts = [shared, shared[: 2 * PS + 1] + [5, 9, 11]]
    base = LLM(str(folder), page_size=PS, enable_prefix_caching=False).generate(prompts, GREEDY)
    llm = _llm(folder, 2)
    reference = {tuple(p): o for p, o in zip(prompts + PROMPTS, _tokens(base) + _tokens(plain))}
    oracle_drafts(monkeypatch, reference, VOCAB)
    first = llm.generate(prompts[:1], GREEDY)
    second = llm.generate(prompts[1:], GREEDY)
    assert second[0].metrics["num_cached_prompt_tokens"] == 2 * PS
    assert _tokens(first + second) == _tokens(base)
    assert top_logprob_error(first + second, base) <= BOUND
    tight = _llm(folder, 3, num_pages=7, max_num_seqs=3)
    outs = tight.generate(PROMPTS[8:11], GREEDY)
    assert _tokens(outs) == _tokens(plain[8:11])
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert top_logprob_error(outs, plain[8:11]) <= BOUND

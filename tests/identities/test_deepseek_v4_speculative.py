"""DeepSeek-V4 with speculative="mtp": greedy output == plain greedy, the logprobs of every kept position ==
plain decoding's, with the request states rolled back after rejected drafts (models/deepseek_v4/rollback.py).

Folders: tests/v4_mtp_models.py (the trunk as transformers saves it + a random MTP layer under the release's
mtp.0.* names) on the three test configs (CSA 4 / HCA 8, CSA 3 / HCA 6, CSA 4; windows 5-7), each at its
smallest legal page (8, 6, 4) so page boundaries (and their snapshot rows) fall inside verify chunks.
Random MTP weights draft almost nothing right, so the drafts are also replaced by an oracle (the plain run's
next tokens, every third one wrong; the MTP still runs): full acceptance, partial acceptance and rejection all
happen, and with k = 3 (4-token verify chunks) CSA / HCA windows close inside the kept drafts and inside the
rejected ones. Prompts of 1 .. 13 tokens (every length mod 3, 4, 6 and 8) in one batch of mixed lengths.

Bound on logits and logprobs: 1e-5. A verify step computes positions c .. c+k as one chunk where plain decoding runs them one
by one: the chunked-vs-token-by-token difference of tests/identities/test_deepseek_v4_engine.py (logits within
2.3e-6 of each other there), doubled by the log-softmax's normaliser; measured 9.5e-7 .. 2.1e-6 (logprobs, k = 1, 2, 3) and 1.3e-6 .. 2.0e-6 (the kept
positions' logits rows, k = 3) on the three configs. A state not rolled back
(a ring row of a rejected position, a window pooled over rejected tokens) changes later tokens: the test fails
with runner.rollback disabled (checked when the test was written).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from draft_oracle import oracle_drafts, top_logprob_error
from v4_mtp_models import save_v4_with_mtp  # noqa: E402

import mlaserve.engine.speculative as spec  # noqa: E402
from mlaserve.config.model import ConfigError  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

BOUND = 1e-5
PAGE = {"all_kinds": 8, "hc2_learned": 6, "hc3_hash": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=20)
VOCAB = 96


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, VOCAB, (n - 1,), generator=g).tolist()


PROMPTS = [_ids(n, 100 + n) for n in range(1, 14)]


@pytest.fixture(scope="module", params=list(PAGE))
def model(request, tmp_path_factory):
    """(kind, folder, plain outputs of PROMPTS in one batch)."""
    kind = request.param
    folder = tmp_path_factory.mktemp(f"v4mtp_{kind}")
    save_v4_with_mtp(kind, folder, seed=3)
    plain = LLM(str(folder), page_size=PAGE[kind], max_num_seqs=16).generate(PROMPTS, GREEDY)
    return kind, folder, plain


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_and_logprobs_equal_plain(model, k, monkeypatch):
    kind, folder, plain = model
    llm = LLM(str(folder), page_size=PAGE[kind], max_num_seqs=16, speculative="mtp", num_speculative_tokens=k)
    assert llm.loaded.report.skipped == []  # the MTP layer was built and filled
    real = llm.generate(PROMPTS[:4], GREEDY)  # the real (random) MTP's drafts: nearly all rejected
    assert _tokens(real) == _tokens(plain[:4])
    oracle_drafts(monkeypatch, {tuple(p): o for p, o in zip(PROMPTS, _tokens(plain))}, VOCAB)
    outs = llm.generate(PROMPTS, GREEDY)
    assert _tokens(outs) == _tokens(plain)
    err = top_logprob_error(outs, plain)
    assert err <= BOUND, f"{kind} k={k}: logprobs {err:.2e} from plain decoding"
    proposed = sum(o.metrics["num_draft_tokens"] for o in outs)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    assert 0 < accepted < proposed  # accepted and rejected drafts both happened


def _logits_by_position(llm: LLM) -> dict[tuple[str, int], torch.Tensor]:
    """Spy on the runner: (request id, position) -> the logits row computed there. A rejected draft's position
    is computed again by a later step, which overwrites it: what remains are the kept positions' rows."""
    seen: dict[tuple[str, int], torch.Tensor] = {}
    run = llm.runner.execute_with_hidden

    def spy(chunks, *args, **kwargs):
        batch, logits, hidden = run(chunks, *args, **kwargs)
        starts = {s.request_id: s.context_len for s in batch.seqs}
        for row, (rid, offset) in enumerate(batch.logits_owner):
            seen[(rid, starts[rid] + offset)] = logits[row].clone()
        return batch, logits, hidden

    llm.runner.execute_with_hidden = spy
    return seen


def test_logits_of_kept_positions_equal_plain(model, monkeypatch):
    """Every generated position's logits row (a verify step's kept rows) == plain decoding's row there."""
    kind, folder, plain = model
    base = LLM(str(folder), page_size=PAGE[kind], max_num_seqs=16)
    want = _logits_by_position(base)
    base.generate(PROMPTS, GREEDY)
    llm = LLM(str(folder), page_size=PAGE[kind], max_num_seqs=16, speculative="mtp", num_speculative_tokens=3)
    got = _logits_by_position(llm)
    oracle_drafts(monkeypatch, {tuple(p): o for p, o in zip(PROMPTS, _tokens(plain))}, VOCAB)
    llm.generate(PROMPTS, GREEDY)
    # the sampling positions: the last prompt token's and every generated token's but the last
    keys = {(f"llm-{j}/0", len(p) - 1 + i) for j, p in enumerate(PROMPTS) for i in range(GREEDY.max_tokens)}
    assert keys <= want.keys() and keys <= got.keys()
    err = max((got[k] - want[k]).abs().max().item() for k in keys)
    assert err <= BOUND, f"{kind}: kept positions' logits {err:.2e} from plain decoding"


def test_paused_and_probing_requests_equal_plain(model):
    """The acceptance switch pauses the random MTP's requests and probes them every 2 steps: a probe's MTP
    pass first catches up the positions decoded plainly (from the kept streams), then drafts."""
    kind, folder, plain = model
    llm = LLM(
        str(folder),
        page_size=PAGE[kind],
        max_num_seqs=16,
        speculative="mtp",
        num_speculative_tokens=2,
        speculative_min_acceptance=0.9,
        speculative_probe_interval=2,
    )
    outs = llm.generate(PROMPTS, GREEDY)
    assert _tokens(outs) == _tokens(plain)
    assert top_logprob_error(outs, plain) <= BOUND
    assert sum(o.metrics["num_spec_paused_steps"] for o in outs) > 0
    assert sum(o.metrics["num_spec_probes"] for o in outs) > 0


def test_acceptance_in_ledger_and_metrics(model, monkeypatch):
    kind, folder, plain = model
    if kind != "all_kinds":
        pytest.skip("one config suffices for the bookkeeping")
    llm = LLM(
        str(folder), page_size=PAGE[kind], max_num_seqs=16, speculative="mtp", num_speculative_tokens=3, trace="memory"
    )
    oracle_drafts(monkeypatch, {tuple(p): o for p, o in zip(PROMPTS, _tokens(plain))}, VOCAB)
    outs = llm.generate(PROMPTS[4:9], GREEDY)
    assert _tokens(outs) == _tokens(plain[4:9])
    recs = list(llm.runner.tracer.records)
    summary = spec.acceptance_summary(recs)
    assert summary["num_accepted_tokens"] == sum(o.metrics["num_accepted_tokens"] for o in outs) > 0
    assert summary["num_proposed_tokens"] == sum(o.metrics["num_draft_tokens"] for o in outs)
    drafts = [r for r in recs if r.get("spec_phase") == "draft"]
    assert drafts and all(r["layers"].startswith("mtp") for r in drafts)
    verifies = [e for r in recs if r.get("spec_phase") == "verify" for e in r["verify"]]
    assert verifies and max(e["query_len"] for e in verifies) == 4  # last token + 3 drafts in one chunk


def test_prefix_hit_and_preemption_equal_plain(model, monkeypatch):
    """A request at a prefix hit (its MTP ring starts empty, its trunk states from the page's snapshot) and
    requests preempted mid-decode keep plain greedy output under speculation."""
    kind, folder, plain = model
    ps = PAGE[kind]
    shared = _ids(3 * ps + 2, 7)
    prompts = [shared, shared[: 2 * ps + 1] + [5, 9, 11]]
    base = LLM(str(folder), page_size=ps, enable_prefix_caching=False).generate(prompts, GREEDY)
    llm = LLM(str(folder), page_size=ps, speculative="mtp", num_speculative_tokens=2)
    reference = {tuple(p): o for p, o in zip(prompts + PROMPTS, _tokens(base) + _tokens(plain))}
    oracle_drafts(monkeypatch, reference, VOCAB)
    first = llm.generate(prompts[:1], GREEDY)
    second = llm.generate(prompts[1:], GREEDY)
    assert second[0].metrics["num_cached_prompt_tokens"] == 2 * ps
    assert _tokens(first + second) == _tokens(base)
    assert top_logprob_error(first + second, base) <= BOUND
    # few pages: decodes preempt each other (drafts never preempt; the preempted recompute or hit)
    tight = LLM(str(folder), page_size=ps, num_pages=7, max_num_seqs=3, speculative="mtp", num_speculative_tokens=3)
    outs = tight.generate(PROMPTS[8:11], GREEDY)
    assert _tokens(outs) == _tokens(plain[8:11])
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert top_logprob_error(outs, plain[8:11]) <= BOUND


def test_speculative_needs_the_mtp_layer(tmp_path):
    from v4_models import build_hf_v4

    build_hf_v4("hc2_learned", seed=1).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="MTP layer"):
        LLM(str(tmp_path), speculative="mtp")


def test_speculative_refused_on_a_deepseek4_gguf(tmp_path):
    """llama.cpp's deepseek4 converter writes no MTP tensors: the option is refused with that reason."""
    pytest.importorskip("gguf")
    from v4_gguf import BLOCK_DIMS, write_v4_gguf
    from v4_models import save_hf_v4

    save_hf_v4("all_kinds", tmp_path / "float", seed=1, **BLOCK_DIMS)
    write_v4_gguf(tmp_path / "float", tmp_path / "model.gguf")
    with pytest.raises(ConfigError, match="speculative='mtp'.*deepseek4 GGUF layout carries no MTP layer"):
        LLM(str(tmp_path / "model.gguf"), speculative="mtp")

"""DeepSeek-V4 under expert parallelism (CPU, gloo, 2 processes): every MoE layer's routed experts spread (6 over 2
ranks: [0, 3) and [3, 6)), the MTP layer's too; attention, mHC, the shared expert and the routers replicated. The
hash-routed layer (layer 0: idx = tid2eid[token_id]) routes on every rank from the step's own token ids (every rank
runs the step's whole batch, verify steps included); the learned sqrt-softplus layers route on every rank from the
replicated hidden states. One spawn, with speculative="mtp" (tests/v4_mtp_models.py "all_kinds": sliding + CSA
ratio 4 + HCA ratio 8, hc_mult 4, one hash layer; its MTP layer in the module layout, stacked experts, which a
rank reads whole and slices), checks:
- prompt logits: EP=2 == one process == transformers' deepseek_v4 (the trunk) on a 23-token prompt (3 mod 4);
- greedy decode across the compression boundaries (prompt 7, 14 new tokens: CSA rows close at 8, 12, 16, 20, the
  HCA row at 8 and 16) == transformers' full recompute, with speculation under EP;
- every MTP pass's logits under EP=2 == one process's (measured 3.6e-7 .. 9.5e-7) and the drafts token for token
  (a wrong MTP layer under EP would only lower acceptance, never change the output), with the real drafts and
  with oracle drafts (the plain run's next tokens, every third one wrong: acceptance, partial acceptance and the
  request states' rollback on both ranks), and a batch of mixed lengths == one process without speculation.
  num_speculative_tokens 3: a depth-3 pass writes the MTP ring row that the next step's first pass still reads,
  so the workers' ring hold / end_draft matter (at 2 they do not: measured);
- which rank holds which experts (echo, notes, ledger), the bytes each reads, every (token, expert) pair once.

Bound: 1e-5 max abs (fp32 logits of magnitude ~4; tests/identities/test_deepseek_v4_engine.py measures the
engine 0 .. 2.3e-6 from transformers at every position). EP=2 only reorders the routed experts' fp32 additions
(each rank's partial, then the all-reduce). Measured here: EP=2 vs one process 1.2e-6, vs transformers 9.5e-7.
Broken on purpose: rank 1's hash router reading token id 0 for every token moves the logits by 0.64; a worker
skipping the rollback message changes the greedy tokens; a worker skipping end_draft moves an MTP pass's
logits by 0.06."""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_greedy

pytest.importorskip("transformers")

from draft_oracle import capture_mtp_logits, oracle_drafts, record_drafts
from v4_models import hf_v4_logits  # noqa: E402

import mlaserve.engine.speculative as spec  # noqa: E402
from mlaserve import LLM  # noqa: E402
from mlaserve.config.model import ConfigError  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

BOUND = 1e-5
E = 5  # the quantized folders' experts: 3 + 2
SPEC = dict(speculative="mtp", num_speculative_tokens=3, page_size=8, max_num_seqs=8, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from v4_mtp_models import save_v4_with_mtp

    folder = tmp_path_factory.mktemp("v4_ep")
    trunk, _, _ = save_v4_with_mtp("all_kinds", folder, seed=3, layout="module")
    return trunk, str(folder)


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).abs().max().item()
    print(f"{what}: max abs {err:.2e}")
    assert err <= BOUND, f"{what}: max abs {err:.3g} > {BOUND}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{what}: top-1 differs"


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_v4_ep2_equals_one_process_and_transformers(v4, monkeypatch):
    hf, path = v4
    vocab, n_experts = hf.config.vocab_size, hf.config.n_routed_experts
    tid2eid = hf.model.layers[0].mlp.gate.tid2eid
    prompts = [_ids(n, vocab, n) for n in (7, 11, 3, 13)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain_llm = LLM(path, max_num_batched_tokens=16, page_size=8)
    plain = _tokens(plain_llm.generate(prompts, greedy))
    one = LLM(path, **SPEC)
    with monkeypatch.context() as m:
        one_drafts, one_logits = record_drafts(m), capture_mtp_logits(m, one)
        assert _tokens(one.generate(prompts, greedy)) == plain
    with LLM(path, expert_parallel_size=2, trace="memory", **SPEC) as two:
        ids = _ids(23, vocab, 5)  # 23 = 3 mod 4: the CSA window boundary of the reported wrong token
        hashed = tid2eid[torch.tensor(ids)]
        assert (hashed < 3).any() and (hashed >= 3).any()  # the hash layer's pairs fall on both ranks
        b = two.prompt_logits(ids)
        _close(b, plain_llm.prompt_logits(ids), "EP=2 vs one process")
        _close(b, hf_v4_logits(hf, ids), "EP=2 vs transformers")

        # greedy decode across the compression boundaries, with speculation under EP: transformers' full recompute
        prompt = _ids(7, vocab, 7)
        params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
        assert two.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 14, logits=hf_v4_logits)

        # the MTP layer's real drafts == one process's; greedy == plain one process
        before = len(two.runner.tracer.records)
        with monkeypatch.context() as m:
            two_drafts, two_logits = record_drafts(m), capture_mtp_logits(m, two)
            assert _tokens(two.generate(prompts, greedy)) == plain
        assert two_drafts == one_drafts and any(d for step in two_drafts for *_, d in step)
        assert len(two_logits) == len(one_logits) > 0
        for got, want in zip(two_logits, one_logits):
            _close(got, want, "an MTP pass, EP=2 vs one process")
        # oracle drafts: accepted, partly accepted, rejected (the request states rolled back on both ranks); the
        # drafting stays on, so deeper passes run (their ring hold / end_draft on both ranks): every MTP pass's
        # logits == one process's under the same oracle
        oracle = {tuple(p): t for p, t in zip(prompts, plain)}
        with monkeypatch.context() as m:
            oracle_drafts(m, oracle, vocab)
            one_logits = capture_mtp_logits(m, one)
            assert _tokens(one.generate(prompts, greedy)) == plain
        with monkeypatch.context() as m:
            oracle_drafts(m, oracle, vocab)
            two_logits = capture_mtp_logits(m, two)
            mark = len(two.runner.tracer.records)
            assert _tokens(two.generate(prompts, greedy)) == plain
        assert len(two_logits) == len(one_logits) > len(prompts)
        for got, want in zip(two_logits, one_logits):
            _close(got, want, "an MTP pass under oracle drafts, EP=2 vs one process")
        records = list(two.runner.tracer.records)
        summary = spec.acceptance_summary(records[mark:])
        assert 0 < summary["num_accepted_tokens"] < summary["num_proposed_tokens"], summary

        # which rank holds which experts (echo, notes for inspect, the ledger's first record), and the reads
        echoes = two.runner.rank_echoes
        layers = [f"model.layers.{i}.mlp" for i in range(hf.config.num_hidden_layers)] + ["mtp.0.mlp"]
        for name in layers:
            held = [next(h for h in echo["routed_experts"] if h["layer"] == name) for echo in echoes]
            assert [tuple(h["experts"]) for h in held] == [(0, 3), (3, n_experts)], name
            assert held[0]["bytes"] == held[1]["bytes"], name
        notes = echoes[1]["notes"]
        hash_note = "rank 1: model.layers.0.mlp experts [3, 6) of 6 (hash-routed: tid2eid[token id] on every rank)"
        assert any(n.startswith(hash_note) for n in notes), notes
        assert any(n.startswith("rank 1: model.layers.1.mlp experts [3, 6) of 6, ") for n in notes), notes
        assert any(n.startswith("rank 1: mtp.0.mlp experts [3, 6) of 6, ") for n in notes), notes
        assert any("(the other ranks' 36 routed-expert tensors not read)" in n for n in notes), notes
        # a rank skips the others' per-expert w1 / w2 / w3 of the trunk (I x D fp32 each); the MTP layer's stacks
        # (module layout) are read whole and sliced
        per_expert = 3 * hf.config.moe_intermediate_size * hf.config.hidden_size * 4
        whole = one.loaded.report.bytes_read
        assert [whole - echo["file_bytes_read"] for echo in echoes] == [3 * per_expert * 4] * 2
        assert any("expert_holdings" in r for r in records)

        # every (token, expert) pair of the trunk's steps (verify steps included) and of the MTP passes (the MTP
        # layer's one MoE) ran on exactly one rank: tokens x k per MoE layer, as one process routes
        new = records[before:]
        ranked = [r for r in new if r.get("rank") == 0 and "num_tokens" in r]
        steps = {r["step"]: r["num_tokens"] for r in ranked if "mtp" not in r["layers"]}
        passes = {(r["step"], r["draft_depth"]): r["num_tokens"] for r in ranked if "mtp" in r["layers"]}
        loads = [r for r in new if "expert_load" in r]
        assert [r["step"] for r in loads if r["pass"] == "trunk"] == list(steps)
        assert [(r["step"], r["draft_depth"]) for r in loads if r["pass"] == "mtp"] == list(passes) != []
        k, n_layers = hf.config.num_experts_per_tok, hf.config.num_hidden_layers
        for rec in loads:
            assert [x["rank"] for x in rec["expert_load"]] == [0, 1]
            pairs = sum(x["pairs"] for x in rec["expert_load"])
            if rec["pass"] == "trunk":
                assert pairs == steps[rec["step"]] * k * n_layers, rec
            else:
                assert pairs == passes[(rec["step"], rec["draft_depth"])] * k, rec


def test_v4_ep_refusals_are_named(v4, tmp_path):
    """What V4 under EP does not run yet, refused before any worker starts."""
    _, path = v4
    with pytest.raises(ConfigError, match="expert_parallel_size=7 exceeds n_routed_experts=6"):
        LLM(path, expert_parallel_size=7)
    with pytest.raises(ConfigError, match="DeepSeek-V4 with tensor_parallel_size=2: not supported"):
        LLM(path, tensor_parallel_size=2)


@pytest.mark.parametrize("experts", ["fp8", "fp4"])
def test_v4_quantized_folder_rank_holds_its_experts_stored_bytes(tmp_path, experts):
    """An FP8 / FP4-expert folder (the project's writer): each rank's holders are made for its experts only and
    hold exactly one process's stored bytes of those experts (codes and scales bit for bit), the other ranks'
    expert tensors unread. In-process (no spawn): the end-to-end sum over ranks is the float test above."""
    from v4_models import save_hf_v4

    from mlaserve.distributed.expert_parallel import expert_range
    from mlaserve.loading.deepseek_v4 import load_folder
    from mlaserve.quant.deepseek_v4 import FP4V4Experts, FP8V4Experts
    from mlaserve.quant.writer import write_fp8_folder

    save_hf_v4("all_kinds", tmp_path / "float", seed=6, n_routed_experts=E)
    write_fp8_folder(tmp_path / "float", tmp_path / "q", block=(16, 16), keep_dtype=torch.float32, experts=experts)
    whole, whole_report = load_folder(tmp_path / "q")
    holder = FP4V4Experts if experts == "fp4" else FP8V4Experts
    read = []
    for rank in range(2):
        start, stop = expert_range(E, rank, 2)
        part, report = load_folder(tmp_path / "q", experts=(start, stop))
        assert report.hidden == 3 * 2 * (E - (stop - start)) * len(part.model.layers)  # weight + scale per w1/w2/w3
        read.append(report.bytes_read)
        for mine, full in zip(part.model.layers, whole.model.layers):
            assert type(mine.mlp.experts) is holder
            for name, p in mine.mlp.experts.named_parameters():
                ref = dict(full.mlp.experts.named_parameters())[name][start:stop]
                assert (
                    p.shape == ref.shape
                    and p.dtype == ref.dtype
                    and torch.equal(p.view(torch.uint8), ref.view(torch.uint8))
                ), name
    # the two ranks together read the replicated tensors twice and every expert once
    replicated = sum(read) - whole_report.bytes_read
    assert 0 < replicated < whole_report.bytes_read and read[0] > read[1]

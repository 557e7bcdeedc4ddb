"""DeepSeek-V4 under expert parallelism (CPU, gloo, 2 processes): every MoE layer's routed experts spread (5 over
2 ranks: [0, 3) and [3, 5)), attention, mHC, the shared expert and the routers replicated. The hash-routed layer
(layer 0: idx = tid2eid[token_id]) routes on every rank from the step's own token ids (every rank runs the
step's whole batch); the learned sqrt-softplus layers route on every rank from the replicated hidden states.
EP=2 == one process == transformers' deepseek_v4 on the same random fp32 weights (tests/v4_models.py
"all_kinds": sliding + CSA ratio 4 + HCA ratio 8, hc_mult 4, one hash layer).

Bound: 1e-5 max abs (fp32 logits of magnitude ~4; tests/identities/test_deepseek_v4_engine.py measures the
engine 0 .. 2.3e-6 from transformers at every position). EP=2 only reorders the routed experts' fp32 additions
(each rank's partial, then the all-reduce). Measured here: EP=2 vs one process 7.8e-7, vs transformers 1.2e-6;
the greedy decode across the compression boundaries (prompt 7 = 3 mod 4, 14 new tokens: CSA rows close at 8,
12, 16, 20, the HCA row at 8 and 16) identical to one process and to transformers' full recompute.
Broken on purpose: rank 1's hash router reading token id 0 for every token moves the logits by 0.64.
One spawn serves every check."""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_greedy

pytest.importorskip("transformers")

from v4_models import build_hf_v4, hf_v4_logits  # noqa: E402

from mlaserve import LLM  # noqa: E402
from mlaserve.config.model import ConfigError  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

BOUND = 1e-5
E = 5


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    hf = build_hf_v4("all_kinds", seed=3, n_routed_experts=E)
    folder = tmp_path_factory.mktemp("v4_ep")
    hf.save_pretrained(folder)
    return hf, str(folder)


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).abs().max().item()
    print(f"{what}: max abs {err:.2e}")
    assert err <= BOUND, f"{what}: max abs {err:.3g} > {BOUND}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{what}: top-1 differs"


def test_v4_ep2_equals_one_process_and_transformers(v4):
    hf, path = v4
    vocab = hf.config.vocab_size
    tid2eid = hf.model.layers[0].mlp.gate.tid2eid
    one = LLM(path, max_num_batched_tokens=16)
    with LLM(path, expert_parallel_size=2, max_num_batched_tokens=16, trace="memory") as two:
        ids = _ids(23, vocab, 5)  # 23 = 3 mod 4: the CSA window boundary of the reported wrong token
        hashed = tid2eid[torch.tensor(ids)]
        assert (hashed < 3).any() and (hashed >= 3).any()  # the hash layer's pairs fall on both ranks
        a, b = one.prompt_logits(ids), two.prompt_logits(ids)
        _close(b, a, "EP=2 vs one process")
        _close(b, hf_v4_logits(hf, ids), "EP=2 vs transformers")

        # greedy decode across the compression boundaries, alone and batched with other lengths
        prompt = _ids(7, vocab, 7)
        params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
        want = hf_greedy(hf, prompt, 14, logits=hf_v4_logits)
        before = len(two.runner.tracer.records)
        assert two.generate([prompt], params)[0].outputs[0].token_ids == want
        prompts = [prompt, _ids(11, vocab, 11), _ids(3, vocab, 3)]
        short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in two.generate(prompts, short)]
        assert got == [o.outputs[0].token_ids for o in one.generate(prompts, short)]
        records = list(two.runner.tracer.records)

        # which rank holds which experts (echo, notes for inspect, the ledger's first record), and the reads
        echoes = two.runner.rank_echoes
        for layer in range(hf.config.num_hidden_layers):
            name = f"model.layers.{layer}.mlp"
            held = [next(h for h in echo["routed_experts"] if h["layer"] == name) for echo in echoes]
            assert [tuple(h["experts"]) for h in held] == [(0, 3), (3, 5)], name
            assert held[0]["bytes"] * 2 == held[1]["bytes"] * 3, name
        notes = echoes[1]["notes"]
        assert (
            "rank 1: model.layers.0.mlp experts [3, 5) of 5 (hash-routed: tid2eid[token id] on every rank), 12288 bytes held"
            in notes
        )
        assert any(n.startswith("rank 1: model.layers.1.mlp experts [3, 5) of 5, ") for n in notes), notes
        assert any("(the other ranks' 36 routed-expert tensors not read)" in n for n in echoes[1]["notes"])
        # a rank reads its experts' w1 / w2 / w3 only (I x D fp32 each), the rest as one process does
        per_expert = 3 * hf.config.moe_intermediate_size * hf.config.hidden_size * 4
        whole = one.loaded.report.bytes_read
        assert [whole - echo["file_bytes_read"] for echo in echoes] == [2 * per_expert * 4, 3 * per_expert * 4]
        assert any("expert_holdings" in r for r in records)

        # every (token, expert) pair ran on exactly one rank: the ranks' pairs add up to tokens x k x layers
        new = records[before:]
        steps = {r["step"]: r["num_tokens"] for r in new if r.get("rank") == 0 and "num_tokens" in r}
        loads = [r for r in new if "expert_load" in r]
        assert loads and len(loads) == len(steps)
        k, layers = hf.config.num_experts_per_tok, hf.config.num_hidden_layers
        for rec in loads:
            assert [x["rank"] for x in rec["expert_load"]] == [0, 1]
            assert sum(x["pairs"] for x in rec["expert_load"]) == steps[rec["step"]] * k * layers, rec


def test_v4_ep_refusals_are_named(v4, tmp_path):
    """What V4 under EP does not run yet, refused before any worker starts."""
    _, path = v4
    with pytest.raises(ConfigError, match="expert_parallel_size=6 exceeds n_routed_experts=5"):
        LLM(path, expert_parallel_size=6)
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

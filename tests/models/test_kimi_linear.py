"""Kimi-Linear through the engine (config reader, strict loader, KDA request states in the cache's slots, NoPE MLA
over paged latent rows, scheduler) against transformers' KimiLinearForCausalLM on the same random weights.

The folders are written by transformers' save_pretrained (checkpoint names: block_sparse_moe, experts w1/w2/w3,
q/k/v_conv1d, f_a/f_b_proj, A_log, dt_bias); tests/kimi_linear_models.py builds two layer patterns with head counts
that are not powers of two, one of them with the released config's linear_attn_config pattern.

Bound: 1e-5 max abs against transformers run in float64 on the same weights, 100% top-1. Measured (logits of
magnitude ~4, lengths 5 .. 197, budgets 1, 5, 64, one pass): ours 1.1e-6 .. 7.5e-6 from float64, transformers' own
fp32 run 1.1e-6 .. 7.4e-6 from it: fp32 rounding of these sizes (a KDA state sums up to 197 rank-1 updates), the
same for both, so the float64 run is the reference (why the test models use rms_norm_eps 1e-3:
tests/kimi_linear_models.py). A defect moves logits by 1e-2 .. 1: a conv state one row short, a state not carried
across a chunk or a 64-token block, a rotated "rope" slice, a slot not zeroed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from engine_drain import drain, token_ids  # noqa: E402
from hf_models import hf_greedy  # noqa: E402
from kimi_linear_models import SPECS, float64_copy, hf_logits, random_ids, save_hf_kimi  # noqa: E402
from state_engine import assert_close, model_fixture, together_and_alone  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

BOUND = 1e-5
LONG = 3 * 64 + 5  # 197: three full 64-token blocks and a tail
# prompt lengths run as their own prompts: around the 64-token block edges, and short ones inside the conv width
LENGTHS = (1, 2, 3, 4, 5, 63, 64, 65, 127, 128, 129, LONG)


kimi = model_fixture("kimi", SPECS, save_hf_kimi, float64_copy, seed=3)


@pytest.mark.parametrize("budget", [1, 5, 64, 100, 512])  # 1: token by token (the batched step); 512: one pass
def test_prompt_logits_equal_transformers_at_every_position(kimi, budget):
    """Chunked prefill (chunks of `budget` tokens, the KDA states carried in the request's slot between steps) ==
    transformers' one pass, at every position of a 197-token prompt (every prefix length, the model being causal)
    and for prompts of lengths around the 64-token blocks run as their own prompts."""
    spec, ref, folder = kimi
    llm = LLM(str(folder), max_num_batched_tokens=budget)
    vocab = ref.config.vocab_size
    for n in LENGTHS if budget in (5, 512) else (LONG,):  # every length on two budgets, the long prompt on all
        ids = random_ids(n, vocab, n)
        assert_close(llm.prompt_logits(ids), hf_logits(ref, ids), BOUND, f"{spec} length {n} budget {budget}")


@pytest.mark.parametrize("mla_path", ["absorbed", "decompressed"])
def test_nope_mla_absorbed_and_decompressed_both_exact(kimi, mla_path):
    """Every MLA token down one path: the never-rotated "rope" slice is cached and scored the same way by both."""
    spec, ref, folder = kimi
    llm = LLM(str(folder), mla_path=mla_path, max_num_batched_tokens=40)
    ids = random_ids(LONG, ref.config.vocab_size, 7)
    assert_close(llm.prompt_logits(ids), hf_logits(ref, ids), BOUND, f"{spec} mla_path={mla_path}")


def test_greedy_through_the_state_equals_transformers(kimi):
    """Two requests in flight together (decodes batched in one recurrent step, beside the other's prefill chunks)
    generate transformers' greedy tokens (its full recompute, no cache)."""
    spec, ref, folder = kimi
    llm = LLM(str(folder), max_num_batched_tokens=9)
    prompts = [random_ids(70, ref.config.vocab_size, 70), random_ids(4, ref.config.vocab_size, 4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(ref, p, 12, hf_logits), f"{spec}: prompt of {len(p)} tokens"


def test_a_batch_of_mixed_lengths_equals_each_alone(kimi):
    """Steps mixing two one-token sequences (the batched recurrent step) with prefills of several lengths, each in
    its own slot == each sequence alone, and == transformers."""
    spec, ref, folder = kimi
    llm = LLM(str(folder), max_num_seqs=4)
    vocab = ref.config.vocab_size
    prompts = {"a": random_ids(70, vocab, 1), "b": random_ids(9, vocab, 2), "c": random_ids(66, vocab, 3)}
    # each sequence's chunk ends, in steps: step 1 three prefills; step 2 a and b one token each beside c; step 3
    # a and b's tails
    plan = {"a": (65, 66, 67), "b": (1, 2, 9), "c": (60, 66)}
    alone, together, decodes = together_and_alone(llm.runner, prompts, plan)
    assert decodes[1] == 2  # two one-token sequences beside a prefill
    for rid, got in together.items():
        assert_close(got, alone[rid], BOUND, f"{spec} request {rid}: batch vs alone")
        want = hf_logits(ref, prompts[rid][: plan[rid][-1]])
        assert_close(got, want, BOUND, f"{spec} request {rid} vs transformers")


def test_preemption_recomputes_the_state_exactly(kimi):
    """A pool small enough to preempt, prefix caching off: a re-admitted request restarts from a zeroed slot and
    recomputes from token 0; its tokens equal transformers' greedy. (With prefix caching on it resumes from a
    page's snapshot: tests/identities/test_kimi_linear_prefix_cache.py.)"""
    spec, ref, folder = kimi
    llm = LLM(
        str(folder),
        page_size=4,
        num_pages=14,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        trace="memory",
        enable_prefix_caching=False,
    )
    prompts = [random_ids(n, ref.config.vocab_size, 50 + n) for n in (17, 5, 23, 9)]
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), request_id=f"r{i}")
    outs = token_ids(drain(engine))
    assert any(r["preempted"] for r in llm.runner.tracer.records), "the pool was meant to be small enough to preempt"
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(ref, p, 8, hf_logits), f"{spec}: prompt of {len(p)} tokens"
    assert engine.slots.num_free == engine.slots.num_slots and not engine.slots.owner


def test_abort_gives_the_state_slot_back(kimi):
    _, ref, folder = kimi
    llm = LLM(str(folder), max_num_seqs=2)
    engine, greedy = llm.engine, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request(random_ids(30, ref.config.vocab_size, 1), greedy, request_id="a")
    engine.add_request(random_ids(8, ref.config.vocab_size, 2), greedy, request_id="b")
    engine.step()
    engine.step()
    assert engine.slots.num_free == 0
    assert engine.abort("a") and engine.abort("b")
    assert engine.slots.num_free == engine.slots.num_slots == 2 and not engine.slots.owner
    drain(engine)  # the aborts' final outputs


def test_a_reused_slot_starts_from_a_zeroed_state(kimi):
    """One slot for every request: each prompt after the first starts in the slot the last one left full of its
    state, which the runner zeroes (the chunk at token 0 says reset_state); the pad slot is never written."""
    spec, ref, folder = kimi
    llm = LLM(str(folder), max_num_seqs=1, max_num_batched_tokens=32)
    for n in (70, 9, 66):
        ids = random_ids(n, ref.config.vocab_size, 300 + n)
        assert_close(llm.prompt_logits(ids), hf_logits(ref, ids), BOUND, f"{spec}: length {n} in the reused slot")
    cache = llm.runner.cache
    for t in cache.request_tensors():
        assert torch.count_nonzero(t[cache.state_pad_slot]) == 0


def test_the_ledger_and_inspect_name_each_kind_and_its_state_bytes(kimi, capsys):
    """The route records the kda kind (its layers, the recurrent / chunked segments, the chunk length and the
    state bytes per request) beside the mla kind; `mlaserve inspect` lists the kinds, their states and sources."""
    from mlaserve.entrypoints.cli import main

    spec, ref, folder = kimi
    llm = LLM(str(folder), trace="memory", max_num_batched_tokens=16)
    prompts = [random_ids(3, ref.config.vocab_size, 1), random_ids(40, ref.config.vocab_size, 2)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    kinds = llm.runner.layer_kinds
    kda_ids = [k.index for k in kinds if k.attention == "kda"]
    per_layer = llm.runner.cache.measured_bytes_per_request() // len(kda_ids)
    mixed = None
    for rec in llm.runner.tracer.records:
        kda = next(k for k in rec["kinds"] if k["kind"] == "kda")
        assert kda["state_bytes_per_request"] == per_layer * len(kda_ids) and kda["chunk"] == 64
        assert {k["kind"] for k in rec["kinds"]} == {"kda", "mla"}
        paths = [s["path"] for s in rec["segments"] if s["kind"] == "kda"]
        if paths == ["recurrent", "chunked"]:
            mixed = rec
        assert all(q["state_slot"] is not None for q in rec["requests"])
    assert mixed is not None, "a step with a one-token sequence beside a prefill chunk"
    impls = {s["implementation"] for s in mixed["segments"] if s["kind"] == "kda"}
    assert impls == {"torch:kda_step", "torch:kda_chunked(64)"}
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "kda; cache: recurrent [" in out and "float32 per request (snapshots at page boundaries)" in out
    assert "kda_layers" in out and "bytes/token of snapshots with prefix caching" in out  # prefix caching on


@pytest.mark.parametrize(
    "option, why",
    [(dict(tensor_parallel_size=2), "KDA layers are not split"), (dict(quantization="int8"), "no quantized holders")],
)
def test_what_kimi_linear_does_not_run_yet_is_refused_with_its_reason(kimi, option, why):
    from mlaserve.config.model import ConfigError

    with pytest.raises(ConfigError, match=f"kimi_linear with {next(iter(option))}=.*{why}"):
        LLM(str(kimi[2]), **option)


def test_the_loader_is_strict_under_the_checkpoint_names(kimi, tmp_path):
    """Every checkpoint tensor used once under its own name (block_sparse_moe experts' w1/w3/w2 read as the MoE
    module's gate/up/down): a missing KDA tensor and an unexpected one are errors naming the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mlaserve.loading.safetensors_source import WeightError

    spec, _, folder = kimi
    tensors = load_file(folder / "model.safetensors")
    kda = next(n for n in tensors if n.endswith("self_attn.A_log"))
    for name, change in (
        ("missing", lambda t: t.pop(kda)),
        ("extra", lambda t: t.update({"model.extra.w": t[kda].clone()})),
    ):
        bad = tmp_path / name
        shutil.copytree(folder, bad)
        t = dict(tensors)
        change(t)
        save_file(t, bad / "model.safetensors")
        match = kda.replace(".", "\\.") if name == "missing" else "unexpected tensor 'model.extra.w'"
        with pytest.raises(WeightError, match=match):
            LLM(str(bad))


def test_bfloat16_keeps_the_recurrent_state_and_dt_bias_in_fp32(kimi):
    """In a bf16 engine the recurrent state stays fp32 (its StateSpec dtype), the conv state takes the cache's
    bf16 (it holds the bf16 projections exactly), dt_bias stays fp32 as transformers keeps it; logits finite. bf16
    logits are not held to the fp32 bound (they round at other points than transformers')."""
    _, ref, folder = kimi
    llm = LLM(str(folder), dtype="bfloat16", max_num_batched_tokens=40)
    logits = llm.prompt_logits(random_ids(100, ref.config.vocab_size, 9))
    assert torch.isfinite(logits).all()
    layer = next(layer for layer in llm.runner.cache.layers if layer.kind.attention == "kda")
    assert layer.tensors["recurrent"].dtype == torch.float32 and layer.tensors["conv"].dtype == torch.bfloat16
    dt = [p.dtype for n, p in llm.loaded.model.named_parameters() if n.endswith("dt_bias")]
    assert dt and set(dt) == {torch.float32}

"""Tensor parallelism (CPU, gloo, 2 processes): TP=2 == TP=1 == transformers, the ledger holds
every rank's route, and a rank whose configuration differs, that raises or that is killed is
caught on rank 0 with every process stopped.

Each engine start spawns a worker (~3-8 s on a loaded 2-core box), so the TP=2 engines are
module-scoped and shared by the comparisons."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch
from conftest import FP32_LOGITS_TOL, compare_logits, finishes_within
from hf_models import hf_logits, random_ids

from mlaserve import LLM
from mlaserve.config.engine import make_options
from mlaserve.config.model import ConfigError
from mlaserve.distributed.group import TensorParallelError, start_tensor_parallel
from mlaserve.distributed.sharding import ShardedSource
from mlaserve.distributed.spawn import live_workers
from mlaserve.executor.forward_batch import SeqChunk
from mlaserve.loading.safetensors_source import WeightError
from mlaserve.observability.trace import NullTracer
from mlaserve.sampling.params import SamplingParams

OPTS = dict(page_size=8, max_num_batched_tokens=24)


def _no_children(before: frozenset = frozenset()) -> bool:
    """No child process beyond `before` (the module-scoped engines' workers) is left."""
    deadline = time.monotonic() + 60  # a bound for a leak, returned from as soon as they are gone
    while set(live_workers()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    return not set(live_workers()) - before


@pytest.fixture(scope="module", params=["v3_odd", "v32", "glm_dsa_shared"])
def pair(request, hf_model_dir):
    """(kind, transformers model, TP=1 LLM, TP=2 LLM) on the same folder."""
    folder, ref = hf_model_dir(request.param)
    one = LLM(str(folder), **OPTS)
    before = frozenset(live_workers())
    two = LLM(str(folder), tensor_parallel_size=2, trace="memory", **OPTS)
    yield request.param, ref, one, two
    two.close()
    assert _no_children(before)


def test_prompt_logits_tp2_equal_tp1_and_transformers(pair):
    """60 tokens in chunks of 24 (chunked prefill; past index_topk=16 on the DSA model)."""
    kind, ref_model, one, two = pair
    ids = random_ids(60)
    ref, a, b = hf_logits(ref_model, ids), one.prompt_logits(ids), two.prompt_logits(ids)
    diff, top1 = compare_logits(b, a)
    assert diff <= 1e-5 and top1 == 1.0, (kind, diff, top1)
    diff, top1 = compare_logits(b, ref)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (kind, diff, top1)


def _mixed_steps(llm: LLM, a: list[int], b: list[int]) -> list[torch.Tensor]:
    """Step 1: prefill a[:-1]. Step 2 (mixed): a's last token as a decode + all of b as a prefill.
    Explicit chunks on fixed pages, through the runner (the engine's step path)."""
    ps = llm.config.cache.page_size
    pages_a, pages_b = tuple(range(0, 8)), tuple(range(8, 16))
    first = [SeqChunk("a", tuple(a[:-1]), 0, pages_a[: -(-(len(a) - 1) // ps)], all_logits=True)]
    mixed = [
        SeqChunk("a", (a[-1],), len(a) - 1, pages_a[: -(-len(a) // ps)]),
        SeqChunk("b", tuple(b), 0, pages_b[: -(-len(b) // ps)], all_logits=True),
    ]
    return [llm.runner.execute(first)[1], llm.runner.execute(mixed)[1]]


def test_mixed_decode_prefill_step_equals_tp1_and_transformers(pair):
    kind, ref_model, one, two = pair
    a, b = random_ids(41, seed=1), random_ids(22, seed=2)
    got, base = _mixed_steps(two, a, b), _mixed_steps(one, a, b)
    two_ledger = [r for r in two.runner.tracer.records if r["num_tokens"] == 1 + len(b)]
    assert two_ledger and two_ledger[-1]["num_decode_tokens"] == 1  # the step really mixed both phases
    for g, o in zip(got, base):
        diff, top1 = compare_logits(g, o)
        assert diff <= 1e-5 and top1 == 1.0, (kind, diff, top1)
    ref = torch.cat([hf_logits(ref_model, a), hf_logits(ref_model, b)])
    diff, top1 = compare_logits(torch.cat([got[0], got[1]]), ref)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (kind, diff, top1)


def test_greedy_generation_identical_and_ledger_has_every_rank(pair):
    kind, _, one, two = pair
    prompts = [random_ids(n, seed=n) for n in (30, 9, 17)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    start = len(two.runner.tracer.records)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
    assert got == want, kind
    records = list(two.runner.tracer.records)[start:]
    steps: dict[int, dict[int, dict]] = {}
    for rec in records:
        steps.setdefault(rec["step"], {})[rec["rank"]] = rec
    assert len(records) == 2 * len(steps) and all(sorted(s) == [0, 1] for s in steps.values())
    for by_rank in steps.values():  # the same work and route on both ranks
        r0, r1 = by_rank[0], by_rank[1]
        assert (r0["num_tokens"], r0["num_decode_tokens"]) == (r1["num_tokens"], r1["num_decode_tokens"])
        assert r0["segments"] == r1["segments"] and r0["layers"] == r1["layers"]
        layers, hidden = two.config.model.num_layers, two.config.model.hidden_size
        assert r1["comm"]["all_reduces"] == 2 * layers + 1  # o_proj and MLP per layer, and the embedding
        assert r1["comm"]["all_reduce_bytes"] == (2 * layers + 1) * r1["num_tokens"] * hidden * 4
    assert any(s[0]["num_decode_tokens"] and s[0]["num_tokens"] > s[0]["num_decode_tokens"] for s in steps.values())


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values())


def test_each_rank_echoes_its_config_and_holds_a_slice(pair):
    """Each rank holds the replicated parameters (latent projections, norms, indexer, gate) and
    half of the rest (within one vocabulary row of embed_tokens + lm_head for an odd V)."""
    kind, _, one, two = pair
    echoes = two.runner.rank_echoes
    assert [e["rank"] for e in echoes] == [0, 1]
    assert echoes[0]["config"] == echoes[1]["config"]
    assert echoes[0]["config"]["parallel.tensor_parallel_size"] == "2"
    heads = one.config.model.num_heads
    assert [e["num_local_heads"] for e in echoes] == [heads // 2] * 2
    assert sum(e["vocab_rows"] for e in echoes) == one.config.model.vocab_size
    full_params = dict(one.loaded.model.named_parameters())
    local = dict(two.loaded.model.named_parameters())  # rank 0 runs in this process
    replicated = _bytes(p for n, p in full_params.items() if local[n].shape == p.shape)
    full = _bytes(full_params.values())
    row = 2 * one.config.model.hidden_size * 4
    for e in echoes:
        assert abs(e["weight_bytes"] - (replicated + (full - replicated) / 2)) <= row, (kind, e, full, replicated)
    assert echoes[0]["weight_bytes"] < full


def test_worker_with_a_different_config_is_caught(hf_model_dir):
    folder, _ = hf_model_dir("v3_odd")
    before = frozenset(live_workers())
    opts = make_options(tensor_parallel_size=2, page_size=16)
    with pytest.raises(ConfigError, match=r"rank 1 runs a different configuration: .*page_size: rank 0 16, rank 1 8"):
        start_tensor_parallel(str(folder), opts, NullTracer(), rank_overrides={1: {"page_size": 8}})
    assert _no_children(before)


def test_worker_that_raises_is_named(hf_model_dir):
    folder, _ = hf_model_dir("v3_odd")
    before = frozenset(live_workers())
    opts = make_options(tensor_parallel_size=2)
    with pytest.raises(TensorParallelError, match=r"rank 1 failed: ConfigError: experts_impl must be one of"):
        overrides = {1: {"experts_impl": "bogus"}}
        finishes_within(300, start_tensor_parallel, str(folder), opts, NullTracer(), rank_overrides=overrides)
    assert _no_children(before)


def test_killed_worker_is_named_and_all_processes_exit(hf_model_dir, monkeypatch):
    """The engine fails a step whose forward pass raised (its requests finish with "error"): here
    with the rank and the signal (its exit seen, not the watchdog's hang timeout); the group is stopped, and
    later requests fail at once, naming it, without a collective."""
    folder, _ = hf_model_dir("v3_odd")
    before = frozenset(live_workers())
    llm = LLM(str(folder), tensor_parallel_size=2, **OPTS)
    (worker,) = llm.runner.group.procs
    os.kill(worker.pid, signal.SIGKILL)
    (out,) = finishes_within(300, llm.generate, [random_ids(12)], SamplingParams(max_tokens=3))
    assert out.outputs[0].finish_reason == "error"
    assert re.search(r"TensorParallelError: tensor-parallel rank 1 died \(killed by SIGKILL\)", out.outputs[0].error)
    assert _no_children(before)
    steps: list = []  # no hang: the group stays failed and no step reaches the collectives
    monkeypatch.setattr(llm.runner, "_execute_all", lambda *a: steps.append(a))
    (again,) = finishes_within(300, llm.generate, [random_ids(12)], SamplingParams(max_tokens=3))
    assert "rank 1 died" in again.outputs[0].error and steps == []
    with pytest.raises(TensorParallelError, match="rank 1 died"):  # the runner itself raises
        llm.runner.execute([SeqChunk("x", (5,), 0, (0,))])


def test_heads_not_divisible_is_a_clear_error_before_any_process_starts(hf_model_dir):
    folder, _ = hf_model_dir("v3_odd")  # 6 heads
    before = frozenset(live_workers())
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 does not divide num_attention_heads=6"):
        LLM(str(folder), tensor_parallel_size=4)
    assert set(live_workers()) == before


def test_a_tensor_that_does_not_split_names_the_tensor_and_n():
    class Source:
        def names(self):
            return ["model.layers.0.self_attn.kv_b_proj.weight"]

        def shape(self, name):
            return (5, 4)

        def where(self, name):
            return "model.safetensors"

    from hf_models import make_config

    from mlaserve.config.model import ModelConfig

    mcfg = ModelConfig.from_hf(make_config("v3_odd").to_dict())
    src = ShardedSource(Source(), mcfg, 1, 2)
    with pytest.raises(
        WeightError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.kv_b_proj.weight'.*2 parts"
    ):
        src.get("model.layers.0.self_attn.kv_b_proj.weight")


def test_gguf_tp2_equals_dequantized_reference():
    """A llama.cpp f16 file split across 2 ranks (each rank reads only its rows / columns) == transformers
    on its dequantized weights; so does the q8_0 file, kept in its blocks per rank, whose down_proj splits
    inside its 32-value blocks (moe_intermediate_size 32 / 2 = 16 columns: held as a wider span,
    distributed/sharding.py UnitSpan; more in test_tp_quantized.py)."""
    from conftest import fixture_dir
    from safetensors.torch import load_file

    folder = fixture_dir("ds3")
    exp = load_file(str(folder / "expected.safetensors"))
    before = frozenset(live_workers())
    with LLM(str(folder / "model-f16.gguf"), tensor_parallel_size=2, max_num_batched_tokens=40) as llm:
        got = llm.prompt_logits(exp["input_ids"].tolist())
    diff, top1 = compare_logits(got, exp["hf_dequant_logits_f16"])
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)
    with LLM(str(folder / "model-q8_0.gguf"), tensor_parallel_size=2, max_num_batched_tokens=40) as llm:
        got = llm.prompt_logits(exp["input_ids"].tolist())
    diff, top1 = compare_logits(got, exp["hf_dequant_logits_q8_0"])
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)
    assert _no_children(before)


def test_cli_generate_with_two_ranks_equals_one(tmp_path, capsys):
    """`mlaserve generate --tensor-parallel-size 2` end to end on the embedded model (vocabulary
    and DSA indexer included): the same greedy text as one process, a ledger record per rank."""
    import json

    from mlaserve.entrypoints.cli import main

    before = frozenset(live_workers())
    args = ["generate", "--no-malloc-tuning", "--max-tokens", "6", "--temperature", "0"]
    assert main([*args, "In the beginning"]) == 0
    one = capsys.readouterr().out
    trace = tmp_path / "route.jsonl"
    assert main([*args, "--tensor-parallel-size", "2", "--trace", str(trace), "In the beginning"]) == 0
    assert capsys.readouterr().out == one
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["rank"] for r in records] == [0, 1] * (len(records) // 2) and len(records) >= 2 * 6
    assert _no_children(before)


@pytest.mark.parametrize("gtype", ["q8_0", "q4_k_m", "f16"])
def test_gguf_slices_are_the_blocks_of_the_whole_tensor(gtype):
    """A rank's rows / columns read block by block == the same part of the whole dequantized tensor,
    also where the column split falls inside a block."""
    from conftest import fixture_dir

    from mlaserve.gguf.quants import GGML_TYPES
    from mlaserve.gguf.read.checkpoint import load_gguf

    path = fixture_dir("ds3") / f"model-{gtype}.gguf"
    tensors = load_gguf(path).tensors
    names = [n for n in tensors.names() if ".mlp.experts.3.down_proj" in n or ".mlp.gate_proj" in n]
    names += [n for n in tensors.names() if n.endswith("self_attn.o_proj.weight")]
    block = {t.name: t.block_size for t in GGML_TYPES.values()}
    split = inside_blocks = 0
    for name in names:
        whole = tensors.get(name)
        for dim in (0, 1):
            half = whole.shape[dim] // 2
            inside = dim == 1 and half % block[tensors.gguf_type(name)] != 0
            for start, stop in ((0, half), (half, whole.shape[dim])):
                part = tensors.get_slice(name, dim, start, stop)
                assert torch.equal(part, whole.narrow(dim, start, stop - start)), (name, dim, start)
            split += 1
            inside_blocks += inside
    assert split == 2 * len(names) and (inside_blocks > 0) == (gtype != "f16"), (split, inside_blocks)


def test_two_nodes_in_network_namespaces_equal_one_process(hf_model_dir, tmp_path):
    """Two "machines": network namespaces joined by a veth pair, one torchrun per namespace
    (node ranks 0 and 1, static rendezvous over 10.x addresses). TP=2 logits == TP=1."""
    from network_namespaces import namespaces_unavailable, run_two_nodes

    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    folder, _ = hf_model_dir("v3_odd")
    ids = random_ids(40)
    want = LLM(str(folder), **OPTS).prompt_logits(ids)
    out = tmp_path / "logits.pt"
    run_two_nodes([str(folder), str(out), ",".join(map(str, ids))], port=29517)
    diff, top1 = compare_logits(torch.load(out), want)
    assert diff <= 1e-5 and top1 == 1.0, (diff, top1)


def test_quantized_checkpoint_with_tensor_parallel_is_refused_before_any_process_starts(hf_model_dir, tmp_path):
    """FP4 expert groups are not split yet (FP8 blocks are: test_tp_fp8.py): a clear error naming the folder
    and the scheme."""
    from mlaserve.quant.writer import write_fp8_folder

    folder, _ = hf_model_dir("v3_odd")
    write_fp8_folder(folder, tmp_path / "fp8", "fp8", (128, 128), experts="fp4")
    before = frozenset(live_workers())
    with pytest.raises(ConfigError, match=r"fp8.*tensor_parallel_size=2 with a quantized checkpoint.*experts fp4"):
        LLM(str(tmp_path / "fp8"), tensor_parallel_size=2)
    assert set(live_workers()) == before


def test_server_with_two_ranks_shows_every_rank(capsys):
    """`mlaserve serve --tensor-parallel-size 2`: a completion equals one process's; /debug/config
    lists every rank's echo and /debug/routes one record per step per rank."""
    from server_process import ServerProcess

    want = LLM().generate(["In the beginning"], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].text
    srv = ServerProcess("--tensor-parallel-size", "2", "--enable-debug-endpoints")
    try:
        body = {"model": srv.model, "prompt": "In the beginning", "max_tokens": 6, "temperature": 0}
        got = srv.http.post(f"{srv.url}/v1/completions", json=body).json()["choices"][0]["text"]
        config = srv.http.get(f"{srv.url}/debug/config").json()
        routes = srv.http.get(f"{srv.url}/debug/routes").json()["records"]
    finally:
        assert srv.stop() == 0, srv.logs()
    assert got == want
    assert [r["rank"] for r in config["ranks"]] == [0, 1] and config["ranks"][0]["config"] == config["ranks"][1][
        "config"
    ]
    assert [r["rank"] for r in routes] == [0, 1] * (len(routes) // 2) and len(routes) >= 12

"""CUDA graphs' bookkeeping on the CPU: the batch and context buckets, each refusal of plan_graph with its reason,
the cuda_graphs option (resolved with its source, 'on' refused off CUDA), the ledger's graph field, and the
tensor-parallel refusal on CUDA naming the missing piece."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hf_models import make_config, random_ids

from mlaserve import LLM, SamplingParams
from mlaserve.attention.plan import StepRoute
from mlaserve.attention.router import route
from mlaserve.config.engine import make_options, resolve
from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.executor.graph_plan import GraphSettings, batch_bucket, batch_buckets, context_bucket, plan_graph

PAGE = 4
ON = GraphSettings(enabled=True, max_batch=8, page_size=PAGE, num_pages=32)


def _decode(n: int, ctx: int = 6, **kw) -> SeqChunk:
    return SeqChunk(f"r{n}", (5,), ctx, tuple(range(n * 4, n * 4 + ctx // PAGE + 1)), **kw)


def _plan(chunks, settings=ON, native=False, threshold=1, **route_kw):
    batch = ForwardBatch.build(chunks, PAGE, threshold, pad_slot=999)
    kw = dict(mla_path="auto") | route_kw
    return plan_graph(batch, StepRoute((route(batch, **kw),)), settings, native)


def test_buckets():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert [batch_bucket(n, 64) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    assert batch_bucket(65, 64) is None
    assert [context_bucket(p, 32) for p in (1, 2, 3, 9, 32)] == [1, 2, 4, 16, 32]
    assert context_bucket(5, 6) == 6  # capped at the pool: no sequence holds more pages


def test_pure_decode_is_replayed_with_its_buckets():
    plan = _plan([_decode(i, ctx=6 + 4 * i) for i in range(3)])  # longest 15 tokens: 4 pages
    assert plan.replay and plan.reason is None
    assert (plan.bucket, plan.context_pages, plan.real_rows) == (4, 4, 3)
    assert plan.to_record() == {"replayed": True, "bucket": 4, "context_pages": 4, "rows": 3}
    assert plan.shape == (("mla", "absorbed", False, False, None),)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("off", "cuda_graphs off"),
        ("prefill", "prefill or mixed step"),
        ("mixed", "prefill or mixed step"),
        ("verify", "speculative verify step"),
        ("two_token_decode", "more than one token"),
        ("request_states", "request states"),
        ("kv8", "8-bit kv_cache_dtype"),
        ("native", "native decode layers"),
        ("too_many", "9 sequences > cuda_graph_max_batch 8"),
        ("native_backend", "attention backend 'native'"),
        ("experts", "routed experts in float32"),
    ],
)
def test_refusals_say_why(case, reason):
    d = [_decode(0), _decode(1)]
    prefill = SeqChunk("p", tuple(range(3, 9)), 0, (20, 21))
    args = {
        "off": (d, replace(ON, enabled=False)),
        "prefill": ([prefill],),
        "mixed": (d + [prefill],),
        "verify": ([_decode(0, num_draft=1)],),
        "request_states": (d, replace(ON, request_states=True)),
        "kv8": (d, replace(ON, quantized_cache=True)),
        "native": (d, ON, True),
        "experts": (d, replace(ON, model_blocker="routed experts in float32: ...")),
        "too_many": ([_decode(i) for i in range(9)],),
    }.get(case, (d,))
    kw = {}
    if case == "two_token_decode":
        args, kw = ([SeqChunk("t", (5, 6), 6, (0, 1))], ON, False, 2), {}
    if case == "native_backend":
        kw = dict(backend="native")
    plan = _plan(*args, **kw)
    assert not plan.replay and reason in plan.reason
    assert plan.to_record() == {"replayed": False, "reason": plan.reason}


def test_fp32_sparse_selection_is_replayed_and_keyed_apart():
    """DSA with fp32 scoring replays; selecting and non-selecting steps are different graphs."""
    short = _plan([_decode(0, ctx=6)], sparse=True, index_topk=16)
    long = _plan([_decode(0, ctx=40)], sparse=True, index_topk=16)
    assert short.replay and long.replay and short.key != long.key
    assert long.shape == (("mla", "absorbed", True, True, "fp32"),) and "index_scoring" not in long.to_record()


def test_bf16_scoring_is_replayed_in_fp32_and_recorded():
    """bf16_then_fp32 reads its rescoring width on the host: a replayed step scores in fp32, and says so."""
    plan = _plan([_decode(i, ctx=40) for i in range(2)], sparse=True, index_topk=16, key_dtype=torch.bfloat16)
    assert plan.replay and plan.rescored and plan.to_record()["index_scoring"] == "fp32"
    assert plan.shape == (("mla", "absorbed", True, True, "fp32"),)


def _config(**opts):
    model = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    return resolve(model, make_options(**opts), False)


def test_option_resolved_with_its_source():
    cfg = _config(device="cpu")
    got = {s.name: s for s in cfg.provenance}
    assert cfg.runtime.cuda_graphs is False and got["cuda_graphs"].value is False
    assert "off on device 'cpu'" in got["cuda_graphs"].source
    assert cfg.runtime.cuda_graph_max_batch == 64 and got["cuda_graph_max_batch"].source == "engine default (64)"
    assert _config(device="cpu", cuda_graphs="off").runtime.cuda_graphs is False
    with pytest.raises(ConfigError, match="cuda_graphs='on' needs device 'cuda'.*device is 'cpu'"):
        _config(device="cpu", cuda_graphs="on")
    with pytest.raises(ConfigError, match="cuda_graphs must be one of"):
        _config(device="cpu", cuda_graphs="yes")
    with pytest.raises(ConfigError, match="cuda_graph_max_batch"):
        _config(device="cpu", cuda_graph_max_batch=0)


def test_auto_is_on_for_cuda_and_tp_on_cuda_names_the_missing_piece(monkeypatch):
    """Resolution only (no CUDA tensor is made): a machine where torch sees a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = _config(device="cuda", dtype="float32")
    got = {s.name: s for s in cfg.provenance}
    assert cfg.runtime.cuda_graphs is True and got["cuda_graphs"].source.startswith(
        "engine default (auto: device cuda; not yet run on a GPU"
    )
    with pytest.raises(ConfigError, match="NCCL.*not implemented.*2\\+ GPUs"):
        _config(device="cuda", dtype="float32", tensor_parallel_size=2)


def test_ledger_says_every_step_ran_eagerly_and_why(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder), trace="memory")
    llm.generate([random_ids(9, seed=1), random_ids(5, seed=2)], SamplingParams(temperature=0, max_tokens=3))
    recs = llm.runner.tracer.records
    assert recs and all(r["graph"]["replayed"] is False for r in recs)
    assert {r["graph"]["reason"] for r in recs} == {
        "cuda_graphs off (engine default (auto: off on device 'cpu', on for cuda only))"
    }


def test_capture_blocker_reads_the_model():
    from torch import nn

    from mlaserve.executor.padded_decode import capture_blocker
    from mlaserve.models.deepseek import MLAForCausalLM

    model = MLAForCausalLM(ModelConfig.from_hf(make_config("v3_yarn").to_dict()))
    assert "routed experts in float32" in capture_blocker(model)
    model = model.to(torch.bfloat16)
    assert capture_blocker(model) is None
    moe = model.model.layers[1].mlp
    moe.experts.impl = "loop"
    assert "experts_impl 'loop'" in capture_blocker(model)
    moe.experts.impl = "grouped_mm"

    class OtherLayer(nn.Module):
        pass

    model.model.layers[2] = OtherLayer()
    assert capture_blocker(model) == "decoder layers of class OtherLayer (not checked for capture)"

"""The one-call decode layer's tensor-parallel reduce hook (mls_layer_t.reduce), in one process: with an
all_reduce that sums over one rank (returns its input) the hooked call gives the same bits as the call without
the hook (the buffer and length the C code hands over are o_proj's and the MLP's whole outputs), it is called
twice per layer per step, and an exception raised in it (a rank that died) comes out of the step unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import fixture_dir
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.executor.forward_batch import SeqChunk
from mlaserve.models.deepseek import single_process
from mlaserve.quant.ggml_layer import GGUFDecodeLayer
from mlaserve.sampling.params import SamplingParams


class RankDied(RuntimeError):
    pass


def _hook(llm: LLM, all_reduce) -> None:
    for layer in llm.loaded.model.model.layers:
        assert layer.native_layer is not None  # the one call is on (one process, Q8_0 native)
        layer.all_reduce = all_reduce  # read when the call is built: the hook goes into its struct
        layer.native_layer = GGUFDecodeLayer(layer, layer.self_attn.cfg.rope.interleaved)
        layer.all_reduce = single_process  # the per-op path (prefill) as before: only the one call calls the hook


def _decode_logits(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def test_reduce_hook_over_one_rank_changes_no_bit_and_runs_twice_per_layer():
    path = str(fixture_dir("ds3") / "model-q8_0.gguf")
    prompts = [random_ids(n, seed=n) for n in (12, 5, 9)]
    plain = LLM(path, max_num_batched_tokens=40)
    want = _decode_logits(plain, prompts)
    calls: list[int] = []

    def one_rank(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.numel())
        return x.clone()  # a new tensor: the hook copies it back into the C call's buffer

    _hook(plain, one_rank)
    got = _decode_logits(plain, prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]  # the same bits
    layers, d = plain.config.model.num_layers, plain.config.model.hidden_size
    # 3 decode steps of 3 requests (the 4th token of each is sampled from the 3rd step's logits): o_proj's and
    # the MLP's [3, D] outputs of every layer
    assert calls == [3 * d] * (2 * layers * 3), calls


def test_an_exception_in_the_reduce_comes_out_of_the_step():
    llm = LLM(str(fixture_dir("ds3") / "model-q8_0.gguf"), max_num_batched_tokens=40)

    def died(x: torch.Tensor) -> torch.Tensor:
        raise RankDied("tensor-parallel rank 1 died (killed by SIGKILL)")

    _hook(llm, died)
    llm.runner.execute([SeqChunk("a", (5, 6, 7), 0, (0,))])  # prefill: per op, no hook
    with pytest.raises(RankDied, match="rank 1 died"):
        llm.runner.execute([SeqChunk("a", (8,), 3, (0,))])  # decode: the one call, whose reduce raises

"""Quantization at load (quantization="int8" / "int4": Q8_0 / Q4_0, 32-value blocks along a row) under tensor
parallelism: each rank quantizes its own slices after the fill (distributed/sharding.py, "at load").

Why that is one process's quantization: a block is 32 consecutive values of one row, quantized from those
values alone. Row splits (q_b_proj by heads, gate / up by units, the vocabulary rows of embed_tokens /
lm_head) keep whole rows; o_proj's column split of the ds3 fixture (128 -> 64 columns) falls on block
boundaries; its routed / shared experts' I_e = 32 split in two (16 units: half a block) is held as the
covering block (UnitSpan: down's 32 columns with the checkpoint's values, gate / up rows zero outside the
rank's units), so every block a rank quantizes is a block one process quantizes, byte for byte (checked
below without starting a process). An o_proj whose head columns fall inside blocks (the tiny v3 model: 4
heads x 24 = 96 columns, 48 per rank) cannot be: it stays float on every rank, named at load.

Bound: FP32_LOGITS_TOL (1e-5, conftest.py): the same blocks, products in fp32 (activations="float", the
default for quantization at load) summed in another order. Measured on ds3: TP=2 vs one process 2.6e-6
(int8; int4 by hand 2.4e-6), greedy tokens identical.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FP32_LOGITS_TOL, compare_logits, fixture_dir
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.config.engine import make_options
from mlaserve.distributed.sharding import ShardedSource, at_load_split_notes, unit_spans
from mlaserve.distributed.spawn import live_workers
from mlaserve.gguf.convert.writer import quantize_q4_0, quantize_q8_0
from mlaserve.loading.model_loader import open_checkpoint
from mlaserve.sampling.params import SamplingParams

OPTS = dict(max_num_batched_tokens=40)


def test_tp2_equals_one_process_with_the_same_quantization():
    """int8 (one worker start; int4 splits the same way, its blocks are checked below without a process and
    its TP=2 run measured 2.4e-6 from one process by hand)."""
    scheme = "int8"
    from safetensors.torch import load_file

    folder = fixture_dir("ds3")
    ids = load_file(str(folder / "expected.safetensors"))["input_ids"].tolist()
    prompts = [random_ids(n, seed=n) for n in (21, 6)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    one = LLM(str(folder), quantization=scheme, **OPTS)
    before = frozenset(live_workers())
    with LLM(str(folder), quantization=scheme, tensor_parallel_size=2, **OPTS) as two:
        diff, top1 = compare_logits(two.prompt_logits(ids), one.prompt_logits(ids))
        assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (scheme, diff, top1)
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == want
        # every rank quantized the same module kinds into the same holders as one process
        assert two.loaded.quantized_at_load == one.loaded.quantized_at_load
        mine = {k: v for k, v in two.runner.rank_echoes[0]["holders"].items()}
        assert mine and all(e["holders"] == mine for e in two.runner.rank_echoes), two.runner.rank_echoes
        rank1 = two.runner.rank_echoes[1]["notes"]
        assert any("rank 1: moe_intermediate_size units [16, 32) held as [0, 32)" in n for n in rank1), rank1
        experts = two.loaded.model.model.layers[1].mlp.experts
        assert type(experts).__name__ == "GGUFExperts", type(experts)  # spanned: whole blocks, quantized
    assert not set(live_workers()) - before


@pytest.mark.parametrize("quantize,block_bytes", [(quantize_q8_0, 34), (quantize_q4_0, 18)])
def test_each_rank_quantizes_one_process_blocks(quantize, block_bytes):
    """Without a process: each rank's slices as the loader reads them (ShardedSource with the at-load spans),
    quantized (Q8_0: int8, Q4_0: int4), are byte for byte the blocks of one process's quantized tensor they
    cover."""
    path = fixture_dir("ds3")
    ck = open_checkpoint(path, make_options(quantization="int8"))
    src, cfg = ck.source, ck.model_cfg
    names = {
        "model.layers.1.self_attn.o_proj.weight": 1,  # columns by heads: 2 whole blocks per row each
        "model.layers.0.mlp.gate_proj.weight": 0,  # rows by units (q_b_proj's 48 columns: float in both)
        "model.layers.1.mlp.experts.3.down_proj.weight": 1,  # columns: the covering block (a span)
        "model.layers.1.mlp.shared_experts.down_proj.weight": 1,
        "model.layers.0.mlp.down_proj.weight": 1,  # the dense MLP: 256 -> 128, 4 whole blocks
        "lm_head.weight": 0,  # vocabulary rows
    }
    for rank in (0, 1):
        spans = unit_spans(src, cfg, rank, 2, at_load=32)
        assert spans["experts"].widened and not spans["dense"].widened
        sharded = ShardedSource(src, cfg, rank, 2, spans)
        assert at_load_split_notes(sharded, 32, "int8", f"rank {rank}") == []
        for name, dim in names.items():
            whole = src.get(name)
            part = sharded.get(name)
            blocks = quantize(part).view(part.shape[0], -1, block_bytes)
            full = quantize(whole).view(whole.shape[0], -1, block_bytes)
            span = sharded.span(name)
            if dim == 0:  # whole rows: rank r's rows of the whole tensor's blocks
                first = part.shape[0] * rank if not name.startswith("lm_head") else sharded.vocab[0]
                assert torch.equal(blocks, full[first : first + part.shape[0]]), (name, rank)
            else:  # whole blocks of every row: their column range of the whole tensor's blocks
                first = span.first if span is not None else part.shape[1] * rank
                assert first % 32 == 0 and part.shape[1] % 32 == 0, (name, rank, first, part.shape)
                assert torch.equal(blocks, full[:, first // 32 : (first + part.shape[1]) // 32]), (name, rank)


def test_o_proj_columns_inside_blocks_are_named(hf_model_dir):
    """4 heads x v_head_dim 24: o_proj's 96 columns are 3 whole blocks (one process quantizes them), each rank's
    48 are not: named at load, kept float on every rank; without the at-load block (GGUF-only spans) an
    intermediate dim of whole 32-blocks split in half would be read as half a block, which the spans avoid."""
    folder, _ = hf_model_dir("v3_yarn")
    ck = open_checkpoint(folder, make_options(quantization="int8"))
    src, cfg = ck.source, ck.model_cfg
    for rank in (0, 1):
        spans = unit_spans(src, cfg, rank, 2, at_load=32)
        notes = at_load_split_notes(ShardedSource(src, cfg, rank, 2, spans), 32, "int8", f"rank {rank}")
        o_proj = [n for n in notes if "self_attn.o_proj.weight" in n]
        assert len(o_proj) == cfg.num_layers == len(notes), notes
        cols = f"[{48 * rank}, {48 * (rank + 1)})"
        assert all(cols in n and "kept float on every rank" in n for n in o_proj), notes
        # I_e = 32 -> 16 per rank: the covering block; I = 128 -> 64: two whole blocks, not widened
        assert spans["experts"].width == 32 and spans["experts"].first == 0
        assert not spans["dense"].widened
        assert unit_spans(src, cfg, rank, 2)["experts"].width == 16  # a float load: the even split

"""Tensor parallelism over a DeepSeek FP8 block checkpoint (CPU, gloo, 2 processes): each rank keeps its
slices in e4m3 (FP8Linear / FP8Experts, the same holders as one process) with their block scales, and TP=2
== TP=1 == transformers on the checkpoint's dequantized weights.

Two block shapes: the release's 128 x 128 (every tiny weight is one partial block, so rank 1's slices all
start inside a block: its scales are held on the finer grid, sharding.regrid_fp8) and (16, 32) on the
kimi_k2 layout (hidden 72, I_e 40 -> 20 per rank: gcd 4 rows; partial edge blocks).

Bound: FP32_LOGITS_TOL (1e-5, conftest.py). Measured: TP=2 vs TP=1 2.7e-6 (v3_odd, 128 x 128) and 2.3e-6
(kimi_k2, 16 x 32), logits up to ~4.4 in size: partial sums of the ranks added in another order."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import FP32_LOGITS_TOL, compare_logits
from hf_models import hf_logits, random_ids
from test_fp8 import _hf_from, dequantized_folder

from mlaserve import LLM
from mlaserve.distributed.sharding import ShardedSource
from mlaserve.distributed.spawn import live_workers
from mlaserve.distributed.worker import held_weights
from mlaserve.quant import fp8_block
from mlaserve.quant.linear import FP8Experts, FP8Linear
from mlaserve.quant.writer import write_fp8_folder
from mlaserve.sampling.params import SamplingParams

OPTS = dict(page_size=8, max_num_batched_tokens=24)


@pytest.fixture(scope="module", params=[("v3_odd", (128, 128)), ("kimi_k2", (16, 32))], ids=lambda p: p[0])
def fp8_pair(request, hf_model_dir, tmp_path_factory):
    """(kind, block, FP8 folder, transformers on its dequantized weights, TP=1 LLM, TP=2 LLM)."""
    kind, block = request.param
    src, _ = hf_model_dir(kind)
    tmp = tmp_path_factory.mktemp(f"{kind}-tp-fp8")
    write_fp8_folder(src, tmp / "fp8", "fp8", block)
    ref = _hf_from(dequantized_folder(tmp / "fp8", tmp / "dequant"))
    one = LLM(str(tmp / "fp8"), **OPTS)
    before = frozenset(live_workers())
    two = LLM(str(tmp / "fp8"), tensor_parallel_size=2, **OPTS)
    yield kind, block, tmp / "fp8", ref, one, two
    two.close()
    deadline = time.monotonic() + 60  # a bound for a leaked worker, left as soon as it is gone
    while set(live_workers()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(live_workers()) - before


def test_fp8_tp2_logits_equal_tp1_and_transformers(fp8_pair):
    kind, _, _, ref, one, two = fp8_pair
    ids = random_ids(40)
    want, a, b = hf_logits(ref, ids), one.prompt_logits(ids), two.prompt_logits(ids)
    diff, top1 = compare_logits(b, a)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (kind, diff, top1)
    diff, top1 = compare_logits(b, want)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (kind, diff, top1)


def test_fp8_tp2_greedy_tokens_identical(fp8_pair):
    kind, _, _, _, one, two = fp8_pair
    prompts = [random_ids(n, seed=n) for n in (30, 9, 17)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
    assert got == want, kind


def test_fp8_every_rank_keeps_e4m3_holders(fp8_pair):
    """Every rank holds the same FP8 holders as one process, its e4m3 bytes half of one process's for the
    split tensors (the replicated latent projections whole); resident weights well under 1/N of fp32."""
    kind, _, _, _, one, two = fp8_pair
    mine = held_weights(one.loaded.model)
    assert set(mine["holders"]) == {"FP8Experts fp8 e4m3", "FP8Linear fp8 e4m3"}
    float_bytes = sum(  # the fp32 model one process would hold without the FP8 holders
        m.weight.numel() * 4 if isinstance(m, FP8Linear) else 0 for m in one.loaded.model.modules()
    ) + sum(
        (m.gate_up_proj.numel() + m.down_proj.numel()) * 4
        for m in one.loaded.model.modules()
        if isinstance(m, FP8Experts)
    )
    for e in two.runner.rank_echoes:
        assert e["holders"] == mine["holders"], (kind, e["rank"])
        # rank 1's slices start inside the blocks: its echo says which grid its scales are on
        assert any("scales are held on" in note for note in e["notes"]) == (e["rank"] == 1), e["notes"]
        assert e["stored_bytes"] <= float_bytes / 4 / 2 * 1.5, (kind, e["stored_bytes"], float_bytes)
    full = dict(one.loaded.model.named_parameters())
    halves = 0
    for name, p in two.loaded.model.named_parameters():  # rank 0, in this process
        if p.dtype != fp8_block.FP8:
            continue
        assert full[name].dtype == fp8_block.FP8
        assert p.numel() in (full[name].numel(), full[name].numel() // 2), (name, p.shape, full[name].shape)
        halves += 2 * p.numel() == full[name].numel()
    assert halves >= 6, halves


def test_fp8_rank_scales_are_the_stored_blocks_scales(fp8_pair, hf_model_dir):
    """Each rank's (weight, scale) on its grid dequantizes to exactly the rank's slice of the whole
    dequantized weight, for every quantized tensor (rows, columns, replicated; edge blocks)."""
    from mlaserve.config.engine import make_options
    from mlaserve.loading.model_loader import open_checkpoint

    kind, block, folder, _, _, _ = fp8_pair
    ck = open_checkpoint(folder, make_options())
    whole = ck.source
    regridded = 0
    for rank in (0, 1):
        src = ShardedSource(whole, ck.model_cfg, rank, 2)
        grid = src.regrid_fp8(ck.scheme.scale_name, block)
        regridded += grid != block
        for name in [n for n in whole.names() if n.endswith(".weight_scale_inv")]:
            w = name.removesuffix("_scale_inv")
            got = fp8_block.dequantize_reference(src.get(w), src.get(name), grid)
            want = fp8_block.dequantize_reference(whole.get(w), whole.get(name), block)
            (r0, r1), (c0, c1) = src._ranges(w)
            assert torch.equal(got, want[r0:r1, c0:c1]), (kind, rank, w)
    assert regridded == 1, (kind, regridded)  # rank 1's slices start inside the blocks; rank 0's at 0

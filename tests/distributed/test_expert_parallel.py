"""Expert parallelism (CPU, gloo, 2 processes): each rank holds a contiguous range of every MoE layer's routed
experts in their stored form (float stacks, GGUF blocks), everything else replicated; the partial routed sums
are all-reduced once per MoE layer. EP=2 == one process == transformers (float).

Bound: FP32_LOGITS_TOL (1e-5, conftest.py). Measured: EP=2 vs one process on the ds3 fixture's prompt logits
(rewritten so that a token's experts fall on both ranks) f32 / Q8_0 / Q4_K_M 7.8e-7 / 0 / 0, on the 5-expert float
model 7.2e-7 (vs transformers 7.2e-7): the same experts' outputs summed in another order (each rank's partial
sum, then the all-reduce), fp32 rounding only; greedy tokens identical."""

from __future__ import annotations

import pytest
import torch
from conftest import fixture_dir
from hf_models import hf_logits, random_ids
from parallel_compare import OPTS, assert_equals_one_process, save_uneven_experts

from mlaserve import LLM
from mlaserve.config.model import ConfigError
from mlaserve.distributed.expert_parallel import expert_range
from mlaserve.observability.expert_load import summarize_expert_load


def test_expert_ranges_are_contiguous_and_the_first_ranks_take_the_remainder():
    assert [expert_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [expert_range(7, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [expert_range(8, r, 2) for r in range(2)] == [(0, 4), (4, 8)]
    with pytest.raises(ConfigError, match="expert_parallel_size=3 exceeds n_routed_experts=2"):
        expert_range(2, 0, 3)


def _compare(path: str, ids: list[int], ref: torch.Tensor | None = None):
    """(one process, EP=2 LLM) on `path`: prompt logits within the bound (and of the reference), greedy
    tokens identical, every rank's experts ~1/N of the layer's bytes, the ledger's pairs all accounted."""
    one = LLM(path, **OPTS)
    with LLM(path, expert_parallel_size=2, trace="memory", **OPTS) as two:
        records = assert_equals_one_process(one, two, ids, ref, max_tokens=6, what=path)
        _check_holdings(one, two)
        _check_ledger(two, records)


def _check_holdings(one: LLM, two: LLM) -> None:
    """Each rank holds its range of every MoE layer's experts and only those: per layer the ranks' bytes add
    up to one process's, each rank's share is its count of experts over E (the stacks are per expert)."""
    from mlaserve.distributed.expert_parallel import expert_bytes
    from mlaserve.models.moe import MoE

    whole = {
        n: (m.gate.cfg.n_routed_experts, expert_bytes(m.experts))
        for n, m in one.loaded.model.named_modules()
        if isinstance(m, MoE)
    }
    echoes = two.runner.rank_echoes
    assert whole and len(echoes) == 2
    for layer, (e, nbytes) in whole.items():
        held = [next(h for h in echo["routed_experts"] if h["layer"] == layer) for echo in echoes]
        assert [tuple(h["experts"]) for h in held] == [expert_range(e, r, 2) for r in range(2)]
        assert sum(h["bytes"] for h in held) == nbytes, layer
        for h in held:
            assert h["bytes"] * e == nbytes * (h["experts"][1] - h["experts"][0]), (layer, h)


def _check_ledger(two: LLM, records: list[dict]) -> None:
    """Every step's expert_load record: the ranks' received pairs add up to tokens x k x MoE layers."""
    cfg = two.config.model
    moe_layers = sum(kind == "moe" for kind in cfg.mlp_layer_types)
    steps = {r["step"]: r["num_tokens"] for r in records if r.get("rank") == 0 and "num_tokens" in r}
    loads = [r for r in records if "expert_load" in r]
    assert loads and len(loads) == len(steps)
    for rec in loads:
        assert [x["rank"] for x in rec["expert_load"]] == [0, 1]
        pairs = sum(x["pairs"] for x in rec["expert_load"])
        assert pairs == steps[rec["step"]] * cfg.moe.num_experts_per_tok * moe_layers, rec
    # `trace summarize`'s per-rank totals: the pairs of the run add up to what one process routes, the worker's
    # all-reduce payload is one fp32 hidden row per token and MoE layer
    ep = summarize_expert_load(records).to_json()
    tokens = sum(steps.values())
    assert sum(r["pairs"]["trunk"] for r in ep["ranks"]) == tokens * cfg.moe.num_experts_per_tok * moe_layers
    assert ep["ranks"][1]["all_reduce_bytes"] == tokens * cfg.hidden_size * 4 * moe_layers, ep


@pytest.mark.parametrize("form", ["f32", "q8_0", "q4_k_m"])
def test_ep2_equals_one_process_on_the_gguf_fixture(form, tmp_path):
    """The fixture routes group-limited (2 groups of 4, topk_group 1): at EP=2 the groups are the ranks' ranges,
    so every token's experts sit on one rank and nothing crosses. Rewritten with topk_group 2 (every expert
    eligible) a token's two experts are often on both ranks: the partial sums and the all-reduce are exercised
    (one process reads the same rewritten file)."""
    import gguf
    from gguf_helpers import rewrite_gguf

    src = fixture_dir("ds3") / f"model-{form}.gguf"
    dst = rewrite_gguf(
        src, tmp_path / src.name, set_keys={"deepseek2.expert_group_used_count": (2, gguf.GGUFValueType.UINT32)}
    )
    _compare(str(dst), random_ids(20, vocab=512, seed=3))


def test_ep2_uneven_experts_equals_one_process_and_transformers(tmp_path):
    """5 routed experts over 2 ranks (3 + 2), a float checkpoint made here; transformers is the reference."""
    model = save_uneven_experts(tmp_path)
    ids = random_ids(16, seed=5)
    _compare(str(tmp_path), ids, hf_logits(model, ids))

"""Tensor x expert parallelism (CPU, gloo, 4 processes: TP=2 x EP=2): process g = e * 2 + t holds the heads,
intermediate units and vocabulary rows of TP rank t and the routed experts of EP rank e (distributed/mesh.py);
attention, dense MLP, shared expert and embedding partials are all-reduced over its TP group, the routed experts'
partials over its EP group, and the logits come from rank 0's TP group. == one process (and == transformers on a
float checkpoint).

Bound: FP32_LOGITS_TOL (1e-5, conftest.py): the same weights, partial sums added in another order (the TP
units' and the EP ranks'). Measured max |TP2xEP2 - one process| on the prompt logits (logits up to ~5): ds3
Q4_K_M 3.0e-6 (its I_e/2 = 16 split falls inside the Q5_0 / Q8_0 down projections' 32-value blocks: the widened
spans of tensor parallelism, per expert), Q8_0 2.9e-6 (not in the suite, for time); the 5-expert float
kimi_k2 folder 2.6e-6, and 2.6e-6 from transformers; greedy tokens identical. Broken on purpose (the routed
partials all-reduced over the whole world instead of the EP group): Q4_K_M off by 3.2."""

from __future__ import annotations

import pytest
import torch
from conftest import fixture_dir
from hf_models import hf_logits, random_ids
from parallel_compare import OPTS, assert_equals_one_process, save_uneven_experts
from test_int4_experts import folders  # noqa: F401 -- the Kimi-K2.5 INT4 folder fixture

from mlaserve import LLM
from mlaserve.distributed.expert_parallel import expert_range
from mlaserve.distributed.mesh import logits_sizes, place_of


def test_places_and_groups_are_plain_data():
    """g = e * T + t; TP groups are the T ranks of one e, EP groups the E ranks of one t; rank 0 gathers the
    logits from its own TP group only."""
    places = [place_of(g, 2, 3) for g in range(6)]
    assert [(p.tp_rank, p.ep_rank) for p in places] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert logits_sizes(801, 2, 3) == (401, 400, 0, 0, 0, 0)
    assert logits_sizes(801, 1, 3) is None


def _compare(path: str, ids: list[int], ref: torch.Tensor | None = None, experts_over: int = 2, **opts) -> None:
    """experts_over: the processes the experts are spread over (2: the EP ranks; 4: every process, whole)."""
    one = LLM(path, **OPTS, **opts)
    with LLM(path, tensor_parallel_size=2, expert_parallel_size=2, trace="memory", **OPTS, **opts) as four:
        records = assert_equals_one_process(one, four, ids, ref, max_tokens=5, what=path)
        echoes = four.runner.rank_echoes
    cfg = one.config.model
    e = cfg.moe.n_routed_experts
    for g, echo in enumerate(echoes):  # each process: its TP rank's heads and vocabulary, its EP rank's experts
        t, ep = g % 2, g // 2
        assert echo["num_local_heads"] == cfg.num_heads // 2
        assert echo["vocab_rows"] == (cfg.vocab_size + 1 - t) // 2
        held = expert_range(e, ep, 2) if experts_over == 2 else expert_range(e, g, 4)
        assert {tuple(h["experts"]) for h in echo["routed_experts"]} == {held}
        assert echo["notes"] and all(note.startswith(f"rank {g}: ") for note in echo["notes"]), echo["notes"]
    # per step and process: 2 all-reduces per layer + the embedding's (TP group), 1 per MoE layer (EP group / world)
    moe_layers = sum(kind == "moe" for kind in cfg.mlp_layer_types)
    comm = [r["comm"]["all_reduces"] for r in records if "comm" in r]
    assert len(comm) >= 3 and set(comm) == {2 * cfg.num_layers + 1 + moe_layers}, comm


def test_tp2_x_ep2_equals_one_process_on_the_gguf_fixture(tmp_path):
    """ds3 rewritten with topk_group 2 (every expert eligible) so a token's experts fall on both EP ranks."""
    import gguf
    from gguf_helpers import rewrite_gguf

    src = fixture_dir("ds3") / "model-q4_k_m.gguf"
    dst = rewrite_gguf(
        src, tmp_path / src.name, set_keys={"deepseek2.expert_group_used_count": (2, gguf.GGUFValueType.UINT32)}
    )
    # exact products (activations="float"): the partitioning is what this holds to fp32 rounding. Under int8
    # activations (the default for Q4_K) the 4 processes and the one quantize fp32 inputs that differ by rounding
    # (partial sums in another order), and an activation within that of a rounding boundary takes the neighbouring
    # code in one of them: 0.0048 on an AVX-512 Xeon (measured; 3e-6 on an AMD EPYC, where no code flipped), the
    # size of one flipped code, not a fault of the split; with activations="int8" for Q5_0 too, 0.042 (open).
    _compare(str(dst), random_ids(20, vocab=512, seed=3), activations="float")


def test_tp2_x_ep2_uneven_experts_equals_transformers(tmp_path):
    """5 routed experts over 2 EP ranks (3 + 2), each expert's 40 units over 2 TP ranks; a float folder."""
    model = save_uneven_experts(tmp_path)
    ids = random_ids(16, seed=5)
    _compare(str(tmp_path), ids, hf_logits(model, ids))


def test_tp2_x_ep2_on_an_fp8_block_folder_equals_one_process(hf_model_dir, tmp_path):
    """kimi_k2 as DeepSeek FP8 with (16, 32) blocks: TP rank 1's slices start inside blocks (its scales on the
    finer grid, sharding.regrid_fp8) and each EP rank holds its FP8Experts. Measured 2.3e-6 from one process."""
    from mlaserve.quant.writer import write_fp8_folder

    write_fp8_folder(hf_model_dir("kimi_k2")[0], tmp_path / "fp8", "fp8", (16, 32))
    _compare(str(tmp_path / "fp8"), random_ids(20))


@pytest.mark.parametrize("form", ["fp4", "int4"])
def test_tp2_x_ep2_holds_fp4_and_int4_experts_whole(form, hf_model_dir, tmp_path, request):
    """Expert groups tensor parallelism does not split (DeepSeek-V4-style e2m1, Kimi-K2.5 INT4 packed): under
    TP x EP the experts are held whole, spread over all 4 processes (2 of the 8 each), their partials summed
    over the world and added by TP rank 0 of each group only (the others add 0) before the TP all-reduce.
    Measured: fp4 2.5e-6, int4 2.7e-6 from one process. Broken on purpose (every TP rank adding the sum): fp4
    off by 2.6."""
    from mlaserve.quant.writer import write_fp8_folder

    if form == "int4":
        folder = request.getfixturevalue("folders")[0]
    else:
        folder = tmp_path / "fp4"
        write_fp8_folder(hf_model_dir("v3_yarn")[0], folder, "fp8", (16, 16), experts="fp4")
    _compare(str(folder), random_ids(20), experts_over=4)

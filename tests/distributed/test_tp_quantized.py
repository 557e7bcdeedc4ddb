"""Tensor parallelism over GGUF weights kept in their blocks (CPU, gloo, 2 processes): each rank reads its
slice of the file into the same holders as one process (GGUFLinear / GGUFExperts / GGUFEmbedding /
GGUFHeads on the native kernels), and TP=2 == TP=1 == transformers on the file's dequantized weights.

The ds3 fixture's files have both kinds of split: Q8_0 o_proj (128 -> 64 columns, 2 blocks) splits on
blocks; its down projections of the routed and shared experts (I_e = 32 -> 16 columns of a 32-value
block), and Q4_K_M's dense down_proj (Q4_K, 256 -> 128 columns of a 256-value super-block) do not, and
are held as wider spans with zero units (distributed/sharding.py UnitSpan).

Bound: FP32_LOGITS_TOL (1e-5, conftest.py). Measured on these files: TP=2 vs TP=1 2.9e-6 (Q8_0) and
2.6e-6 (Q4_K_M); TP=2 vs transformers on the dequantized weights 4.5e-6 / 5.5e-6, TP=1 vs it 4.3e-6 /
4.5e-6: fp32 rounding of partial sums added in another order, the same size as the float TP tests'."""

from __future__ import annotations

import pytest
import torch
from conftest import FP32_LOGITS_TOL, compare_logits, fixture_dir
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.distributed.sharding import ShardedSource, unit_spans
from mlaserve.distributed.spawn import live_workers
from mlaserve.distributed.worker import held_weights
from mlaserve.executor.forward_batch import SeqChunk
from mlaserve.gguf.quants import GGML_TYPES, dequantize
from mlaserve.gguf.read.checkpoint import load_gguf
from mlaserve.quant.ggml_heads import GGUFHeads
from mlaserve.quant.ggml_linear import GGUFEmbedding, GGUFExperts, GGUFLinear
from mlaserve.sampling.params import SamplingParams

OPTS = dict(max_num_batched_tokens=40, activations="float")  # exact products: the identities below are fp32's


@pytest.fixture(scope="module", params=["q8_0", "q4_k_m"])
def gguf_pair(request):
    """(type, expected tensors, TP=1 LLM, TP=2 LLM) on the ds3 fixture's file of that type."""
    from safetensors.torch import load_file

    folder = fixture_dir("ds3")
    path = str(folder / f"model-{request.param}.gguf")
    one = LLM(path, **OPTS)
    before = frozenset(live_workers())
    two = LLM(path, tensor_parallel_size=2, trace="memory", **OPTS)
    yield request.param, load_file(str(folder / "expected.safetensors")), one, two
    two.close()
    assert not set(live_workers()) - before or _gone(before)


def _gone(before: frozenset) -> bool:
    import time

    deadline = time.monotonic() + 60
    while set(live_workers()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    return not set(live_workers()) - before


def test_tp2_logits_equal_tp1_and_the_dequantized_reference(gguf_pair):
    gtype, exp, one, two = gguf_pair
    ids = exp["input_ids"].tolist()
    a, b = one.prompt_logits(ids), two.prompt_logits(ids)
    diff, top1 = compare_logits(b, a)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (gtype, diff, top1)
    diff, top1 = compare_logits(b, exp[f"hf_dequant_logits_{gtype}"])
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (gtype, diff, top1)


def test_tp2_greedy_tokens_identical(gguf_pair):
    """Mixed batches: three prompts, decode steps of a batch (the native decode kernels on both ranks)."""
    gtype, _, one, two = gguf_pair
    prompts = [random_ids(n, seed=n) for n in (30, 9, 17)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
    assert got == want, gtype


def test_every_rank_keeps_the_blocks_in_the_same_holders(gguf_pair):
    """Each rank's holders (class and stored types) are those of one process, on the native kernels; its
    resident weights are well under 1/N of the float model's (a rank that dequantized its slice would hold
    0.53x of it: the replicated latent projections and norms plus half of the rest, docs/ARCHITECTURE.md)."""
    gtype, _, one, two = gguf_pair
    mine = held_weights(one.loaded.model)
    assert mine["holders"] and all(k.startswith(("GGUF",)) for k in mine["holders"])
    prov = {s.name: s for s in two.config.all_provenance()}
    assert prov["gguf_weights"].value == "quantized" and "2 ranks" in prov["gguf_weights"].source
    echoes = two.runner.rank_echoes
    assert [e["rank"] for e in echoes] == [0, 1]
    with LLM(str(fixture_dir("ds3") / f"model-{gtype}.gguf"), gguf_weights="dequantized", **OPTS) as dense:
        float_bytes = sum(p.numel() * p.element_size() for p in dense.loaded.model.parameters())
    for e in echoes:
        assert e["holders"] == mine["holders"], (gtype, e["rank"])
        assert e["kernel_plan"] == echoes[0]["kernel_plan"]
        assert e["weight_bytes"] <= float_bytes / 2 * 0.5, (gtype, e["weight_bytes"], float_bytes)
    plan = two.loaded.kernel_plan  # rank 0's: every holder's product on the native kernels
    for c in plan.choices:
        if c.op in ("linear", "grouped_experts", "heads") and isinstance(
            two.loaded.model.get_submodule(c.module), GGUFLinear | GGUFExperts | GGUFHeads
        ):
            assert c.impl == "native", c
    # rank 0's stored tensors: the same dtype (uint8 blocks) as one process's, and per tensor the whole
    # (replicated, or a wider span that covers the whole dim here) or exactly half of it (an even split)
    full = dict(one.loaded.model.named_parameters())
    halves = 0
    for name, p in two.loaded.model.named_parameters():
        module = two.loaded.model.get_submodule(name.rsplit(".", 1)[0])
        if not isinstance(module, GGUFLinear | GGUFExperts | GGUFEmbedding | GGUFHeads) or p.dtype != torch.uint8:
            continue
        assert full[name].dtype == torch.uint8
        assert p.numel() in (full[name].numel(), full[name].numel() // 2), (name, p.shape, full[name].shape)
        halves += p.numel() * 2 == full[name].numel()
    assert halves >= 3 * 3, halves  # q_b, o_proj and the heads (or down / gate / up) of each of 3 layers


def test_uneven_splits_are_named_at_load(gguf_pair):
    """Where I_e / N (and Q4_K_M's I / N) falls inside the down projection's blocks, the load report says
    which dim is held as which wider span."""
    gtype, _, _, two = gguf_pair
    notes = "\n".join(two.loaded.report.notes)
    assert "rank 0: moe_intermediate_size units [0, 16) held as [0, 32)" in notes
    assert "rank 0: shared experts units [0, 16) held as [0, 32)" in notes
    assert ("rank 0: intermediate_size units [0, 128) held as [0, 256)" in notes) == (gtype == "q4_k_m")
    rows = {s.name: s for s in two.loaded.gguf.settings()}  # rank 0's GGUF plan, as `inspect` prints it
    assert rows["tensor parallel experts"].value == "units [0, 32) for its own [0, 16)", rows.keys()
    assert ("tensor parallel dense" in rows) == (gtype == "q4_k_m")
    rank1 = two.runner.rank_echoes[1]["notes"]  # each rank's own, in its echo (mlaserve inspect prints them)
    assert any("rank 1: moe_intermediate_size units [16, 32) held as [0, 32)" in n for n in rank1), rank1


@pytest.mark.parametrize("gtype", ["q8_0", "q4_k_m"])
def test_wider_spans_add_up_to_the_whole_mlp(gtype):
    """Each rank's gate / up / down blocks (the file's bytes) dequantized: gate / up rows of the other ranks'
    units are zero, and the ranks' partial MLPs add up to the whole one (fp32 rounding: two partial sums)."""
    tensors = load_gguf(fixture_dir("ds3") / f"model-{gtype}.gguf").tensors
    from mlaserve.config.engine import make_options
    from mlaserve.config.model import ModelConfig
    from mlaserve.loading.model_loader import open_checkpoint

    cfg: ModelConfig = open_checkpoint(fixture_dir("ds3") / f"model-{gtype}.gguf", make_options()).model_cfg
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for prefix in ("model.layers.0.mlp.", "model.layers.1.mlp.experts.3.", "model.layers.2.mlp.shared_experts."):
        names = {p: f"{prefix}{p}_proj.weight" for p in ("gate", "up", "down")}
        whole = {p: tensors.get(n) for p, n in names.items()}
        want = (torch.nn.functional.silu(x @ whole["gate"].T) * (x @ whole["up"].T)) @ whole["down"].T
        got = torch.zeros_like(want)
        for rank in (0, 1):
            src = ShardedSource(tensors, cfg, rank, 2, unit_spans(tensors, cfg, rank, 2))
            part = {}
            for p, n in names.items():
                raw = src.get_blocks(n).contiguous()
                cols = raw.shape[1] // GGML_TYPES[tensors.ggml_type(n)].type_size
                part[p] = dequantize(
                    raw, tensors.ggml_type(n), (raw.shape[0], cols * GGML_TYPES[tensors.ggml_type(n)].block_size)
                )
                assert torch.equal(part[p], src.get(n)), n  # the float read and the blocks agree
            span = src.span(names["down"])
            if span is not None:  # the other ranks' units: zero gate / up rows
                own = torch.zeros(span.width, dtype=torch.bool)
                own[span.start - span.first : span.stop - span.first] = True
                assert not part["gate"][~own].any() and not part["up"][~own].any(), (prefix, rank)
            got += (torch.nn.functional.silu(x @ part["gate"].T) * (x @ part["up"].T)) @ part["down"].T
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= 1e-5 * max(scale, 1.0), (prefix, (got - want).abs().max())


def test_o_proj_columns_inside_blocks_are_named_and_read_dequantized():
    """An o_proj whose heads' columns fall inside its blocks (here: the Q8_0 file's o_proj seen as Q4_K, whose
    256-value super-blocks span both ranks' 64 columns) is read dequantized, with the tensor named."""
    from mlaserve.config.engine import make_options
    from mlaserve.loading.model_loader import open_checkpoint
    from mlaserve.quant.ggml_plan import _split_problem

    path = fixture_dir("ds3") / "model-q8_0.gguf"
    ck = open_checkpoint(path, make_options())
    tensors = ck.source

    class AsQ4K:  # the same tensors, o_proj reported as Q4_K (only its type is asked)
        def __getattr__(self, name):
            return getattr(tensors, name)

        def ggml_type(self, name):
            return 12 if name.endswith("o_proj.weight") else tensors.ggml_type(name)

        def gguf_type(self, name):
            return GGML_TYPES[self.ggml_type(name)].name

    name = "model.layers.1.self_attn.o_proj.weight"
    src = ShardedSource(AsQ4K(), ck.model_cfg, 1, 2)
    why = _split_problem(src, name)
    assert why is not None and name in why and "[64, 128)" in why and "256-value Q4_K" in why, why
    assert _split_problem(ShardedSource(tensors, ck.model_cfg, 1, 2), name) is None  # Q8_0: 2 whole blocks


def _decode_step(llm: LLM, seqs: list[list[int]]) -> torch.Tensor:
    """Each sequence but its last token prefilled (chunks of max_num_batched_tokens), then one pure decode
    step of every last token together (explicit chunks on fixed pages, through the runner) -> its logits."""
    ps, chunk = llm.config.cache.page_size, llm.config.scheduler.max_num_batched_tokens
    per = -(-max(len(s) for s in seqs) // ps)
    pages = [tuple(range(i * per, (i + 1) * per)) for i in range(len(seqs))]
    for i, s in enumerate(seqs):
        for start in range(0, len(s) - 1, chunk):
            part = tuple(s[start : min(start + chunk, len(s) - 1)])
            llm.runner.execute([SeqChunk(str(i), part, start, pages[i][: -(-(start + len(part)) // ps)])])
    step = [SeqChunk(str(i), (s[-1],), len(s) - 1, pages[i][: -(-len(s) // ps)]) for i, s in enumerate(seqs)]
    return llm.runner.execute(step)[1]


def test_decode_steps_run_the_one_call_layers_on_every_rank(gguf_pair):
    """A pure decode step of 3 requests: each rank runs every decoder layer as one native call (its reduce
    hook sums o_proj's and the MLP's partial outputs over the ranks), == TP=1 (which runs them too) and ==
    transformers on the dequantized weights at those positions."""
    gtype, exp, one, two = gguf_pair
    ids = exp["input_ids"].tolist()
    seqs = [ids[:50], ids[:70], ids]
    start = len(two.runner.tracer.records)
    got, base = _decode_step(two, seqs), _decode_step(one, seqs)
    last = [r for r in list(two.runner.tracer.records)[start:] if r["num_decode_tokens"] == 3]
    assert sorted(r["rank"] for r in last) == [0, 1], last
    assert all(r["kernels"]["decode_layer"] == "native" for r in last), [r["kernels"] for r in last]
    assert all(r["comm"]["all_reduces"] == 2 * two.config.model.num_layers + 1 for r in last if "comm" in r)
    diff, top1 = compare_logits(got, base)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (gtype, diff, top1)
    want = exp[f"hf_dequant_logits_{gtype}"][[49, 69, len(ids) - 1]]
    diff, top1 = compare_logits(got, want)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (gtype, diff, top1)


def test_dequantized_ranks_narrow_exactly_without_wider_spans():
    """gguf_weights="dequantized" under TP=2: each rank's float slice narrowed from the blocks covering it (no
    wider span: nothing is held in blocks), == transformers on the dequantized weights."""
    from safetensors.torch import load_file

    folder = fixture_dir("ds3")
    exp = load_file(str(folder / "expected.safetensors"))
    path = str(folder / "model-q4_k_m.gguf")
    with LLM(path, tensor_parallel_size=2, gguf_weights="dequantized", **OPTS) as two:
        got = two.prompt_logits(exp["input_ids"].tolist())
        assert all(e["holders"] == {} and e["notes"] == [] for e in two.runner.rank_echoes)
        assert two.config.model.intermediate_size == 256  # the whole model's; rank 0 holds 128 of its units
        assert two.loaded.model.model.layers[0].mlp.gate_proj.out_features == 128
    diff, top1 = compare_logits(got, exp["hf_dequant_logits_q4_k_m"])
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)

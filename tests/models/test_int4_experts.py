"""Kimi-K2.5's INT4 routed experts (compressed-tensors W4A16 pack-quantized, symmetric, group 32) kept
packed in memory (quant/int4_experts.py) == "dequantize, then run".

The INT4 folder is written here from a float Kimi-K2.5 folder (transformers' save of the wrapper), following
compressed-tensors' layout: each routed expert's `weight` becomes `weight_packed` int32 [N, K/8] (column
8j+i in bits 4i..4i+3 of word j, the value + 8), `weight_scale` bf16 [N, K/32] (amax / 7.5) and
`weight_shape` int64 [2]; config.json gains its quantization_config group. The dequantized folder holds
W = q * S as fp32 weights, the same model for every reference.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from conftest import compare_logits, fp32_logits_tol
from hf_models import BASE, random_ids, reinit_
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.config.model import ConfigError
from mlaserve.kernels import native
from mlaserve.loading.safetensors_source import WeightError
from mlaserve.quant import int4_group
from mlaserve.quant.config import parse_quantization
from mlaserve.quant.int4_experts import INT4Experts

TEXT = {
    **BASE,
    "model_type": "kimi_k2",
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "num_nextn_predict_layers": 0,
}
QCONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 32,
                "symmetric": True,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
            },
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    },
    # the Kimi-K2.x release's list: everything but the routed experts, and the vision parts
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
}
EXPERT = "language_model.model.blocks.{}.mlp.experts."


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """-> (int4 folder, dequantized folder, the float original): the same Kimi-K2.5 model, routed experts
    packed / as W = q * S; the original they were quantized from."""
    import transformers

    base = tmp_path_factory.mktemp("k25_float")
    cfg = transformers.Kimi_K25Config(
        text_config=dict(TEXT, tie_word_embeddings=False),
        vision_config=dict(
            num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, pos_emb_height=4
        ),
        projection_hidden_size=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration(cfg).float().eval()
    reinit_(model, 0)
    model.save_pretrained(base)
    stored = load_file(str(base / "model.safetensors"))
    packed, deq = {}, {}
    for name, t in stored.items():
        if ".mlp.experts." in name and name.endswith(".weight"):
            p, s = int4_group.quantize(t)
            stem = name.removesuffix(".weight")
            packed |= {f"{stem}.weight_packed": p, f"{stem}.weight_scale": s}
            packed[f"{stem}.weight_shape"] = torch.tensor(t.shape)
            deq[name] = int4_group.dequantize_reference(p, s)
        else:
            packed[name] = deq[name] = t
    out = {}
    for kind, tensors in (("int4", packed), ("deq", deq)):
        folder = tmp_path_factory.mktemp(f"k25_{kind}")
        shutil.copy(base / "config.json", folder / "config.json")
        save_file(tensors, str(folder / "model.safetensors"))
        if kind == "int4":
            raw = json.loads((folder / "config.json").read_text())
            # under text_config, where the Kimi-K2.x releases keep it
            raw["text_config"]["quantization_config"] = QCONFIG
            (folder / "config.json").write_text(json.dumps(raw))
        out[kind] = folder
    return out["int4"], out["deq"], base


def test_pack_layout_is_compressed_tensors():
    """Column 8j+i of a row in nibble i of word j, stored as value + 8, words as signed int32 (the format's
    pack_to_int32), written out by hand for one row."""
    q = torch.tensor([[-8, -1, 0, 1, 2, 3, 4, 7, 5, 6, -2, -3, -4, -5, -6, -7]])
    words = [sum((v + 8) << (4 * i) for i, v in enumerate(q[0, j * 8 : j * 8 + 8].tolist())) for j in range(2)]
    want = torch.tensor([[w - 2**32 if w >= 2**31 else w for w in words]], dtype=torch.int32)
    assert torch.equal(int4_group.pack(q), want)
    assert torch.equal(int4_group.unpack(want).long(), q)
    w = torch.randn(6, 64)
    p, s = int4_group.quantize(w)
    assert p.dtype == torch.int32 and p.shape == (6, 8) and s.dtype == torch.bfloat16 and s.shape == (6, 2)
    assert torch.equal(int4_group.dequantize(p, s), int4_group.dequantize_reference(p, s))
    # symmetric rule: the group's largest |W| is 7.5 steps (a +7.5 clamps to 7), so the error is at most half a
    # step, plus the bf16 rounding of S (relative 2^-9) moving the largest value by up to 7.5 * 2^-8 steps
    # (0.03); measured 0.528 steps over 600 random rows
    step = s.float().repeat_interleave(32, -1)
    assert ((int4_group.dequantize(p, s) - w).abs() <= step * (0.5 + 7.5 * 2**-8)).all()


def test_the_config_group_is_read_and_others_refused():
    scheme = parse_quantization({"quantization_config": QCONFIG})
    assert (scheme.expert_dtype, scheme.fmt, scheme.group_size) == ("int4", "int4", 32)
    for field, bad in (("group_size", 128), ("symmetric", False), ("num_bits", 8), ("strategy", "channel")):
        group = dict(QCONFIG["config_groups"]["group_0"], weights={**QCONFIG["config_groups"]["group_0"]["weights"]})
        group["weights"][field] = bad
        with pytest.raises(ConfigError, match=f"weights.{field} {bad!r} is not supported"):
            parse_quantization({"quantization_config": {**QCONFIG, "config_groups": {"group_0": group}}})
    with pytest.raises(ConfigError, match="format 'int-quantized' is not supported"):
        group = dict(QCONFIG["config_groups"]["group_0"], format="int-quantized")
        parse_quantization(
            {"quantization_config": {**QCONFIG, "format": "int-quantized", "config_groups": {"group_0": group}}}
        )


def test_int4_experts_equal_dequantized_then_run(folders):
    """The holder keeps the packed int32 words (an eighth of fp32's bytes, plus fp32 group scales) and its
    per-call unpacking gives exactly W = q * S. Logits: measured max |diff| 2.6e-6 against the dequantized
    folder through the engine, and 2.5e-6 against transformers on that folder: fp32 rounding (bound 1e-5,
    |max logit| < 8); 100% top-1; greedy tokens equal."""
    from transformers import AutoModelForImageTextToText

    int4, deq, _ = folders
    ids = random_ids(48)
    llm = LLM(str(int4), max_num_batched_tokens=16, page_size=8)
    experts = llm.loaded.model.model.layers[1].mlp.experts
    assert isinstance(experts, INT4Experts) and experts.gate_up_proj.dtype == torch.int32
    want = load_file(str(deq / "model.safetensors"))
    gu, down = experts.dequantize()
    e3 = EXPERT.format(1) + "3."
    assert torch.equal(gu[3], torch.cat([want[e3 + "gate_proj.weight"], want[e3 + "up_proj.weight"]]))
    assert torch.equal(down[3], want[e3 + "down_proj.weight"])
    assert all(
        torch.equal(a, b)
        for a, b in zip(experts.expert_weights(torch.tensor([0, 3]), torch.float32), (gu[[0, 3]], down[[0, 3]]))
    )
    held = sum(p.numel() * p.element_size() for n, p in experts.named_parameters() if not n.endswith("_shape"))
    # per weight: half a byte packed + an fp32 scale per 32 (1/8 byte), against fp32's 4 bytes
    assert held == (gu.numel() + down.numel()) * 5 // 8
    prov = {s.name: s.value for s in llm.loaded.quant.settings()}
    assert prov["quant.expert_dtype"] == "int4" and prov["quantized model.layers.*.mlp.experts"] == "layers 1-2"

    got = llm.prompt_logits(ids)
    dense = LLM(str(deq), max_num_batched_tokens=16, page_size=8)
    diff, top1 = compare_logits(got, dense.prompt_logits(ids))
    assert diff <= 1e-5 and top1 == 1.0, (diff, top1)
    ref_model = AutoModelForImageTextToText.from_pretrained(deq, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = ref_model.eval()(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    diff, top1 = compare_logits(got, ref)
    assert diff <= fp32_logits_tol(ref) and top1 == 1.0, (diff, top1)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    a = llm.generate([ids[:10]], greedy)[0].outputs[0].token_ids
    b = dense.generate([ids[:10]], greedy)[0].outputs[0].token_ids
    assert list(a) == list(b)


@pytest.mark.skipif(not native.status().available, reason=f"native kernels unavailable: {native.status().detail}")
def test_native_int4_kernel_equals_the_torch_path(folders, monkeypatch, capsys):
    """kernels="native": the plan gives the routed experts the native INT4 decode-and-dot (naming the ISA build
    that runs) and each MoE layer's decode step the one-call block (csrc/moe/block.c, with the INT4 scales);
    steps past 16 tokens take the per-op path, whose grouped products are the INT4 kernel. Against
    kernels="torch" (the reference: unpack, then the grouped GEMM) on the same folder: prompt logits one token
    per step (decode's shape), in chunks of 16 (the block) and 32 (per op), and greedy decoding of 3 requests at
    once. The float layers take their native kernels too, so the runs agree within fp32 summation order:
    measured max |diff| 2.5e-6, 2.3e-6 and 2.4e-6, bound 1e-5 (the tiny fp32 models' rounding, |max logit| <
    8); greedy tokens equal, their logprobs within 1e-5."""
    from mlaserve.entrypoints.cli import main
    from mlaserve.kernels import native_layers

    int4, _, _ = folders
    ids = random_ids(24)
    grouped_calls, block_calls = [], []
    grouped, block = native.grouped_gemm, native_layers.moe_block

    def counted_grouped(type_id, *args, **kwargs):
        grouped_calls.append(type_id)
        return grouped(type_id, *args, **kwargs)

    def counted_block(args, *rest, **kwargs):
        block_calls.append((args.type_gu, args.type_dn))
        return block(args, *rest, **kwargs)

    monkeypatch.setattr(native, "grouped_gemm", counted_grouped)
    monkeypatch.setattr(native_layers, "moe_block", counted_block)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [ids[:5], ids[3:14], ids[8:11]]
    runs, chunks = {}, (1, 16, 32)
    for kernels in ("native", "torch"):
        for chunk in chunks:
            llm = LLM(str(int4), kernels=kernels, max_num_batched_tokens=chunk, page_size=8)
            experts = llm.loaded.model.model.layers[1].mlp.experts
            assert experts.kernel == kernels
            runs[kernels, chunk] = llm.prompt_logits(ids)
            if kernels == "native":  # a chunk of 16 or fewer tokens: the block; of 24 (chunks of 32): per op
                assert (bool(block_calls), bool(grouped_calls)) == (chunk <= 16, chunk > 16), (chunk, block_calls)
                assert set(block_calls) <= {(native.INT4_PACKED,) * 2} and set(grouped_calls) <= {native.INT4_PACKED}
                block_calls.clear(), grouped_calls.clear()
        runs[kernels, "greedy"] = llm.generate(prompts, greedy)
        if kernels == "native":
            plan = llm.loaded.kernel_plan
            choice = native_choice = plan.of("model.layers.1.mlp.experts", "grouped_experts")
            assert choice.impl == "native" and f"native ({native.isa()} INT4 decode-and-dot) up to" in choice.reason
            assert plan.of("model.layers.1.mlp", "moe_block").impl == "native"
            # decode steps of 1-3 tokens: the block; the first step's 19 prompt tokens: per op
            assert block_calls and grouped_calls
            block_calls.clear(), grouped_calls.clear()
    assert not block_calls and not grouped_calls, "the torch path called a native INT4 kernel"
    for chunk in chunks:
        with capsys.disabled():
            diff, top1 = compare_logits(runs["native", chunk], runs["torch", chunk])
        assert diff <= 1e-5 and top1 == 1.0, (chunk, diff, top1)
    for a, b in zip(runs["native", "greedy"], runs["torch", "greedy"]):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        la = torch.tensor([next(iter(d.values())) for d in a.outputs[0].logprobs])
        lb = torch.tensor([next(iter(d.values())) for d in b.outputs[0].logprobs])
        assert (la - lb).abs().max() <= 1e-5
    main(["inspect", str(int4)])
    out = capsys.readouterr().out
    assert "int4" in out and "vision tower / projector tensor(s)" in out and "wrapper" in out, out
    # the plan inspect prints
    assert re.search(rf"grouped_experts +native +layers 1-2 +{re.escape(native_choice.reason)}\n", out), out


def test_a_wrong_weight_shape_is_named(folders, tmp_path):
    int4, _, _ = folders
    tensors = load_file(str(int4 / "model.safetensors"))
    tensors[EXPERT.format(2) + "5.down_proj.weight_shape"] = torch.tensor([64, 33])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(int4 / "config.json", tmp_path / "config.json")
    with pytest.raises(WeightError, match=r"model.layers.2.mlp.experts.5.down_proj.weight_shape is \[64, 33\]"):
        LLM(str(tmp_path))


def test_error_estimate_and_verify_against_the_original(folders, tmp_path):
    """quant/error.py's uniform-rounding model on INT4 groups is close to the true error (measured ratio
    0.97 on random normal rows: the grid is uniform; the largest value of each group, +7.5 steps clamped to
    7, errs by half a step more than the model says, so it reads a little low); verify
    --against passes the INT4 folder against the float original it was written from, and names a block
    whose stored values were changed."""
    from mlaserve.entrypoints.verify_against import compare, open_side
    from mlaserve.quant import error

    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(4))
    p, s = int4_group.quantize(w, scale_dtype=torch.float32)
    deq = int4_group.dequantize_reference(p, s)
    est = error.relative_error(deq, s.repeat_interleave(32, -1))
    true = ((deq - w).norm() / deq.norm()).item()
    assert 0.95 < est / true < 1.1, (est, true)

    int4, _, original = folders
    side = open_side(str(int4))
    assert side.block_error["layer.1.mlp"] > 0 and "INT4" in side.types["layer.1.mlp"]
    ids = random_ids(32)
    report = compare(side, open_side(str(original)), ids)
    assert report.passed, [(b.block, b.rel_diff, b.tolerance) for b in report.blocks if not b.passed]
    bad = tmp_path / "bad"
    shutil.copytree(int4, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    # layer 2's routed experts with their down_proj scales x10. A weaker change passes: the allowance of a
    # block is the sum of its tensors' e(W) (quant/error.py), 24 INT4 expert tensors at ~0.09 each, x2 safety:
    # 4.4 relative, wider than an output that flips sign (2.0); the model counts every expert, not the 2 of 8
    # a token routes to
    for e in range(TEXT["n_routed_experts"]):
        tensors[EXPERT.format(2) + f"{e}.down_proj.weight_scale"] *= 10
    save_file(tensors, str(bad / "model.safetensors"))
    report = compare(open_side(str(bad)), open_side(str(original)), ids)
    assert report.first_failure is not None and report.first_failure.block == "layer.2.mlp", [
        (b.block, b.rel_diff, b.tolerance) for b in report.blocks
    ]

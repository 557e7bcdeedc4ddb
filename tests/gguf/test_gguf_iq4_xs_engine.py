"""A GGUF whose routed experts are IQ4_XS (the type carrying most bytes in dynamic DeepSeek/GLM releases), kept in
their blocks with the native kernels and with the torch path, against the same file dequantized at load.

The file: a tiny DeepSeek-V3 at hidden size 256 and expert width 256 (IQ4_XS rows are whole 256-value
super-blocks) converted to F32 GGUF by the project's converter, its ffn_{gate,up,down}_exps rewritten as IQ4_XS by
the small quantizer below (gguf-py has none for the type; any valid blocks serve, since both sides decode the same
blocks, bit-identically with gguf-py: tests/gguf/test_gguf_iquants.py). The dequantized side is checked against
gguf-py's dequantization of the file's expert tensors, so the reference is independent of our decoder. The two runs
multiply the same values and differ by fp32 summation order only: within 1e-5 on these logits (|logit| < 10,
the tiny fp32 models' bound; the measured figure is printed).
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from gguf_helpers import copy_kv
from hf_models import BASE, SPECS, random_ids, reinit_

from mlaserve import LLM, SamplingParams
from mlaserve.kernels import native
from mlaserve.quant.ggml_linear import GGUFExperts

gguf = pytest.importorskip("gguf")
NATIVE = native.status()
IQ4_XS = 23
EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """[..., K] float32 -> [..., K / 256 * 136] IQ4_XS blocks: per 32 values a scale d * ls (ls 0..31 stored as
    ls + 32, d fp16 per 256 values), each value the nearest of IQ4_NL's 16 levels times it."""
    lead, k = x.shape[:-1], x.shape[-1]
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    n = sub.shape[0]
    dl = np.abs(sub).max(-1) / 127  # [n, 8]
    d = (dl.max(-1) / 31).astype(np.float16)  # [n]
    d32 = d.astype(np.float32)
    ls = np.clip(np.rint(np.divide(dl, d32[:, None], out=np.zeros_like(dl), where=d32[:, None] > 0)), 0, 31)
    ls = ls.astype(np.int64)
    scale = (d32[:, None] * ls)[..., None]  # [n, 8, 1]
    codes = np.abs(scale[..., None] * IQ4NL - sub[..., None]).argmin(-1).astype(np.uint8)  # [n, 8, 32]
    stored = ls + 32
    scales_l = ((stored[:, 0::2] & 0xF) | ((stored[:, 1::2] & 0xF) << 4)).astype(np.uint8)  # [n, 4]
    scales_h = (((stored >> 4) & 3) << (2 * np.arange(8))).sum(-1).astype(np.uint16)  # [n]
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, 128)
    out = np.concatenate([d.view(np.uint8).reshape(n, 2), scales_h.view(np.uint8).reshape(n, 2), scales_l, qs], axis=1)
    return out.reshape(*lead, k // 256 * 136)


def test_the_test_quantizer_round_trips():
    """The quantizer's blocks decode (gguf-py) close to the input: a 4-bit format's relative rms error of a few
    per cent on normal values (measured 0.085 on this seeded draw: the 5-bit sub-block scales add to the levels'
    own error), so the expert weights stay weights; a broken packing gives ~1."""
    x = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    q = quantize_iq4_xs(x)
    back = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.IQ4_XS)
    rel = np.sqrt(((back - x) ** 2).mean() / (x**2).mean())
    print(f"IQ4_XS test quantizer: relative rms error {rel:.3f}")
    assert back.shape == x.shape and rel < 0.1


def write_tiny_v3_256(tmp, rewrite) -> tuple:
    """The tiny DeepSeek-V3 at hidden 256 / expert width 256 as a GGUF whose tensors rewrite(name, f32 data) may
    return as (blocks, ggml type) -> (path, bytes of the rewritten tensors)."""
    from test_gguf_convert import _byte_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    from mlaserve.gguf.convert.convert import convert_hf_to_gguf

    folder = tmp / "v3"
    model_type, extra = SPECS["v3_yarn"]
    cfg = AutoConfig.for_model(model_type, **{**BASE, **extra, "hidden_size": 256, "moe_intermediate_size": 256})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    reinit_(model, 0)
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("head_dim", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    _byte_tokenizer(folder, 256)
    f32 = tmp / "v3-f32.gguf"
    convert_hf_to_gguf(folder, f32, "f32")
    reader = gguf.GGUFReader(f32)
    out = tmp / "v3-rewritten.gguf"
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    copy_kv(reader, writer)
    rewritten = 0
    for t in reader.tensors:
        data = np.ascontiguousarray(t.data)
        new = rewrite(t.name, data)
        if new is None:
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, new[0], raw_dtype=gguf.GGMLQuantizationType(new[1]))
            rewritten += new[0].nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shutil.rmtree(folder)
    return out, rewritten


@pytest.fixture(scope="module")
def iq4_xs_file(tmp_path_factory):
    def experts(name, data):
        return (quantize_iq4_xs(data), IQ4_XS) if name.endswith(EXPERT_TENSORS) else None

    return write_tiny_v3_256(tmp_path_factory.mktemp("iq4xs"), experts)


def test_dequantized_experts_are_gguf_py_s(iq4_xs_file):
    """The dequantized side's expert weights are gguf-py's dequantization of the file's blocks, bit for bit."""
    path, _ = iq4_xs_file
    llm = LLM(str(path), gguf_weights="dequantized")
    params = dict(llm.runner.model.named_parameters())
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_up_exps.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.IQ4_XS
    up = gguf.quants.dequantize(t.data, t.tensor_type)  # [E, I, D]
    gate_up = params["model.layers.1.mlp.experts.gate_up_proj"].detach()  # [E, 2I, D], gate rows first
    assert np.array_equal(gate_up[:, up.shape[1] :].numpy().view(np.uint32), up.view(np.uint32))


@pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")
def test_iq4_xs_experts_kept_in_blocks_equal_dequantized(iq4_xs_file, capsys):
    """The experts stay IQ4_XS blocks (resident bytes = the file's), the plan runs them native (pair by pair,
    grouped, and the one-call MoE block of a decode step) and the logits of prefill (chunks of 16 and one token
    per step) and greedy decoding of 3 requests equal the dequantized file's within 1e-5."""
    from mlaserve.entrypoints.cli import main

    path, expert_bytes = iq4_xs_file
    ids = random_ids(24, seed=2)
    dense = {c: LLM(str(path), gguf_weights="dequantized", max_num_batched_tokens=c) for c in (1, 16)}
    for kernels in ("native", "torch"):
        for chunk in (1, 16):
            # exact products (the default takes int8 activations for IQ4_XS: tests/identities/test_verify_against_int8_more.py)
            kept = LLM(str(path), kernels=kernels, max_num_batched_tokens=chunk, activations="float")
            experts = [m for m in kept.runner.model.modules() if isinstance(m, GGUFExperts)]
            assert experts and all(
                (e.type_gate_up, e.type_down, e.kernel) == (IQ4_XS, IQ4_XS, kernels) for e in experts
            )
            assert sum(e.gate_proj.nbytes + e.up_proj.nbytes + e.down_proj.nbytes for e in experts) == expert_bytes
            a, b = kept.prompt_logits(ids), dense[chunk].prompt_logits(ids)
            diff = (a - b).abs().max().item()
            with capsys.disabled():
                print(
                    f"\nIQ4_XS experts {kernels}, chunks of {chunk}: max |logit diff| {diff:.2e}, max |logit| {b.abs().max():.1f}"
                )
            assert b.abs().max() < 10 and diff <= 1e-5 and torch.equal(a.argmax(-1), b.argmax(-1)), (
                kernels,
                chunk,
                diff,
            )
        if kernels == "native":
            plan = {c.op: c.impl for c in kept.loaded.kernel_plan.choices if c.layer == "1"}
            assert plan["grouped_experts"] == "native" and plan["moe_block"] == "native", plan
            greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            prompts = [ids[:5], ids[2:13], ids[7:10]]
            got = kept.generate(prompts, greedy)
            want = dense[16].generate(prompts, greedy)
            assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]
    main(["inspect", str(path)])
    out = capsys.readouterr().out
    kept_line = "stored IQ4_XS; kept in its blocks: only the experts a step routes to are multiplied"
    assert re.search(rf"gguf IQ4_XS model\.layers\.\*\.mlp\.experts +layers 1-2 +{kept_line}", out), out

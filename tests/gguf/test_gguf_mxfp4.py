"""MXFP4 routed experts in a GGUF file (what llama.cpp's converter writes for FP4-released experts) kept in their
blocks (gguf_weights="quantized") with the native kernels, against the same file dequantized at load.

The file: a tiny DeepSeek-V3 converted to F32 GGUF by the project's converter, its ffn_{gate,up,down}_exps
rewritten as MXFP4 by gguf-py's quantizer (the reference implementation of the type). Both runs multiply the
same dequantized values (the decoder is bit-identical with gguf-py's: tests/kernels/test_mxfp4_kernel.py), so
they differ by fp32 summation order only: 1e-5 on these logits (|logit| < 10, the tiny fp32 models' bound).
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch
from gguf_helpers import copy_kv
from hf_models import random_ids

from mlaserve import LLM, SamplingParams
from mlaserve.kernels import native
from mlaserve.quant.ggml_linear import GGUFExperts

gguf = pytest.importorskip("gguf")
NATIVE = native.status()
MXFP4 = 39
EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


@pytest.fixture(scope="module")
def mxfp4_file(hf_model_dir, tmp_path_factory):
    from test_gguf_convert import _byte_tokenizer

    from mlaserve.gguf.convert.convert import convert_hf_to_gguf

    folder, _ = hf_model_dir("v3_yarn")
    tmp = tmp_path_factory.mktemp("mxfp4")
    copy = tmp / "v3"
    shutil.copytree(folder, copy)
    _byte_tokenizer(copy, 256)
    f32 = tmp / "v3-f32.gguf"
    convert_hf_to_gguf(copy, f32, "f32")
    reader = gguf.GGUFReader(f32)
    out = tmp / "v3-mxfp4-experts.gguf"
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    copy_kv(reader, writer)
    expert_bytes = 0
    for t in reader.tensors:
        data = np.ascontiguousarray(t.data)
        if t.name.endswith(EXPERT_TENSORS):
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.MXFP4)
            writer.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            expert_bytes += q.nbytes
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out, expert_bytes


@pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")
def test_mxfp4_experts_kept_in_blocks_equal_dequantized(mxfp4_file, capsys):
    """The experts stay MXFP4 blocks (resident bytes = the file's), the plan runs them native (the pair-by-pair
    and grouped decode-and-dot, the one-call MoE block of a decode step) and the logits of prefill (chunks of 16
    and one token per step) and greedy decoding of 3 requests equal the dequantized file's within 1e-5
    (measured in the printout)."""
    from mlaserve.entrypoints.cli import main

    path, expert_bytes = mxfp4_file
    ids = random_ids(24, seed=2)
    dense = {c: LLM(str(path), gguf_weights="dequantized", max_num_batched_tokens=c) for c in (1, 16)}
    for kernels in ("native", "torch"):
        for chunk in (1, 16):
            kept = LLM(str(path), kernels=kernels, max_num_batched_tokens=chunk)
            experts = [m for m in kept.runner.model.modules() if isinstance(m, GGUFExperts)]
            assert experts and all((e.type_gate_up, e.type_down, e.kernel) == (MXFP4, MXFP4, kernels) for e in experts)
            assert sum(e.gate_proj.nbytes + e.up_proj.nbytes + e.down_proj.nbytes for e in experts) == expert_bytes
            a, b = kept.prompt_logits(ids), dense[chunk].prompt_logits(ids)
            diff = (a - b).abs().max().item()
            with capsys.disabled():
                print(f"\nMXFP4 experts {kernels}, chunks of {chunk}: max |logit diff| {diff:.2e}")
            assert diff <= 1e-5 and torch.equal(a.argmax(-1), b.argmax(-1)), (kernels, chunk, diff)
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
    assert re.search(rf"^kernels +native +.*: {native.isa()} kernels, ", out, re.M), out  # the build's ISA
    kept_line = "stored MXFP4; kept in its blocks: only the experts a step routes to are multiplied"
    assert re.search(rf"gguf MXFP4 model\.layers\.\*\.mlp\.experts +layers 1-2 +{kept_line}", out), out


def test_check_tensors_finds_an_overflowing_mxfp4_scale(mxfp4_file, tmp_path):
    """e = 255 is 2^127 to ggml (not NaN): a block whose codes reach 6 then decodes to Inf, which the value scan
    (`--check-tensors`) names; the file as written scans clean."""
    from mlaserve.gguf.read.file import open_gguf
    from mlaserve.loading.tensor_check import scan_gguf

    path, _ = mxfp4_file
    assert scan_gguf(open_gguf(path)) == []
    gf = open_gguf(path)
    info = gf.tensors["blk.2.ffn_down_exps.weight"]
    data = bytearray(path.read_bytes())
    start = info.offset  # absolute, in the file
    data[start] = 255  # the first block's e8m0 byte
    data[start + 1 : start + 17] = bytes([0x77]) * 16  # every code 6.0 (0b0111)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    found = scan_gguf(open_gguf(bad))
    assert [b.name for b in found] == ["bad.gguf:blk.2.ffn_down_exps.weight"], found
    assert "0 NaN, 32 Inf" in found[0].detail, found

"""FP8 block-scaled checkpoints (DeepSeek FP8, compressed-tensors) kept in 8 bits.

Fixtures: the tiny random models of hf_models.py, quantized here as the releases are (block amax /
448 -> e4m3) by mlaserve.quant.writer. The oracle is independent: transformers on a folder whose
weights this file dequantizes itself (q.float() * the block's scale), compared with the engine
running on the FP8 folder (fp32 compute, <= 1e-4, 100% top-1).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mlaserve.models.moe import Experts
from mlaserve.quant import fp8_block
from mlaserve.quant.linear import FP8Experts, FP8Linear
from mlaserve.quant.writer import write_fp8_folder

# kind -> (format, block): the release's [128, 128] (each tiny weight is one partial block) and
# smaller blocks with partial edge blocks (48 / 32, 64 / 24, 72 / 16 ...), both formats.
FAMILIES = {
    "v3_yarn": ("fp8", (128, 128)),  # deepseek_v3
    "v32": ("fp8", (32, 24)),  # deepseek_v32 (DSA indexer wq_b / wk quantized)
    "glm_dsa": ("compressed-tensors", (16, 16)),  # glm_moe_dsa
    "kimi_k2": ("fp8", (16, 32)),  # kimi_k2 layout, hidden 72 / moe_intermediate 40
}


def _block_of(qc: dict, shape: tuple[int, int]) -> tuple[int, int]:
    if qc["quant_method"] == "fp8":
        return tuple(qc["weight_block_size"])
    w = qc["config_groups"]["group_0"]["weights"]
    return tuple(w["block_structure"]) if w["strategy"] == "block" else (1, shape[1])


def dequantized_folder(fp8_dir, out_dir):
    """The same checkpoint with every quantized weight replaced by q.float() * its block's scale."""
    out_dir.mkdir()
    cfg = json.loads((fp8_dir / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    suffix = "weight_scale_inv" if qc["quant_method"] == "fp8" else "weight_scale"
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(suffix)]:
        s, wname = tensors.pop(name), name.removesuffix(suffix) + "weight"
        q = tensors[wname]
        bn, bk = _block_of(qc, tuple(q.shape))
        full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: q.shape[0], : q.shape[1]]
        tensors[wname] = q.float() * full
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return out_dir


@pytest.fixture(scope="module")
def fp8_folder(hf_model_dir, tmp_path_factory):
    cache: dict = {}

    def get(kind: str, fmt: str, block):
        if (kind, fmt, block) not in cache:
            src, _ = hf_model_dir(kind)
            dst = tmp_path_factory.mktemp(f"{kind}-fp8")
            write_fp8_folder(src, dst, fmt, block)
            cache[(kind, fmt, block)] = dst
        return cache[(kind, fmt, block)]

    return get


def _compare(got, ref):
    return (got - ref).abs().max().item(), (got.argmax(-1) == ref.argmax(-1)).float().mean().item()


def _hf_from(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


# ---- the format: quantizer, dequantizers ------------------------------------------------------


def test_fast_dequantize_is_bit_exact_for_every_code_and_edge_blocks():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(fp8_block.FP8)  # all 254 finite e4m3 values
    one = torch.ones(1, 1)
    assert torch.equal(fp8_block.dequantize(codes[None], one, (1, 254), torch.float32), codes.float()[None])
    g = torch.Generator().manual_seed(0)
    for shape, block in [((70, 50), (32, 24)), ((64, 64), (128, 128)), ((3, 40, 33), (16, 16)), ((9, 7), (1, 7))]:
        w = torch.randn(shape, generator=g) * torch.rand(shape[:-2] + (1, 1), generator=g)
        q, s = fp8_block.quantize(w, block)
        ref = fp8_block.dequantize_reference(q, s, block)
        assert torch.equal(fp8_block.dequantize(q, s, block, torch.float32).view(torch.int32), ref.view(torch.int32))
        assert torch.equal(fp8_block.dequantize(q, s, block, torch.bfloat16), ref.bfloat16())


def test_quantizer_is_the_release_recipe():
    """S = block amax / 448; Q = e4m3(W / S) -- recomputed here block by block."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 50, generator=g)
    w[32:64, 24:48] = 0  # a zero block
    q, s = fp8_block.quantize(w, (32, 24))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3) and s.dtype == torch.float32
    for i in range(3):
        for j in range(3):
            blk = w[32 * i : 32 * (i + 1), 24 * j : 24 * (j + 1)]
            amax = blk.abs().max()
            want = amax / 448 if amax > 0 else torch.tensor(1.0)
            assert s[i, j] == want
            expect = (blk / want).to(torch.float8_e4m3fn)
            assert torch.equal(
                q[32 * i : 32 * (i + 1), 24 * j : 24 * (j + 1)].view(torch.uint8), expect.view(torch.uint8)
            )


def test_fp8_linear_equals_dequantize_then_matmul():
    from mlaserve.quant.config import QuantScheme

    scheme = QuantScheme("fp8", "e4m3", "block", (32, 24), "weight_scale_inv", ())
    lin = FP8Linear(50, 70, scheme, bias=False, dtype=torch.float32, device="cpu")
    q, s = fp8_block.quantize(torch.randn(70, 50), (32, 24))
    with torch.no_grad():
        lin.weight.copy_(q)
        lin.weight_scale_inv.copy_(s)
    x = torch.randn(5, 50)
    assert torch.equal(lin(x), F.linear(x, lin.dequantize()))
    xb = x.bfloat16()
    assert torch.equal(lin(xb), F.linear(xb, lin.dequantize(torch.bfloat16)))


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_fp8_experts_equal_dequantized_experts(impl):
    from mlaserve.quant.config import QuantScheme

    e, d, i = 6, 40, 24
    scheme = QuantScheme("fp8", "e4m3", "block", (16, 16), "weight_scale_inv", ())
    qe = FP8Experts(d, e, i, scheme, "cpu")
    g = torch.Generator().manual_seed(2)
    for q_name, s_name, w in [
        ("gate_up_proj", "gate_up_proj_scale", torch.randn(e, 2, i, d, generator=g)),
        ("down_proj", "down_proj_scale", torch.randn(e, d, i, generator=g)),
    ]:
        q, s = fp8_block.quantize(w, (16, 16))
        with torch.no_grad():
            getattr(qe, q_name).copy_(q.flatten(1, 2) if q.dim() == 4 else q)
            getattr(qe, s_name).copy_(s)
    qe.impl = impl
    dense = Experts.__new__(Experts)
    torch.nn.Module.__init__(dense)
    gu, down = qe.dequantize()
    dense.gate_up_proj, dense.down_proj, dense.impl = torch.nn.Parameter(gu), torch.nn.Parameter(down), "loop"
    x = torch.randn(9, d, generator=g)
    used = torch.tensor([0, 1, 2, 4, 5])  # expert 3 idle: the step dequantizes only active experts
    idx = torch.stack([used[torch.randperm(5, generator=g)[:2]] for _ in range(9)])
    w = torch.rand(9, 2, generator=g)
    assert torch.allclose(qe(x, w, idx), dense(x, w, idx), atol=1e-5, rtol=1e-5)

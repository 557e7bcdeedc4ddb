"""FP8 block-scaled checkpoints (DeepSeek FP8, compressed-tensors) kept in 8 bits.

Fixtures: the tiny random models of hf_models.py, quantized here as the releases are (block amax /
448 -> e4m3) by mlaserve.quant.writer. The oracle is independent: transformers on a folder whose
weights this file dequantizes itself (q.float() * the block's scale), compared with the engine
running on the FP8 folder (fp32 compute, <= FP32_LOGITS_TOL, 100% top-1).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import FP32_LOGITS_TOL, compare_logits, fp32_logits_tol
from hf_models import hf_logits, random_ids
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.config.model import ConfigError
from mlaserve.loading.safetensors_source import WeightError
from mlaserve.models.moe import Experts
from mlaserve.quant import fp8_block
from mlaserve.quant.config import parse_quantization
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


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _e2m1(packed, scale, group):
    """Two e2m1 codes per byte, low nibble first, times the scale of each row's group of columns."""
    u = packed.view(torch.uint8)
    values = torch.tensor(E2M1)[torch.stack([u & 0xF, u >> 4], dim=-1).flatten(-2).long()]
    return values * scale.repeat_interleave(group, 1)[:, : values.shape[1]]


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
    for name in [n for n in tensors if n.endswith(".weight_packed")]:  # compressed-tensors NVFP4 / MXFP4
        module = name.removesuffix(".weight_packed")
        s, glob = tensors.pop(f"{module}.weight_scale"), tensors.pop(f"{module}.weight_global_scale", None)
        scale = 2.0 ** (s.float() - 127) if s.dtype == torch.uint8 else s.float() / glob
        tensors[f"{module}.weight"] = _e2m1(tensors.pop(name), scale, 32 if glob is None else 16)
    for name in [n for n in tensors if n.endswith(suffix)]:
        s, wname = tensors.pop(name).float(), name.removesuffix(suffix) + "weight"
        q = tensors[wname]
        if q.dtype == torch.int8:  # fp4 experts (DeepSeek-V4 style)
            tensors[wname] = _e2m1(q, s, 32)
            continue
        bn, bk = _block_of(qc, tuple(q.shape))
        full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: q.shape[0], : q.shape[1]]
        tensors[wname] = q.float() * full
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return out_dir


@pytest.fixture(scope="module")
def fp8_folder(hf_model_dir, tmp_path_factory):
    cache: dict = {}

    def get(kind: str, fmt: str, block, experts: str = "fp8", scale_fmt: str = "float"):
        key = (kind, fmt, block, experts, scale_fmt)
        if key not in cache:
            src, _ = hf_model_dir(kind)
            dst = tmp_path_factory.mktemp(f"{kind}-fp8")
            write_fp8_folder(src, dst, fmt, block, experts=experts, scale_fmt=scale_fmt)
            cache[key] = dst
        return cache[key]

    return get


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
    xb = x.bfloat16()  # bf16 activations: the product in fp32, rounded to bf16 once
    assert torch.equal(lin(xb), F.linear(xb.float(), lin.dequantize()).bfloat16())


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


# ---- the engine on FP8 folders -----------------------------------------------------------------


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_engine_on_fp8_folder_equals_transformers_on_its_dequantized_weights(fp8_folder, tmp_path, kind):
    fmt, block = FAMILIES[kind]
    folder = fp8_folder(kind, fmt, block)
    ref_model = _hf_from(dequantized_folder(folder, tmp_path / "deq"))
    ids = random_ids(48)
    ref = hf_logits(ref_model, ids)
    llm = LLM(str(folder), max_num_batched_tokens=24, page_size=8)
    assert llm.loaded.quant is not None and llm.loaded.quant.experts, "routed experts must stay quantized"
    diff, top1 = compare_logits(llm.prompt_logits(ids), ref)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (kind, diff, top1)


@pytest.mark.parametrize("mla_path", ["absorbed", "decompressed"])
def test_fp8_layers_equal_dequantize_then_matmul_on_the_reference_backend(fp8_folder, tmp_path, mla_path):
    """The same engine on the FP8 folder and on its dequantized copy (real layers: MLA projections,
    dense MLP, shared and routed experts, DSA indexer), plain reference attention: only the
    matmul's weight form differs, so the logits agree to fp32 rounding."""
    folder = fp8_folder("v32", *FAMILIES["v32"])
    deq = dequantized_folder(folder, tmp_path / "deq")
    ids = random_ids(40)
    opts = dict(attention_backend="reference", mla_path=mla_path, max_num_batched_tokens=16, page_size=8)
    got = LLM(str(folder), **opts).prompt_logits(ids)
    ref = LLM(str(deq), **opts).prompt_logits(ids)
    diff, top1 = compare_logits(got, ref)
    assert diff <= 1e-5 and top1 == 1.0, (mla_path, diff, top1)


def test_reference_backend_and_channel_strategy(fp8_folder, tmp_path):
    """compressed-tensors channel strategy ([N, 1] scales), on the plain reference attention backend."""
    folder = fp8_folder("v3_tied", "compressed-tensors", None)
    ref = hf_logits(_hf_from(dequantized_folder(folder, tmp_path / "deq")), random_ids(32))
    llm = LLM(str(folder), attention_backend="reference", experts_impl="loop", max_num_batched_tokens=16)
    diff, top1 = compare_logits(llm.prompt_logits(random_ids(32)), ref)
    assert diff <= fp32_logits_tol(ref) and top1 == 1.0, (diff, top1)  # v3_tied: logits |max| ~60


def test_transformers_loads_the_fp8_folder_on_cpu(fp8_folder):
    """transformers' fine-grained FP8 integration runs on CPU by dequantizing at load (it needs
    accelerate); the engine, keeping e4m3, agrees with it. Whole blocks only: its load-time
    dequantizer derives the block from the scale grid (rows // scale rows), which is wrong for
    partial edge blocks (a [192, 48] weight with [128, 128] blocks gets 96-row blocks)."""
    pytest.importorskip("accelerate")
    if torch.cuda.is_available():
        pytest.skip("with a GPU present transformers runs FP8 through its CUDA kernels (the `kernels` package)")
    folder = fp8_folder("v3_yarn", "fp8", (16, 16))
    ids = random_ids(32)
    ref = hf_logits(_hf_from(folder), ids)
    diff, top1 = compare_logits(LLM(str(folder)).prompt_logits(ids), ref)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)


def test_weights_are_read_back_bit_exactly(fp8_folder):
    folder = fp8_folder("kimi_k2", *FAMILIES["kimi_k2"])
    stored = load_file(str(folder / "model.safetensors"))
    model = LLM(str(folder)).loaded.model.cpu()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert linears
    for name, m in linears:
        assert torch.equal(m.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8)), name
        assert torch.equal(m.weight_scale_inv, stored[f"{name}.weight_scale_inv"]), name
    experts = model.model.layers[1].mlp.experts
    inter = experts.down_proj.shape[-1]
    p = "model.layers.1.mlp.experts.5"
    assert torch.equal(
        experts.gate_up_proj[5, inter:].view(torch.uint8), stored[f"{p}.up_proj.weight"].view(torch.uint8)
    )
    assert torch.equal(experts.gate_up_proj_scale[5, 1], stored[f"{p}.up_proj.weight_scale_inv"])
    assert torch.equal(experts.down_proj_scale[5], stored[f"{p}.down_proj.weight_scale_inv"])


def _weight_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def test_resident_weights_at_most_0_6_of_bf16(tmp_path):
    """A deepseek_v3 layout whose routed experts dominate the bytes as in the releases (64 experts;
    the tiny default's 256 x 64 embeddings would be a tenth of it, 0.3% in DeepSeek-V3). Kept in
    bf16: embeddings, lm_head, norms; fp32: the router; dequantized at load: kv_b_proj."""
    from hf_models import BASE, SPECS
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("deepseek_v3", **{**BASE, **SPECS["v3_yarn"][1], "n_routed_experts": 64})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "bf16")
    write_fp8_folder(tmp_path / "bf16", tmp_path / "fp8", "fp8", (128, 128))
    fp8 = _weight_bytes(LLM(str(tmp_path / "fp8"), dtype="bfloat16").loaded.model)
    bf16 = _weight_bytes(LLM(str(tmp_path / "bf16"), dtype="bfloat16").loaded.model)
    file = (tmp_path / "fp8" / "model.safetensors").stat().st_size
    assert fp8 <= 0.6 * bf16, (fp8, bf16, fp8 / bf16)
    assert fp8 <= 1.1 * file, (fp8, file)  # resident ~= the file


def test_inspect_shows_scheme_and_modules(fp8_folder, capsys):
    from mlaserve.entrypoints.cli import main

    folder = fp8_folder("v32", *FAMILIES["v32"])
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "quant.method" in out and "(32, 24)" in out
    assert "quantized model.layers.*.mlp.experts" in out and "quantized model.layers.*.self_attn.indexer.wq_b" in out
    assert "kept lm_head" in out and "kept model.layers.*.mlp.gate" in out


# ---- bad checkpoints: errors name the tensor / field --------------------------------------------


@pytest.fixture
def broken(fp8_folder, tmp_path):
    """-> (folder, tensors, config): a writable copy of an FP8 folder; call save() after editing."""
    src = fp8_folder("v3_yarn", "fp8", (32, 32))
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())

    def save():
        save_file(tensors, str(dst / "model.safetensors"))
        (dst / "config.json").write_text(json.dumps(config))
        return str(dst)

    return tensors, config, save


Q_A = "model.layers.1.self_attn.q_a_proj"


def test_missing_scale_names_the_tensor(broken):
    tensors, _, save = broken
    del tensors[f"{Q_A}.weight_scale_inv"]
    with pytest.raises(WeightError, match=f"{Q_A}.weight'.*float8_e4m3fn.*no scale"):
        LLM(save())


def test_wrong_scale_shape_names_the_tensor(broken):
    tensors, _, save = broken
    tensors[f"{Q_A}.weight_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(WeightError, match=f"{Q_A}.weight_scale_inv.*shape \\[1, 1\\].*\\[2, 2\\]"):
        LLM(save())


def test_missing_expert_scale_names_the_tensor(broken):
    tensors, _, save = broken
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"]
    with pytest.raises(WeightError, match="missing model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"):
        LLM(save())


def test_unquantized_weight_with_a_scale_is_rejected(broken):
    tensors, _, save = broken
    tensors[f"{Q_A}.weight"] = tensors[f"{Q_A}.weight"].float()
    with pytest.raises(WeightError, match=f"{Q_A}.weight'.*float32.*has a scale"):
        LLM(save())


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"fmt": "e5m2"}, "quantization_config.fmt 'e5m2'"),
        ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"scale_fmt": "e4m3"}, "scale_fmt 'e4m3' is not supported"),
        ({"expert_dtype": "nvfp4"}, "expert_dtype 'nvfp4' is not supported"),
        (
            {"modules_to_not_convert": ["model.layers.0.mlp.nope"]},
            "ignore pattern 'model.layers.0.mlp.nope' matches no",
        ),
        ({"modules_to_not_convert": [Q_A]}, f"{Q_A}.*ignore list but is stored quantized"),
    ],
)
def test_bad_quantization_config(broken, edit, match):
    _, config, save = broken
    config["quantization_config"].update(edit)
    with pytest.raises((ConfigError, WeightError), match=match):
        LLM(save())


def test_compressed_tensors_config_parsing():
    def cfg(weights, ignore=()):
        group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", **weights}}
        return {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": group},
                "ignore": list(ignore),
            }
        }

    s = parse_quantization(cfg({"strategy": "block", "block_structure": [128, 64]}, ["lm_head", "re:.*mlp\\.gate$"]))
    assert (s.strategy, s.block, s.scale_name) == ("block", (128, 64), "weight_scale")
    assert (
        s.ignores("lm_head") and s.ignores("model.layers.3.mlp.gate") and not s.ignores("model.layers.3.mlp.gate_proj")
    )
    assert parse_quantization(cfg({"strategy": "channel"})).scale_shape(70, 50) == (70, 1)
    assert parse_quantization(cfg({"strategy": "tensor"})).scale_shape(70, 50) == (1,)
    with pytest.raises(ConfigError, match="strategy 'group'"):
        parse_quantization(cfg({"strategy": "group", "group_size": 128}))
    with pytest.raises(ConfigError, match="4-bit strategy/group_size \\('group', 16\\)"):
        parse_quantization(cfg({"num_bits": 4, "strategy": "group", "group_size": 16}))
    # an int group is read only as W4A16 pack-quantized (test_int4_experts.py): anything else names the field
    with pytest.raises(ConfigError, match="weights.strategy None is not supported: int weights are read as"):
        parse_quantization(
            {
                "quantization_config": {
                    "quant_method": "compressed-tensors",
                    "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
                }
            }
        )


def test_bf16_scales_and_a_kept_module_listed_in_the_config(broken, tmp_path):
    """llm-compressor may store weight_scale in bf16 (read exactly into fp32); a module listed in
    modules_to_not_convert and stored unquantized loads as it is."""
    tensors, config, save = broken
    for name in [n for n in tensors if n.endswith("weight_scale_inv")]:
        tensors[name] = tensors[name].bfloat16()
    name = f"{Q_A}.weight"
    scale = tensors.pop(f"{Q_A}.weight_scale_inv").float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    tensors[name] = tensors[name].float() * scale[: tensors[name].shape[0], : tensors[name].shape[1]]
    config["quantization_config"]["modules_to_not_convert"] = [Q_A]
    folder = save()
    llm = LLM(folder, attention_backend="reference")
    assert Q_A in llm.loaded.quant.kept and Q_A not in llm.loaded.quant.linears
    ref = hf_logits(_hf_from(dequantized_folder(tmp_path / "bad", tmp_path / "deq")), random_ids(24))
    diff, top1 = compare_logits(llm.prompt_logits(random_ids(24)), ref)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)


# ---- FP4 (e2m1) routed experts, DeepSeek-V4 style ---------------------------------------------------


def test_fp4_codes_and_quantizer():
    from mlaserve.quant import fp4_group

    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).view(torch.int8)[None]
    assert fp4_group.dequantize(packed, torch.ones(1, 1)).tolist() == [E2M1]
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 6, 72, generator=g)  # 72 = two groups of 32 and a partial one
    p, s = fp4_group.quantize(w)
    assert p.shape == (3, 6, 36) and s.shape == (3, 6, 3)
    ref = fp4_group.dequantize_reference(p, s)
    assert torch.equal(fp4_group.dequantize(p, s).view(torch.int32), ref.view(torch.int32))
    scaled = w / s.repeat_interleave(32, -1)[..., :72]
    grid = torch.tensor(E2M1)
    best = (scaled[..., None] - grid).abs().min(dim=-1).values  # the nearest e2m1 value's distance
    assert torch.allclose((scaled - ref / s.repeat_interleave(32, -1)[..., :72]).abs(), best, atol=1e-6)
    assert torch.equal(s, torch.stack([c.abs().amax(-1) for c in w.split(32, -1)], -1) / 6)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp4_experts_engine_equals_transformers(fp8_folder, tmp_path, scale_fmt):
    """Routed experts in e2m1 (the rest FP8 blocks): the engine == transformers on the dequantized
    weights, and == transformers loading the FP4 folder itself (its CPU path dequantizes at load).
    ue8m0: power-of-two scales stored as float8_e8m0fnu (MXFP4 experts, MXFP8-scaled blocks)."""
    folder = fp8_folder("v3_yarn", "fp8", (16, 16), "fp4", scale_fmt)
    llm = LLM(str(folder), max_num_batched_tokens=24)
    assert type(llm.loaded.model.model.layers[1].mlp.experts).__name__ == "FP4Experts"
    ids = random_ids(40)
    got = llm.prompt_logits(ids)
    diff, top1 = compare_logits(got, hf_logits(_hf_from(dequantized_folder(folder, tmp_path / "deq")), ids))
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_transformers_loads_the_fp4_folder_on_cpu(fp8_folder, scale_fmt):
    """transformers dequantizes the FP4 folder at load on a CPU-only machine (it needs accelerate); the engine,
    keeping e2m1, agrees with it. With a GPU present it takes its CUDA kernels (the `kernels` package) instead."""
    pytest.importorskip("accelerate")
    if torch.cuda.is_available():
        pytest.skip("with a GPU present transformers runs FP4 through its CUDA kernels (the `kernels` package)")
    folder = fp8_folder("v3_yarn", "fp8", (16, 16), "fp4", scale_fmt)
    ids = random_ids(40)
    got = LLM(str(folder), max_num_batched_tokens=24).prompt_logits(ids)
    diff, top1 = compare_logits(got, hf_logits(_hf_from(folder), ids))
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, ("transformers on the FP4 folder", diff, top1)


def test_ue8m0_scales_stored_as_fp32(broken, tmp_path):
    """DeepSeek-V3.1 style: scale_fmt ue8m0, the power-of-two scales stored as fp32."""
    tensors, config, save = broken
    for name in [n for n in tensors if n.endswith("weight_scale_inv")]:
        w = name.removesuffix("_scale_inv")
        s = tensors[name]
        full = s.repeat_interleave(32, 0).repeat_interleave(32, 1)[: tensors[w].shape[0], : tensors[w].shape[1]]
        pow2 = torch.exp2(torch.ceil(torch.log2(s)))
        full2 = pow2.repeat_interleave(32, 0).repeat_interleave(32, 1)[: tensors[w].shape[0], : tensors[w].shape[1]]
        tensors[w] = (tensors[w].float() * full / full2).to(torch.float8_e4m3fn)
        tensors[name] = pow2
    config["quantization_config"]["scale_fmt"] = "ue8m0"
    llm = LLM(save())
    assert any(s.name == "quant.scale_fmt" and s.value == "ue8m0" for s in llm.loaded.quant.settings())
    ref = hf_logits(_hf_from(dequantized_folder(tmp_path / "bad", tmp_path / "deq")), random_ids(24))
    diff, top1 = compare_logits(llm.prompt_logits(random_ids(24)), ref)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)


def test_fp4_experts_without_expert_dtype_name_the_tensor(fp8_folder, tmp_path):
    dst = tmp_path / "bad"
    shutil.copytree(fp8_folder("v3_yarn", "fp8", (16, 16), "fp4"), dst)
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]["expert_dtype"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightError, match=r"experts\.\d+\.\w+_proj\.weight' is stored as int8.*implies float8_e4m3fn"):
        LLM(str(dst))


@pytest.mark.parametrize("variant", ["nvfp4", "mxfp4"])
def test_compressed_tensors_fp4_experts_equal_transformers(fp8_folder, tmp_path, variant):
    """compressed-tensors 4-bit expert groups (weight_packed + e4m3 scales over a global scale, or
    e8m0 bytes), FP8 blocks elsewhere, on glm_moe_dsa: engine == transformers on the dequantized
    weights (transformers does not load these pre-quantized on CPU)."""
    folder = fp8_folder("glm_dsa", "compressed-tensors", (16, 16), variant)
    llm = LLM(str(folder), max_num_batched_tokens=24)
    experts = llm.loaded.model.model.layers[1].mlp.experts
    assert (type(experts).__name__, experts.variant) == ("FP4Experts", variant)
    ids = random_ids(40)
    ref = hf_logits(_hf_from(dequantized_folder(folder, tmp_path / "deq")), ids)
    diff, top1 = compare_logits(llm.prompt_logits(ids), ref)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (variant, diff, top1)


# ---- verify --against: an FP8 / FP4 folder and its original --------------------------------------


def test_quantization_error_estimate_matches_the_true_error():
    """quant/error.py reads e(W) off the stored values; on random normal weights it is close to the
    true relative error of the quantizers (the estimate verify --against relies on)."""
    from mlaserve.quant import error, fp4_group

    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(4))
    q, s = fp8_block.quantize(w, (128, 128))
    deq = fp8_block.dequantize_reference(q, s, (128, 128))
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    est = error.relative_error(deq, error.e4m3_step(q) * full)
    true = ((deq - w).norm() / deq.norm()).item()
    assert 0.9 < est / true < 1.1, (est, true)
    p, s4 = fp4_group.quantize(w)
    deq4 = fp4_group.dequantize_reference(p, s4)
    est4 = error.relative_error(deq4, error.e2m1_step(fp4_group.unpack_codes(p)) * s4.repeat_interleave(32, 1))
    true4 = ((deq4 - w).norm() / deq4.norm()).item()
    # e2m1 has 8 levels: the uniform-rounding model overestimates (1.19x measured), the safe side
    # (a looser tolerance), like weight_error.py's float rule (1.36x)
    assert 1.0 < est4 / true4 < 1.3, (est4, true4)


def test_verify_against_passes_the_original_and_names_a_changed_layer(hf_model_dir, fp8_folder, tmp_path):
    from mlaserve.entrypoints.verify_against import compare, open_side

    src, _ = hf_model_dir("v3_yarn")
    ids = random_ids(32)
    for folder in (fp8_folder("v3_yarn", *FAMILIES["v3_yarn"]), fp8_folder("v3_yarn", "fp8", (16, 16), "fp4")):
        side = open_side(str(folder))
        assert side.block_error["layer.1.mlp"] > 0 and "F8_E4M3" in side.types["layer.1.attn"]
        report = compare(side, open_side(str(src)), ids)
        assert report.passed, [(b.block, b.rel_diff, b.tolerance) for b in report.blocks if not b.passed]
    bad = tmp_path / "bad"
    shutil.copytree(fp8_folder("v3_yarn", *FAMILIES["v3_yarn"]), bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"  # heads 0 and 1 swapped
    w = tensors[name].view(torch.uint8).view(4, -1, tensors[name].shape[1]).clone()
    w[[0, 1]] = w[[1, 0]]
    tensors[name] = w.reshape(tensors[name].shape).view(torch.float8_e4m3fn)
    save_file(tensors, str(bad / "model.safetensors"))
    report = compare(open_side(str(bad)), open_side(str(src)), ids)
    assert report.first_failure is not None and report.first_failure.block == "layer.1.attn"


def test_check_tensors_scans_fp8_weights(broken):
    """--check-tensors on an FP8 folder: a NaN code (s.1111.111) in an e4m3 weight is named."""
    tensors, _, save = broken
    w = tensors[f"{Q_A}.weight"].view(torch.uint8).clone()
    w[0, 0] = 0x7F
    tensors[f"{Q_A}.weight"] = w.view(torch.float8_e4m3fn)
    with pytest.raises(WeightError, match=f"(?s)check_tensors.*{Q_A}.weight: 1 NaN"):
        LLM(save(), check_tensors=True)


@pytest.mark.parametrize("kind, experts", [("v3_yarn", "fp8"), ("v32", "fp8"), ("v3_yarn", "fp4")])
def test_native_kernels_equal_torch_kernels_in_the_engine(fp8_folder, tmp_path, kind, experts):
    """Chunks of 8 tokens take the native decode-and-dot kernel (<= GEMV_ROWS rows), decodes too;
    FP4 (e2m1) routed experts with fp32 group scales as well."""
    from mlaserve.kernels import native

    if not native.status().available:
        pytest.skip(f"native kernels unavailable: {native.status().detail}")
    folder = fp8_folder(kind, *FAMILIES[kind], experts)
    ids = random_ids(40)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # experts 0 and 3 of layer 1 as this file's own dequantizer gives them (gate_up = gate rows, then up rows)
    deq = load_file(str(dequantized_folder(folder, tmp_path / "deq") / "model.safetensors"))
    some, pre = torch.tensor([0, 3]), "model.layers.1.mlp.experts"
    want = (
        torch.stack(
            [torch.cat([deq[f"{pre}.{e}.gate_proj.weight"], deq[f"{pre}.{e}.up_proj.weight"]]) for e in (0, 3)]
        ),
        torch.stack([deq[f"{pre}.{e}.down_proj.weight"] for e in (0, 3)]),
    )
    runs = {}
    for kernel in ("native", "torch"):
        llm = LLM(str(folder), kernels=kernel, device="cpu", max_num_batched_tokens=8, page_size=8)
        assert {s.name: s.value for s in llm.loaded.config.provenance}["kernels"] == kernel
        assert llm.loaded.model.model.layers[1].mlp.experts.kernel == kernel
        assert type(llm.loaded.model.model.layers[1].mlp.experts).__name__ == (
            "FP4Experts" if experts == "fp4" else "FP8Experts"
        )
        # prefill-sized groups decode the routed experts (natively with kernels="native"): the reference's values
        got = llm.loaded.model.model.layers[1].mlp.experts.expert_weights(some, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), kernel
        runs[kernel] = llm.prompt_logits(ids), llm.generate([ids[:12]], greedy)
    diff, top1 = compare_logits(runs["native"][0], runs["torch"][0])
    assert diff <= 1e-5 and top1 == 1.0, (kind, diff, top1)
    assert runs["native"][1][0].outputs[0].token_ids == runs["torch"][1][0].outputs[0].token_ids

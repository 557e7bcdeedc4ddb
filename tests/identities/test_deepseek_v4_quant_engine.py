"""DeepSeek-V4 FP8 and FP4-expert folders through the engine (`LLM`, generate, inspect), kept quantized in memory.

The folders are written by the project's writer (quant/writer.py) from a transformers save_pretrained folder
(tests/v4_models.py, every layer kind). The independent reference is transformers run on the dequantized
weights: every stored block dequantized by the plain references (fp8_block.dequantize_reference,
fp4_group.dequantize_reference), saved as a float folder without quantization_config, loaded by transformers.

Bound 1e-5 max abs on logits of magnitude ~4: both sides multiply the same dequantized fp32 weights, so what
remains is fp32 summation order (the engine's chunked prefill sums keys over differently shaped sets);
measured 1.4e-6 .. 1.7e-6 over the three forms here, as the float engine tests (0 .. 2.3e-6). A wrong scale grid or a swapped gate/up
half moves logits by 1e-1 .. 1.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from hf_models import hf_greedy  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from v4_models import dequantized_folder, hf_v4_logits, save_hf_v4  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.quant.deepseek_v4 import FP4V4Experts, FP8GroupedLinear, FP8V4Experts  # noqa: E402
from mlaserve.quant.linear import FP8Linear  # noqa: E402
from mlaserve.quant.writer import write_fp8_folder  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

BOUND = 1e-5
# (block, scale format, expert form): several 16x16 blocks per tiny weight with partial edge blocks; the
# released 128x128 grid (one partial block per tiny weight) with fp32 scales; the release's FP4 experts
FORMS = {
    "fp8_ue8m0_16": ((16, 16), "ue8m0", "fp8"),
    "fp8_float_128": ((128, 128), "float", "fp8"),
    "fp4_experts": ((16, 16), "ue8m0", "fp4"),
}


@pytest.fixture(scope="module", params=list(FORMS))
def quantized(request, tmp_path_factory):
    """(form, quantized folder, transformers on its dequantized weights)."""
    from transformers import DeepseekV4ForCausalLM

    block, scale_fmt, experts = FORMS[request.param]
    root = tmp_path_factory.mktemp(f"v4_{request.param}")
    save_hf_v4("all_kinds", root / "float", seed=6)
    write_fp8_folder(
        root / "float", root / "q", block=block, keep_dtype=torch.float32, experts=experts, scale_fmt=scale_fmt
    )
    dequantized_folder(root / "q", root / "deq", block)
    ref = DeepseekV4ForCausalLM.from_pretrained(root / "deq", dtype=torch.float32, experts_implementation="eager")
    return request.param, root / "q", ref.eval()


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def test_quantized_folder_through_the_engine_equals_transformers_on_the_dequantized_weights(quantized):
    form, folder, ref = quantized
    llm = LLM(str(folder), max_num_batched_tokens=3)  # chunks of 3 cross every window edge of CSA 4 / HCA 8
    model = llm.runner.model.inner.model
    layer = model.layers[1]  # a CSA layer
    assert isinstance(layer.self_attn.q_a_proj, FP8Linear)
    assert isinstance(layer.self_attn.o_a_proj, FP8GroupedLinear)
    assert isinstance(layer.mlp.experts, FP4V4Experts if form == "fp4_experts" else FP8V4Experts)
    stored = torch.int8 if form == "fp4_experts" else torch.float8_e4m3fn
    assert layer.mlp.experts.gate_up_proj.dtype == stored  # the stored codes, no dequantized copy beside them
    # no float copy anywhere: every floating parameter of 2+ dims is one the folder stores float
    float_folder = load_file(folder.parent / "float" / "model.safetensors")
    float_bytes = sum(t.numel() * 4 for t in float_folder.values())
    held = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
    held += sum(b.numel() * b.element_size() for b in llm.runner.model.buffers())
    assert held < 0.6 * float_bytes, f"{held} bytes held for a {float_bytes}-byte float model"
    vocab = ref.config.vocab_size
    worst = 0.0
    for n in (1, 4, 7, 8, 9, 17, 29):
        ids = _ids(n, vocab, n)
        got, want = llm.prompt_logits(ids), hf_v4_logits(ref, ids)
        err = (got - want).abs().max().item()
        worst = max(worst, err)
        assert err <= BOUND, f"{form} length {n}: max abs {err:.3g} > {BOUND}"
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{form} length {n}: top-1 differs"
    prompts = [_ids(11, vocab, 11), _ids(3, vocab, 3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(ref, p, 16, hf_v4_logits), f"{form}: prompt of {len(p)} tokens"


def test_inspect_shows_the_weight_forms(quantized, capsys):
    from mlaserve.entrypoints.cli import main

    form, folder, _ = quantized
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "quantized weights:" in out
    assert "quantized model.layers.*.self_attn.q_a_proj" in out
    experts = "quantized model.layers.*.mlp.experts"
    assert experts in out
    line = next(ln for ln in out.splitlines() if ln.startswith(experts))
    assert ("fp4:" if form == "fp4_experts" else "fp8:") in line
    assert "kept model.layers.*.self_attn.compressor.kv_proj" in out  # the release keeps it float
    assert "kept lm_head" in out


def test_at_load_quantization_of_a_v4_folder_is_refused_with_its_reason(quantized):
    from mlaserve.config.model import ConfigError

    _, folder, _ = quantized
    with pytest.raises(ConfigError, match=r"DeepSeek-V4 with quantization='int8'.*quantizing its float weights"):
        LLM(str(folder), quantization="int8")

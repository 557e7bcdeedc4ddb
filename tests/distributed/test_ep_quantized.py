"""Expert parallelism over quantized checkpoint folders (CPU, gloo, 2 processes): each rank keeps its routed
experts in their stored form, in the holders one process uses, and reads only their bytes from the file.

Forms (tiny models made here, as the releases store them):
  fp8   DeepSeek FP8, e4m3 with 128 x 128 block scales (kimi_k2 layout: hidden 72, I_e 40, so every expert
        weight is one partial block), FP8Experts
  fp4   DeepSeek-V4-style e2m1 routed experts with group-32 scales, FP8 (16, 16) blocks elsewhere (v3_yarn),
        FP4Experts
  nvfp4 compressed-tensors NVFP4 experts (e2m1 codes, e4m3 group-16 scales over a per-tensor global scale,
        weight_global_scale: one more per-expert tensor), FP8 (16, 16) blocks elsewhere (glm_dsa), FP4Experts
  int4  Kimi-K2.5 compressed-tensors pack-quantized int4 experts (int32 words, bf16 group-32 scales,
        weight_shape), the multimodal wrapper's text model, INT4Experts
The reference is one process on the same folder (the quantized holders themselves are held to transformers on
the dequantized weights in tests/models/test_fp8.py and test_int4_experts.py).

Bound: FP32_LOGITS_TOL (1e-5, conftest.py). EP=2 computes the same experts' outputs from the same stored
weights; only the order of the fp32 additions (each rank's partial sum, then the all-reduce) and the rows a
holder's product sees (a rank also runs its rows' zero-weight pairs, which can change the per-expert row
counts the kernels choose their path by) differ. Measured max |EP=2 - one process| on the prompt logits
(logits up to ~5): fp8 0, fp4 0 (top-2: a sum of two terms is the same in either order), nvfp4 1.2e-6,
int4 9.5e-7;
greedy tokens identical. Broken on purpose (every rank's shard start taken as 0): fp8 off by 3.0."""

from __future__ import annotations

import json
import re
import struct

import pytest
from conftest import FP32_LOGITS_TOL, compare_logits
from hf_models import random_ids
from test_int4_experts import folders  # noqa: F401 -- the Kimi-K2.5 INT4 folder fixture

from mlaserve import LLM
from mlaserve.distributed.expert_parallel import expert_bytes, expert_range
from mlaserve.models.moe import MoE
from mlaserve.quant.writer import write_fp8_folder
from mlaserve.sampling.params import SamplingParams

OPTS = dict(page_size=8, max_num_batched_tokens=24)
HOLDER = {"fp8": "FP8Experts", "fp4": "FP4Experts", "nvfp4": "FP4Experts", "int4": "INT4Experts"}


@pytest.fixture(scope="module")
def form_folder(hf_model_dir, tmp_path_factory, request):
    def make(form: str):
        if form == "int4":
            return request.getfixturevalue("folders")[0]
        kind, fmt, block, experts = {
            "fp8": ("kimi_k2", "fp8", (128, 128), "fp8"),
            "fp4": ("v3_yarn", "fp8", (16, 16), "fp4"),
            "nvfp4": ("glm_dsa", "compressed-tensors", (16, 16), "nvfp4"),
        }[form]
        dst = tmp_path_factory.mktemp(f"ep-{form}")
        write_fp8_folder(hf_model_dir(kind)[0], dst, fmt, block, experts=experts)
        return dst

    return make


def _expert_file_bytes(path) -> dict[int, dict[int, int]]:
    """Per MoE layer and expert: the bytes of its stored tensors (weight, scales, packed words, shapes), from
    the safetensors header's data_offsets."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    out: dict[int, dict[int, int]] = {}
    for name, t in header.items():
        m = re.search(r"\.(?:layers|blocks)\.(\d+)\.mlp\.experts\.(\d+)\.", name)  # blocks: Kimi-K2.5's
        if m:
            layer = out.setdefault(int(m.group(1)), {})
            layer[int(m.group(2))] = layer.get(int(m.group(2)), 0) + t["data_offsets"][1] - t["data_offsets"][0]
    return out


@pytest.mark.parametrize("form", ["fp8", "fp4", "nvfp4", "int4"])
def test_ep2_on_a_quantized_folder_equals_one_process(form, form_folder):
    folder = form_folder(form)
    ids = random_ids(30)
    one = LLM(str(folder), **OPTS)
    with LLM(str(folder), expert_parallel_size=2, trace="memory", **OPTS) as two:
        diff, top1 = compare_logits(two.prompt_logits(ids), one.prompt_logits(ids))
        assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (form, diff, top1)
        prompts = [random_ids(n, seed=n) for n in (17, 5, 9)]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == want, form
        echoes = two.runner.rank_echoes
        # both ranks' experts ran (the partial sums and the all-reduce are exercised, not one rank alone)
        loads = [x for r in two.runner.tracer.records for x in r.get("expert_load", ())]
        assert all(sum(x["pairs"] for x in loads if x["rank"] == rank) > 0 for rank in (0, 1)), loads
        routed = [m for m in two.loaded.model.modules() if isinstance(m, MoE)]
        assert routed and all(type(m.experts).__name__ == HOLDER[form] for m in routed)  # rank 0, in this process

    # every rank keeps its experts in the stored form: the same holder kinds as one process, and per layer the
    # ranks' expert bytes add up to one process's, each rank's share its count of experts over E
    whole = {
        n: (m.gate.cfg.n_routed_experts, expert_bytes(m.experts))
        for n, m in one.loaded.model.named_modules()
        if isinstance(m, MoE)
    }
    for echo in echoes:
        assert any(k.startswith(HOLDER[form]) for k in echo["holders"]), (form, echo["holders"])
    for layer, (e, nbytes) in whole.items():
        held = [next(h for h in echo["routed_experts"] if h["layer"] == layer) for echo in echoes]
        assert [tuple(h["experts"]) for h in held] == [expert_range(e, r, 2) for r in range(2)]
        assert sum(h["bytes"] for h in held) == nbytes
        for h in held:
            assert h["bytes"] * e == nbytes * (h["experts"][1] - h["experts"][0]), (layer, h)

    # and reads only their bytes: one process's read minus the other rank's experts' stored tensors
    files = _expert_file_bytes(folder / "model.safetensors")
    for rank, echo in enumerate(echoes):
        start, stop = expert_range(next(iter(whole.values()))[0], rank, 2)
        others = sum(b for layer in files.values() for x, b in layer.items() if not start <= x < stop)
        assert others > 0 and echo["file_bytes_read"] == one.loaded.report.bytes_read - others, (form, rank)

"""NoPE MLA with no rope slice at all (qk_rope_head_dim 0, GLM-5.3-Flash's MLA): the cache row is the latent only,
and the absorbed and decompressed paths, chunked or one pass, are exact (the latent write runs its torch
reference here: the native one is not planned for this model on this build, not checked).

The reference is transformers' DeepseekV3ForCausalLM (it cannot run a zero rope width itself) on an equivalent
model: rope width 8 whose query and key rope rows are zero, so q_pe . k_pe = 0 whatever the rotation, and whose
nope query rows are scaled by sqrt((dn + 8) / dn), so its softmax scale (dn + 8)^-0.5 equals ours, dn^-0.5. The
engine loads the same checkpoint without those rows (q_b_proj [H dn, q_lora], kv_a_proj_with_mqa [r, D]) and
qk_rope_head_dim 0. The two models are the same function; transformers computes one, the engine the other.

Bound: 1e-5 max abs against the reference run in float64, 100% top-1 (fp32 rounding of these sizes, logits ~4:
measured 1.7e-6 .. 3.0e-6 over paths and budgets 1, 5, 64). A rope rotation applied to a zero-width slice that is
not empty, a scale from qk_head_dim + some rope width, or a cache row sized r + dr moves logits by > 1e-2.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import BASE, hf_logits, random_ids, reinit_  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402

BOUND = 1e-5
H, DN, DR, R = BASE["num_attention_heads"], BASE["qk_nope_head_dim"], 8, BASE["kv_lora_rank"]


@pytest.fixture(scope="module")
def zero_rope(tmp_path_factory):
    """(float64 transformers reference, folder of the zero-rope checkpoint)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "deepseek_v3", **{**BASE, "qk_rope_head_dim": DR, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    reinit_(hf, 5)
    with torch.no_grad():
        for layer in hf.model.layers:
            attn = layer.self_attn
            q = attn.q_b_proj.weight.view(H, DN + DR, -1)
            q[:, DN:] = 0  # no query rope
            q[:, :DN] *= math.sqrt((DN + DR) / DN)  # transformers' scale (DN + DR)^-0.5 -> DN^-0.5
            attn.kv_a_proj_with_mqa.weight[R:] = 0  # no key rope
    folder = tmp_path_factory.mktemp("zero_rope")
    hf.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("head_dim", None)
    raw["qk_rope_head_dim"] = 0
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    state = {}
    for name, t in hf.state_dict().items():
        if name.endswith("q_b_proj.weight"):
            # the rows the engine's model keeps, without the scale that stood in for transformers' softmax scale
            t = t.view(H, DN + DR, -1)[:, :DN].reshape(H * DN, -1) / math.sqrt((DN + DR) / DN)
        elif name.endswith("kv_a_proj_with_mqa.weight"):
            t = t[:R]
        state[name] = t.contiguous().clone()
    for f in folder.glob("*.safetensors"):
        f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")  # grouped_mm has no float64
    return hf.double(), folder


@pytest.mark.parametrize("mla_path", ["absorbed", "decompressed"])
def test_zero_rope_width_is_exact_on_every_path(zero_rope, mla_path):
    ref, folder = zero_rope
    for budget in (1, 5, 64):
        llm = LLM(str(folder), mla_path=mla_path, max_num_batched_tokens=budget)
        assert llm.config.model.qk_rope_head_dim == 0
        assert llm.runner.cache.layers[0].tensors["latent"].shape[-1] == R  # the latent only, no k_pe
        ids = random_ids(29, ref.config.vocab_size, budget)
        got, want = llm.prompt_logits(ids), hf_logits(ref, ids)
        err = (got - want).abs().max().item()
        assert err <= BOUND, f"{mla_path} budget {budget}: max abs {err:.3g}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_an_8bit_cache_without_a_rope_part_runs_on_the_native_backend(zero_rope):
    """kv_cache_dtype int8 on rows with no rope part keeps no values beside the codes (QuantizedRows.kept is
    None): the native latent MQA reads the codes alone and equals the reference backend over the same 8-bit rows
    (fp32 rounding, BOUND). Chunks of 4 tokens keep each segment's queries under the native backend's threshold,
    so its C MQA runs (with longer segments it hands the step to torch, and the test would not see the kernel)."""
    pytest.importorskip("mlaserve.kernels.native")
    from mlaserve.kernels import native

    if native.library() is None:
        pytest.skip("no native library on this machine (no C compiler)")
    ref, folder = zero_rope
    ids = random_ids(29, ref.config.vocab_size, 3)
    got = {}
    for backend in ("native", "reference"):
        llm = LLM(
            str(folder),
            mla_path="absorbed",
            kv_cache_dtype="int8",
            quantization="int8",
            attention_backend=backend,
            max_num_batched_tokens=4,
        )
        assert llm.runner.cache.layers[0].tensors["latent"].kept is None
        got[backend] = llm.prompt_logits(ids)
    err = (got["native"] - got["reference"]).abs().max().item()
    assert err <= BOUND, f"native vs reference over the same 8-bit rows: max abs {err:.3g}"

"""A decoder layer lets go of its attention's output once the residual holds it: no attention output of the layer is
alive when the layer's MLP runs (DeepSeek's DecoderLayer; LongCat-Flash's two sublayers and their shortcut MoE;
GLM-5.3-Flash's hyper-connected layer, KDA and MLA), so a prompt step's peak does not hold a [T, D] tensor beside the
MLP's temporaries. Each failed with its `del` taken out."""

from __future__ import annotations

import weakref

from mlaserve import LLM
from mlaserve.sampling.params import SamplingParams


def _watch(llm: LLM, attentions, mlps) -> list[bool]:
    """Weak references to each attention output of a layer; per MLP call of that layer, whether any is alive."""
    alive: list[bool] = []
    for layer in llm.runner.model.model.layers:
        refs: list = []
        for attn in attentions(layer):
            attn.register_forward_hook(lambda m, args, out, refs=refs: refs.append(weakref.ref(out[0])))
        for mlp in mlps(layer):
            mlp.register_forward_pre_hook(lambda m, args, refs=refs: alive.append(any(r() is not None for r in refs)))
    return alive


def _run(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([[5, 9, 2, 7, 11, 3, 8], [4, 6]], params)  # a prompt step, then decode steps


def test_deepseek_layer(tmp_path):
    from mlaserve.embedded import build_random_tiny

    llm = LLM(str(build_random_tiny(tmp_path / "tiny")))
    alive = _watch(llm, lambda layer: [layer.self_attn], lambda layer: [layer.mlp])
    _run(llm)
    assert alive and not any(alive), alive


def test_longcat_layer(tmp_path):
    from test_longcat_flash import _build

    _build("pow2", "mixed").save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_num_batched_tokens=16, page_size=8)
    alive = _watch(llm, lambda layer: list(layer.self_attn), lambda layer: [layer.mlp, *layer.mlps])
    _run(llm)
    assert alive and not any(alive), alive


def test_glm5_next_layer(tmp_path):
    from glm5_next_models import save_hf_glm5_next

    save_hf_glm5_next("kda3_mla_kpool4", tmp_path)
    llm = LLM(str(tmp_path))
    alive = _watch(llm, lambda layer: [layer.self_attn], lambda layer: [layer.mlp])
    _run(llm)
    assert len(alive) >= 4 and not any(alive), alive

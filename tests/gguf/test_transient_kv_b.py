"""kv_b_proj not held dense beside the kept attn_k_b / attn_v_b blocks (quant/transient_kv_b.py): the plan says
so, the load frees it, a prefill step decodes it per layer (the same bits as the load-time rebuild) and a decode
step does not; held where a reader needs it at every step (kernels=torch, the reference attention backend)."""

from __future__ import annotations

import pytest
import torch
from conftest import fixture_dir

from mlaserve.entrypoints.llm import LLM
from mlaserve.kernels import native
from mlaserve.loading import model_loader
from mlaserve.quant.transient_kv_b import TransientKvB
from mlaserve.sampling.params import SamplingParams

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the native kernels are not built")
IDS = [5, 9, 2, 7, 11, 3, 8, 1, 4, 6, 10, 12]


def _kv_b(llm: LLM) -> list:
    return [layer.self_attn.kv_b_proj for layer in llm.runner.model.model.layers]


@pytest.mark.parametrize("qtype,mla_path", [("q8_0", "auto"), ("q4_k_m", "auto"), ("q8_0", "absorbed")])
def test_prefill_decodes_the_dense_copy_it_no_longer_holds(qtype, mla_path, monkeypatch):
    """The plan's transient kv_b_proj: no dense parameter after load; the prompt's logits and the greedy decode
    equal, bit for bit, a load that keeps the dense copy (same kernels and backend); a decompressed prefill
    (mla_path auto) decodes it once per layer, an absorbed one and the decode steps never."""
    path = str(fixture_dir("ds3") / f"model-{qtype}.gguf")
    opts = {"kernels": "native", "activations": "float", "mla_path": mla_path}
    per_prefill = 3 if mla_path == "auto" else 0  # ds3's 3 layers, each decoding once
    lean = LLM(path, **opts)
    assert lean.loaded.gguf.transient_kv_b
    assert all(isinstance(m, TransientKvB) and m.weight.is_meta for m in _kv_b(lean))
    assert not [n for n, _ in lean.runner.model.named_parameters() if "kv_b_proj" in n]
    row = {s.name: s for s in lean.loaded.gguf.settings()}["gguf dense model.layers.*.self_attn.kv_b_proj"]
    assert "decoded per prefill step from attn_k_b / attn_v_b" in row.source
    with monkeypatch.context() as m:  # the load as before: the dense copy kept beside the blocks
        plan = model_loader.plan_gguf
        m.setattr(model_loader, "plan_gguf", lambda *a, **k: plan(*a, **{**k, "transient_kv_b": False}))
        held = LLM(path, **opts)
    assert all(type(m) is torch.nn.Linear for m in _kv_b(held))
    for a, b in zip(held.runner.model.model.layers, lean.runner.model.model.layers):  # the load-time rebuild's bits
        assert torch.equal(a.self_attn.kv_b_proj.weight, b.self_attn.kv_b_weight())
    calls = []
    decode = TransientKvB.decode
    monkeypatch.setattr(TransientKvB, "decode", lambda self, heads, *a: calls.append(1) or decode(self, heads, *a))
    got, want = lean.prompt_logits(IDS), held.prompt_logits(IDS)
    assert torch.equal(got, want), (got - want).abs().max().item()
    assert len(calls) == per_prefill == (len(_kv_b(lean)) if mla_path == "auto" else 0)  # one chunk
    calls.clear()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = [llm.generate([IDS], params)[0].outputs[0] for llm in (lean, held)]
    assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs
    assert len(calls) == per_prefill  # the prompt's prefill only: its 3 decode steps read the blocks


@pytest.mark.parametrize("opts", [{"kernels": "torch"}, {"kernels": "native", "attention_backend": "reference"}])
def test_dense_copy_held_where_a_reader_needs_it(opts):
    """kernels=torch keeps no blocks for W_UK / W_UV; the reference backend's absorbed path reads the dense views."""
    llm = LLM(str(fixture_dir("ds3") / "model-q8_0.gguf"), **opts)
    assert not llm.loaded.gguf.transient_kv_b
    assert all(type(m) is torch.nn.Linear and not m.weight.is_meta for m in _kv_b(llm))

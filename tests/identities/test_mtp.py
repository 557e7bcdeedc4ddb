"""The MTP layer: loaded from a DeepSeek-V3-layout checkpoint, it computes the plain formula
  logits_i = shared_head.head(shared_head.norm(Block(eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]))))
with h_i the trunk's final hidden state and Block a transformers decoder layer holding the MTP
block's weights (so both the trunk and the block are the independent reference)."""

from __future__ import annotations

import shutil

import pytest
import torch
from hf_models import random_ids
from mtp_models import hf_block_model, hf_trunk, mtp_model_folder

from mlaserve import LLM
from mlaserve.config.model import ConfigError
from mlaserve.executor.forward_batch import SeqChunk

N = 3  # trunk depth of the tiny models (the MTP layer is model.layers.3)


@pytest.fixture(scope="session")
def mtp_model_dir(tmp_path_factory):
    return lambda kind: mtp_model_folder(kind, tmp_path_factory)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp_logits(kind: str, tensors: dict, ids: list[int], eps: float) -> torch.Tensor:
    """[L-1, V]: the MTP's logits at positions 0..L-2 (each predicting t_{i+2}), written out."""
    p = f"model.layers.{N}."
    with torch.no_grad():
        h = hf_trunk(kind, tensors).model(torch.tensor([ids])).last_hidden_state[0]  # final-normed h_i
        emb = tensors["model.embed_tokens.weight"][torch.tensor(ids[1:])]  # Emb(t_{i+1})
        cat = torch.cat([rms(emb, tensors[p + "enorm.weight"], eps), rms(h[:-1], tensors[p + "hnorm.weight"], eps)], -1)
        x = cat @ tensors[p + "eh_proj.weight"].T
        return hf_block_model(kind, tensors)(inputs_embeds=x[None]).logits[0]


def engine_mtp_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The trunk over ids, then the MTP layer over positions 0..L-2 with the next tokens, through the
    engine's paged caches and routes."""
    ps, pool = llm.config.cache.page_size, llm.engine.pool
    pages = tuple(pool.allocate(-(-len(ids) // ps)))
    try:
        _, _, hidden = llm.runner.execute_with_hidden([SeqChunk("r", tuple(ids), 0, pages, all_logits=True)])
        chunk = SeqChunk("r", tuple(ids[1:]), 0, pages, all_logits=True)
        return llm.runner.drafter.forward([chunk], hidden, {"r": 0}, 0)[1]
    finally:
        pool.release(list(pages))


@pytest.mark.parametrize("kind", ["v3_yarn", "glm_dsa"])
def test_mtp_layer_equals_formula(mtp_model_dir, kind):
    folder, tensors = mtp_model_dir(kind)
    llm = LLM(str(folder), speculative="mtp")
    assert llm.loaded.report.skipped == []  # the MTP tensors were loaded, not skipped
    ids = random_ids(24, seed=3)  # 24 > index_topk 16: the DSA layers select
    ref = reference_mtp_logits(kind, tensors, ids, llm.config.model.rms_norm_eps)
    got = engine_mtp_logits(llm, ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_mtp_tensors_skipped_without_speculation(mtp_model_dir):
    folder, _ = mtp_model_dir("v3_yarn")
    llm = LLM(str(folder))
    assert not hasattr(llm.runner.model, "mtp") and llm.runner.drafter is None
    assert all(name.startswith(f"model.layers.{N}.") for name in llm.loaded.report.skipped)
    assert len(llm.loaded.report.skipped) > 5


def test_speculative_needs_mtp_weights(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    with pytest.raises(ConfigError, match="MTP layer"):
        LLM(str(folder), speculative="mtp")


def test_gguf_mtp_equals_safetensors(mtp_model_dir, tmp_path):
    """llama.cpp's layout keeps the nextn block (blk.3.nextn.* + the block's attention, indexer and
    experts): loaded from the GGUF, the MTP layer gives the same logits as from safetensors."""
    from test_gguf_convert import _byte_tokenizer

    from mlaserve.gguf.convert.convert import convert_hf_to_gguf

    folder, _ = mtp_model_dir("glm_dsa")
    copy = tmp_path / "glm_dsa"
    shutil.copytree(folder, copy)
    _byte_tokenizer(copy, 256)
    path = tmp_path / "mtp.gguf"
    convert_hf_to_gguf(copy, path, "f32")
    ids = random_ids(24, seed=4)
    want = engine_mtp_logits(LLM(str(folder), speculative="mtp"), ids)
    llm = LLM(str(path), speculative="mtp")
    assert not [n for n in llm.loaded.report.skipped if ".nextn." in n]
    got = engine_mtp_logits(llm, ids)
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    plain = LLM(str(path))  # without speculation the nextn block is skipped and reported
    assert any(".nextn.eh_proj" in n for n in plain.loaded.report.skipped)

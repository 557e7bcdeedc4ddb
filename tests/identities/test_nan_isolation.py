"""One request's non-finite values never reach another request, during or after it, on every attention
backend and path (dense MLA absorbed / decompressed, DSA sparse).

A model whose embedding row for token BAD is +inf: a prompt holding BAD has NaN hidden states from that
position on, writes NaN latent rows (and index keys) into its pages, and fails alone (finish_reason "error").
Masked rows must be excluded by selection, not by a zero probability (0 x NaN = NaN): padding slots point at
cache slot 0 and freed pages keep their rows, so otherwise the NaN reached the other requests of the step
and, through freed pages, later requests. The healthy requests are compared with the same batch where BAD is
replaced by a benign token (same shapes): the same tokens, finite log-probabilities equal to fp32 rounding
(not bitwise: the bad prompt's NaN tokens route to other experts than the benign ones, so the MoE's grouped
GEMMs see other group sizes; measured <= 5e-7 -> 1e-5), and later requests on the used engine equal a fresh
engine's bit for bit (same batches, nothing of the bad request read)."""

from __future__ import annotations

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.gguf.quants import GGML_TYPES
from mlaserve.kernels import native
from mlaserve.quant.ggml_linear import GGUFEmbedding

BAD, BENIGN = 250, 251
NATIVE = native.status().available
BACKENDS = ["torch", "reference"] + (["native"] if NATIVE else [])
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3)
# the bad request fails at its first sample; its benign twin stops there too, so both runs batch alike
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=3)
# 20 + tokens: past index_topk (16) of the DSA model, so its indexer selects; the bad token mid-prompt
HEALTHY = [[7, 3, 9, 4, 5, 6, 1, 2, 8, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [42], [5, 6, 7, 8, 9, 10]]
LATER = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4, 3, 2, 1, 3, 3], [11, 12], [30, 31, 32, 33]]


def _engine(folder, **kw) -> LLM:
    """The model with +inf in token BAD's embedding row (set after the load: quantization at load refuses a
    non-finite weight; a Q8_0 row is poisoned through its blocks' fp16 scales, inf x code = inf or NaN)."""
    if kw.get("attention_backend") == "native":
        # its C latent MQA runs with the native kernels, which serve quantized weights: Q8_0 blocks at load
        # (the C MoE block and decode layers then run too)
        kw = kw | {"kernels": "native", "quantization": "int8"}
    llm = LLM(str(folder), **kw)
    embed = llm.runner.model.model.embed_tokens
    if isinstance(embed, GGUFEmbedding):
        assert GGML_TYPES[embed.ggml_type].name == "Q8_0"
        blocks = embed.weight[BAD].view(-1, 34)  # Q8_0: fp16 d, then 32 int8 codes
        blocks[:, :2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # d = +inf (little-endian fp16)
    else:
        embed.weight.data[BAD] = float("inf")
    return llm


def _bad_prompt(token: int) -> list[int]:
    return [3, 1, 4, 1, 5, 9, token, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]


def _result(out) -> tuple:
    o = out.outputs[0]
    return o.finish_reason, tuple(o.token_ids), [sorted(d.items()) for d in o.logprobs or []]


def _check(folder, **kw):
    llm = _engine(folder, **kw)
    outs = llm.generate([_bad_prompt(BAD), *HEALTHY], [ONE] + [PARAMS] * len(HEALTHY))
    assert outs[0].outputs[0].finish_reason == "error" and "non-finite" in outs[0].outputs[0].error
    want = _engine(folder, **kw).generate([_bad_prompt(BENIGN), *HEALTHY], [ONE] + [PARAMS] * len(HEALTHY))
    for got, ref in zip(outs[1:], want[1:]):
        (reason, ids, lps), (reason_ref, ids_ref, lps_ref) = _result(got), _result(ref)
        assert (reason, ids) == (reason_ref, ids_ref) == ("length", ids_ref)
        a, b = torch.tensor([[v for _, v in step] for step in lps]), torch.tensor([[v for _, v in s] for s in lps_ref])
        assert [[t for t, _ in step] for step in lps] == [[t for t, _ in step] for step in lps_ref]
        assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-5, (a - b).abs().max()
    # after it: its freed pages (NaN rows) serve other requests; a fresh engine gives the same bits
    later = [_result(o) for o in llm.generate(LATER, PARAMS)]
    assert later == [_result(o) for o in _engine(folder, **kw).generate(LATER, PARAMS)]
    # a request fails only by sampling BAD itself (then its own next step reads the inf row)
    assert all(r[0] == "length" or (r[0] == "error" and r[1][-1] == BAD) for r in later), later


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mla_path", ["auto", "absorbed", "decompressed"])
def test_dense_mla(hf_model_dir, backend, mla_path):
    folder = hf_model_dir("v3_yarn")[0]
    _check(folder, attention_backend=backend, mla_path=mla_path, page_size=4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mla_path", ["auto", "decompressed"])
def test_sparse_dsa(hf_model_dir, backend, mla_path):
    folder = hf_model_dir("glm_dsa")[0]
    _check(folder, attention_backend=backend, mla_path=mla_path, page_size=4)


def test_the_poisoned_model_really_poisons(hf_model_dir):
    """The premise: alone, the bad prompt's logits are non-finite (so the tests above exercise NaN rows)."""
    with pytest.raises(FloatingPointError, match=r"from prompt position 6 on \(14 of 20 positions\)"):
        _engine(hf_model_dir("v3_yarn")[0]).prompt_logits(_bad_prompt(BAD))  # rows 6.. non-finite, 0..5 finite


@pytest.mark.parametrize("kind", ["v3_yarn", "glm_dsa"])
def test_triton(hf_model_dir, kind):
    """The triton backend (Triton's interpreter on CPU: slow, so one mla_path per model) where all its kernels run:
    mla_path auto, i.e. the dense model's decodes absorbed and prompts decompressed, the DSA model's indexer
    scores and sparse latent MQA in decode and prompt steps. Its kernels are held to the same rule on poisoned
    caches, path by path, in tests/identities/test_triton_attention.py."""
    _check(hf_model_dir(kind)[0], attention_backend="triton", mla_path="auto", page_size=4)

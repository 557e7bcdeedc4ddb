"""The embedded default model: engine perplexity and greedy text == transformers on the same files."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.embedded import EMBEDDED, default_model_path

HELDOUT = Path(__file__).parents[1] / "data" / "kjv_heldout.txt"  # held-out KJV text (never trained on)
WINDOW = 256  # the training context: <bos> + 255 tokens per window


@pytest.fixture(scope="module")
def engine():
    if not (EMBEDDED / "model.safetensors").exists():
        pytest.fail(f"the embedded model is missing from {EMBEDDED}")
    return LLM(str(EMBEDDED))


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(EMBEDDED), dtype=torch.float32, attn_implementation="eager").eval()


def _windows(llm: LLM) -> list[list[int]]:
    ids = llm.tokenizer.encode(HELDOUT.read_text(), add_special_tokens=False)
    bos = llm.tokenizer.encode("", add_special_tokens=True)
    step = WINDOW - len(bos)
    return [bos + ids[i : i + step] for i in range(0, len(ids) - step + 1, step)]


def _nll(logits: torch.Tensor, ids: list[int]) -> tuple[float, int]:
    targets = torch.tensor(ids[1:])
    lp = logits[:-1].log_softmax(-1).gather(1, targets[:, None])
    return -lp.sum().item(), len(targets)


def test_default_model_is_the_embedded_one():
    assert default_model_path() == EMBEDDED


def test_heldout_perplexity_engine_equals_transformers(engine, reference):
    windows = _windows(engine)
    assert len(windows) >= 2
    ours = theirs = 0.0
    count = 0
    for w in windows:
        nll, n = _nll(engine.prompt_logits(w), w)
        with torch.no_grad():
            ref_nll, _ = _nll(reference(torch.tensor([w])).logits[0].float(), w)
        ours, theirs, count = ours + nll, theirs + ref_nll, count + n
    ppl, ref_ppl = math.exp(ours / count), math.exp(theirs / count)
    rel = abs(ppl - ref_ppl) / ref_ppl
    print(f"held-out perplexity: engine {ppl:.6f}, transformers {ref_ppl:.6f}, relative difference {rel:.2e}")
    # relative ppl difference = |mean nll difference|; each token's log-probability moves by at most twice the
    # logits' fp32 error (~1e-5 at most, conftest.FP32_LOGITS_TOL) and the signs mostly cancel in the mean:
    # measured 8e-8. 1e-6 is 12x that and still 10x below one logit's worst fp32 error.
    assert rel <= 1e-6, rel
    assert engine.config.attention.sparse  # the shipped model runs with its indexer


def test_greedy_continuation_equals_transformers(engine, reference):
    """80 new tokens: the context passes index_topk (64), so decode steps really select."""
    prompt = engine.encode("And it came to pass, when")
    got = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))[0]
    with torch.no_grad():
        want = reference.generate(
            torch.tensor([prompt]), max_new_tokens=80, do_sample=False, eos_token_id=None, pad_token_id=2
        )[0, len(prompt) :].tolist()  # not 0: that is BOS
    assert got.outputs[0].token_ids == want
    assert len(got.outputs[0].text.split()) >= 10

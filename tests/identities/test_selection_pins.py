"""verify's selection pins (entrypoints/verify_selection_pins.py): a DSA top-k decided at a tie takes the recorded
run's choice, and a wrong selection is still a failed check."""

from __future__ import annotations

import pytest
import torch
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.entrypoints import verify_selection_pins as pins
from mlaserve.entrypoints.verify import run_checks
from mlaserve.models.indexer import Indexer


def _tied_scores(llm: LLM) -> None:
    """Every indexer's head weights 0: every key of every query scores exactly 0, so each top-k is a choice among
    ties, which two implementations of the top-k make differently (as a ReLU that zeroes all of a key's heads does)."""
    for m in llm.loaded.model.modules():
        if isinstance(m, Indexer):
            with torch.no_grad():
                m.weights_proj.weight.zero_()


def _engine(folder, native: bool) -> LLM:
    if native:  # the C top-k (csrc/indexer.c) against the reference's torch.topk
        return LLM(str(folder), attention_backend="native", kernels="native", quantization="int8")
    return LLM(str(folder))


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_ties_take_the_recorded_choice(hf_model_dir, monkeypatch, native):
    from mlaserve.kernels import native as native_lib

    if native and native_lib.library() is None:
        pytest.skip("no native library: no C top-k to compare")
    folder, _ = hf_model_dir("glm_dsa")  # index_topk 16: a 40-token prompt selects
    llm = _engine(folder, native)
    _tied_scores(llm)
    ids = random_ids(40)
    checks = run_checks(llm, ids)
    assert all(c.passed for c in checks), [(c.name, c.max_abs_diff, c.note) for c in checks]
    pinned = [c for c in checks if "pinned to the recorded top-k" in c.note]
    assert pinned and all("within 0 x" in c.note for c in pinned), [c.note for c in checks]
    # without the pins the same ties fail checks: the pins, not luck, keep them
    monkeypatch.setattr(pins, "DELTA", -1.0)  # no gap is within it: nothing pinned
    failed = [c for c in run_checks(llm, ids) if not c.passed]
    assert {c.name for c in failed} == {c.name for c in pinned}
    assert all(c.max_abs_diff > 1e-2 and "differ beyond fp32 noise" in c.note for c in failed)


def test_a_wrong_selection_is_not_pinned(hf_model_dir, monkeypatch):
    """The torch backend keeps each query's bottom-k (its scores negated): the reference's top-k is no tie of it, so
    nothing is pinned and the backend checks of selecting routes fail."""
    from mlaserve.attention.backends.torch_backend import TorchBackend

    folder, _ = hf_model_dir("glm_dsa")
    llm = LLM(str(folder))
    real = TorchBackend.index_topk
    monkeypatch.setattr(TorchBackend, "index_topk", staticmethod(lambda q, w, *a: real(q, -w, *a)))
    checks = {c.name: c for c in run_checks(llm, random_ids(40))}
    sparse = checks["torch vs reference backend, sparse top-16"]
    assert not sparse.passed and "differ beyond fp32 noise" in sparse.note and "pinned" not in sparse.note


def test_pin_query_takes_a_tie_within_fp32_noise_only():
    g = torch.Generator().manual_seed(0)
    q, w, keys = torch.randn(4, 8, generator=g), torch.rand(4, generator=g), torch.randn(12, 8, generator=g)
    keys[7] = keys[3] * (1 - 2e-7)  # key 7 scores just below key 3, within ~1e-7 of its magnitude
    s, m = pins.scores_and_magnitudes(q, w, keys)
    order = s.argsort(descending=True)
    k = int((order == 3).nonzero()) + 1  # key 3 is the k-th: the top-k's last place, key 7 the next
    a = order[:k]
    b = torch.cat([a[a != 3], torch.tensor([7])])  # the recorded run kept key 7 instead
    assert s[3] > 0 and int(order[k]) == 7 and 0 < s[3] - s[7] <= pins.DELTA * m[7]
    assert pins.pin_query(s, m, a, b)
    assert not pins.pin_query(s, m, a, a)  # nothing to pin where both kept the same keys
    far = int(order[-1])  # the lowest-scoring key: no tie of the k-th
    assert not pins.pin_query(s, m, a, torch.cat([a[a != 3], torch.tensor([far])]))


def test_pooled_ties_take_the_recorded_choice(tmp_path, monkeypatch):
    """GLM-5.3-Flash's pooled indexer (queries keep pools): its head weights 0 tie every pool at 0, and torch's top-k
    breaks the ties its own way per query block, so chunked and token-by-token runs keep other pools than the one
    pass (seen: 2.8 max|diff| unpinned); pinned, every check passes."""
    pytest.importorskip("transformers.models.glm5_next")
    from glm5_next_models import random_ids as glm_ids
    from glm5_next_models import save_hf_glm5_next

    from mlaserve.models.pooled_indexer import PooledIndexer

    save_hf_glm5_next("sparse_mla_first_kpool2", tmp_path, seed=5)  # index_topk 8 over kpool 2: 4 pools kept
    llm = LLM(str(tmp_path))
    for m in llm.loaded.model.modules():
        if isinstance(m, PooledIndexer):
            with torch.no_grad():
                m.weights_proj.weight.zero_()
    ids = glm_ids(60, 96, 3)
    checks = run_checks(llm, ids)
    assert all(c.passed for c in checks), [(c.name, c.max_abs_diff, c.note) for c in checks]
    pinned = {c.name for c in checks if "pinned to the recorded top-k" in c.note}
    assert {"chunked prefill (7) vs one pass", "token-by-token decode vs one pass"} <= pinned, pinned
    monkeypatch.setattr(pins, "DELTA", -1.0)
    failed = {c.name for c in run_checks(llm, ids) if not c.passed}
    assert failed and failed <= pinned, failed

"""A path broken on purpose makes the `mlaserve verify` self-check that should catch it fail (and only
the checks that can see it: the others compare two routes that share the broken code)."""

from __future__ import annotations

import pytest
import torch
from conftest import fixture_dir

from mlaserve import LLM
from mlaserve.attention.backends import torch_index
from mlaserve.attention.backends.torch_backend import TorchBackend, absorbed_attention, decompressed_attention
from mlaserve.entrypoints.verify import run_checks

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


@pytest.fixture(scope="module")
def ds3():
    return LLM(str(fixture_dir("ds3")))  # v_head_dim == kv_lora_rank == 32: a transposed W_UV still fits


@pytest.fixture(scope="module")
def ds32():
    return LLM(str(fixture_dir("ds32")))  # DSA, index_topk 16


def failing(llm: LLM) -> set[str]:
    return {c.name for c in run_checks(llm, llm.encode(PROMPT)) if not c.passed}


def test_unbroken_paths_pass(ds3, ds32):
    assert failing(ds3) == set()
    assert failing(ds32) == set()


def test_transposed_w_uv_in_the_absorbed_path(ds3, monkeypatch):
    def broken(q_nope, q_pe, cache, w_uk, w_uv, seg, scale, allowed=None, heads=None):
        return absorbed_attention(q_nope, q_pe, cache, w_uk, w_uv.transpose(1, 2), seg, scale, allowed, heads)

    monkeypatch.setattr(TorchBackend, "absorbed", staticmethod(broken))
    assert failing(ds3) == {
        "absorbed vs decompressed",
        "token-by-token decode vs one pass",  # decodes take the absorbed path, the one pass does not
        "torch vs reference backend, absorbed path",
    }


def test_swapped_rope_halves_in_the_decompressed_path(ds3, monkeypatch):
    def broken(q_nope, q_pe, cache, kv_b, seg, scale, dn, allowed=None, tiles=False):
        r, half = kv_b.shape[1], q_pe.shape[-1] // 2
        k_pe = cache[:, r:]
        swapped = torch.cat([cache[:, :r], k_pe[:, half:], k_pe[:, :half]], dim=-1)
        return decompressed_attention(q_nope, q_pe, swapped, kv_b, seg, scale, dn, allowed, tiles)

    monkeypatch.setattr(TorchBackend, "decompressed", staticmethod(broken))
    assert failing(ds3) == {
        "absorbed vs decompressed",
        "token-by-token decode vs one pass",
        "torch vs reference backend, decompressed path",
    }  # chunked prefill vs one pass: both decompressed, both wrong alike: it cannot see this


def test_off_by_one_in_the_sparse_top_k(ds32, monkeypatch):
    def broken(q, w, keys, seg, topk):
        return torch_index.index_topk(q, w, keys, seg, topk - 1)

    monkeypatch.setattr(TorchBackend, "index_topk", staticmethod(broken))
    # absorbed vs decompressed and chunked vs one pass select with the same broken top-k and agree. The
    # comparison with the reference backend's top-k sees it on every route whose step selects (the prompt
    # is past 16); token-by-token decode sees it at position 15, where a one-token step does not select
    # yet (16 rows fit in index_topk) while the one pass keeps 15 of the 16.
    assert failing(ds32) == {
        "token-by-token decode vs one pass",
        "torch vs reference backend, absorbed path",
        "torch vs reference backend, decompressed path",
        "torch vs reference backend, sparse top-16",
    }

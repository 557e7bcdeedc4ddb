"""The allocator policy is an engine option with provenance, applied by LLM, and takes on glibc."""

from __future__ import annotations

import sys

import pytest

import mlaserve.entrypoints.llm
from mlaserve import LLM
from mlaserve.platform.allocator import keep_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_keep_freed_memory_applies_on_glibc():
    assert keep_freed_memory().startswith("glibc: mmap threshold 32 MiB")


@pytest.mark.parametrize("tuning", [True, False])
def test_llm_applies_the_policy_only_when_asked(hf_model_dir, monkeypatch, tuning):
    folder, _ = hf_model_dir("v3_yarn")
    calls = []
    monkeypatch.setattr(mlaserve.entrypoints.llm, "keep_freed_memory", lambda: calls.append(1) or "called")
    llm = LLM(str(folder), malloc_tuning=tuning)
    prov = {s.name: s for s in llm.config.all_provenance()}
    assert prov["malloc_tuning"].value is tuning and len(calls) == int(tuning)
    assert prov["malloc_tuning"].source.startswith("on:" if tuning else "off: library default")


def test_library_default_leaves_the_allocator_alone(hf_model_dir, monkeypatch):
    """A library user who says nothing keeps their process's malloc policy; the CLI turns it on."""
    folder, _ = hf_model_dir("v3_yarn")
    calls = []
    monkeypatch.setattr(mlaserve.entrypoints.llm, "keep_freed_memory", lambda: calls.append(1) or "called")
    assert LLM(str(folder)).config.runtime.malloc_tuning is False and calls == []

"""Speculative decoding talks to the engine through engine/spec_host.py: no import of engine.py, and
the row subset it verifies by rejection is SamplingBatch.select (the field list lives in the class)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import torch

import mlaserve.engine.speculative as spec
from mlaserve.engine.engine import Engine
from mlaserve.engine.spec_host import SpeculativeHost
from mlaserve.sampling.params import SamplingParams
from mlaserve.sampling.sampler import SamplingBatch, make_generator


def _imports(module) -> set[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_speculative_does_not_import_the_engine():
    assert "mlaserve.engine.engine" not in _imports(spec)  # not even under TYPE_CHECKING


def _self_attributes_assigned(cls) -> set[str]:
    """Names assigned as self.<name> anywhere in the class's module (tuple targets included)."""
    tree = ast.parse(Path(sys.modules[cls.__module__].__file__).read_text())
    targets = [t for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets]
    return {
        a.attr
        for t in targets
        for a in ast.walk(t)
        if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "self"
    }


def test_engine_offers_what_speculation_uses():
    methods = {n for n, v in vars(SpeculativeHost).items() if callable(v) and not n.startswith("_")}
    assert methods == {"sampling_batch", "record_prompt_logprobs", "take_tokens", "fail"}
    assert all(callable(getattr(Engine, n, None)) for n in methods)
    assert set(SpeculativeHost.__annotations__) <= _self_attributes_assigned(Engine)


def test_select_equals_building_from_the_rows():
    V = 16
    params = [
        SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.2, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[4], presence_penalty=0.5, seed=2),
        SamplingParams(temperature=0.9, top_p=0.8, min_p=0.1, frequency_penalty=0.3),
    ]
    prompts, outputs = [[1, 2], [3], [5, 6, 7], [8]], [[2], [], [9], [10, 10]]

    def build(rows):
        gens = [make_generator(params[r].seed) if params[r].seed is not None else None for r in rows]
        return SamplingBatch.build(
            [params[r] for r in rows], [prompts[r] for r in rows], [outputs[r] for r in rows], gens, V, eos_token_id=1
        )

    whole, rows = build(range(4)), [3, 2, 0]
    got, want = whole.select(rows), build(rows)
    for name in ("temperature", "is_greedy", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.frequency_penalty, want.frequency_penalty)
    assert torch.equal(got.output_counts, want.output_counts) and torch.equal(got.seen_mask, want.seen_mask)
    assert sorted(zip(got.banned_rows.tolist(), got.banned_tokens.tolist())) == sorted(
        zip(want.banned_rows.tolist(), want.banned_tokens.tolist())
    )
    assert set(got.generators) == set(want.generators) == {1, 2}
    assert got.generators[2] is whole.generators[0]  # the same request's generator, renumbered

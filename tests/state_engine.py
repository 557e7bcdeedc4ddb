"""What the engine tests of the request-state models (Kimi-Linear, GLM-5.3-Flash, DeepSeek-V4) share: a module's model fixture
(a seeded transformers model saved by its save_pretrained, its float64 copy the reference), the logits check
against a bound, greedy sampling, and the steps that run sequences of mixed lengths together and each alone.

Each test module keeps its own bound and says there why; these helpers only apply it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from conftest import compare_logits

from mlaserve.executor.forward_batch import SeqChunk
from mlaserve.sampling.params import SamplingParams


def model_fixture(name: str, specs, save: Callable, float64_copy: Callable, seed: int):
    """A module-scoped fixture `name`, one per spec: (spec, the float64 transformers reference, the folder written
    by its save_pretrained). Assign it to `name` in the test module: pytest finds it there."""

    @pytest.fixture(scope="module", params=list(specs), name=name)
    def fixture(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
        folder = tmp_path_factory.mktemp(f"{name}_{request.param}")
        return request.param, float64_copy(save(request.param, folder, seed=seed)), folder

    return fixture


def assert_close(ours: torch.Tensor, ref: torch.Tensor, bound: float, what: str) -> float:
    """max |ours - ref| <= bound and the same top-1 at every row (conftest.py compare_logits); -> the max abs
    difference."""
    err, top1 = compare_logits(ours, ref)
    assert err <= bound, f"{what}: max abs {err:.3g} > {bound}"
    assert top1 == 1.0, f"{what}: top-1 differs"
    return err


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def together_and_alone(
    runner, prompts: Mapping[str, list[int]], plan: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[int]]:
    """Each request's prompt in chunks ending at its `plan` entries (token counts, one per step), all logits:
    alone (one request per step, state slot 0) and together (step i runs every request's i-th chunk, each in its
    own slot 1, 2, ...). Each request has 16 pages of its own. -> (alone, together: per request its logits rows
    [sum of its chunks, vocab], each step's number of decode sequences in the together run)."""
    ps = runner.cfg.cache.page_size
    pages = {r: list(range(i * 16, i * 16 + 16)) for i, r in enumerate(prompts)}

    def chunk(rid, ids, done, slot):
        table = tuple(pages[rid][: -(-(done + len(ids)) // ps)])
        return SeqChunk(rid, tuple(ids), done, table, all_logits=True, state_slot=slot, reset_state=done == 0)

    alone = {}
    for rid, ends in plan.items():
        rows, done = [], 0
        for end in ends:
            rows.append(runner.execute([chunk(rid, prompts[rid][done:end], done, 0)])[1])
            done = end
        alone[rid] = torch.cat(rows)
    together: dict[str, list[torch.Tensor]] = {r: [] for r in plan}
    done = dict.fromkeys(plan, 0)
    decodes = []
    for i in range(max(map(len, plan.values()))):
        chunks = []
        for slot, (rid, ends) in enumerate(plan.items(), start=1):
            if i < len(ends):
                chunks.append(chunk(rid, prompts[rid][done[rid] : ends[i]], done[rid], slot))
                done[rid] = ends[i]
        batch, logits = runner.execute(chunks)
        decodes.append(batch.num_decode_seqs)
        for (rid, _), row in zip(batch.logits_owner, logits):
            together[rid].append(row)
    return alone, {rid: torch.stack(rows) for rid, rows in together.items()}, decodes


def state_chunk(
    rid: str, ids: list[int], done: int, pages: list[int], slot: int, page_size: int, drafts: int = 0
) -> SeqChunk:
    """A chunk of request rid (its ids after `done` tokens) over the pages it reaches, in its state slot; its first
    chunk resets the slot; `drafts` of its ids are MTP drafts to verify."""
    end = done + len(ids)
    return SeqChunk(
        rid,
        tuple(ids),
        done,
        tuple(pages[: -(-end // page_size)]),
        state_slot=slot,
        reset_state=done == 0,
        num_draft=drafts,
    )

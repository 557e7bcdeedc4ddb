"""The rollback of DeepSeek-V4's request states after a verify step (models/deepseek_v4/rollback.py), state by
state: a verify chunk [t, d1, d2, d3] whose windows (CSA 4, HCA 8) and page boundary (page 8) close inside the
drafts, then rolled back to keep = 1 .. 4 tokens, against a plain runner that ran only the kept tokens.

Compared per layer: the ring rows of the W positions before the next query, the carry rows of the open window
(fill = context % m), the overlap halves, the pool rows through the block table and the page snapshot rows;
and the rejected rows vanish: pool rows of windows closed by rejected tokens and snapshot rows of boundaries past
the kept tokens are exactly zero, as in a cache that never saw them.
Bound 2e-6: the plain runner projects `keep` rows where the verify step projected 4, and a GEMM's rounding may
depend on its row count: the first layer's K=V rows already differ by 2 ulps (4.8e-7 at 2.75), growing through the
four layers' mHC streams to 4 ulps (9.5e-7 in the last layer's ring); values are within |3.3|. The rollback itself
adds no rounding (the replay pools the same values through the same ops: keep = 4, no rollback, is exact, and so
are the zeroed rows). Measured 0 .. 9.5e-7. Without the rollback the states differ by O(1).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from v4_mtp_models import save_v4_with_mtp  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.executor.forward_batch import SeqChunk  # noqa: E402

BOUND = 2e-6
PS = 8
PROMPT = [0, 17, 44, 9, 61, 23, 5, 88, 31, 70, 12, 54, 40]  # 13 tokens: positions 13..16 close CSA window 3,
DRAFT = [33, 8, 91, 27]  # HCA window 1 at position 15 and reach the page boundary 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("v4mtp_rollback")
    save_v4_with_mtp("all_kinds", f, seed=3)
    return f


def _run(llm: LLM, chunks: list[tuple[list[int], int]], keep: int | None = None) -> list[int]:
    """Prefill and one more chunk into slot 0 of a fresh engine's runner -> the request's pages. chunks:
    (tokens, num_draft); keep: roll the last chunk back to this many tokens."""
    pages = llm.engine.pool.allocate(3)
    done = 0
    for i, (ids, drafts) in enumerate(chunks):
        end = done + len(ids)
        seq = SeqChunk("r", tuple(ids), done, tuple(pages[: -(-end // PS)]), state_slot=0, reset_state=i == 0)
        seq = SeqChunk(**{**seq.__dict__, "num_draft": drafts}) if drafts else seq
        llm.runner.execute_with_hidden([seq])
        done = end
    if keep is not None:
        llm.runner.rollback({"r": keep})
    return pages


def _state(llm: LLM, pages: list[int], length: int, full: int) -> dict[str, torch.Tensor]:
    """Every layer's state of slot 0 as a sequence of `length` tokens would read it, and (name "gone/...") the
    rows a sequence of `full` tokens would add past it (pool rows, snapshot rows)."""
    out = {}
    for i, layer in enumerate(llm.runner.cache.layers):
        t, kind = layer.tensors, layer.kind
        w = t["window"].shape[1]
        ring_rows = torch.tensor([p % w for p in range(max(0, length - w), length)])
        out[f"{i}/window"] = t["window"][0, ring_rows]
        boundary_pages = [pages[b // PS - 1] for b in range(PS, full + 1, PS)]
        kept = [pages[b // PS - 1] for b in range(PS, length + 1, PS)]
        for name in ("window", "kv_overlap", "index_overlap"):
            if name + "_snapshot" in t:
                out[f"{i}/{name}_snapshot"] = t[name + "_snapshot"][kept]
                out[f"gone/{i}/{name}_snapshot"] = t[name + "_snapshot"][[p for p in boundary_pages if p not in kept]]
        if kind.attention == "v4_sliding":
            continue
        m = kind.ratio
        for carry in ("kv_carry", "index_carry"):
            if carry in t:
                out[f"{i}/{carry}"] = t[carry][0, :, : length % m]
        for name in ("kv_overlap", "index_overlap"):
            if name in t and length >= m:
                out[f"{i}/{name}"] = t[name][0]
        per_page = PS // m
        slots = torch.tensor([pages[r // per_page] * per_page + r % per_page for r in range(full // m)])
        for pool in ("kv_pool", "index_pool"):
            if pool in t:
                out[f"{i}/{pool}"] = t[pool][slots[: length // m]]
                out[f"gone/{i}/{pool}"] = t[pool][slots[length // m :]]
    return out


@pytest.mark.parametrize("keep", [1, 2, 3, 4])
def test_rollback_equals_plain_over_kept_tokens(folder, keep):
    spec = LLM(str(folder), page_size=PS, speculative="mtp", num_speculative_tokens=3)
    plain = LLM(str(folder), page_size=PS)
    full = len(PROMPT) + len(DRAFT)
    got = _state(spec, _run(spec, [(PROMPT, 0), (DRAFT, 3)], keep), len(PROMPT) + keep, full)
    want = _state(plain, _run(plain, [(PROMPT, 0), (DRAFT[:keep], 0)]), len(PROMPT) + keep, full)
    assert got.keys() == want.keys()
    gone = [k for k in got if k.startswith("gone/")]
    # keep < 3 drops rows: CSA's window 3 and HCA's window 1 (both close at position 15), the page boundary 16
    assert any(got[name].numel() for name in gone) == (keep < 3)
    for name in gone:
        assert torch.equal(got[name], torch.zeros_like(got[name])), f"keep={keep}: {name} not zero"
        assert torch.equal(got[name], want[name])  # as in a cache that never saw the rejected tokens
    for name in got.keys() - set(gone):
        err = (got[name].float() - want[name].float()).abs().max().item() if got[name].numel() else 0.0
        assert err <= BOUND, f"keep={keep}: {name} {err:.2e} from the plain run"


def test_without_rollback_the_states_differ(folder):
    """The check above can fail: a verify step left as it ran (every draft's advance kept) is far off."""
    spec = LLM(str(folder), page_size=PS, speculative="mtp", num_speculative_tokens=3)
    plain = LLM(str(folder), page_size=PS)
    full = len(PROMPT) + len(DRAFT)
    pages = _run(spec, [(PROMPT, 0), (DRAFT, 3)])
    spec.runner.tape = None  # the verdict's rollback skipped
    got = _state(spec, pages, len(PROMPT) + 1, full)
    want = _state(plain, _run(plain, [(PROMPT, 0), (DRAFT[:1], 0)]), len(PROMPT) + 1, full)
    worst = max((got[k].float() - want[k].float()).abs().max().item() for k in got if got[k].numel())
    assert worst > 0.1

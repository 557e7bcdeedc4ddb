"""greedy_pick.argmax_finite: a step's greedy tokens and NaN check in one pass, the native pass (csrc/glue.c
mls_argmax_rows) and torch's ops alike, against torch.argmax and torch.isfinite row by row."""

from __future__ import annotations

import pytest
import torch

from mlaserve.engine import greedy_pick
from mlaserve.kernels import native

STATUS = native.status()


def logits_with_every_case() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 1000, generator=g)
    x[1, 17] = x[1, 900] = 50.0  # a tie: the first index
    x[2, 5] = float("nan")
    x[3, 999] = float("inf")
    x[4, 0] = float("-inf")  # finite maximum, a -Inf elsewhere: still not a finite row
    x[5] = -1e30  # every value equal and very negative: index 0
    x[6, :] = -3.0
    x[6, 400] = -0.0  # the maximum is -0.0 ...
    x[6, 401] = 0.0  # ... equal to 0.0: the first of them
    x[7, 999] = 60.0  # the last index
    x[8, 0] = 60.0  # the first index
    return x


def expected(x: torch.Tensor) -> tuple[list[int], list[bool]]:
    finite = torch.isfinite(x).all(-1).tolist()
    return [int(x[i].argmax()) if ok else None for i, ok in enumerate(finite)], finite


def check(got: tuple[list[int], list[bool]], x: torch.Tensor) -> None:
    want_ids, want_finite = expected(x)
    assert got[1] == want_finite == [True, True, False, False, False, True, True, True, True]
    assert [i if ok else None for i, ok in zip(got[0], got[1])] == want_ids
    assert want_ids[1] == 17 and want_ids[6] == 400 and want_ids[7] == 999 and want_ids[8] == 0


@pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
def test_native_pass_matches_torch_argmax_and_isfinite():
    check(greedy_pick.argmax_finite(logits_with_every_case()), logits_with_every_case())


def test_torch_ops_where_the_native_pass_does_not_run(monkeypatch):
    x = logits_with_every_case()
    monkeypatch.setattr(native, "library", lambda: None)
    check(greedy_pick.argmax_finite(x), x)
    check(greedy_pick.argmax_finite(x.t().contiguous().t()), x)  # not contiguous: torch's ops too


@pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
def test_native_pass_in_lanes_and_tail_over_many_rows():
    """1003 values: 125 vectors of 8 lanes and a tail of 3, whose values the pass takes one by one; 33 rows shared
    out over the threads. Every case where a lane's and the tail's results meet."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(33, 1003, generator=g)
    x[0, 1002] = 40.0  # the maximum in the tail
    x[1, 1002] = float("nan")  # NaN in the tail only
    x[2, 8] = float("inf")  # Inf in a lane
    x[3, 999], x[3, 1000] = 45.0, 45.0  # a tie across the last vector and the tail: the first
    x[4, :] = -2.0
    x[4, 1001] = -0.0  # the maximum in the tail is -0.0 ...
    x[4, 1002] = 0.0  # ... equal to 0.0: the first of them
    x[5, 3] = x[5, 1000] = 45.0  # a tie across the first vector and the tail
    x[6, 1001] = float("-inf")  # -Inf in the tail: not finite
    got_ids, got_finite = greedy_pick.argmax_finite(x)
    finite = torch.isfinite(x).all(-1).tolist()
    assert got_finite == finite and finite[:7] == [True, False, False, True, True, True, False]
    want = [int(x[i].argmax()) for i in range(33)]
    assert [i for i, ok in zip(got_ids, finite) if ok] == [w for w, ok in zip(want, finite) if ok]
    assert (got_ids[0], got_ids[3], got_ids[4], got_ids[5]) == (1002, 999, 1001, 3)

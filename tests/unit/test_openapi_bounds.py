"""The OpenAPI document bounds logit_bias keys (token ids written as JSON object keys) to the vocabulary
through a regular expression on their spelling: it must match exactly 0 .. vocab-1, without leading zeros
or signs (the server checks keys with the same expression, so the document and the server agree)."""

from __future__ import annotations

import re

import pytest

from mlaserve.entrypoints.openai.constraints import below


@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 100, 101, 129, 256, 1000, 1001, 32000, 102400, 129280])
def test_below_matches_exactly_the_ids_under_n(n):
    r = re.compile(below(n))
    assert all(r.match(str(k)) for k in range(n))
    assert not [k for k in range(n, 3 * n + 20) if r.match(str(k))]
    assert not [x for x in ("00", "01", "-1", "+1", "1.0", "", "a", " 1") if r.match(x)]

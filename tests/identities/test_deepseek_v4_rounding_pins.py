"""verify's V4 identities over the official FP8 rounding (mlaserve/entrypoints/verify_v4_pins.py): the other
schedules take the one pass's decision on a value within fp32 noise of a rounding boundary.

- The rule itself: two rows within DELTA straddling a midpoint take the recorded decision; rows further apart
  than DELTA keep their own (a fault is never pinned away); the rope part is never touched.
- On any CPU (not only where BLAS sums rows of different counts differently): every K=V row's first value is
  put 1e-6 either side of an e4m3 midpoint (17/32: 17 x 2^k needs one mantissa bit more than e4m3 has), on
  one side in the one pass and on the other in chunked / token-by-token runs. Unpinned, each such value
  lands one FP8 step away and verify fails those checks; pinned, they pass, with the pins counted.
- A fault is still caught with the pins on: a carry written 1% off moves only the rows entering the rounding
  (the pooled rows of windows resumed from it); the chunked and decode checks fail under kv_cache_dtype=fp8_e4m3.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from official_v4 import OFFICIAL_SHAPES  # noqa: E402
from v4_models import build_hf_v4  # noqa: E402

from mlaserve.entrypoints import verify  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.entrypoints.verify_v4_pins import DELTA, pin  # noqa: E402
from mlaserve.models.deepseek_v4.attention import V4Attention  # noqa: E402
from mlaserve.models.deepseek_v4.compressor import Compressor  # noqa: E402
from mlaserve.models.deepseek_v4.official import FP8KVRows  # noqa: E402

N = 30
MIDPOINT = 17 / 32  # between the e4m3 values 16 and 18 (x 2^k) at every power-of-two scale


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4_pins")
    build_hf_v4("all_kinds", seed=2, **OFFICIAL_SHAPES).save_pretrained(path)
    return LLM(str(path), kv_cache_dtype="fp8_e4m3", page_size=8)


def _ids(vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return [0] + torch.randint(2, vocab, (N - 1,), generator=g).tolist()


def _checks(llm) -> dict:
    return {c.name.split(":")[0]: c for c in verify.run_checks(llm, _ids(llm.loaded.model.config.vocab_size))}


def test_the_rule_pins_only_rows_within_fp32_noise_and_only_the_rounded_part():
    rows = FP8KVRows(64, 8)
    a = torch.rand(3, 72, generator=torch.Generator().manual_seed(0)) - 0.5
    a[:, 0] = 4.0  # amax: the scale 2^-6 for every block, so 17/32 sits at a midpoint
    a[:, 1] = MIDPOINT + 1e-6
    b = a.clone()
    b[:, 1] = MIDPOINT - 1e-6
    b[:, 64:] += 1e-7  # the rope part differs too, and passes through unrounded
    b[2, 2] += 10 * DELTA  # row 2 is another row (a fault): its decision is its own
    ra, rb = rows(a), rows(b)
    assert (ra[:, 1] != rb[:, 1]).all()  # one FP8 step apart
    out, count, gap = pin(a, b, ra, rb, 64)
    assert count == 2 and gap <= 3e-6
    assert torch.equal(out[:2, :64], rb[:2, :64]) and torch.equal(out[2], ra[2])
    assert torch.equal(out[:, 64:], ra[:, 64:])


def _values_at_a_midpoint(monkeypatch):
    """The first value of every attention K=V row at 17/32 + 1e-6 in a pass over all N tokens, - 1e-6 in any
    step of fewer rows (chunks, decode steps): every one of them straddles a midpoint by 2e-6."""
    real = V4Attention.forward

    def forward(self, x, positions, spans, tables, csa_dense=False, step=None):
        side = 1e-6 if x.shape[0] >= N else -1e-6
        norm = self.kv_norm

        def kv_norm(h):
            out = type(norm).forward(norm, h).clone()
            out[..., 0] = MIDPOINT + side
            return out

        norm.forward = kv_norm
        try:
            return real(self, x, positions, spans, tables, csa_dense, step)
        finally:
            del norm.forward

    monkeypatch.setattr(V4Attention, "forward", forward)


ROUNDED = ("token-by-token decode vs one pass", "chunked prefill (3) vs one pass", "prefill then decode vs one pass")


def test_values_across_a_midpoint_fail_unpinned_and_pass_pinned(llm, monkeypatch):
    _values_at_a_midpoint(monkeypatch)
    pinned = _checks(llm)
    for name in ROUNDED:
        assert pinned[name].passed, (name, pinned[name].max_abs_diff, pinned[name].note)
        assert int(pinned[name].note.split("; ")[1].split()[0]) >= N // 2, pinned[name].note  # the forced ones
    monkeypatch.setattr(verify, "has_roundings", lambda model: False)
    unpinned = _checks(llm)
    for name in ROUNDED:
        assert not unpinned[name].passed and unpinned[name].max_abs_diff > 1e-3, name


def test_a_fault_is_not_pinned_away(llm, monkeypatch):
    """The carry a later step resumes a window from is written 1% off: only rows entering the rounding move
    (the pooled rows of resumed windows), by far more than DELTA, so their decisions stay their own."""
    real = Compressor.close_step

    def close_step(self, kv, gate, plan, carry, *rest):
        rows = real(self, kv, gate, plan, carry, *rest)
        if isinstance(self.round_rows, FP8KVRows):  # the attention's compressors (not the indexer's)
            carry[:, 0, :, :64] *= 1.01  # non-rope values only: the rope part passes through unpinned
        return rows

    monkeypatch.setattr(Compressor, "close_step", close_step)
    checks = _checks(llm)
    failed = {name for name, c in checks.items() if not c.passed}
    assert set(ROUNDED) <= failed, failed

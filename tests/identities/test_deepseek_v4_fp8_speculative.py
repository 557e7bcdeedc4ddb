"""DeepSeek-V4 with speculative="mtp" over the FP8 cache (kv_cache_dtype="fp8_e4m3"): greedy output == plain
greedy over the same cache. The rollback of rejected drafts clears their compressed pool rows, which the FP8
cache keeps as codes + scales (cache/quantized_rows.py QuantizedRows.index_fill_); before it could, every
request of a speculative V4 engine with the FP8 cache finished with an error at its first rejected draft.

The model: tests/v4_mtp_models.py's all_kinds folder at the official shapes (tests/official_v4.py: head_dim 136,
two FP8 blocks of 64 non-rope values), page 8 so page boundaries fall inside verify chunks. Its random MTP
layer drafts almost nothing right, so nearly every verify step rolls back. Tokens are compared exactly: both
runs store the same rows through the same quantizer; the verify chunk computes positions as one chunk where
plain decoding goes one by one, which test_deepseek_v4_official_engine bounds (a row can land one e4m3 step
away; measured: no token differs here).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import v4_mtp_models  # noqa: E402
from official_v4 import OFFICIAL_SHAPES  # noqa: E402

from mlaserve.cache.quantized_rows import QuantizedRows  # noqa: E402
from mlaserve.config.row_format import RowFormat  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def test_index_fill_clears_rows_to_zero():
    fmt = RowFormat(codes="fp8_e4m3", quantized=128, block=64, kept=8, scale="ue8m0")
    rows = torch.randn(5, 136)
    q = QuantizedRows.of(rows, fmt)
    q.index_fill_(0, torch.tensor([1, 3]), 0)
    out = q.index_select(0, torch.arange(5))
    assert torch.equal(out[[1, 3]], torch.zeros(2, 136))
    assert torch.equal(out[[0, 2, 4]], QuantizedRows.of(rows[[0, 2, 4]], fmt).index_select(0, torch.arange(3)))
    with pytest.raises(ValueError, match="to 0"):
        q.index_fill_(0, torch.tensor([0]), 1.0)


def test_mtp_over_the_fp8_cache_equals_plain(tmp_path, monkeypatch):
    base = v4_mtp_models.make_v4_config
    monkeypatch.setattr(v4_mtp_models, "make_v4_config", lambda kind, **kw: base(kind, **{**OFFICIAL_SHAPES, **kw}))
    v4_mtp_models.save_v4_with_mtp("all_kinds", tmp_path, seed=3)
    vocab = base("all_kinds").vocab_size
    prompts = [_ids(n, 100 + n, vocab) for n in (1, 3, 4, 7, 9, 12)]
    opts = dict(page_size=8, max_num_seqs=8, kv_cache_dtype="fp8_e4m3")
    plain = LLM(str(tmp_path), **opts).generate(prompts, GREEDY)
    spec = LLM(str(tmp_path), speculative="mtp", num_speculative_tokens=2, **opts).generate(prompts, GREEDY)
    assert [o.outputs[0].finish_reason for o in spec] == ["length"] * len(prompts)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    drafted = sum(o.metrics["num_draft_tokens"] for o in spec)
    assert sum(o.metrics["num_accepted_tokens"] for o in spec) < drafted  # rejected drafts were rolled back

"""Speculative decoding (MTP) over an 8-bit cache: the trunk and the MTP layer's own cache both keep 8-bit rows
(the drafter declares its states through the same kv_cache_dtype), and greedy output equals plain greedy over
the same 8-bit cache, with drafts accepted, partly accepted and rejected (test_speculative.py's oracle)."""

from __future__ import annotations

import pytest
from draft_oracle import oracle_drafts
from test_speculative import GREEDY, PROMPTS, _tokens

from mlaserve import LLM
from mlaserve.cache.quantized_rows import QuantizedRows


@pytest.mark.parametrize("codes", ["int8", "fp8_e4m3"])
def test_speculative_over_8bit_rows_equals_plain(tmp_path_factory, monkeypatch, codes):
    from mtp_models import mtp_model_folder

    folder, _ = mtp_model_folder("glm_dsa", tmp_path_factory)
    plain = _tokens(LLM(str(folder), kv_cache_dtype=codes).generate(PROMPTS[:4], GREEDY))
    llm = LLM(str(folder), kv_cache_dtype=codes, speculative="mtp", num_speculative_tokens=2)
    drafter = llm.runner.drafter.cache.layers[0]
    assert isinstance(drafter.latent, QuantizedRows) and drafter.latent.fmt.codes == codes
    oracle_drafts(monkeypatch, {tuple(p): o for p, o in zip(PROMPTS, plain)}, 256)
    outs = llm.generate(PROMPTS[:4], GREEDY)
    assert _tokens(outs) == plain
    rate = sum(o.metrics["num_accepted_tokens"] for o in outs) / sum(o.metrics["num_draft_tokens"] for o in outs)
    assert 0.3 < rate < 1.0  # accepted and rejected drafts both happened

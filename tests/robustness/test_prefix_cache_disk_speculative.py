"""The prefix cache on disk under MTP speculative decoding: a restarted engine (same prefix_cache_dir) reads the
prompt's full pages from files -- the trunk's rows and the MTP layer's own latent rows of those pages -- and its
greedy output equals the cold run's and plain decoding's (no speculation).

The drafts are the sharp check: the MTP layer attends over its own cache rows of the prefix. Were only the
trunk's rows read back, a restarted engine's MTP would read zero (or a freed page's stale) rows there and draft
from another context; output would still be plain greedy (verification keeps it exact) but the drafts would
differ. With the MTP rows in the page files, every draft logit of the restarted engine equals the one of an
in-memory prefix hit over the same pages bit for bit (rows copied verbatim, the same kernels run the same
suffix: test_prefix_cache_disk.py's argument).
"""

from __future__ import annotations

import pytest
import torch
from hf_models import random_ids
from mtp_models import mtp_model_folder

from mlaserve import LLM
from mlaserve.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PS = 4


def _run(llm: LLM, ids: list[int]):
    """-> (greedy tokens, metrics, every MTP pass's logits in order), the disk writer drained."""
    seen = []
    drafter = llm.runner.drafter
    forward = drafter.forward

    def capture(*args, **kw):
        batch, logits, g = forward(*args, **kw)
        seen.append(logits.clone())
        return batch, logits, g

    drafter.forward = capture
    out = llm.generate([ids], GREEDY)[0]
    drafter.forward = forward
    llm.runner.disk_tier.flush()
    return out.outputs[0].token_ids, out.metrics, seen


@pytest.mark.parametrize("kind", ["v3_yarn", "glm_dsa"])
def test_restart_reads_trunk_and_mtp_rows_from_disk(tmp_path_factory, tmp_path, kind):
    folder, _ = mtp_model_folder(kind, tmp_path_factory)
    ids = random_ids(23, seed=11)  # 5 full pages of 4 before the last token
    plain = LLM(str(folder), page_size=PS).generate([ids], GREEDY)[0].outputs[0].token_ids

    def engine():
        return LLM(
            str(folder), prefix_cache_dir=str(tmp_path), page_size=PS, speculative="mtp", num_speculative_tokens=2
        )

    a = engine()
    assert any(k.startswith("mtp.") for k in a.runner.disk_tier.layout)  # the MTP's rows are page parts
    cold, m, _ = _run(a, ids)
    assert m["num_disk_cached_tokens"] == 0 and m["num_draft_tokens"] > 0
    warm, m, warm_drafts = _run(a, ids)  # an in-memory prefix hit: both caches' rows of the pages still there
    assert m["num_cached_prompt_tokens"] == 20 and m["num_disk_cached_tokens"] == 0
    b = engine()  # the restart
    disk, m, disk_drafts = _run(b, ids)
    assert m["num_disk_cached_tokens"] == 20 and m["num_cached_prompt_tokens"] == 20
    assert b.runner.disk_tier.stats["hits"] == 5
    assert disk == warm == cold == plain
    assert len(disk_drafts) == len(warm_drafts)
    for i, (x, y) in enumerate(zip(disk_drafts, warm_drafts)):
        assert torch.equal(x, y), f"MTP pass {i}: draft logits differ from the in-memory hit's"

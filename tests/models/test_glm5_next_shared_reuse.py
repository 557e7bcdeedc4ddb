"""The shared-indexer decision as data (docs/GLM5_NEXT.md "Shared indexer layers after KDA layers"): a "shared" MLA
layer reuses the nearest previous "full" layer's selection, across KDA layers too (where transformers raises). Read
back from the four places it is recorded: the config's provenance (`shared_indexer_reuse`, only where KDA layers lie
between), the layer kinds (`LayerKind.reuses`), the ledger's `kinds[].reuses` and `mlaserve inspect`'s route. A
config transformers runs (the shared layer right after the full one) records its reuse but no decision.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.glm5_next")

from glm5_next_models import random_ids, save_hf_glm5_next  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module", params=["shared_after_kda", "shared_after_full"])
def folder(request, tmp_path_factory):
    f = tmp_path_factory.mktemp(f"glm5_{request.param}")
    save_hf_glm5_next(request.param, f, seed=2)
    return request.param, f


# (shared layer, the layer whose selection it reuses); the pairs across KDA layers (the engine's decision)
EXPECTED = {"shared_after_kda": (((3, 0),), ((3, 0),)), "shared_after_full": (((2, 1),), ())}


def test_the_decision_is_data_in_every_record(folder, capsys):
    from mlaserve.entrypoints.cli import main

    spec, path = folder
    reuses, across = EXPECTED[spec]
    llm = LLM(str(path), page_size=8, trace="memory")
    kinds = llm.runner.layer_kinds
    assert tuple((k.index, k.reuses) for k in kinds if k.reuses is not None) == reuses
    assert all(k.reuses is None for k in kinds if k.indexer != "shared")
    recorded = [s for s in llm.config.model.provenance if s.name == "shared_indexer_reuse"]
    if across:
        assert [s.value for s in recorded] == [across]
        assert recorded[0].source.startswith("engine:") and "transformers raises" in recorded[0].source
    else:
        assert not recorded
    (out,) = llm.generate([random_ids(20, 96, 4)], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3
    steps = [r for r in llm.runner.tracer.records if "kinds" in r]
    dsa = [k for r in steps for k in r["kinds"] if k["kind"] == "mla_dsa"]
    assert dsa and all(k["reuses"] == [{"layer": a, "selection_of": b} for a, b in reuses] for k in dsa)
    assert main(["inspect", str(path)]) == 0
    route = capsys.readouterr().out.split("attention route:")[1]
    ((shared, of),) = reuses
    assert f"({shared} <- {of})" in route
    assert ("reuse it across KDA layers (this engine's decision: transformers raises there)" in route) == bool(across)

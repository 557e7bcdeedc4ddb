"""The ledger names the DeepSeek-V4 softmax that ran: one padded batch for the step over every sequence's keys
read at once (the engine's default, `_attend_step_torch` with the torch kernels) or one softmax per sequence (V4Serving(batched_attention=False),
the plain reference), counted against the calls the attention layers actually made."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from v4_models import build_hf_v4  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.executor.forward_batch import SeqChunk  # noqa: E402
from mlaserve.executor.model_runner import ModelRunner  # noqa: E402
from mlaserve.models.deepseek_v4.attention import V4Attention  # noqa: E402
from mlaserve.models.deepseek_v4.serving import V4Serving  # noqa: E402
from mlaserve.observability.trace import MemoryTracer  # noqa: E402


@pytest.mark.parametrize(
    ("batched", "recorded", "called"),
    [
        (True, "torch:padded_batch+batched_state", "_attend_step_torch"),
        (False, "torch:per_sequence+batched_state", "_attend"),
    ],
)
def test_the_ledger_names_the_softmax_that_ran(tmp_path, monkeypatch, batched, recorded, called):
    build_hf_v4("all_kinds", seed=5).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_num_seqs=2)
    calls = {"_attend": 0, "_attend_padded": 0, "_attend_step_torch": 0}
    for name in calls:
        real = getattr(V4Attention, name)

        def spy(self, *args, _real=real, _name=name):
            calls[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(V4Attention, name, spy)
    for attn in (m for m in llm.loaded.model.modules() if isinstance(m, V4Attention)):
        attn.kernel = attn.kernel  # rebind the plan's choice: its calls were bound to the methods before the spies
    tracer = MemoryTracer()
    runner = ModelRunner(V4Serving(llm.loaded.model.inner, batched_attention=batched), llm.config, tracer=tracer)
    ids = [0, *range(5, 14)]
    chunks = [
        SeqChunk("a", tuple(ids), 0, (0,), all_logits=True, state_slot=0, reset_state=True),
        SeqChunk("b", tuple(ids[:4]), 0, (1,), all_logits=True, state_slot=1, reset_state=True),
    ]
    _, logits = runner.execute(chunks)
    assert torch.isfinite(logits).all()
    segments = [seg for rec in tracer.records for seg in rec["segments"]]
    assert segments and {seg["implementation"] for seg in segments} == {recorded}
    # what ran: 4 layers, one padded call each, or one call per sequence each (2 sequences)
    assert calls[called] == (4 if batched else 8) and sum(calls.values()) == calls[called]

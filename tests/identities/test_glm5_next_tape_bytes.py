"""`mlaserve inspect`'s KDA rollback tape figure (GLM-5.3-Flash with speculative="mtp", models/kda/rollback.py
tape_bytes, computed from the config) against a real tape: two requests verify [t, d1, d2, d3] in one step, and the
bytes the step's KDATape holds (the saved recurrent and conv states, the kept per-row inputs: every tensor's nbytes)
divided by the two verifying requests equal the printed bytes per verifying request. Exact (integers of bytes). In
bfloat16 too: the forget gate g stays fp32 there while the other inputs and the conv state are bf16, which a
figure of layers x states x one dtype would miss.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers.models.glm5_next")

from glm5_next_mtp_models import save_glm5_next_with_mtp  # noqa: E402
from state_engine import state_chunk

from mlaserve.entrypoints.cli import main  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.executor.forward_batch import SeqChunk  # noqa: E402

PS, K = 8, 3  # page size; draft tokens per step
PROMPTS = {"a": [0, 17, 44, 9, 61, 23], "b": [0, 12, 54, 40, 33, 71, 5, 88, 31, 70, 19, 26, 45, 30]}
DRAFTS = {"a": [33, 8, 91, 27], "b": [3, 63, 14, 50]}  # [t, d1, d2, d3]
SLOTS = {"a": 0, "b": 1}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("glm5mtp_tape_bytes")
    save_glm5_next_with_mtp("kda3_mla_kpool4", f, seed=3)
    return f


def _chunk(rid: str, ids: list[int], done: int, pages: list[int], drafts: int = 0) -> SeqChunk:
    return state_chunk(rid, ids, done, pages, SLOTS[rid], PS, drafts)


def _tape_nbytes(llm: LLM) -> int:
    """Both prompts, then one verify step of both draft chunks: the bytes its tape holds."""
    pages = {rid: llm.engine.pool.allocate(3) for rid in PROMPTS}
    llm.runner.execute([_chunk(rid, ids, 0, pages[rid]) for rid, ids in PROMPTS.items()])
    llm.runner.execute_with_hidden([_chunk(rid, DRAFTS[rid], len(PROMPTS[rid]), pages[rid], K) for rid in PROMPTS])
    tape = llm.runner.tape
    assert tape.request_ids == ("a", "b") and set(tape.saved) == set(tape.inputs) == {0, 1, 2}  # the 3 KDA layers
    tensors = [t for states in tape.saved.values() for t in states.values()]
    tensors += [t for inputs in tape.inputs.values() for t in inputs]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_printed_tape_bytes_are_a_real_tapes(folder, capsys, dtype):
    argv = ["inspect", str(folder), "--dtype", dtype, "--page-size", str(PS), "--speculative", "mtp"]
    assert main([*argv, "--num-speculative-tokens", str(K)]) == 0
    out = capsys.readouterr().out
    found = re.findall(r"KDA rollback tape: (\d+) bytes per verifying request \(3 KDA layers", out)
    assert len(found) == 1, out
    llm = LLM(str(folder), dtype=dtype, page_size=PS, max_num_seqs=2, speculative="mtp", num_speculative_tokens=K)
    assert _tape_nbytes(llm) == 2 * int(found[0])

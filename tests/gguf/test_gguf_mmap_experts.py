"""The routed experts' gate and up stacks kept where the file stores them (ffn_gate_exps, ffn_up_exps): the
kernels take each at its own address, so no [E, 2I] gate_up copy is made at load.

- the stacks are views of the read-only shared map (their storage's address inside it), resident only once a
  step reads them (page presence right after load), and a second engine maps the same pages (its resident
  expert pages are the first one's: Shared_Clean);
- the logits equal bit for bit those of the layout the kernels read before: gate and up copied into one fused
  [E, 2I, R] stack (gate rows first), for a prefill whose experts take decode-then-GEMM (many rows per
  expert), a short prompt (the MoE block and the grouped decode-and-dot) and decode steps (the decode layer's
  one call): the same bytes, read from other addresses, give the same values.
"""

from __future__ import annotations

import gc

import pytest
import torch
from gguf_helpers import need_fixtures
from test_gguf_mmap import _child_smaps, _maps, _present_pages

from mlaserve.kernels import native

pytestmark = [
    pytest.mark.fixtures,
    pytest.mark.skipif(not native.status().available, reason="native kernels unavailable"),
]

LONG = [3 + (7 * i) % 250 for i in range(200)]  # 400 (token, expert) pairs over 8 experts: decode-then-GEMM
SHORT = [5, 9, 2, 7, 11, 4, 8, 13, 6, 10, 12, 3]  # 12 tokens: the one-call MoE block (up to 16)


def _file(kind: str):
    path = need_fixtures() / "ds3" / f"model-{kind}.gguf"
    if not path.is_file():
        pytest.skip(f"fixture {path.name} of ds3 not present")
    return path


def _experts(llm):
    from mlaserve.quant.ggml_linear import GGUFExperts

    found = [m for m in llm.runner.model.modules() if isinstance(m, GGUFExperts)]
    assert found, "the fixture should keep its routed experts in blocks"
    return found


def _fused_slots(self):
    """GGUFExperts.checkpoint_slots as the layout before: gate and up rows in one [E, 2I, R] stack (gate rows
    first), filled by copies (slices of one tensor are not kept in place), the holder reading the two halves."""
    i = self.gate_proj.shape[1]
    fused = torch.empty(self.gate_proj.shape[0], 2 * i, self.gate_proj.shape[2], dtype=torch.uint8)
    self.gate_proj.data, self.up_proj.data = fused[:, :i], fused[:, i:]
    return {"weight": (fused[:, :i], fused[:, i:], self.down_proj)}


def _outputs(llm):
    from mlaserve import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    out = llm.generate([SHORT[:5]], params)[0].outputs[0]
    return llm.prompt_logits(LONG), llm.prompt_logits(SHORT), out.token_ids, out.logprobs


@pytest.mark.parametrize("kind", ["q8_0", "q4_k_m"])
def test_split_stacks_equal_the_fused_copy_bitwise(kind, monkeypatch):
    """Break check: gate_up_row reading up rows at gate + (r - inter) * row_bytes (the fused layout's offset)
    instead of at `up` fails every comparison here (the gate rows are read for the up rows)."""
    from mlaserve import LLM
    from mlaserve.quant.ggml_linear import GGUFExperts

    path = _file(kind)
    split = LLM(str(path), gguf_mmap=True)
    ranges = _maps(path, shared_only=True)
    for ex in _experts(split):
        for t in (ex.gate_proj, ex.up_proj):
            assert any(lo <= t.data_ptr() < hi for lo, hi in ranges)
    want = _outputs(split)
    with monkeypatch.context() as m:
        m.setattr(GGUFExperts, "checkpoint_slots", _fused_slots)
        fused = LLM(str(path), gguf_mmap=True)
    for ex in _experts(fused):  # the fused copy: up rows right after each expert's gate rows
        row = ex.gate_proj.stride(1)
        assert ex.up_proj.data_ptr() == ex.gate_proj.data_ptr() + ex.gate_proj.shape[1] * row
        assert not any(lo <= ex.gate_proj.data_ptr() < hi for lo, hi in ranges)
    got = _outputs(fused)
    for a, b, what in zip(want[:2], got[:2], ("200-token prefill", "12-token prompt")):
        assert torch.equal(a, b), f"{what}: max |diff| {(a - b).abs().max().item()}"
    assert want[2] == got[2]
    assert want[3] == got[3], "decode steps' log-probabilities differ"


@pytest.mark.slow  # starts a second engine's process
def test_expert_stacks_are_paged_in_by_use_and_shared():
    """After load nothing of the gate / up stacks has been read (no copy at load: few of their pages present,
    those the kernel's fault-around mapped beside the other holders' pages); after a prompt their pages are
    present; a second process's resident pages of the file are the first's (Shared_Clean, no Anonymous).
    Break check: copying the stacks at load (GGUFExperts.checkpoint_slots as _fused_slots) makes every
    page of the copy present right after load and moves the stacks out of the map."""
    from mlaserve import LLM

    path = _file("q8_0")
    gc.collect()  # engines of earlier tests would be more mappers
    llm = LLM(str(path), gguf_mmap=True)
    stacks = [t for ex in _experts(llm) for t in (ex.gate_proj, ex.up_proj)]
    present = [_present_pages(t.data_ptr(), t.data_ptr() + t.nbytes) for t in stacks]
    total = sum(n for _, n in present)
    assert total >= 8, "the fixture's stacks should span whole pages"
    # measured: 0 of 64 pages present after load (copied at load instead: 64 of 64, and outside the map)
    assert sum(p for p, _ in present) <= total // 2, present
    llm.prompt_logits(LONG)  # 200 tokens over 8 experts top-2: every expert is read
    after = [_present_pages(t.data_ptr(), t.data_ptr() + t.nbytes) for t in stacks]
    assert sum(p for p, _ in after) == total, after
    child = _child_smaps(path, "on")
    assert child["Shared_Clean"] >= 0.9 * child["Rss"], child
    assert child.get("Anonymous", 0) == 0 and child.get("Private_Dirty", 0) == 0, child

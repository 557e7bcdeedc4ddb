"""Expert parallelism reads only the rank's own experts (CPU, gloo, 2 processes): each rank's load reads from
the checkpoint exactly one process's bytes minus the other ranks' routed experts, counted by the file readers
(GGUFFile.raw, SafetensorsSource) as a byte count, and the expected figure is computed here from the files
themselves (the gguf package's tensor table, the safetensors header's data_offsets), not from the engine.

GGUF: the stacked ffn_{gate,up,down}_exps tensors, each rank reading its experts' byte ranges of every stack.
Safetensors: one tensor per expert, 5 experts over 2 ranks (3 + 2). The route ledger's first record lists
every rank's experts, bytes read and peak RSS (the figures the echo carries)."""

from __future__ import annotations

import json
import re
import struct

from conftest import fixture_dir
from parallel_compare import save_uneven_experts

from mlaserve import LLM
from mlaserve.distributed.expert_parallel import expert_range

OPTS = dict(max_num_batched_tokens=40)


def _gguf_expert_bytes(path) -> dict[int, tuple[int, int]]:
    """Per MoE layer: (experts E, bytes of one expert's gate + up + down in the file), from the gguf package."""
    import gguf

    out: dict[int, list[int]] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        m = re.match(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$", t.name)
        if m:
            e = int(t.shape[-1])  # ggml order: the expert dim last
            assert t.n_bytes % e == 0
            prev = out.setdefault(int(m.group(1)), [e, 0])
            prev[1] += int(t.n_bytes) // e
    return {layer: (e, per) for layer, (e, per) in out.items()}


def _safetensors_expert_bytes(path) -> dict[int, dict[int, int]]:
    """Per MoE layer and expert: the bytes of its tensors, from the file's header (data_offsets)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    out: dict[int, dict[int, int]] = {}
    for name, t in header.items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.", name)
        if m:
            layer = out.setdefault(int(m.group(1)), {})
            layer[int(m.group(2))] = layer.get(int(m.group(2)), 0) + t["data_offsets"][1] - t["data_offsets"][0]
    return out


def _ep2(path: str) -> tuple[int, list[dict], list[dict]]:
    """(one process's bytes read, every rank's echo, the ledger's expert_holdings record)."""
    one = LLM(path, **OPTS).loaded.report.bytes_read
    with LLM(path, expert_parallel_size=2, trace="memory", **OPTS) as two:
        echoes = two.runner.rank_echoes
        held = [r["expert_holdings"] for r in two.runner.tracer.records if "expert_holdings" in r]
    assert len(held) == 1 and [h["rank"] for h in held[0]] == [0, 1]
    for echo, rec in zip(echoes, held[0]):  # the ledger carries what each rank echoed
        assert rec["file_bytes_read"] == echo["file_bytes_read"] and rec["routed_experts"] == echo["routed_experts"]
        assert rec["peak_rss_bytes"] == echo["peak_rss_bytes"]
    return one, echoes, held[0]


def test_gguf_ep_rank_reads_only_its_expert_slices_of_the_stacks():
    """ds3 Q4_K_M: 2 MoE layers of 8 experts (Q4_K gate/up, Q5_0/Q6_K down); a rank skips 4 experts' bytes of
    each of the 6 stacks. Measured: one process 934,464 bytes read, each rank 803,392 (131,072 less: 4 experts x
    (14,848 + 17,920) bytes of the two layers)."""
    path = fixture_dir("ds3") / "model-q4_k_m.gguf"
    one, echoes, _ = _ep2(str(path))
    layers = _gguf_expert_bytes(path)
    assert len(layers) == 2
    for rank, echo in enumerate(echoes):
        start_stop = [expert_range(e, rank, 2) for e, _ in layers.values()]
        others = sum(per * (e - (b - a)) for (e, per), (a, b) in zip(layers.values(), start_stop))
        assert others > 0 and echo["file_bytes_read"] == one - others, (rank, one, echo["file_bytes_read"], others)


def test_safetensors_ep_rank_reads_only_its_own_expert_tensors(tmp_path):
    """A float kimi_k2 folder with 5 experts: rank 0 reads experts [0, 3), rank 1 [3, 5) of every layer."""
    save_uneven_experts(tmp_path)
    one, echoes, _ = _ep2(str(tmp_path))
    per_expert = _safetensors_expert_bytes(tmp_path / "model.safetensors")
    assert per_expert and all(len(x) == 5 for x in per_expert.values())
    for rank, echo in enumerate(echoes):
        start, stop = expert_range(5, rank, 2)
        others = sum(b for layer in per_expert.values() for e, b in layer.items() if not start <= e < stop)
        assert others > 0 and echo["file_bytes_read"] == one - others, (rank, one, echo["file_bytes_read"], others)
        assert any("routed-expert tensors not read" in note for note in echo["notes"])

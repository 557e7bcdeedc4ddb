"""A deepseek4 GGUF under expert parallelism: each rank reads only its routed experts' byte ranges of the stacked
ffn_{gate,up,down}_exps tensors, into GGUFV4Experts holders made for those experts (cut on the meta device before
the holders are made, as for folders), any block type.

- in-process, per block type of the experts (MXFP4 as llama.cpp's converter writes a release, Q8_0; and MXFP4
  dequantized at load): each rank's holders hold exactly one process's stored bytes (or decoded floats) of its
  experts, bit for bit, and the bytes the rank took from the file are one process's minus the other ranks'
  experts' blocks, to the byte;
- one spawn (CPU, gloo, 2 processes, 6 experts: [0, 3) and [3, 6); the hash-routed layer 0 too): prompt logits
  under EP=2 == one process on the same file.

Bound: 1e-5 max abs (fp32 logits of magnitude ~4). Both runs decode the same stored blocks to the same fp32
weights; EP=2 only reorders the routed experts' fp32 additions (each rank's partial sum, then the all-reduce), as
in tests/distributed/test_ep_deepseek_v4.py (folder: 1.2e-6 measured).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from v4_gguf import BLOCK_DIMS, default_type, write_v4_gguf  # noqa: E402

from mlaserve import LLM  # noqa: E402
from mlaserve.config.model import ConfigError  # noqa: E402
from mlaserve.distributed.expert_parallel import expert_range  # noqa: E402
from mlaserve.loading.deepseek_v4 import load_gguf  # noqa: E402
from mlaserve.models.deepseek_v4.moe import Experts  # noqa: E402
from mlaserve.quant.ggml_deepseek_v4 import GGUFV4Experts  # noqa: E402

BOUND = 1e-5
E = 6


def _q8_experts(name: str, ndim: int):
    import gguf

    return gguf.GGMLQuantizationType.Q8_0 if name.endswith("_exps.weight") else default_type(name, ndim)


def _write(tmp_path, choose_type=default_type):
    from v4_models import save_hf_v4

    save_hf_v4("all_kinds", tmp_path / "float", seed=1, n_routed_experts=E, **BLOCK_DIMS)
    out = tmp_path / "model.gguf"
    write_v4_gguf(tmp_path / "float", out, choose_type=choose_type)
    return out


def _expert_bytes(path) -> int:
    """Bytes of every layer's stacked ffn_*_exps tensors (all E experts)."""
    from mlaserve.gguf.read.file import open_gguf

    gf = open_gguf(path)
    try:
        return sum(info.nbytes for name, info in gf.tensors.items() if "_exps." in name)
    finally:
        gf.close()


@pytest.mark.parametrize("experts", ["mxfp4", "q8_0", "mxfp4 dequantized"])
def test_v4_gguf_rank_reads_and_holds_only_its_experts_blocks(tmp_path, experts):
    """Blocks kept (GGUFV4Experts) or dequantized at load (gguf_weights="dequantized": float Experts)."""
    path = _write(tmp_path, _q8_experts if experts == "q8_0" else default_type)
    keep = "dequantized" not in experts
    holder = GGUFV4Experts if keep else Experts
    whole, whole_report, f = load_gguf(path, keep_blocks=keep)
    f.close()
    all_experts = _expert_bytes(path)
    for rank in range(2):
        start, stop = expert_range(E, rank, 2)
        part, report, f = load_gguf(path, keep_blocks=keep, experts=(start, stop))
        f.close()
        for mine, full in zip(part.model.layers, whole.model.layers):
            assert type(mine.mlp.experts) is holder
            for name, p in mine.mlp.experts.named_parameters():
                ref = dict(full.mlp.experts.named_parameters())[name]
                assert p.shape[0] == stop - start and torch.equal(p, ref[start:stop]), name
        others = all_experts * (E - (stop - start)) // E
        assert report.hidden == 3 * (E - (stop - start)) * len(part.model.layers)
        assert report.bytes_read == whole_report.bytes_read - others, (rank, report.bytes_read, others)


def test_v4_gguf_ep2_equals_one_process(tmp_path):
    path = str(_write(tmp_path))
    with pytest.raises(ConfigError, match="expert_parallel_size=7 exceeds n_routed_experts=6"):
        LLM(path, expert_parallel_size=7)  # refused before any worker starts
    g = torch.Generator().manual_seed(5)
    one = LLM(path, max_num_batched_tokens=32, page_size=8)
    vocab = json.loads((tmp_path / "float" / "config.json").read_text())["vocab_size"]
    ids = [0] + torch.randint(2, vocab, (22,), generator=g).tolist()
    want = one.prompt_logits(ids)
    tid2eid = next(b for n, b in one.loaded.model.named_buffers() if n.endswith("layers.0.mlp.gate.tid2eid"))
    hashed = tid2eid[torch.tensor(ids)]
    assert (hashed < 3).any() and (hashed >= 3).any()  # the hash layer's pairs fall on both ranks
    whole, others = one.loaded.report.bytes_read, _expert_bytes(path) // 2  # 3 of 6 experts on the other rank
    with LLM(path, expert_parallel_size=2, max_num_batched_tokens=32, page_size=8) as two:
        got = two.prompt_logits(ids)
        echoes = two.runner.rank_echoes
        assert [tuple(h["experts"]) for h in (next(iter(e["routed_experts"])) for e in echoes)] == [(0, 3), (3, 6)]
        assert [whole - e["file_bytes_read"] for e in echoes] == [others, others]
    err = (got - want).abs().max().item()
    print(f"deepseek4 GGUF EP=2 vs one process: max abs {err:.2e}")
    assert err <= BOUND and torch.equal(got.argmax(-1), want.argmax(-1))

"""A broken expert tensor under expert parallelism is named by its checkpoint id, not the rank's local one
(a rank lists its experts from 0: distributed/expert_source.py), and the error names the rank that found it.
5 experts over 2 ranks: rank 1 holds [3, 5), locally 0 and 1."""

from __future__ import annotations

import json

import pytest
from parallel_compare import save_uneven_experts
from safetensors.torch import load_file, save_file

from mlaserve import LLM
from mlaserve.distributed.group import TensorParallelError

LAYER = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def tensors_and_save(tmp_path_factory):
    src = tmp_path_factory.mktemp("ep5")
    save_uneven_experts(src)
    config = json.loads((src / "config.json").read_text())

    def save(tensors: dict, name: str):
        dst = tmp_path_factory.mktemp(name)
        (dst / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(dst / "model.safetensors"))
        return str(dst)

    return load_file(str(src / "model.safetensors")), save


def test_a_missing_expert_tensor_is_named_by_its_checkpoint_id(tensors_and_save):
    tensors, save = tensors_and_save
    path = save({k: v for k, v in tensors.items() if k != f"{LAYER}.4.gate_proj.weight"}, "missing")
    with pytest.raises(
        TensorParallelError, match=rf"rank 1 failed: WeightError: checkpoint is missing {LAYER}\.4\.gate_proj\.weight"
    ):
        LLM(path, expert_parallel_size=2, max_num_batched_tokens=16)


def test_a_misshapen_expert_tensor_is_named_by_its_checkpoint_id(tensors_and_save):
    tensors, save = tensors_and_save
    bad = dict(tensors)
    bad[f"{LAYER}.3.down_proj.weight"] = bad[f"{LAYER}.3.down_proj.weight"][:, :-8].contiguous()
    with pytest.raises(
        TensorParallelError, match=rf"rank 1 failed: WeightError: .*\({LAYER}\.3\.down_proj\.weight\).* has shape"
    ):
        LLM(save(bad, "misshapen"), expert_parallel_size=2, max_num_batched_tokens=16)

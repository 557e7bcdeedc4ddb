"""Building and loading a model imports no more of torch than the forward passes need: nn.Embedding's random
init on the meta device (where the loader builds models) runs torch's Python reference of normal_, whose first
call imports torch._dynamo (16 s and +0.14 GiB RSS on an idle CPU, ~30 s of a load under a busy machine). The
model files take their table from models.layers.embedding, which skips that init on the meta device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import fixture_dir

from mlaserve.models.layers import embedding

ROOT = Path(__file__).resolve().parents[2]
_CHILD = r"""
import sys
from mlaserve import LLM, SamplingParams
llm = LLM(sys.argv[1])
llm.generate([[5, 9, 2, 7]], SamplingParams(max_tokens=3, temperature=0.0))
print("dynamo" if "torch._dynamo" in sys.modules else "none")
"""


@pytest.mark.slow  # a fresh interpreter: this one has imported torch._dynamo through other tests
def test_load_and_generate_leave_torch_dynamo_unimported():
    """Break check: DeepseekModel building nn.Embedding(vocab, hidden) again prints "dynamo"."""
    path = fixture_dir("ds3") / "model-q8_0.gguf"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "none"


def test_embedding_draws_what_nn_embedding_draws_on_a_real_device():
    torch.manual_seed(3)
    got = embedding(64, 16)
    torch.manual_seed(3)
    want = torch.nn.Embedding(64, 16)
    assert torch.equal(got.weight, want.weight) and got.weight.requires_grad == want.weight.requires_grad
    with torch.device("meta"):
        assert embedding(64, 16).weight.device.type == "meta"

"""What a start (load to first token) runs: no module of torch or of an optional package that the load and the
first step do not need, and memory for the meta-built model without the meta device's empty_like.

torch.empty_like on a meta tensor (inside Module.to_empty) imports sympy and torch's symbolic shapes on its
first call: ~0.5-0.75 s of a 4 s start on an idle 2-core Xeon (loading/allocate.py). transformers, fastapi,
xgrammar and matplotlib are the optional packages of other paths (conversion and references, the server,
structured output, plots): a GGUF's generate needs none of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import fixture_dir
from torch import nn

from mlaserve.config.engine import make_options
from mlaserve.gguf.read import file as gguf_file
from mlaserve.gguf.read.checkpoint import _identity_check_layers
from mlaserve.loading.allocate import allocate
from mlaserve.loading.model_loader import load_model

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("sympy", "torch._dynamo", "transformers", "fastapi", "xgrammar", "matplotlib")
_CHILD = r"""
import sys
from mlaserve import LLM, SamplingParams
llm = LLM(sys.argv[1])
llm.generate(["Hello world"], SamplingParams(max_tokens=2, temperature=0.0))
print(" ".join(m for m in sys.argv[2:] if m in sys.modules) or "none")
"""


@pytest.mark.slow  # a fresh interpreter: this one has imported them through other tests
def test_gguf_load_and_first_tokens_import_no_heavy_module():
    """Break check: build_model calling model.to_empty(device) again prints "sympy"."""
    path = fixture_dir("ds3") / "model-q8_0.gguf"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), *HEAVY], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "none"


class _Parts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4, bias=True)
        self.bf16 = nn.Parameter(torch.ones(3, 5, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("cols", torch.zeros(5, 7).t())  # non-contiguous: strides (1, 7)
        self.register_buffer("gone", None)


def test_allocate_gives_what_to_empty_gives():
    with torch.device("meta"):
        a, b = _Parts(), _Parts()
    got, want = allocate(a, "cpu"), b.to_empty(device="cpu")
    for (n1, t1), (n2, t2) in zip(
        [*got.named_parameters(), *got.named_buffers()], [*want.named_parameters(), *want.named_buffers()]
    ):
        assert n1 == n2
        assert (t1.shape, t1.stride(), t1.dtype, t1.device) == (t2.shape, t2.stride(), t2.dtype, t2.device), n1
        assert type(t1) is type(t2) and t1.requires_grad == t2.requires_grad, n1
    assert got.gone is None and got.cols.stride() == (1, 7)


def test_identity_checked_on_every_fused_layer_and_the_first_rebuilt_one():
    """A kv_b_proj rebuilt from attn_k_b / attn_v_b is the same code in every layer (its check holds _join_kv_b;
    tests/gguf/test_gguf_checkpoint.py breaks it); a fused attn_kv_b is the file's own data, checked per layer."""
    split, fused = {"k_b": "k", "v_b": "v"}, {"kv_b": "kv"}
    assert _identity_check_layers({0: split, 1: split, 2: split}) == [0]
    assert _identity_check_layers({3: fused, 1: split, 0: fused, 2: split}) == [0, 1, 3]
    assert _identity_check_layers({0: {**split, **fused}, 1: split}) == [0, 1]
    assert _identity_check_layers({}) == []


def test_a_gguf_load_parses_its_header_once(monkeypatch):
    """The architecture (deepseek4 or an MLA reader) is read from the header load_gguf then maps: one parse.
    Break check: open_checkpoint asking _gguf_arch(path) again counts 2."""
    parsed = []
    shard_init = gguf_file.GGUFShard.__init__

    def counting(self, path):
        parsed.append(path)
        shard_init(self, path)

    monkeypatch.setattr(gguf_file.GGUFShard, "__init__", counting)
    loaded = load_model(fixture_dir("ds3") / "model-q8_0.gguf", make_options())
    assert loaded.model is not None and len(parsed) == 1

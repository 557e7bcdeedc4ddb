"""Every i-quant and ternary type in one GGUF, on the tensors of a tiny DeepSeek-V3 (hidden 256) whose rows are
whole 256-value super-blocks: `mlaserve inspect` lists each type, and the engine with the blocks kept (native
kernels: decode, then dot, or IQ4's fused kernels) equals the same file dequantized at load within 1e-5 on the
logits (|logit| < 10, the tiny fp32 models' bound: the same values summed in another order; measured printed).

The blocks: TQ1_0 / TQ2_0 by gguf-py's quantizer; the others (gguf-py quantizes none of them) random valid blocks
(tests/gguf/test_gguf_iquants.py iq_blocks) with d rescaled so each tensor's rms is the f32 weight's, so the model
stays a model (finite, O(1) logits)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hf_models import random_ids
from test_gguf_iq4_xs_engine import write_tiny_v3_256
from test_gguf_iquants import iq_blocks

from mlaserve import LLM
from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import native
from mlaserve.loading.tensor_check import SCALE_OFFSETS

gguf = pytest.importorskip("gguf")
NATIVE = native.status()
# tensor -> type: rows of 256 values (hidden-size inputs), every type at least once
MIX = {
    "blk.0.ffn_gate.weight": "IQ4_NL",
    "blk.0.ffn_up.weight": "IQ3_XXS",
    "blk.0.attn_q_a.weight": "IQ3_S",
    "blk.1.attn_q_a.weight": "IQ2_XXS",
    "blk.2.attn_q_a.weight": "IQ2_XS",
    "blk.1.attn_kv_a_mqa.weight": "IQ2_S",
    "blk.2.attn_kv_a_mqa.weight": "IQ1_S",
    "blk.1.ffn_gate_shexp.weight": "IQ1_M",
    "blk.1.ffn_up_shexp.weight": "TQ1_0",
    "blk.2.ffn_gate_shexp.weight": "TQ2_0",
    "blk.2.ffn_up_shexp.weight": "IQ4_XS",
}


def random_tensor(name: str, data: np.ndarray, seed: int) -> np.ndarray:
    """Random valid blocks of the type for data's shape, d scaled so the values' rms is data's."""
    tid = GGML_TYPE_IDS[name]
    t = GGML_TYPES[tid]
    n_blocks = data.size // t.block_size
    raw = iq_blocks(name, n_blocks, seed)
    rms = np.sqrt((gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(tid)) ** 2).mean())
    factor = np.sqrt((data.astype(np.float64) ** 2).mean()) / rms
    if name == "IQ1_M":  # d is the top nibbles of the scale words: rebuild the blocks with the new d
        return _with_iq1_m_d(raw, factor).reshape(*data.shape[:-1], -1)
    off = SCALE_OFFSETS[name][0]
    d = raw[:, off : off + 2].copy().view(np.float16).astype(np.float64) * factor
    raw[:, off : off + 2] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(*data.shape[:-1], -1)


def _with_iq1_m_d(raw: np.ndarray, factor: float) -> np.ndarray:
    words = raw[:, 48:56].copy().view(np.uint16)
    bits = np.zeros(raw.shape[0], dtype=np.uint16)
    for i in range(4):
        bits |= ((words[:, i] >> 12) & 0xF) << (4 * i)
    d = (bits.view(np.float16).astype(np.float64) * factor).astype(np.float16).view(np.uint16)
    for i in range(4):
        words[:, i] = (words[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
    raw[:, 48:56] = words.view(np.uint8)
    return raw


@pytest.fixture(scope="module")
def mix_file(tmp_path_factory):
    def rewrite(name, data):
        kind = MIX.get(name)
        if kind is None:
            return None
        if kind.startswith("TQ"):
            return gguf.quants.quantize(data, gguf.GGMLQuantizationType[kind]), GGML_TYPE_IDS[kind]
        return random_tensor(kind, data, seed=len(name)), GGML_TYPE_IDS[kind]

    path, _ = write_tiny_v3_256(tmp_path_factory.mktemp("iqmix"), rewrite)
    return path


def test_inspect_lists_every_type(mix_file, capsys):
    from mlaserve.entrypoints.cli import main

    main(["inspect", str(mix_file)])
    out = capsys.readouterr().out
    for kind in sorted(set(MIX.values())):
        assert re.search(rf"\bgguf {kind}\b", out), (kind, out)


@pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")
def test_every_type_kept_equals_dequantized(mix_file, capsys):
    ids = random_ids(20, seed=3)
    dense = LLM(str(mix_file), gguf_weights="dequantized", max_num_batched_tokens=16)
    want = dense.prompt_logits(ids)
    assert torch.isfinite(want).all() and want.abs().max() < 10
    for kernels in ("native", "torch"):
        # exact products (the default takes int8 activations for the i-quants: test_verify_against_int8_more.py)
        kept = LLM(str(mix_file), kernels=kernels, max_num_batched_tokens=16, activations="float")
        types = {m.ggml_type for m in kept.runner.model.modules() if hasattr(m, "ggml_type")}
        assert {GGML_TYPE_IDS[k] for k in MIX.values()} <= types, types
        diff = (kept.prompt_logits(ids) - want).abs().max().item()
        with capsys.disabled():
            print(f"\nevery i-quant kept ({kernels}): max |logit diff| {diff:.2e}, max |logit| {want.abs().max():.1f}")
        assert diff <= 1e-5, (kernels, diff)

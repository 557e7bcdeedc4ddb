"""The tensors a GGUF load holds dense (kv_b_proj rebuilt from attn_k_b / attn_v_b, norms, the router; every weight
with gguf_weights=dequantized) are decoded by the native kernels when the engine runs them (kernels=native): the
same bits as the reference decoder (gguf/quants.py, itself held to gguf-py), which kernels=torch keeps."""

from __future__ import annotations

import pytest
import torch
from conftest import fixture_dir

from mlaserve.config.engine import make_options
from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import native
from mlaserve.kernels.ggml import dense_native
from mlaserve.loading.model_loader import load_model
from mlaserve.quant.transient_kv_b import TransientKvB

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the native kernels are not built")
NOTE = "decoded from the GGUF's blocks by the native kernels"


def _dense(model) -> dict[str, torch.Tensor]:
    """Every float parameter and buffer (the blocks kept as uint8 are the file's bytes either way), and the
    kv_b_proj a layer that holds none (quant/transient_kv_b.py) decodes for a prefill step."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for i, layer in enumerate(model.model.layers):
        if isinstance(getattr(layer.self_attn, "kv_b_proj", None), TransientKvB):
            tensors[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = layer.self_attn.kv_b_weight()
    return {n: t for n, t in tensors.items() if t.is_floating_point()}


@pytest.mark.parametrize(
    "model,qtype,weights",
    [
        ("ds3", "q4_k_m", "quantized"),
        ("glm5", "q4_k_m", "quantized"),
        ("ds3", "q8_0", "dequantized"),
        ("ds32", "q4_k_m", "dequantized"),
    ],
)
def test_native_decode_at_load_gives_the_reference_bits(model, qtype, weights, monkeypatch):
    path = fixture_dir(model) / f"model-{qtype}.gguf"
    calls, decode = [], native.dequantize

    def counted(*a, **k):
        calls.append(a[0])
        return decode(*a, **k)

    monkeypatch.setattr(native, "dequantize", counted)
    fast = load_model(path, make_options(kernels="native", gguf_weights=weights))
    got = _dense(fast.model)  # with a transient kv_b_proj: decoded here, as a prefill step does
    assert calls, "the native decoder decoded nothing at load (or for a transient kv_b_proj)"
    calls.clear()
    ref = load_model(path, make_options(kernels="torch", gguf_weights=weights))
    want = _dense(ref.model)
    assert not calls
    assert got.keys() == want.keys()
    assert any("kv_b_proj" in n for n in got)
    for name, t in want.items():
        assert torch.equal(got[name].view(torch.int32), t.view(torch.int32)), name
    assert any(NOTE in n for n in fast.report.notes) and not any(NOTE in n for n in ref.report.notes)


def test_float_types_stay_with_the_reference():
    """F32 / F16 / BF16 are a view or a cast: the decoder declines them (None) and the file's reader decodes them."""
    raw = torch.zeros(64, dtype=torch.uint8)
    for name in ("F32", "F16", "BF16"):
        assert dense_native(raw, GGML_TYPE_IDS[name], (2, 8 if name == "F32" else 16)) is None

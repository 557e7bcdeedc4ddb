"""`verify --against` and the engine with int8 activations on the types that took them last: Q5_0 / Q5_1 (under
activations="int8"; the default keeps them exact, tests/gguf/test_gguf_int8_default.py says why; the
q4_k_m fixtures keep most tensors of 128-wide rows in them: 25-28 Q5_0 and 3 Q5_1 tensors each in ds2lite, ds32 and
glm5) and the i-quants (ds3's f32 file with its 256-wide tensors quantized by tests/iq_quantize.py).

The rule (activations="auto", docs/FORMATS.md): int8 activations where the error they add stays well inside the
file's own quantization error, taken as act(X) <= e(X) / 2 per block, both measured by `verify --against` on the
same teacher-forced inputs. Measured: Q5_0 / Q5_1 files act 5.4e-3 .. 9.4e-3 against e 0.17 .. 0.26 (ratio 0.021 ..
0.042), IQ4 files in the printed figures. act > 0 shows the int8 products ran on those blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fixture_dir
from gguf_helpers import copy_kv
from iq_quantize import quantize

from mlaserve import LLM
from mlaserve.entrypoints.against_report import format_report
from mlaserve.entrypoints.verify_against import compare, encode_prompt, open_side
from mlaserve.kernels import native

gguf = pytest.importorskip("gguf")
pytestmark = [
    pytest.mark.fixtures,
    pytest.mark.skipif(not native.status().available, reason="native kernels unavailable"),
]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 2
# ds3's tensors whose rows are whole 256-value super-blocks: layer 0's dense MLP, layer 1's q_a and kv_a projections
QUANTIZED = ("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight")
QUANTIZED += ("blk.1.attn_q_a.weight", "blk.1.attn_kv_a_mqa.weight")


def _iq_file(dst, name: str):
    """ds3's f32 GGUF with QUANTIZED stored as the i-quant `name`."""
    reader = gguf.GGUFReader(fixture_dir("ds3") / "model-f32.gguf")
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    copy_kv(reader, writer)
    for t in reader.tensors:
        data = np.ascontiguousarray(t.data)
        if t.name in QUANTIZED:
            raw = quantize(data.reshape(-1, data.shape[-1]), name).reshape(data.shape[0], -1)
            writer.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType[name])
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _check_report(model, hf, blocks: set[str], label: str, capsys, setting: str = "int8_6bit") -> None:
    ids, _ = encode_prompt(model, hf, PROMPT)
    report = compare(model, hf, ids)
    assert report.passed  # judged on exact products
    assert blocks <= set(report.activation_error), (label, sorted(report.activation_error))
    for block, act in report.activation_error.items():
        if setting == "int8" and block not in blocks:
            continue  # "int8" also takes the Q8_0 head's products, which reach e / 2: why Q8_0 stays exact by default
        e = report.file_error[block]
        assert 0 < act <= e / 2, (label, block, act, e)
    assert f"int8 activations ({setting})" in format_report(report)
    with capsys.disabled():
        cells = ", ".join(f"{b} {a:.1e}/{report.file_error[b]:.1e}" for b, a in report.activation_error.items())
        print(f"\n{label}: act/e {cells}")


@pytest.mark.parametrize("name", ["ds2lite", "ds32", "glm5"])
def test_q5_files_report_the_activation_error_inside_the_files_own(name, capsys):
    """The q4_k_m fixtures whose products are mostly Q5_0 / Q5_1, under activations="int8" (the default keeps
    Q5_0 / Q5_1 exact: tests/gguf/test_gguf_int8_default.py): every layer's blocks take int8 activations and each
    block's act stays within e / 2."""
    src = fixture_dir(name)
    model = open_side(str(src / "model-q4_k_m.gguf"), activations="int8")
    assert model.activations == "int8"
    blocks = {f"layer.{i}.{p}" for i in range(3) for p in ("attn", "mlp")}
    _check_report(model, open_side(str(src)), blocks, f"{name} q4_k_m", capsys, setting="int8")


@pytest.mark.slow  # quantizes five tensors per type and runs verify (~10-20 s each on 2 cores)
@pytest.mark.parametrize(
    "name", ["IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]
)
def test_iq4_files_report_the_activation_error_inside_the_files_own(name, tmp_path, capsys):
    model = open_side(str(_iq_file(tmp_path / f"{name}.gguf", name)))
    assert model.activations == "int8_6bit"
    _check_report(model, open_side(str(fixture_dir("ds3"))), {"layer.0.mlp", "layer.1.attn"}, name, capsys)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["IQ4_NL", "IQ4_XS"])
def test_engine_default_is_int8_for_iq4_and_within_the_files_own_error(name, tmp_path, capsys):
    """The engine under the default: the kernel plan says which holders take int8 activations for the type and
    with which instructions, and the logits' change (decode-sized steps, where int8 applies) stays within half the
    file's own error (float products on its weights vs transformers' logits on the f32 weights)."""
    from safetensors.torch import load_file

    path = str(_iq_file(tmp_path / f"{name}.gguf", name))
    exp = load_file(str(fixture_dir("ds3") / "expected.safetensors"))
    ids = exp["input_ids"].tolist()
    fast = LLM(path, max_num_batched_tokens=1)
    exact = LLM(path, max_num_batched_tokens=1, activations="float")
    reasons = " ".join(c.reason for c in fast.loaded.kernel_plan.choices)
    assert f"int8 activations for {name} ({native.int8_isa()})" in reasons
    a, b = fast.prompt_logits(ids), exact.prompt_logits(ids)
    act, file = _rel(a, b), _rel(b, exp["hf_logits"])
    with capsys.disabled():
        print(f"\n{name}: int8 activations add {act:.4f} to the logits; the file's error {file:.4f}")
    assert 0 < act <= file / 2, (act, file)

"""prefill_matmul="int8": the prefill products of the weights that take int8 activations and have AMX-INT8 tile kernels
stay int8 on the tiles up to kernels/ggml.tile_rows rows per product (tests/kernels/test_int8_prefill_tiles.py holds
the products to the VNNI row kernels bit for bit); the rest bf16_6bit. End to end on the fixtures' Q4_K_M files:
prefill steps of TILE_ROWS tokens (the dense products on the tiles; the routed experts' groups too), the logits
against transformers on the f32 weights under the int8 default's own rule (tests/gguf/test_gguf_int8_default.py):
the error the prefill's int8 activations add is at most half the file's own quantization error,
  act  = ||logits_int8_prefill - logits_exact|| / ||logits_exact||   (exact: float activations, fp32 prefill)
  file = ||logits_exact - logits_hf|| / ||logits_hf||
Measured (96 tokens in one step of up to 128 on an Intel Xeon with AMX): ds3 act 0.114 (bf16_6bit's 0.008) / file
0.338, ds2lite 0.018 (0.006) / 0.130 (in steps of 64 before TILE_ROWS went to 128: 0.106 / 0.019): the int8
default's decode figures (0.098 / 0.014 there), several times bf16's rounding but inside the rule. Without tiles, on
the AVX512-VNNI panels (the same bits as the row kernels; every row count, dense products too), one 96-token step on
a 2-core AMD EPYC: ds3 act 0.114 (bf16_6bit's 0.062) / file 0.338, ds2lite 0.017 (0.006) / 0.130.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import fixture_dir

from mlaserve import LLM
from mlaserve.config.engine import EngineOptions, resolve
from mlaserve.config.model import ConfigError
from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import ggml, native

TILES = native.status().available and native.tiles_granted()
needs_tiles = pytest.mark.skipif(not TILES, reason="no AMX-INT8 tiles in this process (build or kernel)")
PANELS = native.status().available and native.panel_rows(ggml.GGML_TYPE_IDS["Q4_K"]) > 0
needs_panels = pytest.mark.skipif(not PANELS, reason="no int8 panels in this process (no AVX2, or AMX tiles)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _q4_k_m(name: str) -> tuple[dict, list[int], str]:
    """A fixture's expected tensors, its prompt ids and its Q4_K_M file's path."""
    from safetensors.torch import load_file

    folder = fixture_dir(name)
    exp = load_file(str(folder / "expected.safetensors"))
    return exp, exp["input_ids"].tolist(), str(folder / "model-q4_k_m.gguf")


def _against_fp32_prefill(llm, path: str, ids: list[int], exp: dict) -> tuple:
    """llm's prompt logits, the same file's with an fp32 prefill (its decode settings kept), the exact run's (float
    activations, fp32 prefill), and the relative distance of llm's from the exact run's beside the exact run's own
    from transformers'."""
    fp32 = LLM(path, prefill_matmul="float").prompt_logits(ids)
    exact = LLM(path, activations="float", prefill_matmul="float").prompt_logits(ids)
    got = llm.prompt_logits(ids)
    return got, fp32, exact, _rel(got, exact), _rel(exact, exp["hf_logits"])


def _no_tiles_or_panels(monkeypatch) -> None:
    """Neither the AMX tiles nor the VNNI panels in the route's view (an AVX2 CPU's; the C call may still take them on
    this machine, with the same bits)."""
    monkeypatch.setattr(native, "tiles_granted", lambda: False)
    monkeypatch.setattr(native, "panel_rows", lambda type_id: 0)


def _resolve(monkeypatch, fast: str, flags: set[str], **kw):
    from hf_models import make_config

    from mlaserve.config import cpu
    from mlaserve.config.model import ModelConfig

    monkeypatch.setenv("MLASERVE_FAST_BF16", fast)
    monkeypatch.delenv("MLASERVE_AMX_INT8", raising=False)  # the flags below decide
    monkeypatch.delenv("MLASERVE_INT8_ROWS", raising=False)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    cfg = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    eng = resolve(cfg, EngineOptions(device="cpu", **kw), False, native_kernels=lambda: (True, "built"), gguf=True)
    return eng.kernels.prefill_matmul, {s.name: s for s in eng.provenance}["prefill_matmul"].source


def test_auto_takes_int8_prefill_where_the_cpu_has_amx_int8(monkeypatch):
    value, why = _resolve(monkeypatch, "1", {"amx_bf16", "amx_int8", "amx_tile"})
    assert value == "int8" and why.startswith("engine default (auto: this CPU has amx_int8, activations int8_6bit)")
    assert f"products of up to {ggml.TILE_ROWS} rows" in why
    assert _resolve(monkeypatch, "1", {"avx512_bf16"})[0] == "bf16_6bit"  # no tiles, no VNNI: bf16 GEMMs as before
    assert _resolve(monkeypatch, "1", {"amx_int8"}, activations="float")[0] == "bf16_6bit"  # no int8 products
    assert _resolve(monkeypatch, "0", {"amx_int8"})[0] == "float"  # no integer dot products named: fp32 GEMMs
    value, why = _resolve(monkeypatch, "0", {"avx2"}, prefill_matmul="int8")
    assert value == "int8" and "this CPU has no AMX-INT8: no product takes the tiles here" in why
    with pytest.raises(ConfigError, match="prefill_matmul='int8' keeps int8 activations"):
        _resolve(monkeypatch, "1", {"amx_int8"}, prefill_matmul="int8", activations="float")
    monkeypatch.setenv("MLASERVE_AMX_INT8", "0")  # the suite's setting: the machine's tiles out of auto's choice
    monkeypatch.setenv("MLASERVE_INT8_ROWS", "0")
    monkeypatch.setenv("MLASERVE_FAST_BF16", "1")
    from hf_models import make_config

    from mlaserve.config.model import ModelConfig

    cfg = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    eng = resolve(cfg, EngineOptions(device="cpu"), False, native_kernels=lambda: (True, "built"), gguf=True)
    assert eng.kernels.prefill_matmul == "bf16_6bit"


def test_auto_takes_int8_float_where_bf16_is_slow(monkeypatch):
    """An AVX2 CPU (no bf16 units, no VNNI): auto keeps the int8 products where they run (the routed experts' row
    kernels) and fp32 GEMMs for the rest, int8_float, where int8 activations apply; float activations, or the
    override that the suite sets (MLASERVE_INT8_ROWS=0), give fp32 everywhere; asking for int8_float without int8
    activations is refused. The holders then take int8 rows for the experts and no bf16 anywhere (BF16_BITS 0)."""
    from mlaserve.config.machine import BF16_BITS, PREFILL_TILES

    value, why = _resolve(monkeypatch, "0", {"avx2", "fma"})
    assert value == "int8_float" and "this CPU has avx2" in why and "bf16 GEMMs are slower than fp32 here" in why
    assert "routed experts' products of up to 128 rows per active expert on the int8 row kernels" in why
    assert BF16_BITS[value] == 0 and value in PREFILL_TILES
    assert _resolve(monkeypatch, "0", {"avx2"}, activations="float")[0] == "float"
    assert _resolve(monkeypatch, "0", {"avx2"}, prefill_matmul="int8_float")[0] == "int8_float"
    with pytest.raises(ConfigError, match="prefill_matmul='int8_float' keeps int8 activations"):
        _resolve(monkeypatch, "0", {"avx2"}, prefill_matmul="int8_float", activations="float")
    from mlaserve.config import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setenv("MLASERVE_INT8_ROWS", "0")
    assert cpu.int8_row_kernels() == (False, "MLASERVE_INT8_ROWS=0 in the environment")


def test_auto_takes_int8_prefill_on_the_row_kernels_where_the_cpu_has_vnni_and_no_tiles(monkeypatch):
    value, why = _resolve(monkeypatch, "1", {"avx512_bf16", "avx512_vnni"})
    assert value == "int8" and why.startswith("engine default (auto: this CPU has avx512_vnni, activations int8_6bit)")
    assert "without AMX-INT8 tiles, on a CPU with AVX512-VNNI the products of the weights with q8_K activations" in why
    assert "without AVX512-VNNI (AVX-VNNI, AVX2) the same on 8-row AVX2 panels from 8 rows" in why
    assert "routed experts of a type without panels keep their products of up to 128 rows per active expert" in why
    assert _resolve(monkeypatch, "0", {"avx512_vnni"})[0] == "int8_float"  # bf16 slow here: the int8 products, fp32
    assert _resolve(monkeypatch, "1", {"avx512_vnni", "avx512_bf16"}, activations="float")[0] == "bf16_6bit"
    from mlaserve.config import cpu

    monkeypatch.setenv("MLASERVE_INT8_ROWS", "0")  # the override, not the flags, decides (the suite sets 0)
    assert cpu.int8_rows() == (False, "MLASERVE_INT8_ROWS=0 in the environment")


@needs_tiles
@pytest.mark.parametrize("name", ["ds3", "ds2lite"])
def test_q4_k_m_int8_prefill_within_the_files_own_error(name):
    exp, ids, path = _q4_k_m(name)
    step = {"max_num_batched_tokens": ggml.TILE_ROWS}
    tiles = LLM(path, prefill_matmul="int8", **step)
    assert tiles.config.kernels.prefill_matmul == "int8"
    reasons = " ".join(c.reason for c in tiles.loaded.kernel_plan.choices)
    assert f"int8 prefill on amx-int8 tiles for Q4_K up to {ggml.TILE_ROWS} rows per product" in reasons
    bf16 = LLM(path, prefill_matmul="bf16_6bit", **step).prompt_logits(ids)
    exact = LLM(path, activations="float", prefill_matmul="float", **step).prompt_logits(ids)
    got = tiles.prompt_logits(ids)
    act, file = _rel(got, exact), _rel(exact, exp["hf_logits"])
    print(f"\n{name} q4_k_m prefill: int8 tiles add {act:.4f} (bf16_6bit {_rel(bf16, exact):.4f}); file {file:.4f}")
    assert not torch.equal(got, bf16)  # the route was taken: another computation than bf16's
    assert 0 < act <= file / 2, (act, file)


@needs_panels
@pytest.mark.parametrize("name", ["ds3", "ds2lite"])
def test_q4_k_m_int8_prefill_on_the_panels_within_the_files_own_error(name):
    """Without tiles, on the int8 panels (AVX512-VNNI's or AVX2's): one 96-token prefill step, every Q4_K / Q6_K product int8 (dense ones too,
    which bf16_6bit took before), the logits within half the file's own error, another computation than bf16_6bit's."""
    exp, ids, path = _q4_k_m(name)
    panels = LLM(path, prefill_matmul="int8")
    reasons = " ".join(c.reason for c in panels.loaded.kernel_plan.choices)
    assert "int8 prefill at every row count for Q4_K" in reasons and f"{native.panels_isa()} panels for Q4_K" in reasons
    bf16 = LLM(path, prefill_matmul="bf16_6bit").prompt_logits(ids)
    exact = LLM(path, activations="float", prefill_matmul="float").prompt_logits(ids)
    got = panels.prompt_logits(ids)
    act, file = _rel(got, exact), _rel(exact, exp["hf_logits"])
    print(f"\n{name} q4_k_m prefill: int8 panels add {act:.4f} (bf16_6bit {_rel(bf16, exact):.4f}); file {file:.4f}")
    assert not torch.equal(got, bf16)
    assert 0 < act <= file / 2, (act, file)


@pytest.mark.skipif(not native.status().available, reason="native kernels unavailable")
@pytest.mark.parametrize("name", ["ds3"])  # ds2lite's Q4_K_M experts are Q5_0 / Q8_0 (its narrow widths' fallback)
def test_q4_k_m_int8_float_prefill_within_the_files_own_error(name, monkeypatch):
    """prefill_matmul "int8_float" (auto's choice where bf16 GEMMs are slow) without tiles or panels in the route's view
    (an AVX2 CPU's; the C call may still take them on this machine, with the same bits): one 96-token prefill step,
    the routed Q4_K experts' products int8 on the row kernels, every dense product fp32 (no holder in bf16), the logits
    within half the file's own error, and another computation than int8 decode with an fp32 prefill."""
    _no_tiles_or_panels(monkeypatch)
    exp, ids, path = _q4_k_m(name)
    rows = LLM(path, prefill_matmul="int8_float")
    assert rows.config.kernels.prefill_matmul == "int8_float"
    reasons = " ".join(c.reason for c in rows.loaded.kernel_plan.choices)
    assert f"int8 prefill on the row kernels for Q4_K up to {ggml.ROW_KERNEL_ROWS} rows per active" in reasons
    holders = [m for m in rows.runner.model.modules() if hasattr(m, "bf16") and hasattr(m, "ggml_type")]
    assert holders and not any(m.bf16 for m in holders)  # fp32 above the int8 products, never bf16
    got, fp32, exact, act, file = _against_fp32_prefill(rows, path, ids, exp)
    print(f"\n{name} q4_k_m prefill: int8 expert rows add {act:.4f}; file {file:.4f}")
    assert not torch.equal(got, fp32)  # the route was taken
    assert 0 < act <= file / 2, (act, file)


@pytest.mark.skipif(not native.status().available, reason="native kernels unavailable")
def test_int8_float_prefill_takes_the_int16_rows_for_the_q5_0_and_q8_0_experts(monkeypatch):
    """ds2lite's Q4_K_M file (routed experts Q5_0 gate / up, Q8_0 down) under int16 activations with no int16 panels in
    the route's view (an AVX2 build's: int16_prefill.takes_expert_rows): prefill_matmul "int8_float" keeps the experts'
    prompt products on the int16 row products (fp32 grade) up to ROW_KERNEL_ROWS rows an expert, and the plan says
    so; a 96-token prefill's logits move from the exact run's by int16's grade (the bound of test_decode_int16.py:
    0.57 / 32 of the file's own error) and differ from the fp32 prefill's (the route was taken)."""
    from mlaserve.kernels import int16_prefill

    if not int16_prefill.takes_rows(GGML_TYPE_IDS["Q8_0"]):
        pytest.skip(f"no int16 products here: {int16_prefill.detail()}")
    monkeypatch.setenv("MLASERVE_INT16_ROWS", "1")  # the suite turns auto's int16 off
    monkeypatch.setattr(int16_prefill, "takes", lambda type_id: False)
    _no_tiles_or_panels(monkeypatch)
    exp, ids, path = _q4_k_m("ds2lite")
    rows = LLM(path, prefill_matmul="int8_float")
    assert rows.config.kernels.activations == "int8_6bit_int16"
    reasons = " ".join(c.reason for c in rows.loaded.kernel_plan.choices)
    for name in ("Q5_0", "Q8_0"):
        said = (
            rf"int16 prefill on the row products for [A-Z0-9_, ]*{name}[A-Z0-9_, ]* up to {ggml.ROW_KERNEL_ROWS} rows"
        )
        assert re.search(said, reasons), name
    got, fp32, exact, act, file = _against_fp32_prefill(rows, path, ids, exp)
    print(f"\nds2lite q4_k_m prefill: int16 expert rows add {act:.2e}; file {file:.4f}")
    assert not torch.equal(got, fp32)
    assert 0 < act <= 0.57 / 32 * file, (act, file)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))

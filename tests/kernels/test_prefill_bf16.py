"""bf16 prefill products (engine option prefill_matmul; kernels/bf16_prefill.py) against independent computations.

The products: more than GEMV_ROWS rows per weight, the weight decoded natively then one bf16 GEMM. The reference is
not our code: gguf-py's dequantizer, an explicit round-to-nearest-even to bf16 written here on the bits, and an fp64
matmul. Bounds, with u = 2^-8 (bf16 keeps 8 significant bits) and S = |bf(x)| @ |bf(W)|^T:
  against ref = bf(x) @ bf(W)^T in fp64: the products of two bf16 values are exact in fp32, their fp32 sum is off by at
  most K 2^-24 S, and torch's CPU GEMM returns bf16 (one more rounding): |y - ref| <= u |ref| + (1 + u) K 2^-24 S;
  against the exact x @ W^T (fp64): each operand moves by at most u of itself, so S' = |x| @ |W|^T and
  |y - x W^T| <= u |x W^T| + (2u + u^2 + K 2^-24)(1 + u) S'.
The engine: bf16 prefill moves a tiny GGUF's logits well inside the file's own error (the rule that picks the types);
decode-sized steps are untouched; the choice is resolved from the CPU flag (forced with MLASERVE_FAST_BF16), recorded
in provenance and printed in the kernel plan. The suite runs with MLASERVE_FAST_BF16=0 (tests/conftest.py); torch's bf16
GEMM runs on any CPU (slower without AMX / AVX512-BF16), so nothing here depends on the machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fixture_dir
from test_kernels import gguf_py_dense, random_blocks

from mlaserve import LLM
from mlaserve.attention.backends import get_backend
from mlaserve.config.engine import EngineOptions, resolve
from mlaserve.config.machine import BF16_BITS
from mlaserve.config.model import ConfigError
from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import bf16_pairs, bf16_prefill, ggml, int16_prefill, native
from mlaserve.quant.ggml_heads import GGUFHeads
from mlaserve.quant.ggml_linear import GGUFExperts, GGUFLinear

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
U = 2.0**-8  # bf16's unit roundoff (round to nearest, 8 significant bits)
U32 = 2.0**-24
TYPES = ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"]


def bf16_round(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest bf16 value (ties to even), as fp64: done on the bits here, not by torch's conversion."""
    bits = t.float().contiguous().numpy().view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return torch.from_numpy(rounded.astype(np.uint32).view(np.float32).astype(np.float64))


def assert_bf16_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y [M, N] against x [M, K] @ w [N, K]^T (fp32 inputs) by the two bounds of the module's docstring."""
    k = x.shape[-1]
    xb, wb = bf16_round(x), bf16_round(w)
    ref, s = xb @ wb.T, xb.abs() @ wb.abs().T
    tight = U * ref.abs() + (1 + U) * k * U32 * s
    over = (y.double() - ref).abs() - tight
    assert (over <= 0).all(), f"max excess over the bf16 GEMM bound {over.max().item():.3g}"
    exact, s1 = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    loose = U * exact.abs() + (2 * U + U * U + k * U32) * (1 + U) * s1
    assert ((y.double() - exact).abs() <= loose).all()


@needs_native
@pytest.mark.parametrize("name", TYPES)
def test_linear_bf16_against_gguf_py_and_fp64(name):
    g = torch.Generator().manual_seed(3)
    t, k, n, m = GGML_TYPE_IDS[name], 512, 48, ggml.GEMV_ROWS + 24
    w = random_blocks(name, n, k, g)
    x = torch.randn(m, k, generator=g)
    y = ggml.linear_native(x, w, t, k, bf16=True)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert_bf16_product(y, x, gguf_py_dense(w, name))
    assert not torch.equal(y, ggml.linear_native(x, w, t, k))  # the fp32 path is another computation


@needs_native
def test_linear_bf16_in_parts(monkeypatch):
    """A dense weight decoded DENSE_BYTES of rows at a time (made small: 3 parts, the last shorter): every part's
    columns within the bound, and the same products as the weight decoded whole."""
    g = torch.Generator().manual_seed(6)
    t, k, n, m = GGML_TYPE_IDS["Q4_K"], 256, 80, ggml.GEMV_ROWS + 40
    w, x = random_blocks("Q4_K", n, k, g), torch.randn(m, k, generator=g)
    whole = ggml.linear_native(x, w, t, k, bf16=True)
    monkeypatch.setattr(ggml, "DENSE_BYTES", 32 * k * 2)
    y = ggml.linear_native(x, w, t, k, bf16=True)
    assert_bf16_product(y, x, gguf_py_dense(w, "Q4_K"))
    assert torch.equal(y, whole)


@needs_native
def test_decode_sized_products_do_not_change():
    """Up to GEMV_ROWS rows the decode-and-dot kernels run whatever the prefill setting: the same bits."""
    g = torch.Generator().manual_seed(4)
    t, k = GGML_TYPE_IDS["Q4_K"], 256
    w, x = random_blocks("Q4_K", 32, k, g), torch.randn(ggml.GEMV_ROWS, k, generator=g)
    assert torch.equal(ggml.linear_native(x, w, t, k, bf16=True), ggml.linear_native(x, w, t, k))


@needs_native
@pytest.mark.parametrize("name", ["Q4_0", "Q6_K"])
def test_grouped_bf16_against_gguf_py_and_fp64(name, monkeypatch):
    """Routed experts / heads: each group's rows times its expert, in chunks (EXPERT_BYTES made small so that
    the chunked loop runs), every chunk within the bound."""
    monkeypatch.setattr(ggml, "EXPERT_BYTES", 2 * 32 * 256 * 4)  # two experts per chunk
    g = torch.Generator().manual_seed(5)
    t, k, n = GGML_TYPE_IDS[name], 256, 32
    w = random_blocks(name, n, k, g, lead=(6,))
    experts = torch.tensor([0, 2, 3, 5])
    counts = [50, 0, 9, 30]  # more than GEMV_ROWS rows per active expert on average: the decode-then-GEMM path
    assert sum(counts) > ggml.GEMV_ROWS * len(counts)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    xs = torch.randn(sum(counts), k, generator=g)
    ys = ggml.expert_linear_native(xs, w, t, k, experts, offs, bf16=True)
    dense = gguf_py_dense(w, name)
    lo = 0
    for e, c in zip(experts.tolist(), counts, strict=True):
        assert_bf16_product(ys[lo : lo + c], xs[lo : lo + c], dense[e])
        lo += c


def _q8_0_mode() -> int:
    """Q8_0's many-rows mode under a cap below BF16_ALL here: the bf16 pairs on the AMX-BF16 tiles where this process
    has them (kernels/bf16_pairs.py), int16 activations where it has AVX512-VNNI (kernels/int16_prefill.py), else fp32."""
    if bf16_pairs.granted():
        return bf16_prefill.BF16_PAIRS
    return bf16_prefill.INT16 if int16_prefill.takes(GGML_TYPE_IDS["Q8_0"]) else bf16_prefill.FP32


def _block32_mode(name: str) -> int:
    """A 4-5 bit 32-value block type's many-rows mode under bf16_6bit here: int16 activations where the process has
    them and no AMX-BF16 tiles (kernels/int16_prefill.py), else plain bf16."""
    int16 = not bf16_pairs.granted() and int16_prefill.takes(GGML_TYPE_IDS[name])
    return bf16_prefill.INT16 if int16 else bf16_prefill.BF16


def test_weight_types_by_setting():
    q8, q6, q4 = (GGML_TYPE_IDS[n] for n in ("Q8_0", "Q6_K", "Q4_K"))
    assert not any(bf16_prefill.takes_bf16(t, 0) for t in (q8, q6, q4))
    auto = BF16_BITS["bf16_6bit"]
    assert BF16_BITS["bf16"] >= bf16_prefill.BF16_ALL and BF16_BITS["float"] == 0
    assert bf16_prefill.takes_bf16(q6, auto) == bf16_prefill.takes_bf16(q4, auto) == bf16_prefill.BF16
    # Q8_0 never plain bf16 under auto (test_int16_prefill.py holds each case)
    assert bf16_prefill.takes_bf16(q8, auto) == _q8_0_mode()
    assert all(
        bf16_prefill.takes_bf16(t, bf16_prefill.BF16_ALL) == bf16_prefill.BF16
        for t in (q8, q6, q4, GGML_TYPE_IDS["F16"])
    )


def _resolve(monkeypatch, fast: str, **kw):
    from hf_models import make_config

    from mlaserve.config.model import ModelConfig

    monkeypatch.setenv("MLASERVE_FAST_BF16", fast)
    cfg = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    gguf = kw.pop("gguf", True)
    eng = resolve(cfg, EngineOptions(device="cpu", **kw), False, native_kernels=lambda: (True, "built"), gguf=gguf)
    return eng.kernels.prefill_matmul, {s.name: s for s in eng.provenance}["prefill_matmul"].source


def test_auto_resolves_by_the_cpu_flag_and_the_file(monkeypatch):
    value, why = _resolve(monkeypatch, "1")
    assert value == "bf16_6bit" and why.startswith("engine default (auto: MLASERVE_FAST_BF16=1 in the environment)")
    assert "Q8_0 takes bf16 pairs on AMX-BF16 tiles (fp32 grade), int16 activations on AVX512-VNNI" in why
    value, why = _resolve(monkeypatch, "0")
    assert value == "float" and "bf16 GEMMs are slower than fp32 here" in why
    assert _resolve(monkeypatch, "1", gguf=False) == ("float", "engine default (auto: fp32 GEMMs; not a GGUF file)")
    assert _resolve(monkeypatch, "1", kernels="torch")[0] == "float"
    assert _resolve(monkeypatch, "1", prefill_matmul="float")[0] == "float"
    value, why = _resolve(monkeypatch, "0", prefill_matmul="bf16")
    assert value == "bf16" and why.startswith("user option: every weight type") and "slower than fp32 here" in why
    with pytest.raises(ConfigError, match="prefill_matmul='bf16' runs in the native kernels"):
        _resolve(monkeypatch, "1", prefill_matmul="bf16", kernels="torch")
    with pytest.raises(ConfigError, match="prefill_matmul must be one of"):
        _resolve(monkeypatch, "1", prefill_matmul="fp16")  # ("int8" is a value: tests/gguf/test_gguf_int8_prefill.py)


def _parts(m: torch.nn.Module) -> list[tuple[int, bool]]:
    """(ggml type, bf16 prefill) of each weight a GGUF holder keeps."""
    if isinstance(m, GGUFLinear):
        return [(m.ggml_type, m.bf16)]
    if isinstance(m, GGUFExperts):
        return [(m.type_gate_up, m.bf16_gate_up), (m.type_down, m.bf16_down)]
    if isinstance(m, GGUFHeads):
        return [(m.type_k, m.bf16_k), (m.type_v, m.bf16_v)]
    return []


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@needs_native
def test_engine_logits_within_the_files_own_error(monkeypatch):
    """ds3's Q4_K_M file under auto on a CPU with fast bf16 (forced): its Q4_K / Q6_K holders take bf16 prefill (the
    plan says so), the prompt's logits (one 96-token prefill) move by what bf16 adds, measured against the file's own
    error (exact products vs transformers on the f32 weights): the rule's act <= file / 2, and far below it."""
    from safetensors.torch import load_file

    monkeypatch.setenv("MLASERVE_FAST_BF16", "1")
    folder = fixture_dir("ds3")
    exp = load_file(str(folder / "expected.safetensors"))
    ids = exp["input_ids"].tolist()
    path = str(folder / "model-q4_k_m.gguf")
    fast, exact = LLM(path), LLM(path, prefill_matmul="float")
    assert fast.config.kernels.prefill_matmul == "bf16_6bit" and exact.config.kernels.prefill_matmul == "float"
    taken = {  # weight type -> whether its holders' prefill products run in bf16 (per part)
        GGML_TYPES[t].name: b for m in fast.runner.model.modules() for t, b in _parts(m)
    }
    # the file's Q4_K, Q5_1, Q6_K weights take bf16 (6 bits or fewer), its Q5_0 ones int16 activations where this
    # process runs them (_block32_mode), its two Q8_0 ones are not plain bf16: the bf16 pairs or int16 activations
    # where this process runs them, else fp32 (_q8_0_mode)
    want = {"Q4_K": 1, "Q5_0": _block32_mode("Q5_0"), "Q5_1": 1, "Q6_K": 1, "Q8_0": _q8_0_mode()}
    assert taken == want, taken
    reasons = " ".join(c.reason for c in fast.loaded.kernel_plan.choices)
    assert f"bf16 prefill GEMMs for Q4_K ({bf16_prefill.units()})" in reasons
    assert "bf16 prefill" not in " ".join(c.reason for c in exact.loaded.kernel_plan.choices)
    # the decompressed path's K / V expansion (the context's latent rows times kv_b, rebuilt from the Q5_0 / Q4_K
    # halves) runs in bf16 too, where no backend reads the dense W_UK / W_UV (the reference's, as verify runs it)
    attn = fast.runner.model.model.layers[0].self_attn
    torch_backend, reference = get_backend("torch"), get_backend("reference")
    assert attn.expansion_bf16([torch_backend]) and not attn.expansion_bf16([torch_backend, reference])
    assert not exact.runner.model.model.layers[0].self_attn.expansion_bf16([torch_backend])
    a, b = fast.prompt_logits(ids), exact.prompt_logits(ids)
    act, file = _rel(a, b), _rel(b, exp["hf_logits"])
    print(f"\nds3 q4_k_m: bf16 prefill adds {act:.4f} to the logits; the file's own error {file:.4f}")
    assert 0 < act <= file / 2, (act, file)
    # decode-sized products are the decode kernels': 16-token steps on the absorbed path (no expansion) give the
    # exact run's logits bit for bit
    step = LLM(path, max_num_batched_tokens=ggml.GEMV_ROWS, mla_path="absorbed")
    ref = LLM(path, max_num_batched_tokens=ggml.GEMV_ROWS, mla_path="absorbed", prefill_matmul="float")
    assert torch.equal(step.prompt_logits(ids[:40]), ref.prompt_logits(ids[:40]))


@needs_native
@pytest.mark.parametrize("units", ["here", "none"])
def test_q8_0_is_not_plain_bf16_under_auto(units, monkeypatch):
    """Q8_0 fails the rule (bf16 adds ~0.55x its own error): under auto its products take the bf16 pairs where the
    process has AMX-BF16 tiles (kernels/bf16_pairs.py; their error: test_bf16_pairs.py), int16 activations where it
    has AVX512-VNNI (kernels/int16_prefill.py; test_int16_prefill.py), else stay fp32, bit for bit ("none": neither
    unit, as on an AVX2 CPU)."""
    monkeypatch.setenv("MLASERVE_FAST_BF16", "1")
    if units == "none":
        monkeypatch.setattr(bf16_pairs, "granted", lambda: False)
        monkeypatch.setattr(int16_prefill, "takes", lambda t: False)
    path = str(fixture_dir("ds3") / "model-q8_0.gguf")
    ids = list(range(3, 60))
    auto, exact = LLM(path), LLM(path, prefill_matmul="float")
    assert auto.config.kernels.prefill_matmul == "bf16_6bit"
    reasons = " ".join(c.reason for c in auto.loaded.kernel_plan.choices)
    assert "bf16 prefill GEMMs" not in reasons
    if _q8_0_mode() == bf16_prefill.BF16_PAIRS:
        assert (
            f"bf16-pair prefill for Q8_0 ({bf16_pairs.tiles_detail()}: exact codes, activations as bf16 pairs, fp32 grade)"
            in reasons
        )
    elif _q8_0_mode() == bf16_prefill.INT16:
        assert f"int16-activation prefill for Q8_0 ({int16_prefill.detail()}" in reasons
    else:
        assert "bf16-pair prefill" not in reasons  # ("(token, expert) pairs" is the routed experts' own note)
        assert "int16-activation prefill" not in reasons
        assert torch.equal(auto.prompt_logits(ids), exact.prompt_logits(ids))
    forced = LLM(path, prefill_matmul="bf16")
    assert not torch.equal(forced.prompt_logits(ids), exact.prompt_logits(ids))


def test_the_rule_per_weight_type_on_the_fixtures():
    """The rule that picks the automatic types (kernels/bf16_prefill.py), measured: for every quantized matrix of the
    fixtures' files (gguf-py's dequantization; the f32 file of the same model the original), products with N(0,1)
    activations: what bf16 adds, ||y_bf16 - y_file|| / ||y_file||, against the file's own error, ||y_file - y_f32|| /
    ||y_f32||. Types of 6 bits or fewer stay well inside (<= 1/2; measured <= 0.17); Q8_0 does not (measured
    0.52-0.57), hence fp32 under auto."""
    import gguf

    def dense(t) -> torch.Tensor:
        w = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))
        return w.reshape(-1, w.shape[-1])

    g = torch.Generator().manual_seed(0)
    worst: dict[str, float] = {}
    for name in ("ds3", "ds2lite", "ds32", "glm5"):
        folder = fixture_dir(name)
        f32 = {t.name: t for t in gguf.GGUFReader(folder / "model-f32.gguf").tensors}
        for path in sorted(folder.glob("model-q*.gguf")):
            for t in gguf.GGUFReader(path).tensors:
                kind = t.tensor_type.name
                if kind in ("F32", "F16") or len(t.shape) < 2:
                    continue
                w, w0 = dense(t), dense(f32[t.name])
                x = torch.randn(64, w.shape[1], generator=g)
                y0, y = x.double() @ w0.double().T, x.double() @ w.double().T
                added = _rel(bf16_prefill.linear(x, w).double(), y)
                worst[kind] = max(worst.get(kind, 0.0), added / _rel(y, y0))
    print("\nbf16 added / the file's own error, worst per type:", {k: round(v, 3) for k, v in sorted(worst.items())})
    assert set(worst) >= {"Q4_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"}
    for kind, ratio in worst.items():
        # the rule's answer, whichever unit then runs an admitted type (plain bf16, or int16 activations, finer)
        auto = bf16_prefill.admits_bf16(GGML_TYPE_IDS[kind], BF16_BITS["bf16_6bit"])
        assert (ratio <= 0.5) == auto, (kind, ratio, auto)


@needs_native
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "Q5_1"])
def test_native_bf16_decode_is_torchs_rounding_of_the_reference(name):
    """The bf16 operand is decoded in one pass: bit for bit the reference dequantizer's values rounded by torch (random
    bits, so some scales are Inf / NaN: NaN where the reference has NaN, whatever its payload)."""
    g = torch.Generator().manual_seed(6)
    t, k = GGML_TYPE_IDS[name], 512
    raw = torch.randint(0, 256, (6, 40, ggml.row_bytes(t, k)), dtype=torch.uint8, generator=g)
    ref = ggml.dense(raw, t, k).to(torch.bfloat16)
    assert ref.isfinite().float().mean() > 0.5

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        nan = b.isnan()
        return torch.equal(a.isnan(), nan) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))

    assert same(native.dequantize_bf16(t, raw[2].contiguous(), k), ref[2])
    experts = torch.tensor([4, 0, 5])
    assert same(native.dequantize_experts(t, raw, experts, k, torch.bfloat16), ref[experts])

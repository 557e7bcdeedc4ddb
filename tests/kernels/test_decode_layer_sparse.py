"""Sparse (DSA) decode steps through the one-call decode layer (quant.ggml_layer, csrc/decode_layer.c + indexer.c)
against the per-op path, on tiny DSA models written in the test: transformers' random deepseek_v32 (every layer
a full indexer, half-split indexer rope) and glm_moe_dsa with indexer_types full / shared / full (interleaved
rope, a shared layer reusing the previous full layer's top-k), converted by the project's own converter to Q8_0
(rows of 48 values stay F16: not whole blocks) and that file requantized to Q4_0 (as benchmarks/ makes its Q4
files from the Q8_0 one). No fixtures needed.

index_topk is 16 and the prompts run past it, so most decode steps select (the plan's needs_selection), while
a batch of short prompts crosses 16 mid-run (steps within index_topk write their index keys and attend every
row). The per-op path is the reference: same weights, same kernels for every product; the fused call differs
only by fp32 rounding (torch's LayerNorm and BLAS score GEMMs vs C sums, the order in which the selected rows
are summed), so the top-k sets agree unless two scores tie at the k-th place to rounding, which the random
models do not produce (the tokens are asserted identical).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mlaserve import LLM
from mlaserve.attention.backends import torch_index
from mlaserve.gguf.convert.convert import convert_hf_to_gguf
from mlaserve.kernels import native, native_indexer, native_layers
from mlaserve.sampling.params import SamplingParams

NATIVE = native.status()
pytestmark = pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")

TOPK = 16  # tests/hf_models.py SPECS: index_topk of v32 / glm_dsa_shared
LONG = [30, 9, 20, 5]  # prompt lengths: two past index_topk from the first decode step, two short ones
SHORT = [7, 3]  # 7 + 12 decode tokens crosses index_topk mid-run
# fp32 rounding bound on |dlogprob| between the two paths. Measured over the float cases: <= 1.7e-6 (logprobs of
# magnitude ~5, fp32 ulp 4.8e-7: a few ulps through 3 layers). A wrong key, score or top-k moves them by 1e-2 or
# more (the selection changes the rows attended), so 1e-5 separates rounding from any fault.
BOUND = 1e-5


def _byte_tokenizer(folder: Path, vocab_size: int) -> None:
    """The converter keeps a vocabulary: a byte-level BPE tokenizer (3 specials + byte symbols, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())[: vocab_size - 3]
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2} | {s: i + 3 for i, s in enumerate(symbols)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<s>", "</s>", "<pad>"])
    tk.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def _requantize(src: Path, dst: Path, to: str) -> Path:
    """A copy of src with every Q8_0 tensor dequantized and quantized to `to` by the gguf package (an independent
    quantizer); F16 / F32 tensors and the metadata unchanged."""
    import gguf

    target = gguf.GGMLQuantizationType[to.upper()]
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            writer.add_tensor(t.name, gguf.quants.quantize(values, target), raw_dtype=target)
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(t.name, np.ascontiguousarray(t.data))
        else:
            raise AssertionError(f"{t.name}: unexpected type {t.tensor_type.name} in the converter's Q8_0 file")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def dsa_gguf(hf_model_dir, tmp_path_factory):
    """(kind, type) -> a GGUF of the tiny DSA model, written once per module."""
    made: dict = {}

    def get(kind: str, gtype: str) -> Path:
        if (kind, gtype) not in made:
            out = tmp_path_factory.mktemp(f"{kind}-{gtype}")
            shared, model = hf_model_dir(kind)
            folder = out / "hf"
            shutil.copytree(shared, folder)
            _byte_tokenizer(folder, model.config.vocab_size)
            q8 = convert_hf_to_gguf(folder, out / "q8_0.gguf", "q8_0").path
            made[(kind, gtype)] = q8 if gtype == "q8_0" else _requantize(q8, out / f"{gtype}.gguf", gtype)
        return made[(kind, gtype)]

    return get


def _prompts(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _llm(path: Path, **kw) -> LLM:
    """No prefix caching: a second run of the same prompts would prefill only their uncached tails, which with
    activations="int8" take the int8 small-batch kernels where the first run's full prefill took float ones."""
    return LLM(str(path), kernels="native", enable_prefix_caching=False, **kw)


def _run(llm: LLM, prompts: list[list[int]], monkeypatch, max_tokens: int = 12) -> tuple[list, list, int]:
    calls = []
    real, real_stack = native_layers.decode_layer, native_layers.decode_layers
    monkeypatch.setattr(native_layers, "decode_layer", lambda *a: calls.append(1) or real(*a))
    # the layers' calls in one (GGUFDecodeStack): one per layer
    monkeypatch.setattr(native_layers, "decode_layers", lambda s, *a: calls.extend([1] * s.n) or real_stack(s, *a))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    monkeypatch.setattr(native_layers, "decode_layer", real)
    monkeypatch.setattr(native_layers, "decode_layers", real_stack)
    return [o.token_ids for o in outs], [[sorted(s.values()) for s in o.logprobs] for o in outs], len(calls)


FLIP = 5e-2  # an int8 code flip's move of the logprobs (1e-2 to 3e-2 measured), with room


def _assert_parted_at_a_near_tie(tok_a: list, lp_a: list, tok_b: list, lp_b: list) -> None:
    """Int8 runs whose tokens part: per request identical up to the parting step, and there a near-tie (the top two
    logprobs within 2 FLIP in one of the runs: a code flip's move of both decided the greedy choice, no fault)."""
    for ta, la, tb, lb in zip(tok_a, lp_a, tok_b, lp_b, strict=True):
        if ta == tb:
            continue
        at = next(i for i, (a, b) in enumerate(zip(ta, tb)) if a != b)
        assert _max_diff([la[:at]], [lb[:at]]) <= FLIP, "the runs moved apart before they parted"
        gaps = [side[at][-1] - side[at][-2] for side in (la, lb)]
        assert min(gaps) <= 2 * FLIP, f"parted at step {at} without a near-tie: top-2 gaps {gaps}"


def _max_diff(lp_a: list, lp_b: list) -> float:
    return max(abs(a - b) for ra, rb in zip(lp_a, lp_b) for sa, sb in zip(ra, rb) for a, b in zip(sa, sb))


def _per_op(llm: LLM, prompts: list[list[int]], monkeypatch) -> tuple[list, list]:
    model = llm.runner.model
    fused, model.native_decode = model.native_decode, None
    try:
        tok, lp, calls = _run(llm, prompts, monkeypatch)
    finally:
        model.native_decode = fused
    assert calls == 0
    return tok, lp


CASES = [
    ("v32", "q8_0", "float"),
    ("v32", "q4_0", "float"),
    ("v32", "q8_0", "int8"),
    ("glm_dsa_shared", "q8_0", "float"),
    ("glm_dsa_shared", "q4_0", "int8"),
]


def _record_selections(monkeypatch) -> list:
    """Every full indexer layer's selection, per op (MLAAttention.select) or fused (the step's buffer after a full
    layer's call), as one set of valid positions per request, in the order the layers run."""
    from mlaserve.models import deepseek

    seen: list = []

    def sets(sel) -> list:
        return [set(i[v].tolist()) for i, v in zip(sel.index.flatten(0, 1), sel.valid.flatten(0, 1))]

    real_select, real_fused = deepseek.MLAAttention.select, deepseek.MLAForCausalLM._fused

    def select(self, *a):
        out = real_select(self, *a)
        if self.indexer is not None and out is not None:
            seen.append(sets(out[0]))
        return out

    def fused(fast, x, native, state, selections):
        out = real_fused(fast, x, native, state, selections)
        if fast.role == "full" and out[1] is not None:
            seen.append(sets(out[1][0]))
        return out

    monkeypatch.setattr(deepseek.MLAAttention, "select", select)
    monkeypatch.setattr(deepseek.MLAForCausalLM, "_fused", staticmethod(fused))
    return seen


@pytest.mark.parametrize("kind,gtype,activations", CASES)
def test_sparse_decode_steps_equal_the_per_op_path(dsa_gguf, kind, gtype, activations, monkeypatch):
    """Requests past index_topk (selecting steps) and a pair that crosses it mid-run, every decode step through
    the one-call layers; against the same engine with every layer per op: the same tokens, the same top-k at
    every selecting step and full layer, logprobs within fp32 rounding.
    int8: both paths quantize the same activations with the same kernels, yet quantizing is discontinuous: an
    input that differs by fp32 rounding (~5e-7 here) flips its int8 code with probability ~5e-7 / (max|x| / 127)
    ~ 4e-5, and one flip moves the logprobs by ~1e-2. These runs quantize ~7e4 values, and both int8 cases
    measured one flip (2.3e-2, 2.6e-2: one token of one layer jumping from 5e-7 to 2e-2 with the same
    selections), which on another CPU (AVX2 vs AVX-512 rounding) may fall elsewhere. It is not the sparse path's:
    the dense one-call int8 layers flip on these models too (attention="dense", glm_dsa_shared Q4_0, one request
    of 20 tokens: 2e-2 at its 12th token, the earlier ones <= 1e-6). So int8 holds the tokens and
    every selection identical and reports its logprob difference; the float runs hold the fp32 bound. Where such a
    flip meets a near-tie of the greedy choice, the int8 tokens part there (glm_dsa_shared Q4_0 after the prompts'
    dense products moved to the decoded panels, 2026-12-06: its 5th token): int8 then holds the tokens identical up
    to the parting step, requires a near-tie there (the top two logprobs within 2 FLIP in one of the runs: a flip moves
    each logprob by up to FLIP, their gap by up to twice that), and leaves that pass's selections (they follow the
    parted tokens). Measured there: top-two gaps 0.061 and 0.097 in the two runs."""
    llm = _llm(dsa_gguf(kind, gtype), activations=activations, attention="sparse")
    model = llm.runner.model
    n = len(model.model.layers)
    assert all(layer.native_layer is not None for layer in model.model.layers), llm.loaded.report.notes
    # the layers' calls one by one, so that each full layer's selection is read between them (the layers in one
    # call give the same bits: test_the_layers_in_one_call_select_as_one_by_one below)
    model.native_stack = None
    worst = 0.0
    for lengths in (LONG, SHORT):
        prompts = _prompts(lengths)
        seen = _record_selections(monkeypatch)
        tok_a, lp_a, calls = _run(llm, prompts, monkeypatch)
        assert calls == 11 * n  # 11 decode steps after the prompts' step, every layer one call each
        fused_sel = list(seen)
        seen.clear()
        tok_b, lp_b = _per_op(llm, prompts, monkeypatch)
        if activations == "int8" and tok_a != tok_b:
            _assert_parted_at_a_near_tie(tok_a, lp_a, tok_b, lp_b)
            continue
        assert tok_a == tok_b
        assert fused_sel == seen and len(seen) > 0
        worst = max(worst, _max_diff(lp_a, lp_b))
    print(f"{kind} {gtype} {activations}: fused sparse vs per-op max |dlogprob| {worst:.2e}")
    if activations == "float":
        assert worst <= BOUND, worst


@pytest.mark.parametrize("kind", ["v32", "glm_dsa_shared"])
def test_the_layers_in_one_call_select_as_one_by_one(dsa_gguf, kind, monkeypatch):
    """Sparse steps through the layers in one call (GGUFDecodeStack: each full layer's top-k stays in the step's
    buffer for the layers after it) give the bits of the layers' calls one by one."""
    llm = _llm(dsa_gguf(kind, "q8_0"), attention="sparse")
    model = llm.runner.model
    stacked: list[int] = []
    real = native_layers.decode_layers
    monkeypatch.setattr(native_layers, "decode_layers", lambda s, *a: stacked.append(s.n) or real(s, *a))
    for lengths in (LONG, SHORT):
        prompts = _prompts(lengths)
        stacked.clear()
        tok_a, lp_a, _ = _run(llm, prompts, monkeypatch)
        assert len(stacked) == 11
        stacks, model.native_stack = model.native_stack, None
        stacked.clear()
        tok_b, lp_b, _ = _run(llm, prompts, monkeypatch)
        model.native_stack = stacks
        assert not stacked and tok_a == tok_b and lp_a == lp_b


def test_the_selection_is_what_is_attended(dsa_gguf, monkeypatch):
    """The sparse steps really select: attending every row instead (attention="dense", the same weights, the fused
    dense path) moves the logprobs far beyond the bound, so the test above would see a fused path that ignored
    its top-k, and the ledger says the sparse pure-decode steps ran natively."""
    from mlaserve.observability.trace import MemoryTracer

    path, prompts = dsa_gguf("v32", "q8_0"), _prompts(LONG)
    tracer = MemoryTracer()
    _, lp_sparse, _ = _run(_llm(path, attention="sparse", trace=tracer), prompts, monkeypatch)
    selecting = [r for r in tracer.records if r["needs_selection"] and r["num_tokens"] == r["num_decode_tokens"]]
    assert len(selecting) == 11 and all(r["kernels"]["decode_layer"] == "native" for r in selecting)
    _, lp_dense, calls = _run(_llm(path, attention="dense"), prompts, monkeypatch)
    assert calls > 0
    assert _max_diff(lp_sparse, lp_dense) > 100 * BOUND


def test_a_selection_passes_between_fused_and_per_op_layers(dsa_gguf, monkeypatch):
    """A layer under a forward hook runs per op inside a fused step: a per-op full layer's selection reaches the
    fused shared layer after it (copied into the step's buffer), and a fused full layer's reaches a per-op shared
    layer. Both equal the all-per-op path."""
    llm = _llm(dsa_gguf("glm_dsa_shared", "q8_0"), attention="sparse")
    layers = llm.runner.model.model.layers
    assert [layer.native_layer.role for layer in layers] == ["full", "shared", "full"]
    prompts = _prompts(LONG)
    tok_ref, lp_ref = _per_op(llm, prompts, monkeypatch)
    for hooked, fused_calls in ((0, 2), (1, 2)):
        handle = layers[hooked].register_forward_hook(lambda *a: None)
        try:
            tok, lp, calls = _run(llm, prompts, monkeypatch)
        finally:
            handle.remove()
        assert calls == 11 * fused_calls
        assert tok == tok_ref and _max_diff(lp, lp_ref) <= BOUND, hooked


def _index_case(t: int, lengths: list[int], seed: int = 0) -> tuple:
    """q [T, Hi, Di], w [T, Hi], keys [S, Di], kv_slots [T, L] (padded to L with the pad row S - 1), mask [T, L]."""
    g = torch.Generator().manual_seed(seed)
    hi, di = 8, 32
    s = max(lengths) + 50
    length = max(lengths)
    q = torch.randn(t, hi, di, generator=g)
    w = torch.randn(t, hi, generator=g) * 0.3
    keys = torch.randn(s, di, generator=g)
    kv_slots = torch.full((t, length), s - 1, dtype=torch.int64)
    mask = torch.zeros(t, length, dtype=torch.bool)
    for b, n in enumerate(lengths):
        kv_slots[b, :n] = torch.randperm(s - 1, generator=g)[:n]
        mask[b, :n] = True
    return q, w, keys, kv_slots, mask


def _torch_topk(q, w, keys, kv_slots, mask, k) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-op path's selection (attention/backends/torch_index.py) on the same inputs."""
    from types import SimpleNamespace

    t = q.shape[0]
    seg = SimpleNamespace(
        q_index=torch.arange(t).view(t, 1),
        kv_slots=kv_slots,
        mask=mask.view(t, 1, -1),
        segment=SimpleNamespace(index_scoring="fp32", phase="decode"),
    )
    index = torch_index.index_topk(q, w, keys, seg, k)[:, 0]
    return index, mask.gather(1, index)


@pytest.mark.parametrize("lengths,k,threads", [([150, 40, 16, 9, 1], 16, 1), ([700, 530, 100], 64, 2)])
def test_index_topk_kernel_selects_the_per_op_set(lengths, k, threads):
    """The C top-k against torch's over the same inputs: the same set of valid positions per query, for requests
    with more allowed positions than k, exactly k, and fewer (all kept, then never-attended padding); the
    second case scores its keys on two threads (the kernel parallelises a request's keys from 512 on)."""
    q, w, keys, kv_slots, mask = _index_case(len(lengths), lengths)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        idx_c, val_c = native_indexer.index_topk(q, w, keys, kv_slots, mask, k)
    finally:
        torch.set_num_threads(before)
    idx_t, val_t = _torch_topk(q, w, keys, kv_slots, mask, k)
    for b, n in enumerate(lengths):
        got, want = set(idx_c[b][val_c[b]].tolist()), set(idx_t[b][val_t[b]].tolist())
        assert got == want and len(got) == min(n, k), b
        kept = idx_c[b][val_c[b]].tolist()
        assert (idx_c[b] < kv_slots.shape[1]).all() and sorted(kept) == kept
        assert not mask[b, idx_c[b][~val_c[b]]].any()  # the filler positions are never attendable


def test_index_topk_ties_keep_the_earlier_positions():
    """Exact ties at the k-th score (the same key row at several positions): the C kernel keeps the earliest of
    them (its documented rule; torch's topk leaves the choice unspecified, so the per-op path may keep others)."""
    q, w, keys, kv_slots, mask = _index_case(1, [60], seed=3)
    k = 10
    idx, _ = native_indexer.index_topk(q, w, keys, kv_slots, mask, k)
    # six positions outside the top-k get the 7th-best one's key row: a seven-way tie for the 7th..10th places
    order = idx[0].tolist()
    scores = torch.relu(q[0] @ keys[kv_slots[0]].T).mul(w[0][:, None]).sum(0)
    ranked = sorted(order, key=lambda p: -float(scores[p]))
    pivot = ranked[6]
    twins = [p for p in range(60) if p not in order][:6]
    kv_slots[0, twins] = int(kv_slots[0, pivot])
    idx, val = native_indexer.index_topk(q, w, keys, kv_slots, mask, k)
    tied = sorted([pivot, *twins])
    kept = sorted(set(idx[0][val[0]].tolist()) & set(tied))
    assert kept == tied[:4]  # the 7th..10th places go to the four earliest of the seven equal positions


def test_a_layer_the_one_call_does_not_describe_is_refused_at_load(dsa_gguf):
    """The one call repeats a fixed structure (quant.ggml_layer PARTS, ONE_CALL_MODULES, ONE_CALL_FORWARDS): a layer
    that gained a weight, whose attention overrides a step the call repeats, or that lost a part the call reads, is
    refused by the load-time check with a reason naming it (so the KernelPlan takes per_op for it), never skipped
    by the C code or failing at run time."""
    from torch import nn

    from mlaserve.kernels import registry
    from mlaserve.models.deepseek import MLAAttention
    from mlaserve.quant.ggml_layer import GGUFDecodeLayer

    llm = _llm(dsa_gguf("v32", "q8_0"))
    layer = llm.runner.model.model.layers[1]
    assert GGUFDecodeLayer.unfit(layer) is None
    ctx = registry.KernelContext("native", False)
    layer.self_attn.indexer.q_norm = nn.LayerNorm(4)  # a module the model's structure gained
    impl, reason = registry._choose("decode_layer", layer, ctx)
    assert impl.name == "per_op" and "self_attn.indexer.q_norm.weight" in reason, reason
    del layer.self_attn.indexer.q_norm

    class Changed(MLAAttention):
        def select(self, *a):  # a change to a step the one call repeats
            return super().select(*a)

    layer.self_attn.__class__ = Changed
    impl, reason = registry._choose("decode_layer", layer, ctx)
    assert impl.name == "per_op" and "Changed.select is not MLAAttention.select" in reason, reason
    layer.self_attn.__class__ = MLAAttention
    wk = layer.self_attn.indexer.wk
    del layer.self_attn.indexer.wk  # a part the one call reads, gone
    impl, reason = registry._choose("decode_layer", layer, ctx)
    assert impl.name == "per_op" and "no self_attn.indexer.wk, which the one call reads" in reason, reason
    layer.self_attn.indexer.wk = wk
    assert GGUFDecodeLayer.unfit(layer) is None

"""`mlaserve verify MODEL --against OTHER`: the first layer where two copies of a model part ways.

Notation
  b = MODEL (the copy under test), a = OTHER (the reference); T prompt tokens, D hidden size
  block X     embed | layer i attention | layer i MoE (or dense MLP) | logits, in forward order
  y_a(X)      [T, D] X's output in OTHER
  y_b(X)      [T, D] X's output in MODEL *on OTHER's input of X* (teacher forcing, observability/capture.py)
  rel(X)      = ||y_b - y_a||_F / ||y_a||_F,  cos(X) = <y_a, y_b> / (||y_a|| ||y_b||)
  e(X)        the file's own quantization error of X's weights (observability/weight_error.py); 0 for
              float32/bf16 safetensors loaded in float32
  tol(X)      = FP32_REL_TOL + QUANT_SAFETY * (e_a(X) + e_b(X))
Verdict: the first block with rel(X) > tol(X) names the layer and the sub-block where the copies part
ways; exit code 1. Teacher forcing is what makes "first" meaningful: fed the reference's input, a block
differs only by its own weights, so an error in layer 1 does not also light up layers 2, 3, ...
The free-running hidden state of every layer (each model on its own previous output) is reported too:
it shows how far a divergence has travelled by the logits, but it is not judged (a merely quantized
MoE may legitimately flip an expert choice downstream).

Both copies run exact (float-activation) products: the files are compared. Where MODEL's engine would take int8
activations (engine option activations; the default for a GGUF's weights of <= 6 bits), the error they add is
reported beside the file's own, per block:
  act(X)      = sqrt(sum_p ||y_p^int8 - y_p||^2 / sum_p ||y_p||^2) over the products p of X's GGUF holders
              (linear layers, routed experts, lm_head) on the inputs they saw in the teacher-forced run, in
              decode-sized chunks of <= GEMV_ROWS rows (where the int8 kernels run); W_UK / W_UV (attn_k_b /
              attn_v_b) are not included; every row is quantized on its own and the AMX-INT8 tiles give the
              decode kernels' bits, so this is also the error of prefill_matmul "int8"'s prefill products
              (those of up to kernels/ggml.tile_rows rows on the tiles)
reported with e(X) (the rule: act well inside e), not judged.
Where MODEL's engine keeps a rounded cache (kv_cache_dtype not auto: 8-bit codes or 16-bit rows), the error the
cache adds is reported the same way, per attention block:
  cache(X)    = ||y_b^kv(X) - y_b(X)||_F / ||y_b(X)||_F, the teacher-forced block with its cache rows stored in
              kv_cache_dtype vs in float32 (the same weights, the same input): the error of the stored rows alone
reported with e(X) (the rule for a lossy default: cache well inside e), not judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from mlaserve.config.machine import INT8_BITS, choose_activations
from mlaserve.config.provenance import ProvenanceLog
from mlaserve.entrypoints.llm import LLM
from mlaserve.executor.model_runner import ModelRunner
from mlaserve.kernels import ggml, native
from mlaserve.observability.capture import Activations, Capture
from mlaserve.observability.weight_error import (
    DequantCheck,
    block_errors,
    check_dequantization,
    tensor_errors,
    types_by_block,
)

# fp32 vs fp32 with the same weights: both sides run the same kernels on the same input, so the blocks
# agree exactly (rel 0.0 measured: ds3 folder vs its f32 GGUF) or to float32 reassociation noise when a
# kernel or thread count differs (~1e-7); 1e-5 leaves room for that and still sees a 1% change of one
# expert's down-projection (rel 2e-3 on ds3's layer 2).
FP32_REL_TOL = 1e-5
# Multiplies e(X), the first-order bound of a block's relative output error from its weights' stored
# precision. Measured rel(X) / e(X) on every GGUF of the fixtures (ds3, ds2lite, ds32, glm5; f16, q8_0,
# q4_k_m, q4_0; 107-108 tokens): <= 1.03 on the one-matrix blocks (embed, logits, where rel(X) *is* the
# weights' error, so this checks the estimate itself) and <= 0.61 on attention and MoE/MLP blocks. 2
# passes all of them with room, and a layer whose weights were changed still fails by far (two swapped
# heads of kv_b: rel 1.0 against a q4_k_m tolerance of ~0.55).
QUANT_SAFETY = 2.0


@dataclass(frozen=True)
class BlockDiff:
    block: str  # "embed" | "layer.3.attn" | "layer.3.mlp" | "logits"
    max_abs_diff: float
    rel_diff: float
    cosine: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.rel_diff <= self.tolerance


@dataclass(frozen=True)
class LayerDiff:
    """A decoder layer's output hidden state, each model free-running (propagated divergence)."""

    layer: int
    max_abs_diff: float
    rel_diff: float
    cosine: float


@dataclass
class Side:
    path: str
    llm: LLM
    block_error: dict[str, float] = field(default_factory=dict)  # e(X) of this side's file
    types: dict[str, dict[str, int]] = field(default_factory=dict)  # tensor types per block (GGUF)
    dequant: DequantCheck | None = None  # GGUF: ours vs the gguf package
    activations: str = "float"  # what this copy's engine runs with these options (machine.choose_activations)


@dataclass
class AgainstReport:
    model: str
    against: str
    num_tokens: int
    blocks: list[BlockDiff]
    layers: list[LayerDiff]
    logits_top1: float  # free-running top-1 agreement of the final logits
    mlp_kinds: tuple[str, ...]  # per layer "moe" | "dense"
    types: dict[str, dict[str, int]]  # MODEL's tensor types per block ({} for safetensors)
    notes: list[str]
    dequant_checks: list[tuple[str, DequantCheck]]
    topk_overlap: dict[int, float] = field(default_factory=dict)  # DSA layer -> shared fraction of top-k
    activations: str = "float"  # MODEL's activations setting; int8: activation_error is measured
    activation_error: dict[str, float] = field(default_factory=dict)  # block -> act(X) (int8 activations)
    file_error: dict[str, float] = field(default_factory=dict)  # block -> e(X) of MODEL's file
    kv_cache_dtype: str = "auto"  # MODEL's cache layout; not auto: cache_error is measured
    cache_error: dict[str, float] = field(default_factory=dict)  # attention block -> cache(X)

    @property
    def first_failure(self) -> BlockDiff | None:
        return next((b for b in self.blocks if not b.passed), None)

    @property
    def passed(self) -> bool:
        return self.first_failure is None and all(c.passed for _, c in self.dequant_checks)


def open_side(path: str, **options) -> Side:
    """Load one copy in float32 with exact products (the comparison is of the files' weights, not of a runtime
    dtype or activation rounding); the activations its engine would take with these options are kept apart."""
    llm = LLM(path, **{**options, "dtype": "float32", "activations": "float", "prefill_matmul": "float"})
    gguf = llm.loaded.path.suffix == ".gguf"
    would = choose_activations(options.get("activations", "auto"), llm.config.kernels.impl, gguf, ProvenanceLog())
    side = Side(path, llm, activations=would)
    if llm.loaded.path.suffix == ".gguf":
        from mlaserve.gguf.read.file import open_gguf

        gf = open_gguf(llm.loaded.path)
        try:
            errors = tensor_errors(gf, llm.config.model.num_layers)
            side.block_error = block_errors(errors)
            side.types = types_by_block(errors)
            side.dequant = check_dequantization(gf)
        finally:
            gf.close()
    elif llm.loaded.quant is not None:  # FP8 / FP4 safetensors: the same error model (quant/error.py)
        from mlaserve.quant.error import folder_errors

        side.block_error, side.types = folder_errors(
            llm.loaded.path, llm.loaded.quant.scheme, llm.config.model.num_layers
        )
    return side


def compare(model: Side, against: Side, ids: list[int]) -> AgainstReport:
    _check_compatible(model, against)
    ref = _forward(against.llm, ids)
    forced = _forward(model.llm, ids, force=ref)
    free = _forward(model.llm, ids)
    n = model.llm.config.model.num_layers
    blocks = [_block(x, ref[x], forced[x], _tolerance(x, model, against)) for x in _block_order(n)]
    layers = [_layer(i, ref[f"layer.{i}"], free[f"layer.{i}"]) for i in range(n)]
    top1 = (ref["logits"].argmax(-1) == free["logits"].argmax(-1)).float().mean().item()
    checks = [(s.path, s.dequant) for s in (model, against) if s.dequant is not None]
    act = activation_errors(model, ids, ref) if INT8_BITS[model.activations] else {}
    kv = model.llm.config.cache.kv_cache_dtype
    cache = cache_errors(model, ids, ref, forced) if kv != "auto" else {}
    return AgainstReport(
        model.path,
        against.path,
        len(ids),
        blocks,
        layers,
        top1,
        model.llm.config.model.mlp_layer_types,
        model.types,
        [],
        checks,
        _topk_overlaps(ref, forced, n),
        model.activations,
        act,
        {b: model.block_error.get(b, 0.0) for b in (*act, *cache)},
        kv,
        cache,
    )


def cache_errors(side: Side, ids: list[int], ref: Activations, forced: Activations) -> dict[str, float]:
    """cache(X) per attention block (module docstring): the teacher-forced run once more over a float32 cache."""
    full = _forward(side.llm, ids, force=ref, kv_cache_dtype="auto")
    out = {}
    for x in _block_order(side.llm.config.model.num_layers):
        if x.endswith(".attn"):
            a, b = full[x].double(), forced[x].double()
            out[x] = ((b - a).norm() / a.norm().clamp(min=1e-30)).item()
    return out


def _block_of(module: str) -> str | None:
    """The block (as _block_order names them) a module's products belong to; None outside them (MTP)."""
    parts = module.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 3 and parts[3] in ("self_attn", "mlp"):
        return f"layer.{parts[2]}.{'attn' if parts[3] == 'self_attn' else 'mlp'}"
    return "logits" if module == "lm_head" else None


def activation_errors(side: Side, ids: list[int], ref: Activations) -> dict[str, float]:
    """act(X) per block (module docstring): the teacher-forced run once more with a forward hook on every GGUF
    holder whose weights take int8 activations under the side's setting, then each recorded product twice, exact
    and with int8 activations, GEMV_ROWS rows (tokens) at a time. The holders are not changed: the products are
    the kernels' functions called with the setting (kernels/ggml.py)."""
    from mlaserve.quant.ggml_linear import GGUFExperts, GGUFLinear

    cap = INT8_BITS[side.activations]
    seen: list[tuple[str, torch.nn.Module, tuple]] = []
    hooks = []
    for name, m in side.llm.loaded.model.named_modules():
        block = _block_of(name)
        if block is None:
            continue
        types = (
            (m.ggml_type,)
            if isinstance(m, GGUFLinear)
            else (m.type_gate_up, m.type_down)
            if isinstance(m, GGUFExperts)
            else ()
        )
        if any(native.takes_int8(t, cap) for t in types):
            hook = lambda mod, args, out, b=block: seen.append((b, mod, tuple(a.detach() for a in args)))  # noqa: E731
            hooks.append(m.register_forward_hook(hook))
    try:
        _forward(side.llm, ids, force=ref)
    finally:
        for h in hooks:
            h.remove()
    sums: dict[str, list[float]] = {}
    for block, m, args in seen:
        for c0 in range(0, args[0].reshape(-1, args[0].shape[-1]).shape[0], ggml.GEMV_ROWS):
            exact, fast = _products(m, args, c0, cap)
            acc = sums.setdefault(block, [0.0, 0.0])
            acc[0] += (fast.double() - exact.double()).pow(2).sum().item()
            acc[1] += exact.double().pow(2).sum().item()
    return {b: (d / max(r, 1e-300)) ** 0.5 for b, (d, r) in sums.items()}


def _products(m: torch.nn.Module, args: tuple, c0: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows c0 .. c0 + GEMV_ROWS of a holder's call, exact and with int8 activations under the setting cap."""
    from mlaserve.quant.ggml_linear import GGUFLinear

    c1 = c0 + ggml.GEMV_ROWS
    if isinstance(m, GGUFLinear):
        x = args[0].reshape(-1, m.in_features)[c0:c1].float().contiguous()
        return tuple(ggml.linear_native(x, m.weight, m.ggml_type, m.in_features, i8) for i8 in (0, cap))
    x, topk_w, topk_idx = (a[c0:c1] for a in args)  # GGUFExperts(x [T, D], topk_w [T, k], topk_idx [T, k])

    def with_int8(i8: int):  # the step's mean rows per expert (_grouped's last argument) picks the path, as it runs
        return lambda xs, w, t, k, active, offs, *rest: ggml.expert_linear_native(
            xs, w, t, k, active, offs, i8, rows_per_expert=rest[-1]
        )

    return tuple(m._grouped(x.float(), topk_w, topk_idx, with_int8(i8)) for i8 in (0, cap))


def _block_order(num_layers: int) -> list[str]:
    inner = [f"layer.{i}.{part}" for i in range(num_layers) for part in ("attn", "mlp")]
    return ["embed", *inner, "logits"]


def _tolerance(block: str, *sides: Side) -> float:
    return FP32_REL_TOL + QUANT_SAFETY * sum(s.block_error.get(block, 0.0) for s in sides)


def _forward(
    llm: LLM, ids: list[int], force: Activations | None = None, kv_cache_dtype: str | None = None
) -> Activations:
    """The whole prompt in one step through a fresh runner (own cache, in kv_cache_dtype when given, else the
    engine's), hooks capturing every block."""
    cfg = llm.config
    pages = -(-len(ids) // cfg.cache.page_size) + 1
    kv = kv_cache_dtype or cfg.cache.kv_cache_dtype
    cfg = replace(
        cfg,
        scheduler=replace(cfg.scheduler, max_num_batched_tokens=len(ids)),
        cache=replace(cfg.cache, num_pages=pages, kv_cache_dtype=kv),
    )
    runner = ModelRunner(llm.loaded.model, cfg)
    with Capture(llm.loaded.model, force) as acts:
        slot = 0 if runner.cache.num_slots else None  # its own cache: slot 0 is free (request states only)
        runner.prompt_logits("verify-against", ids, list(range(cfg.cache.num_pages)), slot)
    return acts


def _stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    a, b = a.double(), b.double()
    na, nb = a.norm().item(), b.norm().item()
    rel = (b - a).norm().item() / max(na, 1e-30)
    cos = (a * b).sum().item() / max(na * nb, 1e-30) if na and nb else (1.0 if na == nb else 0.0)
    return (b - a).abs().max().item(), rel, cos


def _block(name: str, a: torch.Tensor, b: torch.Tensor, tol: float) -> BlockDiff:
    return BlockDiff(name, *_stats(a, b), tol)


def _layer(i: int, a: torch.Tensor, b: torch.Tensor) -> LayerDiff:
    return LayerDiff(i, *_stats(a, b))


def _check_compatible(model: Side, against: Side) -> None:
    ma, mb = against.llm.config.model, model.llm.config.model
    for name in ("num_layers", "hidden_size", "vocab_size", "num_heads", "kv_lora_rank", "mlp_layer_types"):
        va, vb = getattr(ma, name), getattr(mb, name)
        if va != vb:
            raise ValueError(f"{model.path} and {against.path} are not copies of one model: {name} {vb} vs {va}")
    ka, kb = against.llm.config.attention.index_topk, model.llm.config.attention.index_topk
    if ka != kb:  # a config difference the layer table would misattribute to the attention weights
        raise ValueError(f"{model.path} and {against.path} differ in index_topk: {kb} vs {ka}")


def _topk_overlaps(ref: Activations, forced: Activations, num_layers: int) -> dict[int, float]:
    """Per DSA layer with a selection: the fraction of MODEL's own top-k rows that OTHER also kept
    (informational: MODEL's attention ran over OTHER's rows; see observability/capture.py)."""
    out = {}
    for i in range(num_layers):
        key = f"layer.{i}.topk.0"
        own = forced.selections.get(f"layer.{i}.topk_own.0")
        if own is None or key not in ref.selections:
            continue
        theirs = ref.selections[key]
        length = int(max(own.index.max(), theirs.index.max())) + 1
        mine, other = own.as_mask(length), theirs.as_mask(length)
        out[i] = float((mine & other).sum() / mine.sum().clamp_min(1))
    return out


def encode_prompt(model: Side, against: Side, text: str) -> tuple[list[int], list[str]]:
    """The prompt's ids, from MODEL's tokenizer (else OTHER's); a note when the two tokenizers disagree."""
    toks = [(s.path, s.llm.tokenizer) for s in (model, against) if s.llm.tokenizer is not None]
    if not toks:
        raise ValueError(f"neither {model.path} nor {against.path} has a tokenizer: nothing to encode the prompt")
    ids = toks[0][1].encode(text)
    notes = []
    if len(toks) == 2 and toks[1][1].encode(text) != ids:
        notes.append(f"the two tokenizers encode the prompt differently; both models get {toks[0][0]}'s ids")
    return ids, notes


def verify_against(model_path: str, against_path: str, text: str, **options) -> AgainstReport:
    model, against = open_side(model_path, **options), open_side(against_path, **options)
    ids, notes = encode_prompt(model, against, text)
    if options.get("dtype") not in (None, "auto", "float32"):
        notes.append(f"dtype {options['dtype']} ignored: both copies run in float32 (the files are compared)")
    report = compare(model, against, ids)
    report.notes = notes + report.notes
    return report

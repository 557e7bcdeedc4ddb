"""Which modules of a model keep a GGUF file's block-quantized weights as stored, decided from the
file's tensor types before loading (engine option gguf_weights="quantized").

A module keeps its blocks when its stored type is a block format gguf/quants.py dequantizes
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, MXFP4, IQ*, TQ*) and the engine only multiplies by it (or looks rows up):
  linear layers       -> GGUFLinear      (lm_head too: the biggest single matrix)
  token embeddings    -> GGUFEmbedding   (and lm_head shares it when the config ties them)
  routed experts      -> GGUFExperts     (gate and up of a layer of one type; down may differ)
Stays dense (dequantized at load, as today), with the reason recorded:
  kv_b_proj           rebuilt from attn_k_b + attn_v_b (the decompressed path and the reference backend
                      read it dense); with the native kernels the absorbed path's W_UK / W_UV products
                      read attn_k_b / attn_v_b in their blocks too (GGUFHeads, `heads` below), and then,
                      unless the attention backend is the reference, kv_b_proj is not held at all
                      (transient_kv_b: decoded per prefill step, quant/transient_kv_b.py)
  weights_proj        the DSA indexer's head weights stay a float projection
  mlp.gate            the router reads its weight as a dense fp32 matrix
  experts             of a layer whose gate/up types differ, or whose projections are not all blocks
Under tensor parallelism the source is a rank's ShardedSource: the same plan over the rank's slices (its
heads' attn_k_b / attn_v_b too); an o_proj whose head columns fall inside blocks is the one tensor read
dequantized there, with the reason naming it.
Steps: plan_gguf (names + types -> GGUFPlan), swap_in_gguf (before the strict fill), BlockSource
(the file's bytes for the planned tensors, so the loader copies bytes and never converts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from mlaserve.config.model import ModelConfig
from mlaserve.config.provenance import Setting
from mlaserve.gguf.quants import DEQUANTIZABLE, GGML_TYPES
from mlaserve.loading.safetensors_source import WeightError
from mlaserve.models.moe import Experts
from mlaserve.models.mtp import mtp_param_name
from mlaserve.quant.ggml_heads import GGUFHeads
from mlaserve.quant.ggml_linear import GGUFEmbedding, GGUFExperts, GGUFLinear
from mlaserve.quant.plan import DENSE_AT_LOAD, _group
from mlaserve.quant.transient_kv_b import drop_dense

BLOCK_TYPES = frozenset(DEQUANTIZABLE - {0, 1, 30})  # not F32 / F16 / BF16: those load as floats
_EXPERT = re.compile(r"^((?:model\.layers|mtp)\.\d+\.mlp\.experts)\.\d+\.(gate_proj|up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_PROJS = ("gate_proj", "up_proj", "down_proj")
REBUILT = "dequantized at load: rebuilt from attn_k_b + attn_v_b, read as per-head views W_UK/W_UV"
REBUILT_KEPT = (
    "dequantized at load for the decompressed path (rebuilt from attn_k_b + attn_v_b); the absorbed path "
    "multiplies attn_k_b / attn_v_b in their blocks"
)
REBUILT_TRANSIENT = (
    "not held: decoded per prefill step from attn_k_b / attn_v_b for the decompressed path and dropped after "
    "the layer (quant/transient_kv_b.py); the absorbed path multiplies attn_k_b / attn_v_b in their blocks"
)
ROUTER = "dequantized at load: the router reads its weight as a dense fp32 matrix"
FLOATS = "not a block format: loaded as a float matrix"
SPAN = (
    "loader: the rank's split falls inside the down projection's stored blocks; it holds their whole blocks, "
    "gate / up rows zero outside its own units (they add exactly 0), not a dequantized slice"
)


@dataclass(frozen=True)
class GGUFPlan:
    linears: tuple[tuple[str, int], ...]  # (module, ggml type) -> GGUFLinear
    embeddings: tuple[tuple[str, int], ...]  # (module, ggml type) -> GGUFEmbedding
    experts: tuple[tuple[str, int, int], ...]  # (module, gate/up type, down type) -> GGUFExperts
    dense: tuple[tuple[str, str, str], ...]  # (module, stored type name(s), why) block-quantized, kept dense
    floats: tuple[tuple[str, str, str], ...]  # (module, F32/F16/BF16, why) linear / embedding stored as floats
    tied_head: bool  # lm_head is a GGUFLinear over the kept embedding (tie_word_embeddings)
    blocks: frozenset[str]  # checkpoint tensor names read as stored bytes
    heads: tuple[tuple[int, int, int], ...] = ()  # (layer, attn_k_b type, attn_v_b type) -> GGUFHeads
    # tensor parallel: (dim, held units, why) for each intermediate dim this rank holds as a wider span
    spans: tuple[tuple[str, str, str], ...] = ()
    # the heads' layers hold no dense kv_b_proj (TransientKvB): decided at plan time from the attention backend
    transient_kv_b: bool = False

    def settings(self) -> tuple[Setting, ...]:
        """One row per module kind and type: kept in ggml blocks, or dense and why."""
        rows: list[Setting] = []
        by: dict[tuple[str, str], list[str]] = {}
        for m, t in self.linears:
            by.setdefault((GGML_TYPES[t].name, "kept in its blocks, multiplied per call (kernels.ggml)"), []).append(m)
        for m, t in self.embeddings:
            by.setdefault((GGML_TYPES[t].name, "kept in its blocks, rows dequantized on lookup"), []).append(m)
        if self.tied_head:
            by.setdefault(
                (GGML_TYPES[dict(self.embeddings)["model.embed_tokens"]].name, "tied: shares embed_tokens' blocks"), []
            ).append("lm_head")
        for m, tgu, td in self.experts:
            name = GGML_TYPES[tgu].name + ("" if td == tgu else f", down_proj {GGML_TYPES[td].name}")
            by.setdefault((name, "kept in its blocks: only the experts a step routes to are multiplied"), []).append(m)
        for layer, tk, tv in self.heads:
            name = GGML_TYPES[tk].name + ("" if tv == tk else f", attn_v_b {GGML_TYPES[tv].name}")
            why = "attn_k_b / attn_v_b kept in their blocks: W_UK / W_UV of the absorbed path"
            by.setdefault((name, why), []).append(f"model.layers.{layer}.self_attn.kv_b_proj")
        for (tname, why), mods in by.items():
            for kind, layers in _group(tuple(mods)):
                rows.append(Setting(f"gguf {tname} {kind}", layers, f"stored {tname}; {why}"))
        dense: dict[tuple[str, str], list[str]] = {}
        for m, tname, why in self.dense + self.floats:
            dense.setdefault((tname, why), []).append(m)
        for (tname, why), mods in dense.items():
            for kind, layers in _group(tuple(mods)):
                rows.append(Setting(f"gguf dense {kind}", layers, f"stored {tname}; {why}"))
        rows.extend(Setting(f"tensor parallel {dim}", held, why) for dim, held, why in self.spans)
        return tuple(rows)

    def skipped(self) -> frozenset[str]:
        """Checkpoint tensors the model holds no weight for: the transient kv_b_proj of the heads' layers."""
        if not self.transient_kv_b:
            return frozenset()
        return frozenset(f"model.layers.{layer}.self_attn.kv_b_proj.weight" for layer, _, _ in self.heads)

    def summary(self) -> str:
        return (
            f"gguf: {len(self.linears) + int(self.tied_head)} linear(s), {len(self.embeddings)} embedding(s) and "
            f"{len(self.experts)} expert stack(s) kept in their ggml blocks; {len(self.dense) - len(self.skipped())} block-quantized "
            "module(s) dequantized at load"
            + (f"; W_UK/W_UV of {len(self.heads)} layer(s) also kept as attn_k_b/attn_v_b blocks" if self.heads else "")
            + (
                "; their kv_b_proj not held dense (decoded per prefill step)"
                if self.heads and self.transient_kv_b
                else ""
            )
        )


def plan_gguf(
    source, cfg: ModelConfig, model: nn.Module, kept_heads: bool = False, transient_kv_b: bool = False
) -> GGUFPlan:
    """source: GGUFTensors (HF names, ggml_type / rebuilt); model: the built model (its module kinds).
    MTP layers (model.layers.N >= num_hidden_layers) are planned under the model's mtp.{j} names when
    the model has them (speculative="mtp"), else skipped like the loader skips them.
    kept_heads: also keep the trunk's attn_k_b / attn_v_b blocks for the absorbed path (the engine does
    with the native kernels; with the torch ones the dense views are the faster product).
    transient_kv_b: those layers then hold no dense kv_b_proj (the engine: unless the attention backend is the
    reference, whose absorbed path reads the dense views at every step)."""
    modules = dict(model.named_modules())
    with_mtp = hasattr(model, "mtp")
    linears, embeddings, dense, floats, blocks, heads = [], [], [], [], set(), []
    experts: dict[str, dict[str, list[tuple[str, int]]]] = {}
    for name in source.names():
        if not name.endswith(".weight"):
            continue
        layer = _LAYER.match(name)
        target = name
        if layer and int(layer.group(1)) >= cfg.num_layers:
            if not with_mtp:
                continue
            target = mtp_param_name(name, cfg)
        module, t = target[: -len(".weight")], source.ggml_type(name)
        m = _EXPERT.match(module)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(m.group(2), []).append((name, t))
            continue
        kind, mod, tname = module.rsplit(".", 1)[-1], modules.get(module), GGML_TYPES[t].name
        if t not in BLOCK_TYPES:
            if type(mod) in (nn.Linear, nn.Embedding):
                floats.append((module, tname, FLOATS))
            continue
        if source.rebuilt(name):
            blocks_of = getattr(source, "mla_split_blocks", None) if kept_heads and target == name else None
            split = blocks_of(int(layer.group(1))) if blocks_of is not None else None
            if split is not None and {split[0][1], split[1][1]} <= BLOCK_TYPES:
                heads.append((int(layer.group(1)), split[0][1], split[1][1]))
                dense.append((module, tname, REBUILT_TRANSIENT if transient_kv_b else REBUILT_KEPT))
            else:
                dense.append((module, tname, REBUILT))
        elif kind in DENSE_AT_LOAD:
            dense.append((module, tname, DENSE_AT_LOAD[kind]))
        elif type(mod) is nn.Embedding:
            embeddings.append((module, t))
            blocks.add(name)
        elif type(mod) is nn.Linear and _split_problem(source, name) is not None:
            dense.append((module, tname, f"dequantized at load: {_split_problem(source, name)}"))
        elif type(mod) is nn.Linear:
            linears.append((module, t))
            blocks.add(name)
        elif mod is not None:
            dense.append((module, tname, ROUTER if kind == "gate" else "dequantized at load: read as a dense matrix"))
        # no such module: the strict loader names the unexpected tensor
    kept_experts = _plan_experts(experts, modules, dense, floats, blocks)
    tied = cfg.tie_word_embeddings and any(m == "model.embed_tokens" for m, _ in embeddings)
    spans = tuple(
        (dim, f"units [{s.first}, {s.first + s.width}) for its own [{s.start}, {s.stop})", SPAN)
        for dim, s in getattr(source, "spans", {}).items()
        if s.widened
    )
    return GGUFPlan(
        tuple(linears),
        tuple(embeddings),
        tuple(kept_experts),
        tuple(dense),
        tuple(floats),
        tied,
        frozenset(blocks),
        tuple(heads),
        spans,
        transient_kv_b and bool(heads),
    )


def _plan_experts(
    experts: dict[str, dict[str, list[tuple[str, int]]]], modules: dict, dense: list, floats: list, blocks: set
) -> list[tuple[str, int, int]]:
    """Each routed-experts module's stacks ({module: {proj: [(name, type)]}}): kept in blocks where gate and up share
    a block type and down is one too -> [(module, gate_up type, down type)], their tensor names added to blocks;
    otherwise a line in dense (some block type) or floats (none). A missing or mixed-up expert tensor is left to the
    strict loader, which names it."""
    kept = []
    for module, projs in experts.items():
        types = {p: {t for _, t in projs.get(p, [])} for p in _PROJS}
        if not isinstance(modules.get(module), Experts) or any(len(s) != 1 for s in types.values()):
            continue
        tg, tu, td = (next(iter(types[p])) for p in _PROJS)
        if tg != tu:
            why = "dequantized at load: gate_proj and up_proj differ in type (the kernels read both with one type)"
        elif not {tg, td} <= BLOCK_TYPES:
            why = "dequantized at load: not every projection is stored in a block format"
        else:
            kept.append((module, tg, td))
            blocks.update(n for p in _PROJS for n, _ in projs[p])
            continue
        names = "/".join(GGML_TYPES[t].name for t in (tg, tu, td))
        if {tg, tu, td} & BLOCK_TYPES:
            dense.append((module, names, why))
        else:
            floats.append((module, names, FLOATS))
    return kept


def _split_problem(source, name: str) -> str | None:
    """A tensor-parallel rank's slice that is not whole blocks (distributed.sharding.ShardedSource), or None."""
    problem = getattr(source, "block_split_problem", None)
    return problem(name) if problem is not None else None


def attach_heads(model: nn.Module, source, plan: GGUFPlan, cfg: ModelConfig, mapped: bool = False) -> None:
    """After the fill: each planned layer's attention gets its attn_k_b / attn_v_b bytes as GGUFHeads, beside
    the dense kv_b_proj rebuilt from the same tensors: views of the read-only mapped file (mapped, on the CPU,
    where the rank's heads are whole rows of it), else copied out of the file."""
    for layer, type_k, type_v in plan.heads:
        (k_b, _), (v_b, _) = source.mla_split_blocks(layer, mapped)
        attn = model.model.layers[layer].self_attn
        device = attn.kv_a_layernorm.weight.device  # (kv_b_proj may hold no weight: TransientKvB)
        keep = mapped and device.type == "cpu" and k_b.is_contiguous() and v_b.is_contiguous()
        k_b, v_b = (w if keep else w.to(device, copy=True) for w in (k_b, v_b))
        latent = getattr(attn.kv_a_proj_with_mqa, "ggml_type", None)  # a GGUFLinear's; None: a float weight
        attn.kept_heads = GGUFHeads(k_b, type_k, v_b, type_v, cfg.qk_nope_head_dim, cfg.kv_lora_rank, latent)


def swap_in_gguf(model: nn.Module, plan: GGUFPlan, dtype: torch.dtype) -> None:
    """Replace the planned modules in place with holders of the right byte shapes (on the model's
    device: the meta device when build_model calls it, so no float weight is allocated for them)."""
    for name, t in plan.linears:
        old = model.get_submodule(name)
        new = GGUFLinear(old.in_features, old.out_features, t, old.bias is not None, dtype, old.weight.device)
        model.set_submodule(name, new)
    if plan.transient_kv_b:  # never allocated: the fill skips these layers' kv_b_proj (BlockSource.names)
        drop_dense(model, tuple(layer for layer, _, _ in plan.heads), dtype)
    for name, t in plan.embeddings:
        old = model.get_submodule(name)
        model.set_submodule(name, GGUFEmbedding(old.num_embeddings, old.embedding_dim, t, dtype, old.weight.device))
    if plan.tied_head:  # the loader then points lm_head.weight at embed_tokens.weight (same bytes)
        old, t = model.lm_head, dict(plan.embeddings)["model.embed_tokens"]
        model.lm_head = GGUFLinear(old.in_features, old.out_features, t, False, dtype, old.weight.device)
    for name, tgu, td in plan.experts:
        old = model.get_submodule(name)
        e, two_i, d = old.gate_up_proj.shape
        new = GGUFExperts(d, e, two_i // 2, tgu, td, old.gate_up_proj.device)
        new.impl = old.impl
        model.set_submodule(name, new)


class BlockSource:
    """A GGUF tensor source whose planned tensors come back as their stored bytes (uint8 [rows, R]);
    the others dequantized as before. mapped (engine option gguf_mmap): the bytes are views of the file's
    read-only shared map and the loader keeps them in place (`in_place`, `stacked_blocks`) instead of
    copying them; else views of the private map, copied, then released."""

    def __init__(
        self, source, blocks: frozenset[str], mapped: bool = False, skipped: frozenset[str] = frozenset()
    ) -> None:
        self.source, self.blocks, self.mapped, self.skipped = source, blocks, mapped, skipped

    def in_place(self, name: str) -> bool:
        """The loader may keep `get(name)` as the parameter itself (a view of the mapped file)."""
        return self.mapped and name in self.blocks

    def stacked_blocks(self, names: list[str]) -> torch.Tensor | None:
        """A routed-expert stack [E, rows, R] kept in place, when the file stores it as one tensor (else None)."""
        stacked = getattr(self.source, "stacked_blocks", None)
        if not self.mapped or stacked is None or not all(n in self.blocks for n in names):
            return None
        return stacked(names, mapped=True)

    def names(self) -> list[str]:
        """The file's tensors less `skipped` (a transient kv_b_proj: the model holds no weight for it)."""
        return [n for n in self.source.names() if n not in self.skipped]

    def where(self, name: str) -> str:
        return self.source.where(name)

    def checkpoint_name(self, name: str) -> str:
        return getattr(self.source, "checkpoint_name", lambda n: n)(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)

    def release(self, name: str) -> None:
        """The loader copied this tensor (it never releases one it keeps): drop its pages."""
        self.source.release(name)

    def get(self, name: str) -> torch.Tensor:
        if name in self.blocks:
            try:
                return self.source.get_blocks(name, mapped=self.mapped)
            except (ValueError, RuntimeError) as e:  # a view the file's bytes cannot give: name the tensor
                raise WeightError(f"{self.source.where(name)}: tensor {name!r}: {e}") from e
        return self.source.get(name)

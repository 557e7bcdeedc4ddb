"""Hugging Face MLA checkpoint folder -> GGUF file in llama.cpp's layout, as its own
``convert_hf_to_gguf.py`` writes it (so llama.cpp loads it, and so does `load_gguf`).  For the
shared fixtures the files are byte-identical to llama.cpp's (same keys in the same order, same
tensors, types, order and bytes).

Notation (per layer): H heads, L = kv_lora_rank, n = qk_nope_head_dim, r = qk_rope_head_dim,
v = v_head_dim, E routed experts, I = moe_intermediate_size, D = hidden_size.  Shapes are torch
order (outermost first; GGUF's ne is the reverse).

Architecture: deepseek_v2 / deepseek_v3 / kimi_k2 / glm4_moe_lite -> ``deepseek2`` (llama.cpp maps
Glm4MoeLiteForCausalLM there too), deepseek_v32 -> ``deepseek32``, glm_moe_dsa -> ``glm-dsa``.
A DeepSeek-V4 folder (not MLA) goes to deepseek_v4.py's converter -> ``deepseek4``.

Tensors (HF name under model.layers.N. -> blk.N.):
    kv_b_proj [H*(n+v), L]  -> attn_k_b [H, L, n] (each head's k rows, transposed) + attn_v_b [H, v, L]
    mlp.experts.e.{gate,up,down}_proj -> ffn_{gate,up,down}_exps [E, I, D] / [E, D, I] (stacked)
    mlp.gate.weight -> ffn_gate_inp, mlp.gate.e_score_correction_bias -> exp_probs_b.bias, and
    the 1:1 renames in _LAYER.  MTP/nextn layers (N >= num_hidden_layers) are written for
    deepseek32 / glm-dsa (and glm4_moe_lite with nextn layers) and dropped for deepseek2, as
    llama.cpp does; block_count counts them.

Tensor types (llama.cpp's converter, ModelBase.prepare_tensors):
    F32 always: 1-D tensors, ``*_norm.weight``, names not ending in ``.weight``
        (exp_probs_b.bias, indexer.k_norm.bias), the router ffn_gate_inp, indexer.proj
    otherwise the outtype, except that Q8_0 falls back to F16 for rows that are not whole
        32-blocks (e.g. attn_q_b with q_lora_rank 48).
Values: every source tensor is read as float32 first (bf16/f16 exactly; FP8 with
``weight_scale_inv`` block scales is dequantized), then rounded once to the target type.

Deliberate differences from llama.cpp's converter (none shows for the fixtures; each makes
llama.cpp, and our loader, compute what transformers computes for that config):
  * expert_gating_func is written for sigmoid-gated families even when config.json has no
    ``scoring_func`` (llama.cpp's converter then writes nothing and llama.cpp assumes softmax);
  * expert_weights_norm is not written for deepseek_v2 (transformers' V2 router ignores
    norm_topk_prob);
  * a deepseek_v3 / glm4_moe_lite config with ``rope_interleave: false`` gets its rope rows
    (q_b_proj/q_proj per head, kv_a_proj_with_mqa) permuted to the interleaved order llama.cpp's
    deepseek2 graph uses (q.k is unchanged by a common permutation).
Where we decide differently (same result for the fixtures):
  * the BPE pre-tokenizer: llama.cpp's hash table (its MLA-family entries) *and* a structural
    rule (a plain GPT-2 ByteLevel pre-tokenizer -> ``gpt-2``; llama.cpp's converter needed an
    outside hash mapping for the fixtures), or the caller's name;
  * add_bos_token follows what tokenizer.json's post-processor does (a leading special token
    means True, and is the BOS when tokenizer_config.json names none) before
    tokenizer_config.json's flag -- this is what llama.cpp's files for the DeepSeek and GLM
    fixtures hold (GLM: bos = [gMASK], add_bos_token = true);
  * added tokens are not re-normalized through the tokenizer (llama.cpp encodes/decodes
    non-normalized added tokens; the same for byte-level BPE specials);
  * descriptive ``general.*`` keys: general.name (llama.cpp's title-casing of the folder name)
    and general.size_label only; llama.cpp may add more from a model card (license, basename, ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from mlaserve.config.deepseek_v4 import is_v4
from mlaserve.gguf.convert.deepseek_v4 import convert_v4
from mlaserve.gguf.convert.metadata import OUTTYPES, _metadata, _Model, _open_model, size_label
from mlaserve.gguf.convert.plan import ConvertReport, Plan, rows
from mlaserve.gguf.convert.tokenizer import ConvertError, _read_json
from mlaserve.gguf.convert.writer import F16, F32, GGUFWriter, can_quantize
from mlaserve.gguf.quants import GGML_TYPES
from mlaserve.loading.safetensors_source import SafetensorsSource

__all__ = ["ConvertError", "ConvertReport", "OUTTYPES", "convert_hf_to_gguf", "size_label", "tensor_type"]

# =============================================================================================
# tensors

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {  # HF suffix under model.layers.N. -> GGUF suffix under blk.N.
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "indexer.proj.weight",
    # MTP / nextn block extras
    "eh_proj.weight": "nextn.eh_proj.weight",
    "embed_tokens.weight": "nextn.embed_tokens.weight",
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "shared_head.head.weight": "nextn.shared_head_head.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_ALWAYS_F32 = ("ffn_gate_inp.weight", "indexer.proj.weight")  # router / indexer weights: precision matters


def tensor_type(gguf_name: str, shape: tuple[int, ...], outtype: str) -> int:
    """The ggml type llama.cpp's converter gives this tensor under ``--outtype outtype``."""
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return F32
    if gguf_name.endswith(_ALWAYS_F32):
        return F32
    t = OUTTYPES[outtype]
    return t if can_quantize(t, shape[-1]) else F16  # llama.cpp: QuantError -> "falling back to F16"


class _Source:
    """Tensors of the folder by HF name.  FP8 weights with ``<name>_scale_inv`` block scales
    (DeepSeek's released checkpoints) are dequantized as llama.cpp's converter does: float32
    weight times its block's scale (blocks of quantization_config.weight_block_size)."""

    def __init__(self, folder: Path, raw: dict):
        self.st = SafetensorsSource(folder)
        self.names = [n for n in self.st.names() if not n.endswith("_scale_inv")]
        self.scales = {n[: -len("_scale_inv")] for n in self.st.names() if n.endswith("_scale_inv")}
        qc = raw.get("quantization_config") or {}
        self.block = tuple(qc.get("weight_block_size") or (128, 128))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.st.shape(name))

    def get(self, name: str) -> torch.Tensor:
        """The tensor in its stored dtype (float8 ones dequantized to float32)."""
        t = self.st.get(name)
        if name not in self.scales:
            if t.dtype.is_floating_point and t.element_size() == 1:
                raise ConvertError(f"{self.st.where(name)}: {name} is {t.dtype} without a '{name}_scale_inv'")
            return t
        scale = self.st.get(name + "_scale_inv").to(torch.float32)
        for dim, size in enumerate(self.block):
            scale = scale.repeat_interleave(size, dim)
        return t.to(torch.float32) * scale[: t.shape[0], : t.shape[1]]


def _interleave_rope(w: torch.Tensor, head_dim: int, r: int) -> torch.Tensor:
    """Rows of each head [.. | rope(r)] from half-split order (i, i + r/2 pairs) to interleaved
    (2i, 2i+1): llama.cpp's deepseek2 graph only has interleaved RoPE; q.k is unchanged."""
    h = w.reshape(-1, head_dim, w.shape[-1]).clone()
    rope = h[:, head_dim - r :]
    h[:, head_dim - r :] = rope.reshape(-1, 2, r // 2, w.shape[-1]).transpose(1, 2).reshape(-1, r, w.shape[-1])
    return h.reshape(w.shape)


class Planner:
    """HF tensor names -> the GGUF tensors to write, each with a lazy producer of its data."""

    def __init__(self, m: _Model, src: _Source):
        self.m, self.src, self.c = m, src, m.cfg
        self.plans: list[Plan] = []
        self.skipped: list[str] = []

    def run(self) -> list[Plan]:
        """Plans in the checkpoint's tensor order, as llama.cpp writes them (so for the fixtures
        the whole file comes out byte-identical to llama.cpp's)."""
        layers: dict[int, list[str]] = {}
        for name in self.src.names:
            mt = _LAYER_NAME.match(name)
            if mt:
                layers.setdefault(int(mt[1]), []).append(name)
        done: set[int] = set()
        for name in self.src.names:
            mt = _LAYER_NAME.match(name)
            if mt and int(mt[1]) >= self.m.n_blocks:
                self.skipped.append(name)  # MTP layers llama.cpp's deepseek2 conversion drops
            elif mt and int(mt[1]) not in done:
                done.add(int(mt[1]))
                self._layer(int(mt[1]), layers[int(mt[1])])
            elif mt:
                continue
            elif name == "lm_head.weight" and self.c.tie_word_embeddings:
                self.skipped.append(name)  # tied: llama.cpp reuses token_embd
            elif name in _GLOBAL:
                self._plain(_GLOBAL[name], name)
            elif not name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
                raise ConvertError(
                    f"{self.src.st.where(name)}: unknown tensor {name!r} (not part of an MLA checkpoint)"
                )
        return self.plans

    def _plain(self, gguf_name: str, hf: str, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        def chunks() -> Iterator[torch.Tensor]:
            t = self.src.get(hf)
            yield from rows(transform(t) if transform else t)

        self.plans.append(Plan(gguf_name, self.src.shape(hf), chunks))

    def _layer(self, layer: int, names: list[str]) -> None:
        pre, blk = f"model.layers.{layer}.", f"blk.{layer}."
        experts: dict[str, dict[int, str]] = {}
        for name in names:
            me = _EXPERT.match(name[len(pre) :])
            if me:
                experts.setdefault(me[2], {})[int(me[1])] = name
        if experts and len(experts) != 3:
            raise ConvertError(f"layer {layer}: routed experts have only {sorted(experts)} projections")
        for name in names:
            suffix = name[len(pre) :]
            if _EXPERT.match(suffix):
                if experts:  # the three stacks go where the experts are, in llama.cpp's order
                    self.plans += [self._experts(blk, p, experts[p]) for p in ("down", "gate", "up")]
                    experts = {}
            elif suffix == "self_attn.kv_b_proj.weight":
                self._kv_b(blk, name)
            elif suffix in _LAYER:
                self._plain(blk + _LAYER[suffix], name, self._rope_fix(suffix))
            else:
                raise ConvertError(f"{self.src.st.where(name)}: unknown tensor {name!r} (no GGUF name for it)")

    def _rope_fix(self, suffix: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        c = self.c
        if c.rope.interleaved or suffix not in (
            "self_attn.q_b_proj.weight",
            "self_attn.q_proj.weight",
            "self_attn.kv_a_proj_with_mqa.weight",
        ):
            return None
        r = c.qk_rope_head_dim
        head = c.kv_lora_rank + r if "kv_a" in suffix else c.qk_nope_head_dim + r
        return lambda w: _interleave_rope(w, head, r)

    def _experts(self, blk: str, proj: str, by_index: dict[int, str]) -> Plan:
        n_exp = self.c.moe.n_routed_experts
        if sorted(by_index) != list(range(n_exp)):
            missing = sorted(set(range(n_exp)) - set(by_index))
            raise ConvertError(
                f"{blk}ffn_{proj}_exps: experts {missing or sorted(by_index)} missing or extra "
                f"(n_routed_experts={n_exp})"
            )
        names = tuple(by_index[e] for e in range(n_exp))
        shapes = {self.src.shape(n) for n in names}
        if len(shapes) != 1:
            raise ConvertError(f"{blk}ffn_{proj}_exps: experts have different shapes {sorted(shapes)}")

        def chunks() -> Iterator[torch.Tensor]:
            for n in names:  # one expert at a time: the stack is never built in memory
                yield from rows(self.src.get(n))

        return Plan(f"{blk}ffn_{proj}_exps.weight", (n_exp, *shapes.pop()), chunks)

    def _kv_b(self, blk: str, name: str) -> None:
        c = self.c
        H, L, n, v = c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim
        if self.src.shape(name) != (H * (n + v), L):
            raise ConvertError(
                f"{self.src.st.where(name)}: {name} has shape {list(self.src.shape(name))}, "
                f"expected [{H}*({n}+{v}), {L}] from the config"
            )

        def per_head(k_part: bool) -> Iterator[torch.Tensor]:
            kv = self.src.get(name).reshape(H, n + v, L)
            for h in range(H):
                yield (kv[h, :n].T if k_part else kv[h, n:]).to(torch.float32)

        self.plans.append(Plan(f"{blk}attn_k_b.weight", (H, L, n), lambda: per_head(True)))
        self.plans.append(Plan(f"{blk}attn_v_b.weight", (H, v, L), lambda: per_head(False)))


# =============================================================================================
# entry point


def convert_hf_to_gguf(
    hf_dir: str | Path,
    out_path: str | Path,
    outtype: str = "f16",
    *,
    name: str | None = None,
    pre_tokenizer: str | None = None,
) -> ConvertReport:
    """Write ``out_path`` (GGUF v3, llama.cpp's MLA layout) from the Hugging Face folder ``hf_dir``.

    outtype: f32 | f16 | bf16 | q8_0 (see the module doc for which tensors stay F32).
    name: general.name (default: the folder name, title-cased as llama.cpp does).
    pre_tokenizer: tokenizer.ggml.pre, for tokenizers whose pre-tokenizer is not recognized.
    Tensors are read, converted and written one at a time (experts and attention heads one
    slice at a time), so memory holds one tensor, not the model.
    """
    folder = Path(hf_dir)
    if not folder.is_dir():
        raise ConvertError(f"{folder}: not a Hugging Face model folder")
    if not Path(out_path).resolve().parent.is_dir():  # before minutes of work, not after
        raise ConvertError(f"{out_path}: the output folder does not exist")
    raw = _read_json(folder / "config.json")
    if is_v4(raw):  # not MLA: llama.cpp's deepseek4 layout, its own converter
        return convert_v4(folder, raw, out_path, outtype, name, pre_tokenizer)
    m = _open_model(folder)
    planner = Planner(m, _Source(folder, m.raw))
    plans = {p.name: p for p in planner.run()}
    meta = _metadata(m, outtype, name, pre_tokenizer, {p.name: p.shape for p in plans.values()})
    writer = GGUFWriter(out_path)
    for key, value in meta:
        writer.add(key, value)
    for p in plans.values():
        writer.add_tensor(p.name, p.shape, tensor_type(p.name, p.shape, outtype))
    writer.write(lambda spec: plans[spec.name].chunks())
    report = ConvertReport(Path(out_path), m.arch, outtype, skipped=planner.skipped)
    report.tensors = {t.name: GGML_TYPES[t.ggml_type].name for t in writer.tensors}
    if planner.skipped:
        report.notes.append(
            f"skipped {len(planner.skipped)} tensor(s) llama.cpp's {m.arch} conversion drops "
            "(MTP layers / tied lm_head)"
        )
    return report

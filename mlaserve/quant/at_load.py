"""Quantize-at-load (engine option quantization="int8" | "int4"): a float checkpoint's weights put
into llama.cpp's block formats once loaded, so a safetensors user gets the GGUF path's memory and
kernels (kernels/) without converting a file.

  int8  Q8_0: blocks of 32 values along a row, one fp16 scale each, d = max|w| / 127, q = round(w / d)
  int4  Q4_0: blocks of 32, one fp16 scale, d = w_peak / -8, q = trunc(w / d + 8.5) in 0..15
        (the embedding and lm_head stay int8 (Q8_0): the two matrices most sensitive to 4 bits;
        llama.cpp's Q4_0 files keep the output matrix at 6 bits for the same reason)
The quantizers are gguf-py's, bit for bit (gguf/convert/writer.py), so the result equals quantizing
the checkpoint to a GGUF file of that type and loading it.
Quantized: every linear layer whose rows are whole blocks (K % 32 == 0), the routed experts, the
token embedding and lm_head. Kept dense, with the reason: kv_b_proj (absorbed attention takes
per-head views of it), the DSA indexer's weights_proj, the router, norms, and any weight whose rows
are not whole blocks. The model is filled in its float dtype first, then quantized module by
module: peak memory is the float model's, resident memory after loading the quantized one's.
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.config.provenance import Setting
from mlaserve.gguf.convert.writer import GGUFWriteError, quantize_q4_0, quantize_q8_0
from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.loading.safetensors_source import WeightError
from mlaserve.models.moe import Experts
from mlaserve.quant.ggml_linear import GGUFEmbedding, GGUFExperts, GGUFLinear
from mlaserve.quant.plan import DENSE_AT_LOAD, _group

Q8_0, Q4_0 = GGML_TYPE_IDS["Q8_0"], GGML_TYPE_IDS["Q4_0"]
SCHEMES = {"int8": Q8_0, "int4": Q4_0}
BLOCK = 32
_QUANTIZE = {Q8_0: quantize_q8_0, Q4_0: quantize_q4_0}
_EIGHT_BITS = ("model.embed_tokens", "lm_head")  # int4 keeps these at Q8_0


def _blocks(w: torch.Tensor, ggml_type: int, name: str) -> torch.Tensor:
    """[..., N, K] float -> [..., N, R] uint8 ggml bytes; a NaN/Inf weight is refused, named."""
    try:
        return _QUANTIZE[ggml_type](w.detach().float().contiguous()).view(*w.shape[:-1], -1)
    except GGUFWriteError as e:
        raise WeightError(f"quantization at load: module {name!r}: {e}") from e


def quantize_model(model: nn.Module, scheme: str, dtype: torch.dtype) -> tuple[Setting, ...]:
    """Replace the eligible modules of a filled model in place; -> provenance rows (what became
    which type, what stayed dense and why)."""
    main = SCHEMES[scheme]
    done: dict[tuple[str, str], list[str]] = {}
    dense: dict[str, list[str]] = {}
    tied = isinstance(getattr(model, "lm_head", None), nn.Linear) and model.lm_head.weight is getattr(
        getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None
    )
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            kind = name.rsplit(".", 1)[-1]
            t = Q8_0 if name in _EIGHT_BITS or name.endswith(".embed_tokens") else main
            if type(module) is nn.Linear:
                if kind in DENSE_AT_LOAD:  # same reasons as a quantized checkpoint's, said for a float one
                    dense.setdefault(DENSE_AT_LOAD[kind].replace("dequantized at load", "kept float"), []).append(name)
                elif module.in_features % BLOCK:
                    dense.setdefault(
                        f"kept dense: rows of {module.in_features} are not whole {BLOCK}-blocks", []
                    ).append(name)
                elif not (tied and name == "lm_head"):
                    new = GGUFLinear(
                        module.in_features, module.out_features, t, module.bias is not None, dtype, module.weight.device
                    )
                    new.weight.copy_(_blocks(module.weight, t, name))
                    if module.bias is not None:
                        new.bias.copy_(module.bias)
                    model.set_submodule(name, new)
                    done.setdefault((_name(t), "linear"), []).append(name)
            elif type(module) is nn.Embedding and module.embedding_dim % BLOCK == 0:
                new = GGUFEmbedding(module.num_embeddings, module.embedding_dim, t, dtype, module.weight.device)
                new.weight.copy_(_blocks(module.weight, t, name))
                model.set_submodule(name, new)
                done.setdefault((_name(t), "embedding"), []).append(name)
            elif type(module) is Experts:
                e, two_i, d = module.gate_up_proj.shape
                if d % BLOCK or (two_i // 2) % BLOCK:
                    dense.setdefault(f"kept float: expert rows are not whole {BLOCK}-value blocks", []).append(name)
                    continue
                new = GGUFExperts(d, e, two_i // 2, main, main, module.gate_up_proj.device)
                new.impl = module.impl
                i = two_i // 2
                new.gate_proj.copy_(_blocks(module.gate_up_proj[:, :i], main, name))
                new.up_proj.copy_(_blocks(module.gate_up_proj[:, i:], main, name))
                new.down_proj.copy_(_blocks(module.down_proj, main, name))
                model.set_submodule(name, new)
                done.setdefault((_name(main), "experts"), []).append(name)
        if tied:  # lm_head reads the embedding's blocks (one copy, as the float model had one)
            emb = model.model.embed_tokens
            head = GGUFLinear(emb.embedding_dim, emb.num_embeddings, emb.ggml_type, False, dtype, emb.weight.device)
            head.weight = emb.weight
            model.lm_head = head
            done.setdefault((_name(emb.ggml_type), "linear"), []).append("lm_head (tied to embed_tokens)")
    rows = []
    for (tname, what), mods in done.items():
        for kind, layers in _group(tuple(mods)):
            rows.append(
                Setting(f"quantized {kind}", layers, f"quantization={scheme}: {what} -> {tname} blocks at load")
            )
    for why, mods in dense.items():
        for kind, layers in _group(tuple(mods)):
            rows.append(Setting(f"kept {kind}", layers, why))
    return tuple(rows)


def _name(ggml_type: int) -> str:
    return "Q8_0" if ggml_type == Q8_0 else "Q4_0"

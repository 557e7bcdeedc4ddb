"""The batch-1 roofline: the machine's copy bandwidth, and the weight bytes one decode step reads (attention, dense and
shared MLP, k of E routed experts, lm_head, one embedding row) from a folder or a GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from common import prod, timed


def copy_bandwidth_gbs(threads: int, mib: int = 512, reps: int = 5) -> float:
    """Memory copy bandwidth (STREAM "copy" convention: bytes read + bytes written, per second) of
    `dst.copy_(src)` on float32 buffers far larger than the caches, best of `reps`."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = min(timed(lambda: dst.copy_(src), reps, 1)["all_s"])
    torch.set_num_threads(prev)
    return 2 * src.numel() * 4 / best / 1e9


def _active_share(name: str, cfg: dict) -> float:
    """The share of a tensor a batch-1 decode step reads: routed experts k of E, the embedding one row."""
    if ".mlp.experts." in name or "_exps." in name:
        return cfg["num_experts_per_tok"] / cfg["n_routed_experts"]
    if name in ("model.embed_tokens.weight", "token_embd.weight"):
        return 1 / cfg["vocab_size"]
    return 1.0


_Q_BYTES = {"int8": 34 / 32, "int4": 18 / 32}  # Q8_0 / Q4_0: a 2-byte scale per 32 values
_KEPT_FLOAT = (".kv_b_proj.weight", ".weights_proj.weight", ".mlp.gate.weight")


def _value_bytes(name: str, shape, dtype_bytes: int, quantization: str | None) -> float:
    """Bytes per value of a folder tensor in the engine's memory; with quantization=int8|int4, what
    mlaserve's quantize-at-load makes of it (quant/at_load.py: 2-D weights whose rows are whole
    32-blocks, experts, embedding and lm_head; int4 keeps the embedding and lm_head at int8; kv_b_proj,
    the indexer's weights_proj, the router and norms stay float)."""
    if quantization is None or len(shape) < 2 or shape[-1] % 32 or name.endswith(_KEPT_FLOAT):
        return dtype_bytes
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _Q_BYTES["int8"]
    return _Q_BYTES[quantization]


def active_weight_bytes(path: Path, dtype_bytes: int | None = None, quantization: str | None = None) -> dict:
    """Weight bytes (and parameters) a batch-1 decode step reads: every tensor but the routed
    experts (k of E per layer) and the embedding (one row). A model folder: its safetensors at
    `dtype_bytes` per value (the engine's dtype), or as quantized at load; a GGUF: each tensor's
    stored bytes."""
    params = nbytes = 0.0
    if path.is_dir():
        from safetensors import safe_open

        cfg = json.loads((path / "config.json").read_text())
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            for k in f.keys():
                shape = f.get_slice(k).get_shape()
                n = prod(shape) * _active_share(k, cfg)
                params += n
                nbytes += n * _value_bytes(k, shape, dtype_bytes, quantization)
    else:
        from mlaserve.gguf.read.file import open_gguf

        gf = open_gguf(path)
        md = gf.metadata
        arch = md["general.architecture"]
        cfg = {
            "num_experts_per_tok": md[f"{arch}.expert_used_count"],
            "n_routed_experts": md[f"{arch}.expert_count"],
            "vocab_size": len(md["tokenizer.ggml.tokens"]),
        }
        for name, info in gf.tensors.items():
            share = _active_share(name, cfg)
            params += prod(info.ne) * share
            nbytes += info.nbytes * share
        gf.close()
    return {"params": int(params), "bytes": int(nbytes)}

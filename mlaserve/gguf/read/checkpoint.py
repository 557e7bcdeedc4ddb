"""Load an MLA model (DeepSeek-V2/V3/V3.2, GLM-5) from a llama.cpp GGUF file, in HF terms.

Notation (per layer): H heads, L = kv_lora_rank (latent width), n = qk_nope_head_dim,
r = qk_rope_head_dim, v = v_head_dim, E routed experts.  Torch shapes are outermost first
(= reversed ggml ne).  The HF projection ``kv_b_proj`` [H*(n+v), L] decompresses the latent
c: per head, rows [k_nope (n); v (v)].  llama.cpp splits it for the absorbed ("MQA") path into
    attn_k_b  torch [H, L, n]  (= the k rows of each head, *transposed*)
    attn_v_b  torch [H, v, L]
so that   q_lat[h] = k_b[h] @ q_nope[h]   (score = q_lat . c)   and   o[h] = v_b[h] @ (P c).

`load_gguf(path)` returns a `GGUFCheckpoint` with
  * ``hf_config``   a config.json-like dict in Hugging Face naming, ``provenance`` saying where
    each field came from (a GGUF key, a llama.cpp default for an absent optional key, or a
    derivation);
  * ``tensors``     HF Hub checkpoint names -> float32 tensors, dequantized lazily on ``get``
    (per-expert tensors are slices of the stacked ``ffn_*_exps``; kv_b_proj is rebuilt);
  * ``tokenizer``   the ``tokenizer.ggml.*`` data and ``build_tokenizer()`` (a `tokenizers`
    byte-level BPE).
The names are mapped, and every tensor's shape and the k_b/v_b orientation checked against the config, by
gguf/read/mapping.py; before returning, per layer the absorbed and decompressed MLA attention are compared
numerically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlaserve.gguf.quants import GGML_TYPES, dequantize
from mlaserve.gguf.read.config import Provenance, derive_hf_config
from mlaserve.gguf.read.file import GGUFError, GGUFFile, open_gguf
from mlaserve.gguf.read.mapping import Entry, TensorMapper
from mlaserve.gguf.read.tokenizer import GGUFTokenizer

__all__ = ["GGUFError", "GGUFCheckpoint", "GGUFTensors", "GGUFTokenizer", "load_gguf", "derive_hf_config"]

MLA_CHECK_RTOL = 1e-5


# =============================================================================================
# lazy HF-named tensor view


class GGUFTensors:
    """HF Hub-named float32 tensors of a GGUF file, dequantized on `get`.

    F32 tensors (and per-expert slices of F32 stacks) are views of the memory-mapped file;
    treat them as read-only.
    """

    def __init__(self, gf: GGUFFile, cfg: dict, entries: dict[str, Entry], mla: dict[int, dict[str, str]]):
        self._gf, self._cfg, self._entries, self._mla = gf, cfg, entries, mla

    def names(self) -> list[str]:
        return list(self._entries)

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read from the file so far (GGUFFile.raw's count)."""
        return self._gf.bytes_read

    def decode_with(self, decoder) -> None:
        """How `get` decodes block types from now on (file.Decoder; None: the reference, gguf/quants.py)."""
        self._gf.decoder = decoder

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def sources(self, name: str) -> tuple[str, ...]:
        """GGUF tensor name(s) an HF tensor is made from."""
        return self._entry(name).sources

    def where(self, name: str) -> str:
        """For error messages: the file and GGUF tensor(s) behind an HF name."""
        e = self._entry(name)
        src = " + ".join(e.sources) + (f"[{e.index}]" if e.kind == "expert" else "")
        return f"{self._gf.tensors[e.sources[0]].path} (GGUF {src})"

    def gguf_type(self, name: str) -> str:
        return self._gf.tensors[self._entry(name).sources[0]].type_name

    def ggml_type(self, name: str) -> int:
        """The stored ggml type id of an HF tensor (kv_b_proj rebuilt from k_b/v_b: attn_k_b's)."""
        return self._gf.tensors[self._entry(name).sources[0]].ggml_type

    def rebuilt(self, name: str) -> bool:
        """True for a tensor made from several GGUF tensors (kv_b_proj from attn_k_b + attn_v_b):
        it has no stored bytes of its own, only a dequantized value."""
        return self._entry(name).kind == "kv_b_split"

    def get_blocks(self, name: str, mapped: bool = False) -> torch.Tensor:
        """The stored bytes of an HF tensor as uint8 [rows, R] (R = bytes of one row of ggml blocks),
        a view of the file; a routed expert's slice of its stack. Nothing is converted. mapped: a view of
        the read-only shared map, to be kept in place (GGUFFile.view); else of the private map, to be
        copied (and its pages released)."""
        e = self._entry(name)
        if e.kind == "kv_b_split":
            raise GGUFError(f"{self.where(name)}: {name!r} is rebuilt from two tensors; it has no stored blocks")
        info = self._gf.info(e.sources[0])
        rows = math.prod(e.shape[:-1])
        per_row = info.nbytes // math.prod(info.shape[:-1])
        start = e.index * rows * per_row if e.kind == "expert" else 0
        read = self._gf.view if mapped else self._gf.raw
        return read(e.sources[0], start, rows * per_row).view(rows, per_row)

    def stacked_blocks(self, names: list[str], mapped: bool = False) -> torch.Tensor | None:
        """The stored bytes of a whole routed-expert stack [E, rows, R] when `names` are experts 0..E-1
        of one stored 3-D tensor, in order (as llama.cpp's merged ffn_*_exps are); else None."""
        entries = [self._entries.get(n) for n in names]
        if not entries or any(e is None or e.kind != "expert" for e in entries):
            return None
        src = entries[0].sources[0]
        info = self._gf.info(src)
        if any(e.sources[0] != src or e.index != i for i, e in enumerate(entries)) or len(entries) != info.shape[0]:
            return None
        rows = math.prod(entries[0].shape[:-1])
        per_row = info.nbytes // math.prod(info.shape[:-1])
        read = self._gf.view if mapped else self._gf.raw
        return read(src, 0, info.nbytes).view(len(entries), rows, per_row)

    def release(self, name: str) -> None:
        """The loader has copied this tensor: drop its file pages (a routed expert: its slice only, as
        the stack's other experts are still to be read)."""
        e = self._entry(name)
        if e.kind != "expert":
            for src in e.sources:
                self._gf.release(src)
            return
        info = self._gf.info(e.sources[0])
        per_expert = info.nbytes // info.shape[0]
        self._gf.release(e.sources[0], e.index * per_expert, per_expert)

    def get(self, name: str) -> torch.Tensor:
        e = self._entry(name)
        if e.kind == "plain":
            return self._gf.tensor(e.sources[0])
        if e.kind == "expert":
            return self._gf.slice0(e.sources[0], e.index)
        if e.kind == "reshape":
            return self._gf.tensor(e.sources[0]).reshape(e.shape)
        if e.kind == "a_log":  # checked negative at open
            return torch.log(-self._gf.tensor(e.sources[0]).reshape(e.shape))
        k_b, v_b = (self._gf.tensor(s) for s in e.sources)
        return _join_kv_b(k_b, v_b)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of a 2-D tensor (a tensor-parallel rank's
        part), dequantizing only those blocks. A row is a whole number of blocks, so rows are one
        byte range; columns that start or stop inside a block dequantize the blocks covering them,
        then narrow (the values are the same as the whole tensor's). kv_b (rebuilt from k_b / v_b) is
        rebuilt whole, then narrowed."""
        e = self._entry(name)
        if e.kind in ("kv_b_split", "reshape", "a_log") or len(e.shape) != 2:
            return self.get(name).narrow(dim, start, stop - start)
        info = self._gf.info(e.sources[0])
        rows, cols = e.shape
        row_bytes = info.nbytes // math.prod(info.shape[:-1])
        base = e.index * rows * row_bytes if e.kind == "expert" else 0
        if dim == 0:
            raw = self._gf.raw(e.sources[0], base + start * row_bytes, (stop - start) * row_bytes)
            return dequantize(raw, info.ggml_type, (stop - start, cols))
        t = GGML_TYPES[info.ggml_type]
        # the blocks that cover [start, stop): a slice that starts or stops inside a block (a rank's
        # columns of a K-quant's 256-value blocks) dequantizes those blocks whole, then narrows
        b0, b1 = start // t.block_size, -(-stop // t.block_size)
        raw = self._gf.raw(e.sources[0], base, rows * row_bytes).view(rows, row_bytes)
        part = raw[:, b0 * t.type_size : b1 * t.type_size]
        full = dequantize(part.contiguous(), info.ggml_type, (rows, (b1 - b0) * t.block_size))
        lo = start - b0 * t.block_size
        return full[:, lo : lo + stop - start].contiguous() if (lo or b1 * t.block_size != stop) else full

    def get_experts(self, layer: int, proj: str) -> torch.Tensor:
        """Stacked routed experts [E, out, in] for proj in gate_proj/up_proj/down_proj."""
        e = self._entry(f"model.layers.{layer}.mlp.experts.0.{proj}.weight")
        return self._gf.tensor(e.sources[0])

    def mla_split(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, L, n], W_UV [H, v, L]) as llama.cpp stores attn_k_b / attn_v_b.

        q_lat[h] = W_UK[h] @ q_nope[h] (then score = q_lat . c);  o[h] = W_UV[h] @ (P c).
        Taken from the file's attn_k_b/attn_v_b, or split from a fused attn_kv_b.
        """
        src = self._mla_sources(layer)
        if "k_b" in src:
            return self._gf.tensor(src["k_b"]), self._gf.tensor(src["v_b"])
        return _split_kv_b(self._gf.tensor(src["kv_b"]), self._cfg)

    def mla_split_blocks(
        self, layer: int, mapped: bool = False
    ) -> tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int]] | None:
        """The stored bytes of attn_k_b ([H, L, R_n] uint8, rows of n values) and attn_v_b ([H, v, R_L])
        with their ggml type ids, views of the file (mapped: of the read-only shared map, see get_blocks);
        None where the file stores a fused attn_kv_b."""
        src = self._mla_sources(layer)
        if "k_b" not in src:
            return None
        out = []
        for key in ("k_b", "v_b"):
            info = self._gf.info(src[key])
            lead = tuple(info.shape[:-1])
            per_row = info.nbytes // math.prod(lead)
            read = self._gf.view if mapped else self._gf.raw
            out.append((read(src[key], 0, info.nbytes).view(*lead, per_row), info.ggml_type))
        return out[0], out[1]

    def _mla_sources(self, layer: int) -> dict[str, str]:
        if layer not in self._mla:
            raise KeyError(f"{self._gf.path}: no MLA layer {layer}")
        return self._mla[layer]

    def _entry(self, name: str) -> Entry:
        if name not in self._entries:
            raise KeyError(f"{self._gf.path}: no tensor '{name}' in this checkpoint")
        return self._entries[name]


def _join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """k_b [H, L, n] + v_b [H, v, L] -> HF kv_b_proj [H*(n+v), L] (per head: k rows, then v rows)."""
    H, L, _ = k_b.shape
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, L)


def _split_kv_b(kv_b: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    H, n, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    per_head = kv_b.reshape(H, n + v, -1)
    return per_head[:, :n].transpose(1, 2), per_head[:, n:]


def _identity_check_layers(mla: dict[int, dict[str, str]]) -> list[int]:
    """The layers whose absorbed vs decompressed identity is checked at load. Every layer whose file
    stores a fused attn_kv_b (its split, or a split pair beside it, is data that can disagree); of the
    layers whose kv_b_proj is rebuilt from attn_k_b / attn_v_b (llama.cpp's layout) the first only: there
    the check holds the rebuild (_join_kv_b), the same code for every layer, and each layer's check
    dequantizes its k_b / v_b twice in float64 (12 layers of the standard model's Q8_0 file: 0.16 s of
    a 4 s start on an idle 2-core Xeon, seconds under load)."""
    fused = [layer for layer, src in sorted(mla.items()) if "kv_b" in src]
    split = [layer for layer, src in sorted(mla.items()) if "kv_b" not in src]
    return sorted(fused + split[:1])


def _mla_identity_check(gf: GGUFFile, tensors: GGUFTensors, layer: int, seed: int = 0) -> None:
    """Absorbed attention (k_b/v_b on the latent) == decompressed attention (kv_b_proj), per layer.

    A random latent c [T, L] and query q_nope [H, T, n] are pushed through both paths (float64);
    scores and outputs must agree to MLA_CHECK_RTOL relative to their magnitude.
    """
    w_uk, w_uv = (w.double() for w in tensors.mla_split(layer))  # [H, L, n], [H, v, L]
    kv_name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    kv_b = tensors.get(kv_name).double()
    H, L, n = w_uk.shape
    g = torch.Generator().manual_seed(seed + layer)
    c = torch.randn(5, L, generator=g, dtype=torch.float64)
    q = torch.randn(H, 5, n, generator=g, dtype=torch.float64)
    kv = (c @ kv_b.T).reshape(5, H, -1).transpose(0, 1)  # decompressed [H, T, n+v]
    s_dec = q @ kv[..., :n].transpose(1, 2)
    s_abs = (q @ w_uk.transpose(1, 2)) @ c.T  # q_lat[h] = W_UK[h] q[h]
    p = torch.softmax(s_dec / math.sqrt(n), dim=-1)
    o_dec = p @ kv[..., n:]
    o_abs = (p @ c) @ w_uv.transpose(1, 2)  # o[h] = W_UV[h] (P c)
    for what, a, b in (("scores", s_abs, s_dec), ("outputs", o_abs, o_dec)):
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        if not err <= MLA_CHECK_RTOL:
            src = tensors._mla_sources(layer)
            raise GGUFError(
                f"{gf.path}: layer {layer}: MLA absorbed vs decompressed attention {what} differ "
                f"(relative error {err:.2e}) between {sorted(src.values())} and "
                f"{list(tensors.sources(kv_name))}"
            )


# =============================================================================================
# checkpoint


@dataclass
class GGUFCheckpoint:
    path: Path
    file: GGUFFile
    gguf_arch: str
    hf_config: dict[str, Any]
    provenance: Provenance
    tensors: GGUFTensors
    skipped: list[str]
    tokenizer: GGUFTokenizer

    def mla_split(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, kv_lora, nope], W_UV [H, v, kv_lora]); see `GGUFTensors.mla_split`."""
        return self.tensors.mla_split(layer)

    def build_tokenizer(self, glm_prefix: bool | None = None):
        return self.tokenizer.build_tokenizer(glm_prefix)

    def close(self) -> None:
        self.file.close()


def load_gguf(
    path: str | Path, validate_numeric: bool = True, with_mtp: bool = False, file: GGUFFile | None = None
) -> GGUFCheckpoint:
    """Open an MLA GGUF model (any shard of a split model) and map it to HF naming.
    with_mtp: map the nextn (MTP) blocks to model.layers.N.* too (else they are skipped and listed).
    file: `path` already opened (open_gguf), so that a caller who read its header does not parse it again.

    Raises GGUFError on malformed files, missing required keys/tensors, unknown tensors,
    shape mismatches, a wrongly oriented attn_k_b/attn_v_b, or a failed MLA identity check.
    """
    gf = file if file is not None else open_gguf(path)
    cfg, prov = derive_hf_config(gf)
    mapper = TensorMapper(gf, cfg, with_mtp)
    mapper.run()
    tensors = GGUFTensors(gf, cfg, mapper.entries, mapper.mla)
    if validate_numeric:
        for layer in _identity_check_layers(mapper.mla):
            _mla_identity_check(gf, tensors, layer)
    return GGUFCheckpoint(
        gf.path,
        gf,
        gf.metadata["general.architecture"],
        cfg,
        prov,
        tensors,
        mapper.skipped,
        GGUFTokenizer.from_metadata(gf),
    )

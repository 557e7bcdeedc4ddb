"""The benchmark models' files beside their folders: a synthetic byte-level tokenizer for random-weight models (what
`mlaserve convert` and the engines need), a `<folder>-tok` sibling holding it, and the folder's GGUF made by
`mlaserve convert` and cached (common.py builds the folders)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2: the configs' bos / eos / pad ids


def synthetic_tokenizer(vocab_size: int) -> dict:
    """A byte-level BPE tokenizer.json with exactly `vocab_size` tokens, for models with random
    weights and no tokenizer: ids 0-2 the special tokens, then the 256 byte tokens (GPT-2's byte
    alphabet), then merges of two byte tokens (printable ASCII pairs first) up to the vocab size.
    Plain GPT-2 pre-tokenizer (ByteLevel, its regex, no prefix space), so `mlaserve convert` writes
    tokenizer.ggml.pre = "gpt-2", which llama.cpp knows. Text round-trips; the ids mean nothing."""
    chars = _byte_chars()
    n_merges = vocab_size - len(SPECIAL_TOKENS) - 256
    if n_merges < 0 or n_merges > 256 * 256:
        raise ValueError(f"vocab_size {vocab_size}: a synthetic tokenizer needs 259..{259 + 65536} tokens")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab[c] = len(vocab)
    order = [b for b in range(32, 127)] + [b for b in range(256) if not 32 <= b < 127]
    merges = []
    for a in order:
        for b in order:
            if len(merges) == n_merges:
                break
            merges.append([chars[a], chars[b]])
            vocab[chars[a] + chars[b]] = len(vocab)
    assert len(vocab) == vocab_size
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def with_tokenizer(folder: Path) -> Path:
    """A sibling folder `<folder>-tok` holding links to the folder's config.json and
    model.safetensors plus a synthetic tokenizer.json (what `mlaserve convert` needs)."""
    out = folder.with_name(folder.name + "-tok")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        link = out / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(folder / name, out))
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tj = out / "tokenizer.json"
    if not tj.exists() or len(json.loads(tj.read_text())["model"]["vocab"]) != vocab:
        tj.write_text(json.dumps(synthetic_tokenizer(vocab), ensure_ascii=False))
    return out


def gguf_path(folder: Path, outtype: str) -> Path:
    return folder.with_name(f"{folder.name}-{outtype}.gguf")


def ensure_gguf(folder: Path, outtype: str = "q8_0") -> Path:
    """`mlaserve convert --outtype <outtype>` of the model folder (with a synthetic tokenizer), cached
    beside it; rebuilt when the folder's weights or config are newer than the file."""
    from mlaserve.gguf.convert.convert import convert_hf_to_gguf

    out = gguf_path(folder, outtype)
    newest = max((folder / n).stat().st_mtime for n in ("config.json", "model.safetensors"))
    if out.exists() and out.stat().st_mtime > newest:
        return out
    src = with_tokenizer(folder)
    tmp = out.with_suffix(".gguf.partial")
    t0 = time.perf_counter()
    print(f"[build] mlaserve convert {src.name} -> {out.name} (--outtype {outtype}) ...", flush=True)
    report = convert_hf_to_gguf(src, tmp, outtype)
    tmp.replace(out)
    types: dict[str, int] = {}
    for t in report.tensors.values():
        types[t] = types.get(t, 0) + 1
    print(
        f"[build] done in {time.perf_counter() - t0:.0f} s: {out.stat().st_size / 2**20:.0f} MiB, {types}", flush=True
    )
    return out

"""tokenizer.json (byte-level BPE) -> llama.cpp's tokenizer.ggml.* metadata, for `mlaserve convert`."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlaserve.config import families
from mlaserve.gguf.convert.writer import INT32, STRING, MetaValue, array, boolean, string, u32


class ConvertError(ValueError):
    """A checkpoint folder we cannot convert; the message names the file, key or tensor."""


def _read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise ConvertError(f"{path}: not found")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path}: not valid JSON ({e})") from None


# =============================================================================================
# tokenizer metadata (tokenizer.json byte-level BPE -> tokenizer.ggml.*)

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
# llama.cpp identifies a BPE pre-tokenizer by sha256(str(token ids of this text)) with the
# checkpoint's own tokenizer (convert_hf_to_gguf.py, get_vocab_base_pre); the text is data.
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
# The MLA families' entries of llama.cpp's table (config/families) + GPT-2 itself.
KNOWN_PRE_HASHES = families.tokenizer_pre_names() | {
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}
_SPECIAL_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "sep": "seperator_token_id",
    "pad": "padding_token_id",
    "mask": "mask_token_id",
    "eot": "eot_token_id",
    "eom": "eom_token_id",
}  # sic: llama.cpp spells "seperator"


def _looks_special(tok: str) -> bool:
    """llama.cpp's does_token_look_special: added tokens that should be CONTROL although not
    flagged special."""
    return (
        tok in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (tok.startswith("<|") and tok.endswith("|>"))
        or (tok.startswith("<｜") and tok.endswith("｜>"))
        or (tok.startswith("<unused") and tok.endswith(">"))
    )


def _token_list(tj: dict, vocab_size: int, path: Path) -> tuple[list[str], list[int]]:
    """Tokens 0..vocab_size-1 with llama.cpp token types; ids the tokenizer lacks are [PAD<i>]."""
    by_id = {i: (t, None) for t, i in tj["model"]["vocab"].items()}
    for a in tj.get("added_tokens", []):
        by_id[a["id"]] = (a["content"], a)
    if by_id and max(by_id) >= vocab_size:
        raise ConvertError(f"{path}: token id {max(by_id)} >= config vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        tok, added = by_id.get(i, (None, None))
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
        elif added is None:
            tokens.append(tok)
            types.append(TOKEN_NORMAL)
        elif added.get("special") or _looks_special(tok):
            tokens.append(tok)
            types.append(TOKEN_CONTROL)
        else:  # user-defined tokens are stored pre-normalized (SentencePiece space -> " ")
            tokens.append(tok.replace("\u2581", " "))
            types.append(TOKEN_USER_DEFINED)
    return tokens, types


def _merges(tj: dict, path: Path) -> list[str]:
    merges = tj["model"].get("merges") or []
    out = []
    for mrg in merges:
        if isinstance(mrg, str):
            out.append(mrg)
        elif isinstance(mrg, list) and len(mrg) == 2:
            # pair form (transformers >= 4.45): a space inside a part is stored as U+0120, as gguf-py does
            out.append(" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in mrg))
        else:
            raise ConvertError(f"{path}: unknown BPE merge format {mrg!r}")
    return out


def _is_gpt2_pre(tj: dict) -> bool:
    pre = tj.get("pre_tokenizer") or {}
    return (
        tj.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
    )


def pre_tokenizer_name(tokenizer_json: Path) -> str:
    """tokenizer.ggml.pre for a tokenizer.json: by llama.cpp's hash, else structurally."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_json)).encode(CHKTXT).ids
    chkhsh = hashlib.sha256(str(ids).encode()).hexdigest()
    if chkhsh in KNOWN_PRE_HASHES:
        return KNOWN_PRE_HASHES[chkhsh]
    if _is_gpt2_pre(_read_json(tokenizer_json)):
        return "gpt-2"
    raise ConvertError(
        f"{tokenizer_json}: BPE pre-tokenizer not recognized (llama.cpp hash {chkhsh}); "
        "name it explicitly (--pre-tokenizer, e.g. deepseek-v3, glm4, gpt-2)"
    )


def _content(entry: Any) -> str | None:
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def _special_ids(tj: dict, tc: dict, raw: dict, specials: Mapping[str, str]) -> dict[str, int]:
    """bos/eos/... ids the way gguf-py's SpecialVocab finds them: the tokenizer_config token text
    looked up among tokenizer.json's added tokens, else config.json's *_token_id; then the family's
    `specials` (type -> token text; GLM's bos=[gMASK], eot=<|user|>, ... from llama.cpp's
    _set_vocab_glm) fill in, never overriding an id already found.  Without a bos_token, the special
    token the post-processor puts first is the BOS (GLM: [gMASK], as in llama.cpp's files)."""
    added = {a["content"]: a["id"] for a in reversed(tj.get("added_tokens", []))}  # first match wins
    text = {t: _content(tc.get(f"{t}_token")) for t in ("bos", "eos", "unk", "sep", "pad", "mask")}
    text["bos"] = text["bos"] or _content(tc.get("cls_token")) or _leading_special(tj)
    text["eos"] = text["eos"] or text["sep"]
    ids: dict[str, int] = {}
    for typ, tok in text.items():
        if tok in added:
            ids[typ] = added[tok]
        elif isinstance(raw.get(f"{typ}_token_id"), int):
            ids[typ] = raw[f"{typ}_token_id"]
    for typ, tok in specials.items():
        if typ not in ids and tok in added:
            ids[typ] = added[tok]
    return ids


def _template(tj: dict) -> dict | None:
    pp = tj.get("post_processor") or {}
    for proc in pp.get("processors", [pp]):
        if proc.get("type") == "TemplateProcessing":
            return proc
    return None


def _special_of(item: dict) -> str | None:
    return (item.get("SpecialToken") or {}).get("id")


def _leading_special(tj: dict) -> str | None:
    """The special token the post-processor puts before a single sequence, if any."""
    single = (_template(tj) or {}).get("single", [])
    return _special_of(single[0]) if len(single) > 1 else None


def _add_flags(tj: dict, tc: dict, ids: dict[str, int], tokens: list[str]) -> dict[str, bool]:
    """add_bos/add_sep/add_eos: from what the post-processor template does when it says
    something (a leading / trailing special token, a separator between A and B), else from
    tokenizer_config.json's add_*_token."""
    tmpl = _template(tj)
    single, pair = (tmpl.get("single", []), tmpl.get("pair", [])) if tmpl else ([], [])
    first = _leading_special(tj)
    last = _special_of(single[-1]) if len(single) > 1 else None
    flags: dict[str, bool] = {}
    if first:
        flags["bos"] = True
    sep = _add_sep(pair, first, last, {tokens[i] for t, i in ids.items() if t in ("sep", "eos")})
    if sep is not None:
        flags["sep"] = sep
    if last:
        flags["eos"] = True
    for typ in ("bos", "sep", "eos"):
        if typ not in flags and isinstance(tc.get(f"add_{typ}_token"), bool):
            flags[typ] = tc[f"add_{typ}_token"]
    return {t: flags[t] for t in ("bos", "sep", "eos") if t in flags}


def _add_sep(pair: list[dict], first: str | None, last: str | None, sep_like: set[str]) -> bool | None:
    """A pair template [first] A x B [last]: True when a middle special token is the sep/eos."""
    if first and pair and _special_of(pair[0]) == first:
        pair = pair[1:]
    if last and pair and _special_of(pair[-1]) == last:
        pair = pair[:-1]
    seq = lambda item: (item.get("Sequence") or {}).get("id")  # noqa: E731
    if len(pair) < 3 or seq(pair[0]) != "A" or seq(pair[-1]) != "B":
        return None
    return any(_special_of(item) in sep_like for item in pair[1:-1])


def _chat_template(folder: Path, tc: dict) -> list[tuple[str, MetaValue]]:
    tmpl = tc.get("chat_template")
    if tmpl is None and (folder / "chat_template.jinja").is_file():
        tmpl = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif tmpl is None and (folder / "chat_template.json").is_file():
        tmpl = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(tmpl, str):
        return [("tokenizer.chat_template", string(tmpl))]
    if isinstance(tmpl, list):  # named templates: "default" is the chat template, the others by name
        named = {re.sub(r"[^A-Za-z0-9]", "_", t.get("name", "")): t.get("template") for t in tmpl}
        out = [(f"tokenizer.chat_template.{n}", string(t)) for n, t in named.items() if n not in ("", "default") and t]
        if len(out):
            out.append(("tokenizer.chat_templates", array([k.rsplit(".", 1)[1] for k, _ in out], STRING)))
        if named.get("default"):
            out.append(("tokenizer.chat_template", string(named["default"])))
        return out
    return []


def tokenizer_keys(
    folder: Path, raw: dict, specials: Mapping[str, str], vocab_size: int, pre: str | None
) -> list[tuple[str, MetaValue]]:
    """tokenizer.json (byte-level BPE) + tokenizer_config.json -> the tokenizer.ggml.* keys.
    specials: the family's tokenizer_specials (see `_special_ids`)."""
    tj_path = folder / "tokenizer.json"
    tj = _read_json(tj_path)  # llama.cpp needs the vocabulary inside the GGUF
    if (tj.get("model") or {}).get("type") != "BPE":
        raise ConvertError(
            f"{tj_path}: only byte-level BPE tokenizers are supported "
            f"(model type {(tj.get('model') or {}).get('type')!r})"
        )
    tc = _read_json(folder / "tokenizer_config.json", required=False)
    tokens, types = _token_list(tj, vocab_size, tj_path)
    out = [
        ("tokenizer.ggml.model", string("gpt2")),
        ("tokenizer.ggml.pre", string(pre or pre_tokenizer_name(tj_path))),
        ("tokenizer.ggml.tokens", array(tokens, STRING)),
        ("tokenizer.ggml.token_type", array(types, INT32)),
    ]
    merges = _merges(tj, tj_path)
    if merges:
        out.append(("tokenizer.ggml.merges", array(merges, STRING)))
    ids = _special_ids(tj, tc, raw, specials)
    out += [(f"tokenizer.ggml.{_SPECIAL_KEYS[t]}", u32(i)) for t, i in ids.items()]
    out += [(f"tokenizer.ggml.add_{t}_token", boolean(v)) for t, v in _add_flags(tj, tc, ids, tokens).items()]
    return out + _chat_template(folder, tc)

"""What training and evaluating the embedded tiny-dsa model share: the corpus and its held-out
split, the context and top-k of the recipe, and the indexer's differentiable scores with the probes
that capture its inputs (used by scripts/train_embedded_model.py and scripts/eval_embedded_model.py).

Notation (indexer_scores)
  B batch, S queries, T keys, Hi index heads, Di index head dim, r its roped dims
  score[s, t] = sum_h w[s, h] * Hi^-0.5 * ReLU(q[s, h] . k[t] * Di^-0.5)
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = "/usr/lib/bible.data"
DEFAULT_OUT = REPO / "mlaserve" / "embedded" / "tiny-dsa"
BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
HELDOUT_FRACTION = 0.02
CONTEXT = 256
INDEX_TOPK = 64
DENSE_TOPK = 1 << 30  # any value >= the sequence length selects every key: dense attention


def _bible_lines(data_path: str) -> list[tuple[str, str]]:
    """(book, line) pairs of the whole KJV from the bible-kjv data file, via the ``bible`` program.

    Each chapter becomes a heading line ("Genesis 1"), its verses (without verse numbers, one per
    line) and an empty line.
    """
    d = os.path.dirname(os.path.abspath(data_path))
    out = subprocess.run(
        ["bible", "-p", d, "-l100000", "Genesis1:1-Revelation22:21"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    lines: list[tuple[str, str]] = []
    book = None
    for raw in out.splitlines():
        if not raw.strip():
            continue
        m = re.match(r"^\s+\d+ (.*)$", raw)
        if m:
            lines.append((book, m.group(1).strip()))
            continue
        m = re.match(r"^(\S.*) (\d+)$", raw)
        if not m:
            raise ValueError(f"unexpected line from `bible`: {raw!r}")
        if lines and book is not None:
            lines.append((book, ""))  # blank line closes the previous chapter
        book = m.group(1)
        lines.append((book, raw.strip()))
    lines.append((book, ""))
    return lines


def load_corpus(paths: list[str]) -> tuple[list[str], list[str]]:
    """Return (train_documents, heldout_documents) as lists of strings.

    Documents are the books of the Bible (or the given text files).  The held-out part is the last
    ``HELDOUT_FRACTION`` of all characters, cut at a line boundary.
    """
    lines: list[tuple[str, str]] = []
    for i, p in enumerate(paths):
        if p.endswith(".data"):
            lines += _bible_lines(p)
        else:
            with open(p, encoding="utf-8", errors="replace") as f:
                lines += [(f"file{i}", ln.rstrip("\n")) for ln in f]
    total = sum(len(ln) + 1 for _, ln in lines)
    cut, acc = len(lines), 0
    for j, (_, ln) in enumerate(lines):
        acc += len(ln) + 1
        if acc >= (1 - HELDOUT_FRACTION) * total:
            cut = j + 1
            break

    def docs(part):
        out, cur, key = [], [], None
        for b, ln in part:
            if b != key and cur:
                out.append("\n".join(cur) + "\n")
                cur = []
            key = b
            cur.append(ln)
        if cur:
            out.append("\n".join(cur) + "\n")
        return out

    return docs(lines[:cut]), docs(lines[cut:])


def encode_docs(tok, docs: list[str]) -> torch.Tensor:
    """One token stream: <bos> doc <eos> <bos> doc <eos> ..."""
    ids: list[int] = []
    for d in docs:
        ids += [0] + tok.encode(d, add_special_tokens=False).ids + [1]
    return torch.tensor(ids, dtype=torch.long)


def set_index_topk(model, k: int) -> None:
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = k


def _rope_half(x, cos, sin):
    """Non-interleaved (half-split) RoPE, as the V3.2 indexer uses."""
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


def indexer_scores(attn, x, cos, sin):
    """The indexer's scores [B,S,T], differentiable w.r.t. the indexer's own weights.

    x: the (detached) normed hidden states that enter the attention block; cos/sin: [B,S,rope_dim].
    score[s,t] = sum_h w[s,h] * Hi^-0.5 * ReLU(q[s,h] . k[t] * Di^-0.5)
    """
    ix = attn.indexer
    B, S, _ = x.shape
    Hi, Di, r = ix.n_heads, ix.head_dim, ix.qk_rope_head_dim
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = ix.wq_b(q_resid).view(B, S, Hi, Di)
    k = ix.k_norm(ix.wk(x))  # [B,S,Di]
    q = torch.cat((_rope_half(q[..., :r], cos[:, :, None], sin[:, :, None]), q[..., r:]), dim=-1)
    k = torch.cat((_rope_half(k[..., :r], cos, sin), k[..., r:]), dim=-1)
    s = F.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()) * Di**-0.5)
    w = ix.weights_proj(x.to(ix.weights_proj.weight.dtype)).float() * Hi**-0.5
    return torch.einsum("bsh,bsht->bst", w, s)


class Probe:
    """Forward hooks that capture, per layer: attention input, RoPE cos/sin, attention probs,
    indexer top-k indices, and MoE routing decisions."""

    def __init__(self, model):
        self.model = model
        self.enabled = False
        self.x, self.cs, self.probs, self.topk = {}, {}, {}, {}
        self.expert_counts: dict[int, torch.Tensor] = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            self.handles.append(a.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(a.register_forward_hook(self._post(i)))
            self.handles.append(a.indexer.register_forward_hook(self._idx(i)))
            if hasattr(layer.mlp, "gate"):
                self.handles.append(layer.mlp.gate.register_forward_hook(self._gate(i)))

    def _pre(self, i):
        def hook(mod, args, kwargs):
            if self.enabled:
                self.x[i] = kwargs["hidden_states"].detach()
                cos, sin = kwargs["position_embeddings"]
                self.cs[i] = (cos.detach(), sin.detach())

        return hook

    def _post(self, i):
        def hook(mod, args, out):
            if self.enabled:
                self.probs[i] = out[1]

        return hook

    def _idx(self, i):
        def hook(mod, args, out):
            if self.enabled:
                self.topk[i] = out

        return hook

    def _gate(self, i):
        def hook(mod, args, out):
            if mod.training:
                idx = out[2].detach().reshape(-1)
                c = torch.bincount(idx, minlength=mod.num_experts).float()
                self.expert_counts[i] = self.expert_counts.get(i, 0) + c

        return hook

    def selected_mask(self, i, T):
        idx = self.topk[i].long()
        B, S, _ = idx.shape
        return torch.zeros(B, S, T, dtype=torch.bool, device=idx.device).scatter(-1, idx, True)

    def clear(self):
        self.x, self.cs, self.probs, self.topk = {}, {}, {}, {}

    def remove(self):
        for h in self.handles:
            h.remove()

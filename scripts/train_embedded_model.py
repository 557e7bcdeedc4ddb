#!/usr/bin/env python3
"""Train mlaserve's embedded default model: a tiny DeepSeek-V3.2-style MLA + MoE + DSA model.

What it produces
----------------
``mlaserve/embedded/tiny-dsa/`` (or ``--out``), loadable by ``transformers`` as ``DeepseekV32ForCausalLM``:
``config.json``, ``model.safetensors`` (fp32, ~19 MB), ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json`` and ``README.md`` (the model card, written by ``scripts/eval_embedded_model.py``,
which this script calls at the end).  Training statistics go to ``<work-dir>/train_stats.json`` and the
log to stdout.

Corpus
------
The King James Bible from Debian's ``bible-kjv-text`` package (public domain: the translation is from
1611; the packaging is GPL-2+ but the text itself is not copyrightable).  Install it with
``apt-get install bible-kjv-text`` (the ``bible-kjv`` reader comes with it); the default corpus path
``/usr/lib/bible.data`` is the package's compressed data file, which is turned into plain text with the
``bible`` program.  Any plain-text file(s) may be given instead.  The last 2% of the lines (the end of
the New Testament from 2 Peter 3:12 on: 1-3 John, Jude, Revelation) are held out for evaluation and never seen by the
tokenizer or the model.

Recipe
------
1. Byte-level BPE tokenizer (``tokenizers``), vocab 4096, specials <bos>=0, <eos>=1, <pad>=2, a
   template post-processor that prepends <bos>.
2. Model: ``DeepseekV32ForCausalLM`` (see ``build_config``), ~4.7 M parameters, tied embeddings.
3. Training, following DeepSeek-V3.2's recipe for the DSA lightning indexer:
   a. *dense*: the main model trains with next-token cross-entropy while the indexer's top-k is forced
      off (``index_topk`` >= context, so every causal key is selected, i.e. dense attention);
   b. *indexer warm-up*: the main model is frozen; ONLY the indexer learns, by KL(p || q) where p is the
      main attention distribution (eager attention probs, summed over heads, renormalised) and q is the
      softmax of the indexer's scores, which this script recomputes with gradients from the indexer's
      weights (transformers runs its indexer under ``torch.no_grad``);
   c. *sparse*: ``index_topk`` = 64 (context 256), so transformers' forward masks every non-selected
      key; the main model keeps training on cross-entropy and the indexer on the KL restricted to its
      selected set.  The indexer's inputs are detached, so it never sends gradients into the main model.
   MoE balance uses DeepSeek-V3's auxiliary-loss-free bias update of ``e_score_correction_bias``.
   AdamW, linear warm-up + cosine decay, everything seeded.

How to run
----------
The shipped model was made with a wall-clock budget (the phases end at 65% / 72% / 100% of it and the
learning rates follow elapsed time, so it finishes on time on a busy machine):

    apt-get install bible-kjv-text
    . .venv/bin/activate
    python scripts/train_embedded_model.py --threads 1 --minutes 90 --work-dir runs/tiny-dsa-work

With explicit step counts instead (a step-based cosine schedule; train_stats.json records the step
counts of a timed run):

    python scripts/train_embedded_model.py --threads 2 --dense-steps 1500 --indexer-steps 150 --sparse-steps 500

Expected time: 90 minutes of training plus ~1 minute of data preparation and 3-8 minutes of
evaluation for the first form.  A step costs ~3.3 s (dense), ~4.7 s (indexer-only) and ~4.6 s (sparse)
on one core of a 2-core x86 VM, so the second form takes ~2 hours on one thread, about 70 minutes on
two.  Never run in CI.  A smoke test (~2 minutes):
``--dense-steps 12 --indexer-steps 6 --sparse-steps 6 --out /tmp/tiny-smoke --no-eval``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import time
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


# ----------------------------------------------------------------------------------------------
# corpus
# ----------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------
def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    assert [tok.token_to_id(t) for t in (BOS, EOS, PAD)] == [0, 1, 2]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }


def encode_docs(tok, docs: list[str]) -> torch.Tensor:
    """One token stream: <bos> doc <eos> <bos> doc <eos> ..."""
    ids: list[int] = []
    for d in docs:
        ids += [0] + tok.encode(d, add_special_tokens=False).ids + [1]
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------
def build_config(vocab_size: int):
    from transformers import DeepseekV32Config

    return DeepseekV32Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,  # the dense MLP of layer 0
        moe_intermediate_size=128,  # each routed expert and the shared expert
        num_hidden_layers=4,
        first_k_dense_replace=1,  # layer 0 dense, layers 1-3 MoE
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        kv_lora_rank=64,
        q_lora_rank=96,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        index_n_heads=16,
        index_head_dim=64,  # [32 roped | 32 pass-through]
        index_topk=INDEX_TOPK,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=True,
        num_nextn_predict_layers=0,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        use_cache=True,
    )


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


def indexer_kl(scores, attn_probs, selected=None):
    """KL(p || softmax(scores)) per query row, averaged; p = head-summed attention, renormalised.

    selected: optional bool [B,S,T] restricting both distributions to the indexer's selected set.
    """
    B, S, T = scores.shape
    allowed = torch.ones(S, T, dtype=torch.bool, device=scores.device).tril()[None].expand(B, S, T)
    if selected is not None:
        allowed = allowed & selected
    p = attn_probs.detach().float().sum(1).masked_fill(~allowed, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
    logq = torch.log_softmax(scores.masked_fill(~allowed, -1e9), dim=-1)
    kl = torch.xlogy(p, p) - p * logq
    return kl.sum(-1).mean()


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


def update_router_bias(model, probe, gamma):
    """DeepSeek-V3 auxiliary-loss-free balancing: push each expert's bias toward the mean load."""
    for i, layer in enumerate(model.model.layers):
        c = probe.expert_counts.get(i)
        if c is None:
            continue
        b = layer.mlp.gate.e_score_correction_bias
        b.add_(gamma * torch.sign(c.mean() - c))
    probe.expert_counts = {}


def lr_at(step, total, peak, warmup, floor=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def param_groups(params, wd):
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


# ----------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "corpus",
        nargs="*",
        default=[DEFAULT_CORPUS],
        help=f"corpus file(s): bible-kjv's .data file or plain text (default {DEFAULT_CORPUS})",
    )
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--work-dir", default="runs/tiny-dsa-work")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--context", type=int, default=CONTEXT)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--indexer-lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--dense-steps", type=int, default=1500)
    ap.add_argument("--indexer-steps", type=int, default=150)
    ap.add_argument("--sparse-steps", type=int, default=500)
    ap.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="wall-clock budget for the three training phases (65/7/28%%); overrides the step "
        "counts, and the LR schedules follow elapsed time instead of steps",
    )
    ap.add_argument(
        "--hard-stop-minutes",
        type=float,
        default=None,
        help="safety net: stop training (and still save + evaluate) after this many minutes",
    )
    ap.add_argument("--no-eval", action="store_true", help="skip the evaluation / model card")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    os.makedirs(args.work_dir, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    from transformers import DeepseekV32ForCausalLM, GenerationConfig

    train_docs, held_docs = load_corpus(args.corpus)
    log(
        f"corpus: {len(train_docs)} train docs ({sum(map(len, train_docs))} chars), "
        f"{len(held_docs)} held-out docs ({sum(map(len, held_docs))} chars)"
    )
    tok = train_tokenizer(train_docs, args.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config(512), f, indent=2)
    train_ids = encode_docs(tok, train_docs)
    held_ids = encode_docs(tok, held_docs)
    log(f"tokenizer: vocab {tok.get_vocab_size()}; train {len(train_ids)} tokens, held-out {len(held_ids)}")

    config = build_config(tok.get_vocab_size())
    model = DeepseekV32ForCausalLM._from_config(config, attn_implementation="eager", experts_implementation="eager")
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters")
    probe = Probe(model)

    idx_params = [p for n, p in model.named_parameters() if ".indexer." in n]
    main_params = [p for n, p in model.named_parameters() if ".indexer." not in n]
    opt_main = torch.optim.AdamW(param_groups(main_params, 0.1), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    opt_idx = torch.optim.AdamW(param_groups(idx_params, 0.0), lr=args.indexer_lr, betas=(0.9, 0.95))

    gen = torch.Generator().manual_seed(args.seed)
    B, T = args.batch_size, args.context

    def batch():
        starts = torch.randint(0, len(train_ids) - T, (B,), generator=gen)
        x = torch.stack([train_ids[s : s + T] for s in starts.tolist()])
        x[:, 0] = 0  # every window starts with <bos>, like a prompt does
        return x

    held_windows = [held_ids[i : i + T].clone() for i in range(0, len(held_ids) - T, T)][:8]
    for w in held_windows:
        w[0] = 0
    held_batch = torch.stack(held_windows)

    def quick_eval(sparse: bool):
        model.eval()
        set_index_topk(model, INDEX_TOPK if sparse else DENSE_TOPK)
        with torch.no_grad():
            loss = model(input_ids=held_batch, labels=held_batch).loss.item()
        model.train()
        return loss

    n_dense, n_idx, n_sparse = args.dense_steps, args.indexer_steps, args.sparse_steps
    stats = {
        "seed": args.seed,
        "threads": args.threads,
        "batch_size": B,
        "context": T,
        "params": n_params,
        "train_tokens_in_corpus": len(train_ids),
        "heldout_tokens_in_corpus": len(held_ids),
        "phases": {},
    }
    hard_stop = args.hard_stop_minutes * 60 if args.hard_stop_minutes else float("inf")
    tokens_seen = 0
    last_loss = {}
    main_step = 0  # counts steps of the main optimizer (dense + sparse) for its LR schedule

    timed = args.minutes is not None
    budget = args.minutes * 60 if timed else None
    frac = {"dense": 0.65, "indexer": 0.07, "sparse": 0.28}
    main_time = 0.0  # seconds spent in main-model steps (for the time-based LR schedule)

    def main_lr():
        if not timed:
            return lr_at(main_step, n_dense + n_sparse, args.lr, args.warmup)
        # time-based cosine: progress = main-model seconds / main-model budget
        pseudo_total = 10**6
        prog = min(1.0, main_time / ((frac["dense"] + frac["sparse"]) * budget))
        if main_step < args.warmup:
            return lr_at(main_step, pseudo_total, args.lr, args.warmup)
        return lr_at(args.warmup + prog * (pseudo_total - args.warmup), pseudo_total, args.lr, args.warmup)

    def main_train_step(sparse: bool):
        nonlocal main_step, tokens_seen, main_time
        ts = time.time()
        x = batch()
        lr = main_lr()
        for g in opt_main.param_groups:
            g["lr"] = lr
        probe.enabled = sparse
        out_ = model(input_ids=x, labels=x)
        loss = out_.loss
        kl = torch.zeros(())
        if sparse:
            for i in probe.x:
                sc = indexer_scores(model.model.layers[i].self_attn, probe.x[i], *probe.cs[i])
                kl = kl + indexer_kl(sc, probe.probs[i], probe.selected_mask(i, T))
            kl = kl / len(probe.x)
            if timed:
                ilr = lr_at(int(1000 * min(1.0, phase_elapsed() / (frac["sparse"] * budget))), 1000, args.indexer_lr, 0)
            else:
                ilr = lr_at(main_step - n_dense, n_sparse, args.indexer_lr, 0)
            for g in opt_idx.param_groups:
                g["lr"] = ilr
        (loss + kl).backward()
        probe.enabled = False
        probe.clear()
        torch.nn.utils.clip_grad_norm_(main_params, 1.0)
        opt_main.step()
        opt_main.zero_grad(set_to_none=True)
        if sparse:
            torch.nn.utils.clip_grad_norm_(idx_params, 1.0)
            opt_idx.step()
            opt_idx.zero_grad(set_to_none=True)
        with torch.no_grad():
            update_router_bias(model, probe, 1e-3)
        main_step += 1
        tokens_seen += x.numel()
        main_time += time.time() - ts
        return loss.item(), kl.item(), lr

    def indexer_train_step(step):
        x = batch()
        lr = args.indexer_lr * min(1.0, (step + 1) / 20)
        for g in opt_idx.param_groups:
            g["lr"] = lr
        probe.enabled = True
        with torch.no_grad():
            model(input_ids=x)
        probe.enabled = False
        kl = 0.0
        for i in probe.x:
            sc = indexer_scores(model.model.layers[i].self_attn, probe.x[i], *probe.cs[i])
            kl = kl + indexer_kl(sc, probe.probs[i])
        kl = kl / len(probe.x)
        kl.backward()
        probe.clear()
        torch.nn.utils.clip_grad_norm_(idx_params, 1.0)
        opt_idx.step()
        opt_idx.zero_grad(set_to_none=True)
        return kl.item(), lr

    # ---------------- phase a: dense ----------------
    def phase_elapsed():
        return time.time() - t0

    def keep_going(phase, step, n):
        if time.time() - t_start > hard_stop:
            log(f"hard stop reached in {phase} phase")
            return False
        if timed:
            # each phase ends at its share of the budget, measured from the start of training
            ends = {"dense": frac["dense"], "indexer": frac["dense"] + frac["indexer"], "sparse": 1.0}
            return time.time() - t_train < ends[phase] * budget
        return step < n

    set_index_topk(model, DENSE_TOPK)
    t0 = t_train = time.time()
    step = 0
    ema = None
    while keep_going("dense", step, n_dense):
        loss, _, lr = main_train_step(sparse=False)
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        step += 1
        if step % 25 == 0 or step == n_dense:
            el = time.time() - t0
            log(f"dense {step}/{n_dense} loss {loss:.3f} (ema {ema:.3f}) lr {lr:.2e} {tokens_seen / el:.0f} tok/s")
        if step % 250 == 0:
            log(f"  held-out loss (8 windows): dense {quick_eval(False):.3f}")
            set_index_topk(model, DENSE_TOPK)
    stats["phases"]["dense"] = {"steps": step, "seconds": round(time.time() - t0, 1), "final_loss_ema": round(ema, 4)}
    last_loss["dense"] = ema
    n_dense = step
    model.save_pretrained(os.path.join(args.work_dir, "after_dense"))

    # ---------------- phase b: indexer warm-up (main model frozen) ----------------
    t0 = time.time()
    step = 0
    kl_ema = None
    model.eval()  # no dropout anyway; makes the router hook skip counting
    while keep_going("indexer", step, n_idx):
        kl, lr = indexer_train_step(step)
        kl_ema = kl if kl_ema is None else 0.95 * kl_ema + 0.05 * kl
        step += 1
        if step % 10 == 0 or step == n_idx:
            log(f"indexer {step}/{n_idx} KL {kl:.4f} (ema {kl_ema:.4f}) lr {lr:.2e}")
    model.train()
    stats["phases"]["indexer_warmup"] = {
        "steps": step,
        "seconds": round(time.time() - t0, 1),
        "final_kl_ema": round(kl_ema, 4) if kl_ema else None,
    }
    n_idx = step
    log(f"  held-out loss after indexer warm-up: dense {quick_eval(False):.3f} sparse {quick_eval(True):.3f}")

    # ---------------- phase c: sparse ----------------
    set_index_topk(model, INDEX_TOPK)
    t0 = time.time()
    step = 0
    ema = None
    kl_ema = None
    while keep_going("sparse", step, n_sparse):
        loss, kl, lr = main_train_step(sparse=True)
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        kl_ema = kl if kl_ema is None else 0.95 * kl_ema + 0.05 * kl
        step += 1
        if step % 25 == 0 or step == n_sparse:
            log(f"sparse {step}/{n_sparse} loss {loss:.3f} (ema {ema:.3f}) KL {kl:.4f} (ema {kl_ema:.4f}) lr {lr:.2e}")
        if step % 250 == 0:
            log(f"  held-out loss: dense {quick_eval(False):.3f} sparse {quick_eval(True):.3f}")
            set_index_topk(model, INDEX_TOPK)
    stats["phases"]["sparse"] = {
        "steps": step,
        "seconds": round(time.time() - t0, 1),
        "final_loss_ema": round(ema, 4) if ema else None,
        "final_kl_ema": round(kl_ema, 4) if kl_ema else None,
    }
    n_sparse = step
    probe.remove()

    # ---------------- save ----------------
    set_index_topk(model, INDEX_TOPK)
    model.eval()
    stats["steps"] = {"dense": n_dense, "indexer": n_idx, "sparse": n_sparse}
    stats["tokens_seen_main"] = tokens_seen
    stats["command"] = "python scripts/train_embedded_model.py " + " ".join(argv if argv is not None else sys.argv[1:])
    stats["lr_schedule"] = f"cosine over elapsed time (--minutes {args.minutes})" if timed else "cosine over steps"
    stats["tokens_seen_indexer_warmup"] = n_idx * B * T
    stats["train_seconds"] = round(time.time() - t_start, 1)
    stats["final_train_loss"] = round(ema if ema is not None else last_loss["dense"], 4)
    stats["reproduce"] = (
        f"python scripts/train_embedded_model.py --threads {args.threads} --seed {args.seed} "
        f"--dense-steps {n_dense} --indexer-steps {n_idx} --sparse-steps {n_sparse}"
    )
    model.save_pretrained(str(out))
    # the config carries the shipped sparsity, not the training-time toggles
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["index_topk"] == INDEX_TOPK
    GenerationConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=2, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=64
    ).save_pretrained(str(out))
    with open(os.path.join(args.work_dir, "train_stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    log(f"saved to {out}; stats: {json.dumps(stats)}")

    if not args.no_eval:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import eval_embedded_model

        eval_embedded_model.main(
            [
                str(out),
                *args.corpus,
                "--threads",
                str(args.threads),
                "--train-stats",
                os.path.join(args.work_dir, "train_stats.json"),
                "--write-card",
            ]
        )
    log("done")


if __name__ == "__main__":
    main()

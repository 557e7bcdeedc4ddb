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
What training and evaluation share (corpus split, context, top-k, the indexer's differentiable
scores and the probes) lives in ``scripts/tiny_dsa.py``; this script calls the evaluation at the end,
the evaluation does not import this script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_dsa import (  # noqa: E402
    BOS,
    CONTEXT,
    DEFAULT_CORPUS,
    DEFAULT_OUT,
    DENSE_TOPK,
    EOS,
    INDEX_TOPK,
    PAD,
    Probe,
    encode_docs,
    indexer_scores,
    load_corpus,
    set_index_topk,
)

PHASE_SHARE = {"dense": 0.65, "indexer": 0.07, "sparse": 0.28}  # of a --minutes budget


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


def parse_args(argv=None) -> argparse.Namespace:
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
    return ap.parse_args(argv)


class Log:
    def __init__(self) -> None:
        self.t_start = time.time()

    def __call__(self, msg: str) -> None:
        print(f"[{time.time() - self.t_start:7.1f}s] {msg}", flush=True)


def prepare_data(args, out: Path, log: Log):
    """Corpus -> tokenizer (saved into out) -> (tokenizer, train ids, held-out ids)."""
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
    return tok, train_ids, held_ids


def build_model(vocab_size: int, log: Log):
    from transformers import DeepseekV32ForCausalLM

    config = build_config(vocab_size)
    model = DeepseekV32ForCausalLM._from_config(config, attn_implementation="eager", experts_implementation="eager")
    model.train()
    log(f"model: {sum(p.numel() for p in model.parameters())} parameters")
    return model


@dataclass
class Counters:
    """Progress shared by the phases: the main optimizer's steps (dense + sparse, for its LR
    schedule), the seconds they took (for the time-based schedule), tokens seen, final EMAs."""

    main_step: int = 0
    main_time: float = 0.0
    tokens_seen: int = 0
    steps: dict = field(default_factory=dict)  # phase -> steps run
    last_loss: dict = field(default_factory=dict)


class Trainer:
    """The model, its two optimizers and the step functions of the three phases."""

    def __init__(self, args, model, train_ids: torch.Tensor, held_ids: torch.Tensor, log: Log) -> None:
        self.args, self.model, self.train_ids, self.log = args, model, train_ids, log
        self.probe = Probe(model)
        self.idx_params = [p for n, p in model.named_parameters() if ".indexer." in n]
        self.main_params = [p for n, p in model.named_parameters() if ".indexer." not in n]
        self.opt_main = torch.optim.AdamW(param_groups(self.main_params, 0.1), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
        self.opt_idx = torch.optim.AdamW(param_groups(self.idx_params, 0.0), lr=args.indexer_lr, betas=(0.9, 0.95))
        self.gen = torch.Generator().manual_seed(args.seed)
        self.B, self.T = args.batch_size, args.context
        self.held_batch = self._held_batch(held_ids)
        self.n = {"dense": args.dense_steps, "indexer": args.indexer_steps, "sparse": args.sparse_steps}
        self.timed = args.minutes is not None
        self.budget = args.minutes * 60 if self.timed else None
        self.hard_stop = args.hard_stop_minutes * 60 if args.hard_stop_minutes else float("inf")
        self.c = Counters()
        self.t_train = self.phase_t0 = time.time()

    def _held_batch(self, held_ids: torch.Tensor) -> torch.Tensor:
        T = self.T
        held_windows = [held_ids[i : i + T].clone() for i in range(0, len(held_ids) - T, T)][:8]
        for w in held_windows:
            w[0] = 0
        return torch.stack(held_windows)

    def batch(self) -> torch.Tensor:
        T = self.T
        starts = torch.randint(0, len(self.train_ids) - T, (self.B,), generator=self.gen)
        x = torch.stack([self.train_ids[s : s + T] for s in starts.tolist()])
        x[:, 0] = 0  # every window starts with <bos>, like a prompt does
        return x

    def quick_eval(self, sparse: bool) -> float:
        self.model.eval()
        set_index_topk(self.model, INDEX_TOPK if sparse else DENSE_TOPK)
        with torch.no_grad():
            loss = self.model(input_ids=self.held_batch, labels=self.held_batch).loss.item()
        self.model.train()
        return loss

    def main_lr(self) -> float:
        a, c = self.args, self.c
        if not self.timed:
            return lr_at(c.main_step, self.n["dense"] + self.n["sparse"], a.lr, a.warmup)
        # time-based cosine: progress = main-model seconds / main-model budget
        pseudo_total = 10**6
        prog = min(1.0, c.main_time / ((PHASE_SHARE["dense"] + PHASE_SHARE["sparse"]) * self.budget))
        if c.main_step < a.warmup:
            return lr_at(c.main_step, pseudo_total, a.lr, a.warmup)
        return lr_at(a.warmup + prog * (pseudo_total - a.warmup), pseudo_total, a.lr, a.warmup)

    def sparse_indexer_lr(self) -> float:
        if self.timed:
            prog = min(1.0, (time.time() - self.phase_t0) / (PHASE_SHARE["sparse"] * self.budget))
            return lr_at(int(1000 * prog), 1000, self.args.indexer_lr, 0)
        return lr_at(self.c.main_step - self.n["dense"], self.n["sparse"], self.args.indexer_lr, 0)

    def sparse_kl(self) -> torch.Tensor:
        """The indexer's KL to the main attention over its selected set, averaged over layers."""
        p, T = self.probe, self.T
        kl = torch.zeros(())
        for i in p.x:
            sc = indexer_scores(self.model.model.layers[i].self_attn, p.x[i], *p.cs[i])
            kl = kl + indexer_kl(sc, p.probs[i], p.selected_mask(i, T))
        return kl / len(p.x)

    def main_train_step(self, sparse: bool) -> tuple[float, float, float]:
        """Cross-entropy on the main model (plus, when sparse, the indexer's KL on its selection)."""
        ts, x, lr = time.time(), self.batch(), self.main_lr()
        for g in self.opt_main.param_groups:
            g["lr"] = lr
        self.probe.enabled = sparse
        loss = self.model(input_ids=x, labels=x).loss
        kl = torch.zeros(())
        if sparse:
            kl = self.sparse_kl()
            for g in self.opt_idx.param_groups:
                g["lr"] = self.sparse_indexer_lr()
        (loss + kl).backward()
        self.probe.enabled = False
        self.probe.clear()
        self._step(self.opt_main, self.main_params)
        if sparse:
            self._step(self.opt_idx, self.idx_params)
        with torch.no_grad():
            update_router_bias(self.model, self.probe, 1e-3)
        self.c.main_step += 1
        self.c.tokens_seen += x.numel()
        self.c.main_time += time.time() - ts
        return loss.item(), kl.item(), lr

    @staticmethod
    def _step(opt, params) -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def indexer_train_step(self, step: int) -> tuple[float, float]:
        """Main model frozen: only the indexer learns, by KL to the dense attention."""
        x = self.batch()
        lr = self.args.indexer_lr * min(1.0, (step + 1) / 20)
        for g in self.opt_idx.param_groups:
            g["lr"] = lr
        self.probe.enabled = True
        with torch.no_grad():
            self.model(input_ids=x)
        self.probe.enabled = False
        p, kl = self.probe, 0.0
        for i in p.x:
            sc = indexer_scores(self.model.model.layers[i].self_attn, p.x[i], *p.cs[i])
            kl = kl + indexer_kl(sc, p.probs[i])
        kl = kl / len(p.x)
        kl.backward()
        p.clear()
        self._step(self.opt_idx, self.idx_params)
        return kl.item(), lr

    def keep_going(self, phase: str, step: int) -> bool:
        if time.time() - self.log.t_start > self.hard_stop:
            self.log(f"hard stop reached in {phase} phase")
            return False
        if self.timed:
            # each phase ends at its share of the budget, measured from the start of training
            ends = {"dense": PHASE_SHARE["dense"], "indexer": PHASE_SHARE["dense"] + PHASE_SHARE["indexer"]}
            return time.time() - self.t_train < ends.get(phase, 1.0) * self.budget
        return step < self.n[phase]

    def run_dense(self) -> dict:
        set_index_topk(self.model, DENSE_TOPK)
        self.t_train = self.phase_t0 = time.time()
        step, ema, n = 0, None, self.n["dense"]
        while self.keep_going("dense", step):
            loss, _, lr = self.main_train_step(sparse=False)
            ema = loss if ema is None else 0.98 * ema + 0.02 * loss
            step += 1
            if step % 25 == 0 or step == n:
                rate = self.c.tokens_seen / (time.time() - self.phase_t0)
                self.log(f"dense {step}/{n} loss {loss:.3f} (ema {ema:.3f}) lr {lr:.2e} {rate:.0f} tok/s")
            if step % 250 == 0:
                self.log(f"  held-out loss (8 windows): dense {self.quick_eval(False):.3f}")
                set_index_topk(self.model, DENSE_TOPK)
        self.c.last_loss["dense"] = ema
        self.n["dense"] = step
        return {"steps": step, "seconds": round(time.time() - self.phase_t0, 1), "final_loss_ema": round(ema, 4)}

    def run_indexer_warmup(self) -> dict:
        self.phase_t0 = time.time()
        step, kl_ema, n = 0, None, self.n["indexer"]
        self.model.eval()  # no dropout anyway; makes the router hook skip counting
        while self.keep_going("indexer", step):
            kl, lr = self.indexer_train_step(step)
            kl_ema = kl if kl_ema is None else 0.95 * kl_ema + 0.05 * kl
            step += 1
            if step % 10 == 0 or step == n:
                self.log(f"indexer {step}/{n} KL {kl:.4f} (ema {kl_ema:.4f}) lr {lr:.2e}")
        self.model.train()
        self.n["indexer"] = step
        stats = {"steps": step, "seconds": round(time.time() - self.phase_t0, 1)}
        stats["final_kl_ema"] = round(kl_ema, 4) if kl_ema else None
        dense, sparse = self.quick_eval(False), self.quick_eval(True)
        self.log(f"  held-out loss after indexer warm-up: dense {dense:.3f} sparse {sparse:.3f}")
        return stats

    def run_sparse(self) -> dict:
        set_index_topk(self.model, INDEX_TOPK)
        self.phase_t0 = time.time()
        step, ema, kl_ema, n = 0, None, None, self.n["sparse"]
        while self.keep_going("sparse", step):
            loss, kl, lr = self.main_train_step(sparse=True)
            ema = loss if ema is None else 0.98 * ema + 0.02 * loss
            kl_ema = kl if kl_ema is None else 0.95 * kl_ema + 0.05 * kl
            step += 1
            if step % 25 == 0 or step == n:
                self.log(
                    f"sparse {step}/{n} loss {loss:.3f} (ema {ema:.3f}) KL {kl:.4f} (ema {kl_ema:.4f}) lr {lr:.2e}"
                )
            if step % 250 == 0:
                self.log(f"  held-out loss: dense {self.quick_eval(False):.3f} sparse {self.quick_eval(True):.3f}")
                set_index_topk(self.model, INDEX_TOPK)
        self.c.last_loss["sparse"] = ema
        self.n["sparse"] = step
        self.probe.remove()
        return {
            "steps": step,
            "seconds": round(time.time() - self.phase_t0, 1),
            "final_loss_ema": round(ema, 4) if ema else None,
            "final_kl_ema": round(kl_ema, 4) if kl_ema else None,
        }


def run_stats(args, argv, tr: Trainer, train_ids, held_ids, phases: dict) -> dict:
    n, c = tr.n, tr.c
    final = c.last_loss.get("sparse")
    return {
        "seed": args.seed,
        "threads": args.threads,
        "batch_size": tr.B,
        "context": tr.T,
        "params": sum(p.numel() for p in tr.model.parameters()),
        "train_tokens_in_corpus": len(train_ids),
        "heldout_tokens_in_corpus": len(held_ids),
        "phases": phases,
        "steps": {"dense": n["dense"], "indexer": n["indexer"], "sparse": n["sparse"]},
        "tokens_seen_main": c.tokens_seen,
        "command": "python scripts/train_embedded_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "lr_schedule": f"cosine over elapsed time (--minutes {args.minutes})" if tr.timed else "cosine over steps",
        "tokens_seen_indexer_warmup": n["indexer"] * tr.B * tr.T,
        "train_seconds": round(time.time() - tr.log.t_start, 1),
        "final_train_loss": round(final if final is not None else c.last_loss["dense"], 4),
        "reproduce": (
            f"python scripts/train_embedded_model.py --threads {args.threads} --seed {args.seed} "
            f"--dense-steps {n['dense']} --indexer-steps {n['indexer']} --sparse-steps {n['sparse']}"
        ),
    }


def save(model, out: Path, work_dir: str, stats: dict, log: Log) -> None:
    from transformers import GenerationConfig

    set_index_topk(model, INDEX_TOPK)
    model.eval()
    model.save_pretrained(str(out))
    # the config carries the shipped sparsity, not the training-time toggles
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["index_topk"] == INDEX_TOPK
    GenerationConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=2, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=64
    ).save_pretrained(str(out))
    with open(os.path.join(work_dir, "train_stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    log(f"saved to {out}; stats: {json.dumps(stats)}")


def evaluate(args, out: Path) -> None:
    """Held-out metrics and the model card (README.md in out)."""
    import eval_embedded_model

    stats_path = os.path.join(args.work_dir, "train_stats.json")
    eval_embedded_model.main(
        [str(out), *args.corpus, "--threads", str(args.threads), "--train-stats", stats_path, "--write-card"]
    )


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    os.makedirs(args.work_dir, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log()
    tok, train_ids, held_ids = prepare_data(args, out, log)
    tr = Trainer(args, build_model(tok.get_vocab_size(), log), train_ids, held_ids, log)
    phases = {"dense": tr.run_dense()}
    tr.model.save_pretrained(os.path.join(args.work_dir, "after_dense"))
    phases["indexer_warmup"] = tr.run_indexer_warmup()
    phases["sparse"] = tr.run_sparse()
    save(tr.model, out, args.work_dir, run_stats(args, argv, tr, train_ids, held_ids, phases), log)
    if not args.no_eval:
        evaluate(args, out)
    log("done")


if __name__ == "__main__":
    main()

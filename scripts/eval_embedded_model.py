#!/usr/bin/env python3
"""Evaluate mlaserve's embedded default model with transformers and (optionally) write its model card.

    . .venv/bin/activate
    python scripts/eval_embedded_model.py                      # prints the metrics as JSON
    python scripts/eval_embedded_model.py --write-card --train-stats /path/to/train_stats.json

Arguments: the model folder (default ``mlaserve/embedded/tiny-dsa``) and the corpus file(s) it was
trained on (default ``/usr/lib/bible.data`` from Debian's ``bible-kjv-text``); the held-out slice is
recomputed exactly as ``scripts/train_embedded_model.py`` makes it.  Takes 2-4 minutes on one core.

Metrics (all computed by transformers' ``DeepseekV32ForCausalLM``, fp32, eager attention):
* held-out perplexity over non-overlapping windows of 256 tokens (<bos> + 255), with the DSA indexer
  as shipped (index_topk 64) and forced off (dense attention), plus two non-learned selections of the
  same size (the most recent 64 keys; 64 random causal keys) to show that the indexer's choice matters;
  the same split by query position (< 64, where top-k selects everything, and >= 64);
  and windows of 512 tokens (twice the training context);
* the share of the dense attention mass (summed over heads) that the indexer's top-64 covers;
* the perplexity of a unigram model (add-one smoothed training-token frequencies, same tokenizer)
  on the same target tokens;
* the fraction of words in greedy continuations that occur in the training text;
* sample generations (greedy and sampled).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_dsa  # noqa: E402

WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
PROMPTS = [
    "Hello",
    "In the beginning",
    "And it came to pass, when",
    "The LORD is my shepherd",
    "Blessed are the",
    "And Jesus said unto them,",
    "Wisdom is",
    "Then the king of Israel",
    "My son, hear",
    "For God so loved",
]
CARD_SAMPLES = [  # (prompt, mode)
    ("Hello", "greedy"),
    ("In the beginning", "greedy"),
    ("And Jesus said unto them,", "sampled"),
]


def load(folder):
    from transformers import AutoTokenizer, DeepseekV32ForCausalLM

    model = DeepseekV32ForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(folder)
    return model, tok


class SelectionOverride:
    """Forward hooks on every indexer that replace its top-k indices by a non-learned choice."""

    def __init__(self, model, kind: str, k: int, seed: int = 0):
        self.kind, self.k = kind, k
        self.gen = torch.Generator().manual_seed(seed)
        self.handles = [layer.self_attn.indexer.register_forward_hook(self.hook) for layer in model.model.layers]

    def hook(self, mod, args, out):
        B, S, K = out.shape
        T = S  # no cache in these evaluations
        s = torch.arange(S)[:, None]
        if self.kind == "recent":
            idx = (s - torch.arange(K)[None, :]).clamp_min(0)  # s, s-1, ..., s-K+1 (duplicates of 0 harmless)
        elif self.kind == "random":
            # K random causal keys per row: rank random keys, causal ones first
            r = torch.rand(S, T, generator=self.gen)
            r = r.masked_fill(torch.ones(S, T, dtype=torch.bool).triu(1), 2.0)
            idx = r.topk(K, dim=-1, largest=False).indices
        else:
            raise ValueError(self.kind)
        return idx[None].expand(B, S, K).to(out.dtype).contiguous()

    def remove(self):
        for h in self.handles:
            h.remove()


def windows(ids: torch.Tensor, T: int) -> torch.Tensor:
    ws = [ids[i : i + T].clone() for i in range(0, len(ids) - T + 1, T - 1)]
    out = torch.stack(ws)
    out[:, 0] = 0
    return out


@torch.no_grad()
def nll_by_position(model, wins, topk, batch=8, override=None, seed=0):
    """Per-target NLL [N, T-1] for the windows, with index_topk = topk (or an override selection)."""
    tiny_dsa.set_index_topk(model, topk)
    ov = SelectionOverride(model, override, topk, seed) if override else None
    rows = []
    try:
        for i in range(0, len(wins), batch):
            x = wins[i : i + batch]
            logits = model(input_ids=x).logits.float()
            rows.append(F.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none"))
    finally:
        if ov:
            ov.remove()
        tiny_dsa.set_index_topk(model, tiny_dsa.INDEX_TOPK)
    return torch.cat(rows)


@torch.no_grad()
def indexer_recall(model, wins, k=tiny_dsa.INDEX_TOPK):
    """Mean share of the dense attention mass (heads summed) inside the indexer's top-k, rows >= k."""
    tiny_dsa.set_index_topk(model, tiny_dsa.DENSE_TOPK)
    probe = tiny_dsa.Probe(model)
    probe.enabled = True
    res = {"indexer": [], "recent": []}
    try:
        for i in range(0, len(wins), 8):
            x = wins[i : i + 8]
            model(input_ids=x)
            B, T = x.shape
            for li in probe.x:
                p = probe.probs[li].float().sum(1)
                p = p / p.sum(-1, keepdim=True)
                sc = tiny_dsa.indexer_scores(model.model.layers[li].self_attn, probe.x[li], *probe.cs[li])
                sc = sc.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
                sel = torch.zeros_like(p, dtype=torch.bool).scatter(-1, sc.topk(k, -1).indices, True)
                s = torch.arange(T)[:, None]
                t = torch.arange(T)[None, :]
                recent = ((s - t) >= 0) & ((s - t) < k)
                res["indexer"].append((p * sel)[:, k:].sum(-1).mean().item())
                res["recent"].append((p * recent)[:, k:].sum(-1).mean().item())
            probe.clear()
    finally:
        probe.remove()
        tiny_dsa.set_index_topk(model, tiny_dsa.INDEX_TOPK)
    return {key: round(sum(v) / len(v), 4) for key, v in res.items()}


def ppl(nll):
    return round(math.exp(nll.mean().item()), 3)


def generate(model, tok, prompt, mode, max_new_tokens=80, seed=0):
    enc = tok(prompt, return_tensors="pt")
    kw = dict(max_new_tokens=max_new_tokens, pad_token_id=2)
    if mode == "greedy":
        kw.update(do_sample=False)
    else:
        torch.manual_seed(seed)
        kw.update(do_sample=True, temperature=0.8, top_p=0.95, top_k=0)
    with torch.no_grad():
        out = model.generate(**enc, **kw)
    return tok.decode(out[0, enc.input_ids.shape[1] :], skip_special_tokens=True)


def evaluate(folder, corpus, threads=1):
    torch.set_num_threads(threads)
    t0 = time.time()
    model, tok = load(folder)
    train_docs, held_docs = tiny_dsa.load_corpus(corpus)
    from tokenizers import Tokenizer

    raw_tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    train_ids = tiny_dsa.encode_docs(raw_tok, train_docs)
    held_ids = tiny_dsa.encode_docs(raw_tok, held_docs)
    r = {"heldout_tokens": len(held_ids), "index_topk": tiny_dsa.INDEX_TOPK}
    w256 = windows(held_ids, tiny_dsa.CONTEXT)
    r.update(perplexities(model, held_ids, w256))
    r["attention_mass_in_top64"] = indexer_recall(model, w256[:16])
    r["unigram_ppl_256"] = unigram_ppl(train_ids, w256, raw_tok.get_vocab_size())
    r["model_over_unigram"] = round(r["ppl_256"]["sparse"] / r["unigram_ppl_256"], 4)
    r.update(generations(model, tok, train_docs))
    r["eval_seconds"] = round(time.time() - t0, 1)
    return r


def perplexities(model, held_ids, w256) -> dict:
    """Held-out perplexity with the indexer, dense, and two non-learned selections; by query
    position; and on windows of twice the trained context."""
    K = tiny_dsa.INDEX_TOPK
    r = {"windows_256": len(w256)}
    nll = {
        "sparse": nll_by_position(model, w256, K),
        "dense": nll_by_position(model, w256, tiny_dsa.DENSE_TOPK),
        "recent64": nll_by_position(model, w256, K, override="recent"),
        "random64": nll_by_position(model, w256, K, override="random"),
    }
    r["ppl_256"] = {k: ppl(v) for k, v in nll.items()}
    # target j predicts token j+1 from query position j; top-k only bites for query positions >= K
    r["ppl_256_queries_ge_64"] = {k: ppl(v[:, K:]) for k, v in nll.items()}
    r["ppl_256_queries_lt_64"] = {k: ppl(v[:, :K]) for k, v in nll.items()}
    r["sparse_vs_dense_max_abs_logprob_diff"] = round((nll["sparse"] - nll["dense"]).abs().max().item(), 4)
    w512 = windows(held_ids, 512)
    r["windows_512"] = len(w512)
    r["ppl_512"] = {
        "sparse": ppl(nll_by_position(model, w512, K, batch=4)),
        "dense": ppl(nll_by_position(model, w512, tiny_dsa.DENSE_TOPK, batch=4)),
    }
    return r


def unigram_ppl(train_ids, w256, V: int) -> float:
    """Perplexity of add-one smoothed training-token frequencies on the same targets."""
    counts = Counter(train_ids.tolist())
    total = sum(counts.values())
    logp = torch.tensor([math.log((counts.get(i, 0) + 1) / (total + V)) for i in range(V)])
    return round(math.exp(-logp[w256[:, 1:]].mean().item()), 3)


def generations(model, tok, train_docs) -> dict:
    """Greedy continuations of PROMPTS (and the share of their words found in the training text),
    and the model card's samples."""
    corpus_words = {w.lower() for d in train_docs for w in WORD.findall(d)}
    greedy = {p: generate(model, tok, p, "greedy") for p in PROMPTS}
    words = [w.lower() for text in greedy.values() for w in WORD.findall(text)]
    return {
        "greedy_words": len(words),
        "corpus_word_fraction": round(sum(w in corpus_words for w in words) / max(1, len(words)), 4),
        "greedy_samples": greedy,
        "card_samples": [
            {"prompt": p, "mode": m, "text": greedy[p] if m == "greedy" else generate(model, tok, p, m, seed=0)}
            for p, m in CARD_SAMPLES
        ],
    }


def _blockquote(text):
    return "\n".join("> " + ln if ln else ">" for ln in text.split("\n"))


def write_card(folder, r, stats):
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.name != "README.md"}
    st = stats or {}
    card = (
        CARD_INTRO
        + _card_corpus(r, st)
        + _card_architecture(cfg, st)
        + _card_training(st)
        + _card_evaluation(r)
        + _card_samples(r)
        + "\n".join(f"| `{k}` | {v} |" for k, v in sizes.items())
        + "\n\n"
        + _card_reproduce(st)
    )
    (folder / "README.md").write_text(card)


CARD_INTRO = """# tiny-dsa: mlaserve's embedded default model

A tiny **DeepSeek-V3.2-architecture** causal LM (`model_type: deepseek_v32`,
`DeepseekV32ForCausalLM` in transformers 5.24) trained from scratch on the **King James Bible**.
It ships inside the package so that `mlaserve generate "Hello"` works offline, and it exercises every
part of the architecture: MLA with a compressed latent KV cache, a DeepSeek-V3 MoE (sigmoid router with
`e_score_correction_bias`, top-2 of 6 routed experts plus 1 shared expert) and DSA sparse attention
whose lightning indexer was really trained and really selects (top-64 keys of up to 256).
It writes KJV-flavoured English; it knows nothing else.

"""


def _card_corpus(r, st) -> str:
    return f"""## Corpus and licence

* Text: the King James Version (1611) from Debian's `bible-kjv-text` package (`/usr/lib/bible.data`,
  turned into text with the `bible` program of `bible-kjv`; the package is in Debian `main`). The 1611
  translation is in the public domain (in the United Kingdom, printing the text itself falls under the
  Crown's letters patent; no KJV text is shipped here, only weights). Chapter headings (`Genesis 1`) are kept, verse
  numbers dropped, one verse per line; each book is one document (`<bos> ... <eos>`).
* Why: it is the largest clean, public-domain English *prose* text found in Debian's archive (4.2 MB, pure ASCII);
  `fortunes` is too heterogeneous and too small for a model to read fluently, `dict-gcide` is
  dictionary entries, not running text. The KJV's regular style and closed vocabulary
  (~12.8k word types) let a 5M-parameter model trained for {fmt_s(st.get("train_seconds"))} on one CPU core produce
  fluent-looking text.
* Held out: the last 2% of the lines (from 2 Peter 3:12 on: 1-3 John, Jude, Revelation), {r["heldout_tokens"]} tokens, never seen by the
  tokenizer or the model.
* The model weights are released under the same terms as the rest of mlaserve.

"""


def _card_architecture(cfg, st) -> str:
    return f"""## Architecture ({st.get("params", "n/a")} parameters, fp32)

| | |
|---|---|
| layers | {cfg["num_hidden_layers"]} (layer 0 dense MLP {cfg["intermediate_size"]}, layers 1-3 MoE) |
| hidden | {cfg["hidden_size"]}, RMSNorm eps {cfg["rms_norm_eps"]} |
| MLA | {cfg["num_attention_heads"]} heads (`num_key_value_heads` {cfg["num_key_value_heads"]}), q_lora_rank {cfg["q_lora_rank"]}, kv_lora_rank {cfg["kv_lora_rank"]}, qk_nope {cfg["qk_nope_head_dim"]}, qk_rope {cfg["qk_rope_head_dim"]} (interleaved), v {cfg["v_head_dim"]} |
| DSA indexer | {cfg["index_n_heads"]} heads x {cfg["index_head_dim"]} dims (RoPE on the first {cfg["qk_rope_head_dim"]}, half-split), `index_topk` {cfg["index_topk"]} |
| MoE | {cfg["n_routed_experts"]} routed experts (moe_intermediate {cfg["moe_intermediate_size"]}), top-{cfg["num_experts_per_tok"]}, {cfg["n_shared_experts"]} shared; sigmoid + `e_score_correction_bias`, n_group 1, `norm_topk_prob` true, `routed_scaling_factor` {cfg["routed_scaling_factor"]} |
| vocab | {V_of(cfg)} byte-level BPE, `<bos>`=0, `<eos>`=1, `<pad>`=2; the tokenizer prepends `<bos>` |
| embeddings | tied (`tie_word_embeddings` true: the safetensors file has no `lm_head.weight`) |
| RoPE | default, theta 10000; trained context 256, `max_position_embeddings` {cfg["max_position_embeddings"]} |
| MTP | none (`num_nextn_predict_layers` 0) |

On disk the experts use the Hub layout (`mlp.experts.{{i}}.{{gate,up,down}}_proj.weight`), as written by
`save_pretrained`.

"""


def _card_training(st) -> str:
    ph, steps = st.get("phases", {}), st.get("steps", {})
    B, T = st.get("batch_size", 8), st.get("context", 256)
    return f"""## Training

`scripts/train_embedded_model.py` (seeded, seed {st.get("seed")}), {st.get("threads")} CPU thread(s),
batches of {B} x {T} tokens, AdamW (betas 0.9/0.95, weight decay 0.1, clip 1.0), peak LR 2e-3 with 100
warm-up steps and cosine decay to 10% over the main model's steps; indexer AdamW LR 1e-3.
Following DeepSeek-V3.2's recipe for the indexer:

1. **dense phase**: {steps.get("dense")} steps, {fmt_s(ph.get("dense", {}).get("seconds"))}: next-token cross-entropy, top-k forced off
   (every causal key selected). Final training loss (EMA) {ph.get("dense", {}).get("final_loss_ema")}.
2. **indexer warm-up**: {steps.get("indexer")} steps, {fmt_s(ph.get("indexer_warmup", {}).get("seconds"))}: main model frozen, only the indexer
   learns, by KL(p || softmax(indexer scores)) with p the dense attention distribution summed over heads and
   renormalised (the indexer's scores are recomputed with gradients from its weights, since transformers
   runs it under `no_grad`). Final KL {ph.get("indexer_warmup", {}).get("final_kl_ema")}.
3. **sparse phase**: {steps.get("sparse")} steps, {fmt_s(ph.get("sparse", {}).get("seconds"))}: top-64 selection active in transformers'
   forward; cross-entropy for the main model plus the indexer KL restricted to the selected keys (indexer inputs
   detached). Final KL {ph.get("sparse", {}).get("final_kl_ema")}.

MoE load balance: DeepSeek-V3's auxiliary-loss-free bias update (gamma 1e-3 per step).
Main-model tokens: {st.get("tokens_seen_main")} (~{round(st.get("tokens_seen_main", 0) / max(1, st.get("train_tokens_in_corpus", 1)), 1)} epochs of the
{st.get("train_tokens_in_corpus")}-token training split); total wall time {fmt_s(st.get("train_seconds"))}.
**Final training loss: {st.get("final_train_loss")}** (EMA of the last sparse-phase steps).

"""


def _card_evaluation(r) -> str:
    p256, pge = r["ppl_256"], r["ppl_256_queries_ge_64"]
    return f"""## Evaluation (transformers 5.24, fp32, eager attention; `scripts/eval_embedded_model.py`)

Held-out text, {r["windows_256"]} windows of 256 tokens (`<bos>` + 255; the trained context):

| selection in every layer | perplexity | queries at positions >= 64 | queries < 64 |
|---|---|---|---|
| **indexer top-64 (as shipped)** | **{p256["sparse"]}** | {pge["sparse"]} | {r["ppl_256_queries_lt_64"]["sparse"]} |
| none (dense attention, top-k forced off) | {p256["dense"]} | {pge["dense"]} | {r["ppl_256_queries_lt_64"]["dense"]} |
| the 64 most recent keys | {p256["recent64"]} | {pge["recent64"]} | {r["ppl_256_queries_lt_64"]["recent64"]} |
| 64 random causal keys | {p256["random64"]} | {pge["random64"]} | {r["ppl_256_queries_lt_64"]["random64"]} |

* Unigram model with the same tokenizer (add-one smoothed training frequencies), same targets:
  perplexity **{r["unigram_ppl_256"]}**; model / unigram = **{r["model_over_unigram"]}** (target <= 0.25).
* Long text, {r["windows_512"]} windows of 512 tokens (twice the trained context): sparse {r["ppl_512"]["sparse"]}, dense {r["ppl_512"]["dense"]}.
* Share of the dense attention mass (summed over heads, queries >= 64) inside the indexer's top-64:
  **{r["attention_mass_in_top64"]["indexer"]}**
  (the 64 most recent keys: {r["attention_mass_in_top64"]["recent"]}).
* Largest per-token log-probability change between sparse and dense: {r["sparse_vs_dense_max_abs_logprob_diff"]} nats.
* Words in greedy continuations of {len(r["greedy_samples"])} prompts (80 new tokens each) that occur in the
  training text: **{r["corpus_word_fraction"] * 100:.1f}%** of {r["greedy_words"]} (target >= 90%).
* **mlaserve engine held-out perplexity (256-token windows, index_topk 64):** run `python scripts/engine_perplexity.py` and write its figure here.

"""


def _card_samples(r) -> str:
    """The sample generations, then the head of the files table (its rows follow)."""
    samples = "\n\n".join(
        f"**{s['mode']}**, prompt `{s['prompt']}`"
        + (" (temperature 0.8, top-p 0.95, `torch.manual_seed(0)`)" if s["mode"] == "sampled" else "")
        + ":\n\n"
        + _blockquote(s["prompt"] + s["text"])
        for s in r["card_samples"]
    )
    return f"""## Samples (transformers `generate`, 80 new tokens)

{samples}

## Files

| file | bytes |
|---|---|
"""


def _reproduction(st) -> tuple[str, str]:
    """The command that made the model, and how closely a rerun reproduces it."""
    m = re.search(r"--minutes ([0-9.]+)", st.get("lr_schedule", ""))
    if not m:
        return st.get("reproduce", "python scripts/train_embedded_model.py"), (
            "Training is seeded; fp32 CPU kernels and thread counts can change the last bits, so a "
            "rerun reproduces the numbers closely rather than bit for bit."
        )
    steps = st.get("steps", {})
    command = (
        f"python scripts/train_embedded_model.py --threads {st.get('threads')} --seed {st.get('seed')} "
        f"--minutes {m.group(1)} --work-dir runs/tiny-dsa-work"
    )
    return command, (
        "This run used a wall-clock budget: the phases end at 65% / 72% / 100% of it and the learning rates "
        "follow elapsed time, so the step counts depend on the machine (here one core of a shared 2-core "
        f"VM: {steps.get('dense')} / {steps.get('indexer')} / {steps.get('sparse')} steps). "
        f"`{st.get('reproduce')}` replays the same step counts with a step-based cosine schedule "
        "(the same recipe, not the same bits). The data order, initialisation and tokenizer are seeded."
    )


def _card_reproduce(st) -> str:
    command, repro_note = _reproduction(st)
    return f"""## Reproduce

```
apt-get install bible-kjv-text
. .venv/bin/activate
{command}   # ~{fmt_s(st.get("train_seconds"))} + evaluation; writes this folder
python scripts/eval_embedded_model.py --write-card --train-stats runs/tiny-dsa-work/train_stats.json   # numbers above
```
{repro_note}
"""


def V_of(cfg):
    return cfg["vocab_size"]


def fmt_s(s):
    if s is None:
        return "n/a"
    return f"{s / 60:.1f} min"


def main(argv=None):
    ap = argparse.ArgumentParser(description="evaluate the embedded tiny-dsa model")
    ap.add_argument("folder", nargs="?", default=str(tiny_dsa.DEFAULT_OUT))
    ap.add_argument("corpus", nargs="*", default=[tiny_dsa.DEFAULT_CORPUS])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--train-stats", default=None, help="train_stats.json written by the training script")
    ap.add_argument("--write-card", action="store_true", help="(re)write README.md in the model folder")
    ap.add_argument("--json", default=None, help="also write the metrics to this file")
    args = ap.parse_args(argv)
    r = evaluate(args.folder, args.corpus or [tiny_dsa.DEFAULT_CORPUS], args.threads)
    print(json.dumps(r, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    if args.write_card:
        stats = json.loads(Path(args.train_stats).read_text()) if args.train_stats else None
        write_card(args.folder, r, stats)
        print(f"wrote {Path(args.folder) / 'README.md'}")
    return r


if __name__ == "__main__":
    main()

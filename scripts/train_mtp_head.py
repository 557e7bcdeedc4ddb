#!/usr/bin/env python3
"""Train a multi-token-prediction (MTP) layer for the embedded model, trunk frozen, and ship it in the
release layout (model.layers.4.* + num_nextn_predict_layers 1) so `--speculative mtp` works out of the box.

The MTP layer (DeepSeek-V3 report, section 2.2; mlaserve/models/mtp.py):
    logits_i = shared_head(Block(eh_proj([enorm(Emb(t_{i+1})) ; hnorm(h_i)])))   predicts t_{i+2}
with h_i the frozen trunk's final (normed) hidden state, Emb and the head shared with the trunk (tied
embeddings, frozen; the checkpoint carries no copy, so the loader shares them). The Block is a dense-
attention DeepSeek-V3 decoder layer (MLA + MoE; no DSA indexer: the layer sees at most the trained
256-token context, and an indexer would need its own KL training), initialised from the trunk's last
layer; eh_proj starts as [0.1 N(0, 1/2D) | I] so the first drafts read the trunk's state; shared_head.norm
starts from model.norm. Loss: self-distillation -- cross-entropy of logits_i against the frozen trunk's own
next-position distribution softmax(lm_head(h_{i+1})) on windows of the training split (the trunk forward
computes it anyway; a draft is accepted when it matches the trunk, not the text, so the trunk is the
target). The MoE correction bias stays as copied (no balance updates in so short a run).

Data: the KJV training split of scripts/tiny_dsa.py (as scripts/train_embedded_model.py uses it) (the same held-out tail is never used
here); held-out acceptance is measured by mlaserve itself: greedy generation from held-out passages with
speculative="mtp", k = 1..3, drafts proposed and accepted counted by the engine.

    python scripts/train_mtp_head.py --minutes 15 --threads 1 --corpus /usr/lib/bible.data

Seeded (--seed); the learning rate follows elapsed time (warm-up 5%, cosine to 10%), so a run ends on
its budget on a busy machine. Writes the model folder in place (--out) and <work-dir>/mtp_stats.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_dsa as tr  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "mlaserve" / "embedded" / "tiny-dsa"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", nargs="+", default=[tr.DEFAULT_CORPUS])
    p.add_argument("--out", default=str(FOLDER), help="the embedded model folder (written in place)")
    p.add_argument("--minutes", type=float, default=15.0, help="training wall-clock budget")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--work-dir", default="runs/mtp-head")
    p.add_argument("--eval-prompts", type=int, default=24)
    p.add_argument("--eval-new", type=int, default=48)
    return p.parse_args(argv)


def block_config(trunk_cfg):
    """A one-layer DeepSeek-V3 model shaped like the trunk's MoE layers: model(inputs_embeds=x).logits
    = head(norm(Block(x))), i.e. the MTP's Block and shared head."""
    from transformers import DeepseekV3Config

    c = trunk_cfg
    return DeepseekV3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=1,
        first_k_dense_replace=0,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        n_routed_experts=c.n_routed_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        n_shared_experts=c.n_shared_experts,
        n_group=c.n_group,
        topk_group=c.topk_group,
        norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_interleave=True,  # deepseek_v32's main rope is interleaved
        rope_parameters=dict(c.rope_parameters),
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
    )


class MTPHead(torch.nn.Module):
    def __init__(self, trunk, seed: int) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        d, eps = trunk.config.hidden_size, trunk.config.rms_norm_eps
        self.enorm = torch.nn.RMSNorm(d, eps=eps)
        self.hnorm = torch.nn.RMSNorm(d, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.eh_proj.weight[:, :d].copy_(0.1 * torch.randn(d, d, generator=g) * (2 * d) ** -0.5)
            self.eh_proj.weight[:, d:].copy_(torch.eye(d))
        self.block = AutoModelForCausalLM.from_config(block_config(trunk.config), attn_implementation="eager")
        last = trunk.config.num_hidden_layers - 1
        src = {k[len(f"model.layers.{last}.") :]: v for k, v in trunk.state_dict().items() if f"layers.{last}." in k}
        own = {k: v for k, v in src.items() if ".indexer." not in k}
        state = {f"model.layers.0.{k}": v for k, v in own.items()}
        state["model.embed_tokens.weight"] = trunk.model.embed_tokens.weight
        state["model.norm.weight"] = trunk.model.norm.weight
        state["lm_head.weight"] = trunk.lm_head.weight
        self.block.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
        self.embed, self.head = trunk.model.embed_tokens, self.block.lm_head  # frozen, shared with the trunk
        for p in (*self.block.model.embed_tokens.parameters(), *self.block.lm_head.parameters()):
            p.requires_grad_(False)
        for name, b in self.block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.requires_grad_(False)

    def forward(self, next_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """next_ids [B, L]: t_{i+1}; h [B, L, D]: h_i -> logits [B, L, V] predicting t_{i+2}."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed(next_ids)), self.hnorm(h)], dim=-1))
        return self.block(inputs_embeds=x).logits


def windows(stream: torch.Tensor, n: int, length: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length - 1, (n,), generator=g)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def lr_at(elapsed: float, budget: float, peak: float) -> float:
    frac = elapsed / budget
    if frac < 0.05:
        return peak * max(frac / 0.05, 0.02)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min((frac - 0.05) / 0.95, 1.0))))


def train(args, trunk, head: MTPHead, stream: torch.Tensor) -> dict:
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(args.seed)
    budget, t0, step, ema, ema_agree = args.minutes * 60, time.monotonic(), 0, None, None
    while time.monotonic() - t0 < budget:
        ids = windows(stream, args.batch, args.context, g)
        with torch.no_grad():
            h = trunk.model(ids).last_hidden_state  # [B, L, D], after model.norm
            teacher = trunk.lm_head(h[:, 1:-1]).softmax(-1)  # the trunk's distribution for t_{i+2}
        logits = head(ids[:, 1:-1], h[:, :-2])  # positions 0..L-3: input t_{i+1} and h_i
        loss = F.cross_entropy(logits.flatten(0, 1), teacher.flatten(0, 1))
        agree = (logits.argmax(-1) == teacher.argmax(-1)).float().mean().item()
        for group in opt.param_groups:
            group["lr"] = lr_at(time.monotonic() - t0, budget, args.lr)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        ema_agree = agree if ema_agree is None else 0.95 * ema_agree + 0.05 * agree
        if step % 20 == 0:
            print(
                f"step {step} loss {ema:.4f} top-1 agreement {ema_agree:.3f} ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    return {
        "steps": step,
        "final_loss_ema": ema,
        "final_train_agreement_ema": ema_agree,
        "train_minutes": (time.monotonic() - t0) / 60,
    }


def release_tensors(head: MTPHead, layer: int, work: Path) -> dict[str, torch.Tensor]:
    """The MTP tensors under the release names (experts in the Hub layout, as save_pretrained writes them)."""
    from safetensors.torch import load_file

    tmp = work / "block"
    head.block.save_pretrained(tmp)
    block = load_file(str(tmp / "model.safetensors"))
    out = {}
    for k, v in block.items():
        if "layers.0." not in k:
            continue
        name = f"model.layers.{layer}.{k[len('model.layers.0.') :]}"
        if name.endswith("experts.gate_up_proj"):  # the trunk's on-disk layout: one tensor per expert
            base, inter = name[: -len(".gate_up_proj")], v.shape[1] // 2
            out |= {f"{base}.{e}.gate_proj.weight": v[e, :inter] for e in range(v.shape[0])}
            out |= {f"{base}.{e}.up_proj.weight": v[e, inter:] for e in range(v.shape[0])}
        elif name.endswith("experts.down_proj"):
            base = name[: -len(".down_proj")]
            out |= {f"{base}.{e}.down_proj.weight": v[e] for e in range(v.shape[0])}
        else:
            out[name] = v
    p = f"model.layers.{layer}."
    out[p + "enorm.weight"] = head.enorm.weight.detach().clone()
    out[p + "hnorm.weight"] = head.hnorm.weight.detach().clone()
    out[p + "eh_proj.weight"] = head.eh_proj.weight.detach().clone()
    out[p + "shared_head.norm.weight"] = block["model.norm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def ship(folder: Path, tensors: dict[str, torch.Tensor], layer: int) -> None:
    """Rewrite model.safetensors with the trunk's tensors unchanged plus the MTP layer's (replacing an older one)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    trunk = {k: v for k, v in load_file(str(path)).items() if not k.startswith(f"model.layers.{layer}.")}
    save_file(trunk | tensors, str(path), metadata={"format": "pt"})
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def held_out_agreement(trunk, head: MTPHead, tok, heldout: list[str], args) -> float:
    """Teacher-forced: how often the MTP's argmax at i equals the trunk's argmax at i + 1 on held-out text."""
    stream = tr.encode_docs(tok, heldout)
    g = torch.Generator().manual_seed(args.seed + 2)
    hits = total = 0
    with torch.no_grad():
        for _ in range(8):
            ids = windows(stream, args.batch, args.context, g)
            h = trunk.model(ids).last_hidden_state
            teacher = trunk.lm_head(h[:, 1:-1]).argmax(-1)
            hits += (head(ids[:, 1:-1], h[:, :-2]).argmax(-1) == teacher).sum().item()
            total += teacher.numel()
    return hits / total


def held_out_acceptance(folder: Path, tok, heldout: list[str], args) -> dict:
    """mlaserve greedy generation from held-out passages, with and without speculation."""
    from mlaserve import LLM, SamplingParams

    stream = tr.encode_docs(tok, heldout)
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = [w.tolist() for w in windows(stream, args.eval_prompts, 32, g)]
    params = SamplingParams(temperature=0.0, max_tokens=args.eval_new, ignore_eos=True)
    exact = {"threads": args.threads, "dtype": "float32"}  # "identical_to_plain" is a float32 property
    plain = [o.outputs[0].token_ids for o in LLM(str(folder), **exact).generate(prompts, params)]
    out = {}
    for k in (1, 2, 3):
        llm = LLM(str(folder), **exact, speculative="mtp", num_speculative_tokens=k)
        outs = llm.generate(prompts, params)
        prop, acc, verifies = (
            sum(o.metrics[m] for o in outs) for m in ("num_draft_tokens", "num_accepted_tokens", "num_verify_steps")
        )
        out[f"k={k}"] = {
            "acceptance_rate": acc / max(prop, 1),
            "mean_accepted_length": (acc + verifies) / max(verifies, 1),
            "proposed": prop,
            "accepted": acc,
            "identical_to_plain": [o.outputs[0].token_ids for o in outs] == plain,
            "prompts": len(prompts),
        }
    return out


def batch1_speed(folder: Path, tok, heldout: list[str], args) -> dict:
    """Decode tok/s at batch 1 (after the first token; mean over 4 held-out prompts), plain and k = 1..3."""
    from mlaserve import LLM, SamplingParams

    g = torch.Generator().manual_seed(args.seed + 3)
    prompts = [w.tolist() for w in windows(tr.encode_docs(tok, heldout), 4, 32, g)]
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    out = {}
    for k in (0, 1, 2, 3):
        opts = {"speculative": "mtp", "num_speculative_tokens": k} if k else {}
        llm = LLM(str(folder), threads=args.threads, **opts)
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
        rates = [llm.generate([p], params)[0].metrics["tokens_per_s"] for p in prompts]
        out["plain" if k == 0 else f"k={k}"] = sum(rates) / len(rates)
    return out


def write_card(folder: Path, stats: dict) -> None:
    """The model card's MTP row, MTP section and file sizes (the rest of the card is eval_embedded_model's)."""
    import re

    card = (folder / "README.md").read_text()
    card = re.sub(
        r"\| MTP \|[^\n]*\|",
        "| MTP | 1 layer (`model.layers.4`, `num_nextn_predict_layers` 1): MLA + MoE shaped like layers 1-3, dense "
        "attention (no indexer); embeddings and head shared with the trunk; see below |",
        card,
    )
    ho, sp = stats["held_out"], stats["batch1_tok_s"]
    rows = "\n".join(
        f"| {k} | {v['acceptance_rate']:.1%} | {v['mean_accepted_length']:.2f} | {sp[k]:.1f} "
        f"({sp[k] / sp['plain']:.2f}x) | {'yes' if v['identical_to_plain'] else 'NO'} |"
        for k, v in ho.items()
    )
    a = stats["args"]
    section = f"""## MTP head (speculative decoding)

`mlaserve generate --speculative mtp` drafts with this layer and verifies the drafts in the trunk's forward
(greedy output identical to plain decoding). Trained by `scripts/train_mtp_head.py` (seed {a["seed"]}, {a["threads"]}
thread, {stats["train_minutes"]:.1f} min, {stats["steps"]} steps of {a["batch"]} x {a["context"]} tokens, AdamW lr {a["lr"]})
with the trunk frozen: self-distillation of the trunk's next-position distribution (a draft is accepted
when it matches the trunk), block initialised from layer 3. Final training loss (EMA) {stats["final_loss_ema"]:.3f};
on held-out text the layer's top-1 equals the trunk's next top-1 at {stats["held_out_teacher_forced_agreement"]:.1%}
of positions (teacher-forced).

Held out (greedy, {ho["k=1"]["prompts"]} passages of the held-out books x {a["eval_new"]} new tokens; mlaserve's
counts) and decode speed at batch 1 (mean of 4 held-out prompts, 96 new tokens, plain: {sp["plain"]:.1f} tok/s;
{a["threads"]} thread on a shared 2-core VM):

| k | acceptance | mean accepted length | tok/s | identical |
|---|---|---|---|---|
{rows}

Deeper drafts (k > 1) re-run the layer on its own output, which it was not trained for.

"""
    card = re.sub(r"## MTP head \(speculative decoding\)\n.*?(?=## Files)", "", card, flags=re.S)
    card = card.replace("## Files", section + "## Files", 1)
    size = (folder / "model.safetensors").stat().st_size
    card = re.sub(r"\| `model.safetensors` \| \d+ \|", f"| `model.safetensors` | {size} |", card)
    card = re.sub(r"\| `config.json` \| \d+ \|", f"| `config.json` | {(folder / 'config.json').stat().st_size} |", card)
    line = (
        "python scripts/train_mtp_head.py --threads 1 --seed 1234 --minutes 15   # the MTP head and its section above"
    )
    if line.split("   #")[0] not in card:
        card = re.sub(
            r"(python scripts/eval_embedded_model.py[^\n]*\n)", lambda m: m.group(1) + line + "\n", card, count=1
        )
    (folder / "README.md").write_text(card)


def main(argv=None) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    folder, work = Path(args.out), Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    train_docs, heldout = tr.load_corpus(args.corpus)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    stream = tr.encode_docs(tok, train_docs)
    trunk = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    trunk.eval().requires_grad_(False)
    head = MTPHead(trunk, args.seed)
    print(f"{sum(p.numel() for p in head.parameters() if p.requires_grad)} trainable MTP parameters", flush=True)
    stats = train(args, trunk, head, stream)
    head.eval()
    stats["held_out_teacher_forced_agreement"] = held_out_agreement(trunk, head, tok, heldout, args)
    n = trunk.config.num_hidden_layers
    ship(folder, release_tensors(head, n, work), n)
    stats["held_out"] = held_out_acceptance(folder, tok, heldout, args)
    stats["batch1_tok_s"] = batch1_speed(folder, tok, heldout, args)
    stats["args"] = vars(args)
    (work / "mtp_stats.json").write_text(json.dumps(stats, indent=2))
    write_card(folder, stats)
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()

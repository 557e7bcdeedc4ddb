#!/usr/bin/env python3
"""Decode tok/s with and without MTP speculative decoding, greedy output checked identical.

Models
  embedded   the shipped tiny-dsa model (its MTP head trained on the KJV: a real acceptance rate)
  standard   benchmarks/common.py's standard model plus one random MTP layer (acceptance ~0: this
             measures the overhead of drafts that fail)
  PATH       any folder with an MTP layer
Per setting: plain decode, then speculative with k = 1..3 (the engine's default acceptance switch; with
--always also with the switch off, drafting every step), at batch 1 and at --concurrency requests;
decode tok/s = generated tokens after the first / time after the first token (all requests together).
Each setting loads a plain and a speculative engine side by side and alternates them --rounds times;
"vs plain" is the median of the rounds' ratios, "tok/s" the median run (plain: over all its runs).
"paused" = (request, step) pairs in which the switch kept a request from drafting.

    python benchmarks/speculative.py --model embedded --new 128
    python benchmarks/speculative.py --model standard --quick --new 32 --concurrency 1,16 --always
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from common import MODELS_DIR, RESULTS_DIR, ensure_model, environment, print_table, random_prompt, write_json

from mlaserve import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded", help="embedded | standard | PATH")
    p.add_argument("--quick", action="store_true", help="standard model cut to 2 layers")
    p.add_argument("--k", default="1,2,3", help="num_speculative_tokens values")
    p.add_argument("--concurrency", default="1", help="requests decoded together, e.g. 1,16")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new", type=int, default=64, help="tokens generated per request")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="float32", help="float32: greedy output of speculation checked identical")
    p.add_argument("--rounds", type=int, default=3, help="alternated plain / speculative runs per setting")
    p.add_argument("--always", action="store_true", help="also run each k with the switch off (min acceptance 0)")
    p.add_argument("--out", default=None, help="JSON results path (default: benchmarks/results/...)")
    return p.parse_args()


def with_random_mtp(folder: Path, seed: int = 1) -> Path:
    """A sibling folder: the trunk's safetensors (linked) + one random MTP layer, via an index file."""
    from safetensors.torch import save_file

    from mlaserve.config.model import ModelConfig
    from mlaserve.embedded.random_model import hub_state_dict
    from mlaserve.models.mtp import MTPLayer, MTPLayout

    out = MODELS_DIR / (folder.name + "-mtp")
    if (out / "model.safetensors.index.json").exists():
        return out
    raw = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw)
    layer = MTPLayer(
        cfg, MTPLayout(cfg.num_layers, moe=cfg.moe is not None, indexer=False, own_embed=False, own_head=True)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            if t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
            else:
                t.copy_((1 if name.endswith("norm.weight") else 0) + 0.1 * torch.randn(t.shape, generator=g))
    prefix = f"model.layers.{cfg.num_layers}."
    tensors = {prefix + k: v for k, v in hub_state_dict(layer).items()}
    out.mkdir(parents=True, exist_ok=True)
    trunk = out / "model-00001-of-00002.safetensors"
    if not trunk.exists():
        trunk.symlink_to((folder / "model.safetensors").resolve())
    save_file(tensors, str(out / "model-00002-of-00002.safetensors"))
    from safetensors import safe_open

    with safe_open(str(trunk), "pt") as f:
        weight_map = {k: trunk.name for k in f.keys()}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in tensors}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 1}, indent=2))
    return out


def resolve_model(name: str, quick: bool) -> str | None:
    if name == "embedded":
        return None
    if name == "standard":
        return str(with_random_mtp(ensure_model("standard", quick)))
    return name


def paired(model: str | None, base: dict, spec_opts: dict, prompts, new: int, rounds: int) -> tuple[list, list]:
    """Plain and speculative engines loaded side by side, runs alternated `rounds` times: each round's
    ratio compares two runs seconds apart, so load from other processes mostly cancels (separate
    processes run minutes apart measured the same setting at 0.75x-0.96x). -> (plain runs, spec runs)."""
    gc.collect()  # the previous pair's weights are freed before this one loads
    with LLM(model, **base) as plain_llm, LLM(model, **base | spec_opts) as spec_llm:
        plain, spec = [], []
        for _ in range(rounds):
            plain.append(_timed(plain_llm, prompts, new))
            spec.append(_timed(spec_llm, prompts, new))
    return plain, spec


def _timed(llm: LLM, prompts: list[list[int]], new: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    first = min(o.metrics["time_to_first_token"] for o in outs)
    decode_s = wall - first
    n_after_first = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    proposed = sum(o.metrics.get("num_draft_tokens", 0) for o in outs)
    accepted = sum(o.metrics.get("num_accepted_tokens", 0) for o in outs)
    steps = sum((o.metrics.get("num_accepted_tokens", 0) + o.metrics.get("num_verify_steps", 0)) for o in outs)
    paused = sum(o.metrics.get("num_spec_paused_steps", 0) for o in outs)
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "decode_tok_s": n_after_first / max(decode_s, 1e-9),
        "acceptance_rate": accepted / proposed if proposed else None,
        "proposed": proposed,
        "accepted": accepted,
        "accepted_plus_bonus": steps,
        "paused_steps": paused,
    }


def main() -> None:
    args = parse_args()
    model = resolve_model(args.model, args.quick)
    base = {"dtype": args.dtype} | ({"threads": args.threads} if args.threads else {})
    with LLM(model, **base) as probe:
        vocab, threads = probe.config.model.vocab_size, probe.config.runtime.threads
    rows, results = [], []
    for conc in [int(c) for c in args.concurrency.split(",")]:
        prompts = [random_prompt(args.prompt_len, vocab, seed=i) for i in range(conc)]
        if model is None:  # the embedded model reads English: a KJV-like prompt gives its head something to do
            prompts = [LLM_prompt(i) for i in range(conc)]
        plain_rates, first_row = [], len(rows)
        for k in [int(x) for x in args.k.split(",")]:
            for always in (False, True) if args.always else (False,):
                opts = {"speculative": "mtp", "num_speculative_tokens": k}
                opts |= {"speculative_min_acceptance": 0} if always else {}
                plain, spec = paired(model, base, opts, prompts, args.new, args.rounds)
                plain_rates += [p["decode_tok_s"] for p in plain]
                ratio = statistics.median(s["decode_tok_s"] / p["decode_tok_s"] for p, s in zip(plain, spec))
                same = all(s["tokens"] == p["tokens"] for p, s in zip(plain, spec))
                rate = spec[0]["acceptance_rate"]
                rows.append(
                    [
                        conc,
                        f"mtp k={k}" + (" always" if always else ""),
                        f"{statistics.median(s['decode_tok_s'] for s in spec):.1f}",
                        f"{ratio:.2f}x",
                        "-" if rate is None else f"{rate:.1%}",
                        "-" if always else str(spec[0]["paused_steps"]),
                        "yes" if same else "NO",
                    ]
                )
                results.append(
                    {
                        "concurrency": conc,
                        "k": k,
                        "switch": not always,
                        "identical": same,
                        "vs_plain_median": ratio,
                        "plain": [{a: b for a, b in p.items() if a != "tokens"} for p in plain],
                        "spec": [{a: b for a, b in x.items() if a != "tokens"} for x in spec],
                    }
                )
        rows.insert(first_row, [conc, "plain", f"{statistics.median(plain_rates):.1f}", "1.00x", "-", "-", "-"])
    table = print_table(["requests", "decode", "tok/s", "vs plain", "acceptance", "paused", "identical"], rows)
    out = Path(args.out) if args.out else RESULTS_DIR / f"speculative-{Path(args.model).name}.json"
    write_json(out, {"args": vars(args), "environment": environment(threads), "results": results, "table": table})


def LLM_prompt(i: int) -> str:
    starts = [
        "And it came to pass, when the king heard",
        "In the beginning was the Word,",
        "Blessed are the poor in spirit:",
        "And the LORD spake unto Moses, saying,",
    ]
    return starts[i % len(starts)]


if __name__ == "__main__":
    main()

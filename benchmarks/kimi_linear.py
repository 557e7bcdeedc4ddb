"""Kimi-Linear: the per-step decode cost of KDA layers against the context, next to a same-width all-MLA stack.

    python benchmarks/kimi_linear.py [--threads 2] [--contexts 1024 4096] [--batch 1]

The models (random weights, seed 0, written once by transformers' save_pretrained under benchmarks/models/):
Kimi-Linear-48B's per-layer widths (hidden 2304, 32 KDA heads x 128, conv 4; MLA 32 heads, kv_lora 512, nope 128,
"rope" 64, v 128, q_proj without LoRA) with 4 layers in its 3:1 pattern (KDA, KDA, KDA, MLA), and the same stack
with every layer MLA. Both small where the point is not: 4 routed experts (top 2) of 1024, a first dense layer of
4096, a 4096-token vocabulary.
Measured in float32 through the engine, engines alternated: prefill of one N-token prompt (tokens/s), then the
mean of 8 decode steps at context N for `batch` requests (all in the step). Per request, the KDA state is fixed
(`inspect`'s bytes/request) and the MLA rows grow (bytes/token). The machine is shared: the JSON keeps the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS_DIR, RESULTS_DIR, environment, random_prompt, write_json  # noqa: E402

K, M = "linear_attention", "full_attention"
SHAPE = dict(
    vocab_size=4096,
    hidden_size=2304,
    intermediate_size=4096,
    moe_intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=32,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    num_local_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    linear_num_heads=32,
    linear_head_dim=128,
    pad_token_id=2,
    bos_token_id=0,
    eos_token_id=1,
)
STACKS = {"kimi_linear": [K, K, K, M], "all_mla": [M, M, M, M]}


def folder(name: str):
    path = MODELS_DIR / f"kimi-linear-{name}"
    if not (path / "config.json").exists():
        from transformers import KimiLinearConfig, KimiLinearForCausalLM

        torch.manual_seed(0)
        KimiLinearForCausalLM(KimiLinearConfig(**SHAPE, layer_types=STACKS[name])).save_pretrained(path)
    return path


def run(llm, n: int, batch: int, seed: int) -> tuple[float, float]:
    """-> (prefill tokens/s of the first request alone, mean decode step seconds with `batch` in the step)."""
    from mlaserve.sampling.params import SamplingParams

    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    engine.add_request(random_prompt(n, SHAPE["vocab_size"], seed), params, request_id="p0")
    t = time.perf_counter()
    engine.step()
    prefill = n / (time.perf_counter() - t)
    for i in range(1, batch):
        engine.add_request(random_prompt(n, SHAPE["vocab_size"], seed + i), params, request_id=f"p{i}")
    while any(r.num_computed < n for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the other prompts' prefills
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return prefill, statistics.mean(steps[:-1] or steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    env = environment(args.threads)
    from mlaserve.config.layer_kinds import describe
    from mlaserve.entrypoints.llm import LLM

    rows, out = [], {"environment": env, "shape": SHAPE, "batch": args.batch, "runs": []}
    llms = {
        name: LLM(str(folder(name)), dtype="float32", threads=args.threads, max_num_batched_tokens=8192)
        for name in STACKS
    }
    for name, llm in llms.items():
        out[f"{name}_layer_kinds"] = describe(llm.runner.layer_kinds, 4)
        print(name, *out[f"{name}_layer_kinds"], sep="\n  ")
    for n in args.contexts:
        for name, llm in llms.items():
            prefill, step = run(llm, n, args.batch, seed=n)
            out["runs"].append(dict(engine=name, context=n, prefill_tok_s=prefill, decode_step_s=step))
            rows.append(f"{name:12s} context {n:6d}: prefill {prefill:8.1f} tok/s, decode step {step * 1e3:8.2f} ms")
            print(rows[-1], flush=True)
    out["load_after"] = os.getloadavg()
    write_json(RESULTS_DIR / f"kimi_linear-b{args.batch}.json", out)


if __name__ == "__main__":
    main()

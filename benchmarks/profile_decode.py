"""Where mlaserve's decode step spends its time, at batch 1 and batch 16 (torch.profiler).

    python benchmarks/profile_decode.py [--quick] [--dtype float32] [--threads 2] [--steps 8] [--prompt 128] [--model X.gguf]

Real requests go through the engine (scheduler, forward, sampler): B prompts are prefilled, then
`--steps` pure-decode `engine.step()` calls are profiled. Named scopes are added from outside, by
wrapping methods of mlaserve's classes with torch.profiler.record_function (nothing in mlaserve is
edited); the report gives each scope's inclusive time as a share of the step, then the top aten ops
by self time. A Chrome trace per batch size goes to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, ensure_model, print_table, random_prompt, write_json  # noqa: E402

# (module, class or None for a module function, method) -> scope name. Inclusive scopes nest: attn.* inside attention, moe.* inside mlp.
SCOPES = [
    ("mlaserve.engine.engine", "Engine", "step", "engine.step"),
    ("mlaserve.engine.scheduler", "Scheduler", "schedule", "scheduler.schedule"),
    ("mlaserve.engine.scheduler", "Scheduler", "advance", "scheduler.advance"),
    ("mlaserve.executor.forward_batch", "ForwardBatch", "build", "batch.build"),
    ("mlaserve.executor.step_context", "StepContext", "build", "step_context.build (metadata, rope)"),
    ("mlaserve.models.deepseek", "MLAForCausalLM", "forward", "model.forward (all layers)"),
    ("mlaserve.models.deepseek", "MLAAttention", "forward", "attention (whole)"),
    ("mlaserve.models.deepseek", "MLAAttention", "project_q", "attn.q projection (q_a, norm, q_b)"),
    ("mlaserve.models.deepseek", "MLAAttention", "attend", "attn.attend (absorbed MQA core)"),
    ("mlaserve.models.moe", "MoE", "forward", "moe (whole)"),
    ("mlaserve.models.moe", "Gate", "forward", "moe.gate (router)"),
    ("mlaserve.models.moe", "Experts", "forward", "moe.routed experts"),
    ("mlaserve.models.layers", "SwiGLU", "forward", "swiglu (dense MLP + shared experts)"),
    ("mlaserve.models.layers", "RMSNorm", "forward", "rmsnorm (all)"),
    ("mlaserve.models.deepseek", "MLAForCausalLM", "logits", "lm_head (logits)"),
    ("mlaserve.engine.engine", "Engine", "_sample", "sampling"),
    ("mlaserve.quant.ggml_linear", "GGUFLinear", "forward", "gguf linear (blocks kept)"),
    ("mlaserve.quant.ggml_linear", "GGUFExperts", "forward", "gguf routed experts (blocks kept)"),
    ("mlaserve.quant.ggml_linear", "GGUFEmbedding", "forward", "gguf embedding lookup"),
    ("mlaserve.quant.ggml_heads", "GGUFHeads", "absorb", "gguf W_UK (attn_k_b blocks)"),
    ("mlaserve.quant.ggml_heads", "GGUFHeads", "expand", "gguf W_UV (attn_v_b blocks)"),
    ("mlaserve.kernels.native_layers", None, "decode_layers", "native decoder layers (one call)"),
    ("mlaserve.kernels.native", None, "moe_route", "native router call"),
    ("mlaserve.kernels.native", None, "moe_experts", "native routed-experts call"),
]


def install_scopes() -> list:
    import importlib

    undo = []
    for mod_name, cls_name, meth, label in SCOPES:
        module = importlib.import_module(mod_name)
        cls = getattr(module, cls_name) if cls_name else module  # None: a module-level function
        raw = cls.__dict__[meth]
        is_static = isinstance(raw, staticmethod)
        fn = raw.__func__ if is_static else raw

        def wrapped(*a, __fn=fn, __label=label, **kw):
            with record_function(__label):
                return __fn(*a, **kw)

        setattr(cls, meth, staticmethod(wrapped) if is_static else wrapped)
        undo.append((cls, meth, raw))
    return undo


def profile_batch(llm, batch: int, prompt_len: int, steps: int, vocab: int, tag: str) -> dict:
    from mlaserve.sampling.params import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        eng.add_request(random_prompt(prompt_len, vocab, 7000 + 100 * batch + i), params, request_id=f"p{batch}-{i}")
    # prefill until every request has its first token (then each step is a pure decode of B tokens)
    while any(len(r.output_ids) == 0 for r in eng.requests.values()):
        eng.step()
    eng.step()  # one unprofiled decode step (warm-up)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = time.perf_counter() - t0
    while eng.has_unfinished():
        eng.step()
    trace = RESULTS_DIR / f"profile-decode-b{batch}{tag}.json"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))

    events = prof.key_averages()
    labels = {s[3] for s in SCOPES}
    step_total = next(e.cpu_time_total for e in events if e.key == "engine.step")
    scopes = sorted(((e.key, e.cpu_time_total, e.count) for e in events if e.key in labels), key=lambda x: -x[1])
    ops = sorted(((e.key, e.self_cpu_time_total, e.count) for e in events if e.key not in labels), key=lambda x: -x[1])
    self_total = sum(e.self_cpu_time_total for e in events)
    return {
        "batch": batch,
        "steps": steps,
        "context_at_start": prompt_len,
        "wall_s": wall,
        "ms_per_step": wall / steps * 1e3,
        "tokens_per_s": batch * steps / wall,
        "scopes": [
            {
                "scope": k,
                "ms_per_step": t / 1e3 / steps,
                "pct_of_step": 100 * t / step_total,
                "calls_per_step": c / steps,
            }
            for k, t, c in scopes
        ],
        "top_ops": [
            {
                "op": k,
                "self_ms_per_step": t / 1e3 / steps,
                "pct_of_self": 100 * t / self_total,
                "calls_per_step": c / steps,
            }
            for k, t, c in ops[:15]
        ],
        "chrome_trace": str(trace),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    p.add_argument("--model", default=None, help="a folder or .gguf instead of the standard model (e.g. its Q8_0 GGUF)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model or ensure_model("standard", args.quick)
    from mlaserve import LLM

    llm = LLM(
        model=str(folder),
        dtype=args.dtype,
        max_num_seqs=max(args.batches),
        num_pages=512,
        threads=args.threads,
        malloc_tuning=True,
    )
    vocab = llm.config.model.vocab_size
    undo = install_scopes()
    tag = ("-quick" if args.quick else "") + ("-" + Path(args.model).stem if args.model else "")
    out = {
        "dtype": args.dtype,
        "threads": args.threads,
        "quick": args.quick,
        "loadavg_start": list(os.getloadavg()),
        "runs": [],
    }
    try:
        for b in args.batches:
            r = profile_batch(llm, b, args.prompt, args.steps, vocab, tag)
            out["runs"].append(r)
            print(
                f"\n== decode, batch {b}, context ~{args.prompt}: {r['ms_per_step']:.1f} ms/step "
                f"({r['tokens_per_s']:.1f} tok/s) =="
            )
            print_table(
                ["scope (inclusive)", "ms/step", "% of step", "calls/step"],
                [
                    [s["scope"], f"{s['ms_per_step']:.2f}", f"{s['pct_of_step']:.1f}", f"{s['calls_per_step']:.0f}"]
                    for s in r["scopes"]
                ],
            )
            print_table(
                ["aten op (self)", "ms/step", "% of self time", "calls/step"],
                [
                    [o["op"], f"{o['self_ms_per_step']:.2f}", f"{o['pct_of_self']:.1f}", f"{o['calls_per_step']:.0f}"]
                    for o in r["top_ops"]
                ],
            )
    finally:
        for cls, meth, raw in undo:
            setattr(cls, meth, raw)
    out["loadavg_end"] = list(os.getloadavg())
    write_json(RESULTS_DIR / f"profile-decode{tag}.json", out)


if __name__ == "__main__":
    main()

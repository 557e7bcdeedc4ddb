"""Where a batch-1 decode step of a GGUF goes, part by part, in bytes read and achieved GB/s.

    python benchmarks/decode_parts.py --gguf FILE [--threads 1] [--rounds 5] [--tokens 64]

Each weight a decode step reads, timed alone: the file's own bytes (read with gguf-py) through the native product
the engine's default takes for its type (`activations="auto"` on this CPU, common.default_activations: int8
activations for weights of 6 bits or fewer, and int16 ones for Q8_0 / Q5_0 where the CPU has the int16 products
(AVX512-VNNI, AVX2), else exact fp32; F32 exact), one activation row, best of --rounds process-CPU timings (neighbours on a shared
machine only add time). Routed experts: the first top-k experts' rows of each stack as one matrix (the bytes one
token reads); attn_k_b / attn_v_b: all heads' rows as one matrix (the bytes of the per-head products); the embedding
reads one row (left out). Parts are summed over the layers: attention projections (q_a, q_b, kv_a, k_b, v_b,
o_proj), router, routed experts, shared expert, dense MLP, lm_head. Then the engine's batch-1 decode step at a
128-token prompt (LLM.generate, median of --rounds): what the weights' products do not explain is the attention
kernel, norms, rope, routing, the C calls' glue and the Python around the step (scheduler, sampling, ledger).
Beside them the machine's copy bandwidth (a 256 MiB tensor: copy = read + write, sum = read only), the roofline a
memory-bound step is held to. Prints the CPU flags and the load average; JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, default_activations, environment, random_prompt, write_json

from mlaserve.kernels import ggml

ACTIVATIONS, INT8_AUTO = default_activations()  # the engine's auto on this CPU, as its decode takes it

# gguf tensor name (after blk.N.) -> the part it belongs to
PARTS = {
    "attn_q_a": "attn q_a",
    "attn_q_b": "attn q_b",
    "attn_q": "attn q_b",
    "attn_kv_a_mqa": "attn kv_a",
    "attn_k_b": "attn k_b (W_UK)",
    "attn_v_b": "attn v_b (W_UV)",
    "attn_output": "attn o_proj",
    "ffn_gate_inp": "router",
    "ffn_gate_exps": "routed experts",
    "ffn_up_exps": "routed experts",
    "ffn_down_exps": "routed experts",
    "ffn_gate_shexp": "shared expert",
    "ffn_up_shexp": "shared expert",
    "ffn_down_shexp": "shared expert",
    "ffn_gate": "dense MLP",
    "ffn_up": "dense MLP",
    "ffn_down": "dense MLP",
}


def copy_bandwidth(rounds: int) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.ones(64 * 2**20)  # 256 MiB: past any cache
    b = torch.empty_like(a)
    copy = read = 1e9
    for _ in range(rounds):
        t0 = time.process_time()  # process time: a neighbour's time slices are not ours (one thread)
        b.copy_(a)
        copy = min(copy, time.process_time() - t0)
        t0 = time.process_time()
        a.sum()
        read = min(read, time.process_time() - t0)
    torch.set_num_threads(threads)
    nbytes = a.numel() * 4
    return {"copy_gb_s": 2 * nbytes / copy / 1e9, "read_gb_s": nbytes / read / 1e9}


def product_time(type_id: int, rows: torch.Tensor, k: int, rounds: int) -> float:
    """Best process-CPU seconds of one m=1 product over `rounds` timings of enough calls for ~20 ms."""
    x = torch.randn(1, k)
    ggml.linear_native(x, rows, type_id, k, INT8_AUTO)
    t0 = time.process_time()
    ggml.linear_native(x, rows, type_id, k, INT8_AUTO)
    reps = max(3, int(0.02 / max(time.process_time() - t0, 1e-5)))
    best = 1e9
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(reps):
            ggml.linear_native(x, rows, type_id, k, INT8_AUTO)
        best = min(best, (time.process_time() - t0) / reps)
    return best / max(torch.get_num_threads(), 1)  # process time counts every thread: per-thread wall share


def weights_parts(path: Path, topk: int, rounds: int) -> tuple[dict, list]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    parts: dict[str, dict] = {}
    rows_out = []
    for t in reader.tensors:
        name = t.name
        if name.startswith("blk."):
            short = name.split(".", 2)[2].rsplit(".", 1)[0]
            part = PARTS.get(short)
        else:
            part = "lm_head" if name == "output.weight" else None
        if part is None or len(t.shape) < 2:
            continue
        type_id = int(t.tensor_type)
        data = torch.from_numpy(np.asarray(t.data).view(np.uint8).copy())
        k = int(t.shape[0])
        n_rows = int(np.prod(t.shape[1:]))
        if len(t.shape) == 3 and part == "routed experts":  # one token reads top-k experts' rows
            n_rows = int(t.shape[1]) * topk
        w = data.reshape(int(np.prod(t.shape[1:])), -1)[:n_rows].contiguous()
        if type_id == 0:
            w = w.view(torch.uint8)
        sec = product_time(type_id, w, k, rounds)
        p = parts.setdefault(part, {"bytes": 0, "seconds": 0.0, "types": set()})
        p["bytes"] += w.numel()
        p["seconds"] += sec
        p["types"].add(gguf.GGMLQuantizationType(type_id).name)
        rows_out.append({"tensor": name, "type": type_id, "rows": n_rows, "k": k, "bytes": w.numel(), "s": sec})
    for p in parts.values():
        p["types"] = sorted(p["types"])
        p["gb_s"] = p["bytes"] / p["seconds"] / 1e9
    return parts, rows_out


def engine_step(path: Path, threads: int, tokens: int, rounds: int) -> dict:
    """The engine's decode step: wall time, and process CPU time per thread (the step with the cores to itself,
    where neighbours take time slices; at 2 threads it counts OpenMP's spin-waits too)."""
    from mlaserve import LLM, SamplingParams

    llm = LLM(str(path), threads=threads, enable_prefix_caching=False)
    prompt = random_prompt(128, llm.loaded.config.model.vocab_size, seed=1)
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm
    steps, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        out = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        total, ctotal = time.perf_counter() - t0, time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        prefill, cprefill = time.perf_counter() - t0, time.process_time() - c0
        n = max(len(out[0].outputs[0].token_ids) - 1, 1)
        steps.append((total - prefill) / n)
        cpu.append((ctotal - cprefill) / n / threads)  # per thread: what a step costs with the cores to itself
    return {
        "step_ms_median": statistics.median(steps) * 1e3,
        "step_ms_best": min(steps) * 1e3,
        "all_ms": steps,
        "cpu_ms_per_thread_best": min(cpu) * 1e3,
        "cpu_ms_per_thread_all": cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per engine run")
    ap.add_argument("--topk", type=int, default=None, help="experts per token (default: the file's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    env = environment(args.threads)
    topk = args.topk
    if topk is None:
        import gguf

        r = gguf.GGUFReader(str(args.gguf))
        f = next((f for f in r.fields.values() if f.name.endswith(".expert_used_count")), None)
        topk = int(f.parts[f.data[0]][0]) if f is not None else 0
    bw = copy_bandwidth(args.rounds)
    parts, tensors = weights_parts(args.gguf, topk, args.rounds)
    step = engine_step(args.gguf, args.threads, args.tokens, args.rounds)
    total_b = sum(p["bytes"] for p in parts.values())
    total_s = sum(p["seconds"] for p in parts.values())
    print(f"copy bandwidth: {bw['copy_gb_s']:.1f} GB/s (read + write), read {bw['read_gb_s']:.1f} GB/s")
    print(f"{'part':<18} {'types':<16} {'MB/step':>8} {'ms':>7} {'GB/s':>6} {'% CPU step':>6}")
    for name, p in sorted(parts.items(), key=lambda kv: -kv[1]["seconds"]):
        share = 100 * p["seconds"] * 1e3 / step["cpu_ms_per_thread_best"]
        print(
            f"{name:<18} {','.join(p['types']):<16} {p['bytes'] / 1e6:8.2f} {p['seconds'] * 1e3:7.3f} "
            f"{p['gb_s']:6.2f} {share:6.1f}"
        )
    rest = step["cpu_ms_per_thread_best"] - total_s * 1e3
    print(
        f"weights' products: {total_b / 1e6:.1f} MB in {total_s * 1e3:.2f} ms = {total_b / total_s / 1e9:.2f} GB/s"
        f" (roofline at the read bandwidth: {total_b / bw['read_gb_s'] / 1e6:.2f} ms)"
    )
    print(
        f"engine decode step: wall median {step['step_ms_median']:.2f} ms (best {step['step_ms_best']:.2f}); process"
        f" CPU per thread best {step['cpu_ms_per_thread_best']:.2f} ms = {1e3 / step['cpu_ms_per_thread_best']:.1f}"
        f" tok/s on idle cores; not the weights' products: {rest:.2f} ms"
        f" ({100 * rest / step['cpu_ms_per_thread_best']:.0f}%: attention, norms, routing, glue, Python)"
    )
    env["load_after"] = list(os.getloadavg())
    print(f"load average after: {env['load_after']}")
    out = args.out or RESULTS_DIR / f"decode_parts-{args.gguf.stem}-t{args.threads}.json"
    write_json(
        out,
        {
            "file": args.gguf.name,
            "threads": args.threads,
            "topk": topk,
            "bandwidth": bw,
            "parts": parts,
            "tensors": tensors,
            "step": step,
            "environment": env,
            "activations": ACTIVATIONS,
        },
    )


if __name__ == "__main__":
    main()

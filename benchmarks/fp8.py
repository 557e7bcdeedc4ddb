"""FP8 block-scaled weights vs bf16 vs fp32 on the standard benchmark model, in one run.

The standard model (benchmarks/common.py) is quantized once to the DeepSeek FP8 release layout
(e4m3, [128, 128] blocks, scales `*.weight_scale_inv`) next to it in benchmarks/models/. Each
variant is loaded in turn and measured:
  weights_gib   resident weight bytes (parameters + buffers of the loaded model)
  prefill       tokens/s of one prompt of --prefill-len tokens (max_tokens 1)
  decode_b1     tokens/s of one request decoding --new tokens (the engine's own metric)
  decode_c16    generated tokens/s with --conc concurrent requests (short distinct prompts)
Variants: FP4 (e2m1, DeepSeek-V4 style) routed experts + FP8 blocks elsewhere with fp32 compute,
fp8 weights with bf16 compute, fp8 weights with fp32 compute (native kernels where they build, and
kernels="torch": dequantize per call), bf16, fp32.

  python benchmarks/fp8.py --quick     # 2 layers, short runs: a smoke test, not a benchmark
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
from common import (
    MODELS_DIR,
    RESULTS_DIR,
    contention_warning,
    ensure_model,
    environment,
    fmt,
    print_table,
    random_prompt,
    rss_gib,
    write_json,
)

VARIANTS = [  # name, weights, dtype, extra LLM options
    ("fp4 experts/fp32", "fp4", "float32", {}),
    ("fp8/bf16", "fp8", "bfloat16", {}),
    ("fp8/fp32", "fp8", "float32", {}),
    ("fp8/fp32 kernels=torch", "fp8", "float32", {"kernels": "torch"}),
    ("bf16", "src", "bfloat16", {}),
    ("fp32", "src", "float32", {}),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2-layer model, short runs: a smoke test")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-len", type=int, default=None, help="default 512 (quick: 64)")
    p.add_argument("--new", type=int, default=None, help="decode tokens per request (default 32; quick: 4)")
    p.add_argument("--conc", type=int, default=16)
    p.add_argument("--variants", nargs="*", default=None, help="run only these rows (names as in the table)")
    p.add_argument("--out", default=None)
    return p.parse_args()


def fp8_folder(src: Path, experts: str = "fp8") -> Path:
    from mlaserve.quant.writer import write_fp8_folder

    dst = MODELS_DIR / f"{src.name}-fp8-b128{'-fp4experts' if experts == 'fp4' else ''}"
    if not (dst / "model.safetensors").exists():
        print(f"[build] quantizing {src.name} to FP8 [128, 128] blocks ({experts} experts) -> {dst} ...", flush=True)
        write_fp8_folder(src, dst, "fp8", (128, 128), experts=experts)
    return dst


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def measure(folder: Path, dtype: str, args, options: dict) -> dict:
    from mlaserve import LLM
    from mlaserve.sampling.params import SamplingParams

    rss0 = rss_gib()
    llm = LLM(
        model=str(folder),
        dtype=dtype,
        max_num_batched_tokens=2048,
        max_num_seqs=args.conc,
        threads=args.threads,
        **options,
    )
    vocab = llm.config.model.vocab_size
    out = {"weights_gib": weight_bytes(llm.loaded.model) / 2**30, "rss_delta_gib": rss_gib() - rss0}
    out["kernels"] = {x.name: x.value for x in llm.config.provenance}["kernels"]
    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate([random_prompt(16, vocab, 99)], SamplingParams(max_tokens=2, **greedy))  # warm-up
    t0 = time.perf_counter()
    llm.generate([random_prompt(args.prefill_len, vocab, 1)], SamplingParams(max_tokens=1, **greedy))
    out["prefill_tok_s"] = args.prefill_len / (time.perf_counter() - t0)
    one = llm.generate([random_prompt(32, vocab, 2)], SamplingParams(max_tokens=args.new, **greedy))[0]
    out["decode_b1_tok_s"] = one.metrics["tokens_per_s"]
    prompts = [random_prompt(32, vocab, 100 + i) for i in range(args.conc)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.new, **greedy))
    out[f"decode_c{args.conc}_tok_s"] = args.conc * args.new / (time.perf_counter() - t0)
    del llm
    gc.collect()
    return out


def main() -> None:
    args = parse_args()
    args.prefill_len = args.prefill_len or (64 if args.quick else 512)
    args.new = args.new or (4 if args.quick else 32)
    torch.set_num_threads(args.threads)
    warn = contention_warning(args.threads)
    if warn:
        print(warn, flush=True)
    src = ensure_model("standard", args.quick)
    folders = {"src": src, "fp8": fp8_folder(src), "fp4": fp8_folder(src, "fp4")}
    results = {}
    for name, which, dtype, options in VARIANTS:
        if args.variants and name not in args.variants:
            continue
        print(f"[run] {name} ...", flush=True)
        results[name] = measure(folders[which], dtype, args, options)
    c = f"decode_c{args.conc}_tok_s"
    headers = ["variant", "weights GiB", "prefill tok/s", "decode b1 tok/s", f"decode c{args.conc} tok/s"]
    rows = [
        [n, fmt(r["weights_gib"], 3), fmt(r["prefill_tok_s"]), fmt(r["decode_b1_tok_s"]), fmt(r[c])]
        for n, r in results.items()
    ]
    print(print_table(headers, rows))
    out = Path(args.out or RESULTS_DIR / f"fp8{'-quick' if args.quick else ''}.json")
    write_json(out, {"settings": vars(args), "environment": environment(args.threads), "results": results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Float vs int8 activations (engine option activations) on the native kernels: one weight at 1 and 16 rows per
type, and batch-1 decode of the standard model in a Q4_K_M mix.

  python benchmarks/int8_activations.py kernels [--threads N] [--rounds R] [--types Q4_1,Q5_0,...]
  python benchmarks/int8_activations.py decode [--threads N] [--rounds R] [--tokens T]

kernels: one DeepSeek-V3 expert matrix (2048 x 7168) of random valid blocks (the time does not depend on the
values) times 1 and 16 activation rows, `native.gemm` with int8=False / True, per type (Q4_K, Q5_K, Q6_K, Q4_0,
Q8_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS and the grid i-quants; --types picks some). Each round times both settings back to back (median of --reps calls each), so that a neighbour's load hits
both; the table gives the median over rounds and the spread (min-max) of the rounds' medians.

decode: the standard model (common.py) written as a GGUF in llama.cpp's Q4_K_M type mix (Q6_K for output and for
ffn_down / ffn_down_exps / ffn_down_shexp of the first and last eighth of the layers and every third between:
llama.cpp's use_more_bits; Q4_K for every other 2-D weight whose rows are whole 256-value super-blocks; Q8_0 for
the others, where llama.cpp falls back to Q5_0 / Q8_0; norms, router and biases F32). llama.cpp's quantizer is not
installed here, so this script quantizes: per 32 (Q4_K) or 16 (Q6_K) values a min/max (absmax) scale, the
super-block's scales to 6 / 8 bits (a plain rounding, not llama.cpp's search): the same bytes per tensor as
llama.cpp's file, other values. Then greedy batch-1 decode of a 128-token prompt for --tokens tokens, float and
int8_6bit (the default) alternating per round, output tok/s.
Every run prints the CPU flags, the load average before and after, and writes JSON to benchmarks/results/.
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
from common import RESULTS_DIR, ensure_model, environment, random_prompt, timed, write_json
from model_files import gguf_path, with_tokenizer

from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import native

N, K = 2048, 7168
TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S")
TYPES += ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
SCALES = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q4_0": [0], "Q8_0": [0], "Q4_1": [0, 2], "Q5_0": [0]}
SCALES.update({"Q5_1": [0, 2], "IQ4_NL": [0], "IQ4_XS": [0]})  # where each type keeps its fp16 d (and m / dmin)
SCALES.update({n: [0] for n in ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S")})
SCALES["IQ1_M"] = []  # its d lies in the top nibbles of its scale words: set in blocks()
Q4_K, Q6_K, Q8_0 = GGML_TYPE_IDS["Q4_K"], GGML_TYPE_IDS["Q6_K"], GGML_TYPE_IDS["Q8_0"]


def blocks(name: str) -> torch.Tensor:
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (N * K // t.block_size, t.type_size), dtype=torch.uint8, generator=g)
    for off in SCALES[name]:
        raw[:, off : off + 2] = (
            (torch.rand(raw.shape[0], generator=g) * 0.02 + 0.001).half().view(torch.uint8).view(-1, 2)
        )
    if name == "IQ1_M":  # d = 0x3333 (0.22) from the 4 nibbles, not a random NaN or subnormal
        raw[:, 49:57:2] = (raw[:, 49:57:2] & 0x0F) | 0x30
    return raw.reshape(N, -1).contiguous()


def kernels(args) -> dict:
    rows_out = []
    for name in args.types.split(","):
        tid, w = GGML_TYPE_IDS[name], blocks(name)
        for rows in (1, 16):
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
            per: dict[bool, list[list[float]]] = {False: [], True: []}
            for _ in range(args.rounds):
                for int8 in (False, True):
                    per[int8].append(timed(lambda i=int8: native.gemm(tid, x, w, K, int8=i), args.reps)["all_s"])
            # best: the fastest call of all rounds (the machine's uncontended speed: neighbours only add time);
            # med: the median over rounds of each round's median, with the spread of those (min-max)
            row = {"type": name, "rows": rows, "weight_mib": w.numel() / 2**20}
            for key, int8 in (("float", False), ("int8", True)):
                meds = [statistics.median(r) * 1e3 for r in per[int8]]
                row[f"{key}_best_ms"] = min(min(r) for r in per[int8]) * 1e3
                row[f"{key}_median_ms"], row[f"{key}_spread_ms"] = statistics.median(meds), [min(meds), max(meds)]
            row["speedup_best"] = row["float_best_ms"] / row["int8_best_ms"]
            row["speedup_median"] = row["float_median_ms"] / row["int8_median_ms"]
            rows_out.append(row)
            print(
                f"{name:<5} {rows:>3} rows: best float {row['float_best_ms']:6.2f} ms, int8 {row['int8_best_ms']:6.2f}"
                f" ms = {row['speedup_best']:.2f}x ({w.numel() / row['int8_best_ms'] / 1e6:.1f} GB/s)  | median "
                f"float {row['float_median_ms']:6.2f} ({row['float_spread_ms'][0]:.2f}-{row['float_spread_ms'][1]:.2f})"
                f" int8 {row['int8_median_ms']:6.2f} ({row['int8_spread_ms'][0]:.2f}-{row['int8_spread_ms'][1]:.2f})",
                flush=True,
            )
    return {"shape": [N, K], "rows": rows_out}


# ---------------------------------------------------------------- a Q4_K_M-mix file of the standard model


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(*v.shape, 2)


def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """[R, K] fp32 -> Q4_K bytes [R * K / 256 * 144]: per 32 values scale (max - min) / 15 and offset -min (>= 0),
    both to 6 bits against the super-block's d / dmin (fp16)."""
    v = x.double().numpy().reshape(-1, 8, 32)
    lo = np.minimum(v.min(-1), 0.0)
    scale, offset = (v.max(-1) - lo) / 15.0, -lo
    d = np.maximum(scale.max(-1), 1e-30) / 63.0
    dmin = np.maximum(offset.max(-1), 1e-30) / 63.0
    d16, dmin16 = d.astype(np.float16).astype(np.float64), dmin.astype(np.float16).astype(np.float64)
    sc = np.clip(np.rint(scale / np.maximum(d16, 1e-30)[:, None]), 0, 63).astype(np.int64)
    mn = np.clip(np.rint(offset / np.maximum(dmin16, 1e-30)[:, None]), 0, 63).astype(np.int64)
    step = np.maximum(d16[:, None] * sc, 1e-30)[..., None]
    q = np.clip(np.rint((v + (dmin16[:, None] * mn)[..., None]) / step), 0, 15).astype(np.uint8)
    s = np.zeros((v.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        s[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        s[:, j + 4] = (mn[:, j] & 63) | ((mn[:, j + 4] >> 4) << 6)
        s[:, j + 8] = (sc[:, j + 4] & 15) | ((mn[:, j + 4] & 15) << 4)
    qs = np.zeros((v.shape[0], 128), dtype=np.uint8)
    for c in range(4):
        qs[:, 32 * c : 32 * c + 32] = q[:, 2 * c] | (q[:, 2 * c + 1] << 4)
    out = np.concatenate([_f16_bytes(d16), _f16_bytes(dmin16), s, qs], axis=1)
    return torch.from_numpy(out.reshape(-1))


def quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """[R, K] fp32 -> Q6_K bytes [R * K / 256 * 210]: per 16 values absmax / 32 to an int8 scale against d."""
    v = x.double().numpy().reshape(-1, 16, 16)
    scale = np.abs(v).max(-1) / 32.0
    d16 = (np.maximum(scale.max(-1), 1e-30) / 127.0).astype(np.float16).astype(np.float64)
    sc = np.clip(np.rint(scale / np.maximum(d16, 1e-30)[:, None]), 0, 127).astype(np.int64)
    step = np.maximum(d16[:, None] * sc, 1e-30)[..., None]
    q = (np.clip(np.rint(v / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    ql, qh = np.zeros((q.shape[0], 128), np.uint8), np.zeros((q.shape[0], 64), np.uint8)
    for t in range(256):
        h, r = t >> 7, t & 127
        ql[:, h * 64 + (r & 63)] |= (q[:, t] & 15) << (4 * (r >> 6))
        qh[:, h * 32 + (r & 31)] |= (q[:, t] >> 4) << (2 * (r >> 5))
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d16)], axis=1)
    return torch.from_numpy(out.reshape(-1))


def _more_bits(layer: int, n: int) -> bool:  # llama.cpp's use_more_bits
    return layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2


def ensure_q4_k_m(folder: Path) -> Path:
    """The standard model as a Q4_K_M-mix GGUF (module docstring), written once beside the folder."""
    from mlaserve.gguf.convert import convert, writer

    out = gguf_path(folder, "q4_k_m-mix")
    if out.exists():
        return out
    layers = int(__import__("json").loads((folder / "config.json").read_text())["num_hidden_layers"])
    base = convert.tensor_type

    def mixed(name: str, shape: tuple[int, ...], outtype: str) -> int:
        t = base(name, shape, "q8_0")
        if t != Q8_0:
            return t  # F32 / F16 as the converter decides
        if shape[-1] % 256:
            return Q8_0
        parts = name.split(".")
        down = parts[0] == "blk" and parts[2].startswith("ffn_down") and _more_bits(int(parts[1]), layers)
        return Q6_K if name == "output.weight" or down else Q4_K

    writer.QUANTIZERS.setdefault(Q4_K, quantize_q4_k)
    writer.QUANTIZERS.setdefault(Q6_K, quantize_q6_k)
    convert.tensor_type = mixed  # this script's process only: the mix above instead of one outtype
    try:
        t0 = time.perf_counter()
        print(f"[build] {out.name}: the Q4_K_M mix of {folder.name} ...", flush=True)
        tmp = out.with_suffix(".gguf.partial")
        report = convert.convert_hf_to_gguf(with_tokenizer(folder), tmp, "q8_0")
        tmp.replace(out)
    finally:
        convert.tensor_type = base
    types: dict[str, int] = {}
    for t in report.tensors.values():
        types[t] = types.get(t, 0) + 1
    print(f"[build] done in {time.perf_counter() - t0:.0f} s: {out.stat().st_size / 2**20:.0f} MiB, {types}")
    return out


def decode(args) -> dict:
    from mlaserve import LLM, SamplingParams

    path = ensure_q4_k_m(ensure_model("standard", quick=False))
    prompt = random_prompt(128, 32768, seed=1)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    # no prefix cache: each run prefills its prompt (the prefill-only run is subtracted)
    opts = dict(threads=args.threads, enable_prefix_caching=False)
    engines = {a: LLM(str(path), activations=a, **opts) for a in ("float", "int8_6bit")}
    for llm in engines.values():
        llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm
    rates: dict[str, list[float]] = {a: [] for a in engines}
    for _ in range(args.rounds):
        for a, llm in engines.items():
            t0 = time.perf_counter()
            out = llm.generate([prompt], params)[0].outputs[0]
            total = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            prefill = time.perf_counter() - t0
            rates[a].append((len(out.token_ids) - 1) / max(total - prefill, 1e-9))  # decode steps only
        print("  ".join(f"{a} {rates[a][-1]:.1f} tok/s" for a in engines), flush=True)
    summary = {
        a: {"median_tok_s": statistics.median(r), "min": min(r), "max": max(r), "all": r} for a, r in rates.items()
    }
    for a, s in summary.items():
        print(f"{a:<10} batch-1 decode {s['median_tok_s']:.1f} tok/s (rounds {s['min']:.1f}-{s['max']:.1f})")
    print(f"int8_6bit / float: {summary['int8_6bit']['median_tok_s'] / summary['float']['median_tok_s']:.2f}x")
    plans = {a: llm.loaded.kernel_plan.format() for a, llm in engines.items()}
    return {"file": str(path), "file_mib": path.stat().st_size / 2**20, "summary": summary, "plans": plans}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("kernels", "decode"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="kernels: calls per timing")
    ap.add_argument("--tokens", type=int, default=64, help="decode: output tokens per run")
    ap.add_argument("--types", default=",".join(TYPES), help="kernels: the weight types, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    env = environment(args.threads)
    env.update(native_isa=native.isa(), int8_isa=native.int8_isa(), cpu_flags_vnni="avx512_vnni" in env["cpu_simd"])
    print(f"{env['cpu']}: {' '.join(env['cpu_simd'])}; kernels {env['native_isa']}, int8 dots {env['int8_isa']}")
    result = kernels(args) if args.what == "kernels" else decode(args)
    env["loadavg_end"] = list(os.getloadavg())
    print(f"load average before {env['loadavg_start']}, after {env['loadavg_end']}")
    some = args.what == "kernels" and args.types != ",".join(TYPES)  # a subset: its own file beside the full run's
    name = f"int8_activations-{args.what}" + (f"-{args.types.replace(',', '-').lower()}" if some else "")
    write_json(RESULTS_DIR / f"{name}.json", {"environment": env, **result})


if __name__ == "__main__":
    main()

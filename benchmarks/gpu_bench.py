"""GPU benchmark: mlaserve vs Hugging Face transformers on the standard benchmark model (common.py),
same random weights, same dtype, same device, in one run.

    python benchmarks/gpu_bench.py [--device cuda] [--dtype bfloat16] [--quick] [--out FILE] [--skip-hf]

Measures (the offline benchmark's definitions, on the device):
  prefill tokens/s        one 512-token prompt, end to end to its first token (median of reps)
  decode tokens/s (B=1)   128-token prompt, 64 new tokens: (n-1) / (last token time - first token time)
  output tokens/s (B=16)  16 concurrent requests, prompt 128, 128 new tokens: 16*128 / wall time
Greedy, ignore_eos, distinct prompts (no prefix-cache hits). The JSON is rewritten after every
measurement, so a run cut short by a timeout still leaves what it measured. `--quick`: the 2-layer
model and short runs (a smoke test of the script, e.g. on a CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, count_params, ensure_model, random_prompt  # noqa: E402

FULL = dict(
    prefill_len=512, prefill_reps=3, dec_prompt=128, dec_new=64, dec_reps=2, conc=16, conc_prompt=128, conc_new=128
)
QUICK = dict(prefill_len=64, prefill_reps=1, dec_prompt=16, dec_new=8, dec_reps=1, conc=4, conc_prompt=16, conc_new=8)
PAGE_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--quick", action="store_true", help="2-layer model, short runs (a smoke test)")
    p.add_argument("--skip-hf", action="store_true", help="mlaserve only")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu-<dtype>[-quick].json)")
    return p.parse_args()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class MlaServe:
    name = "mlaserve"

    def __init__(self, folder: Path, device: str, dtype: str, s: dict) -> None:
        from mlaserve import LLM

        need = s["conc"] * math.ceil((s["conc_prompt"] + s["conc_new"]) / PAGE_SIZE)
        need = max(
            need, math.ceil((s["prefill_len"] + 1) / PAGE_SIZE), math.ceil((s["dec_prompt"] + s["dec_new"]) / PAGE_SIZE)
        )
        self.llm = LLM(
            model=str(folder),
            device=device,
            dtype=dtype,
            page_size=PAGE_SIZE,
            max_num_batched_tokens=2048,
            max_num_seqs=max(16, s["conc"]),
            num_pages=need + 16,
        )
        self.device = device

    def generate(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        from mlaserve import SamplingParams

        outs = self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
        if sum(o.metrics.get("num_cached_prompt_tokens", 0) or 0 for o in outs):
            raise RuntimeError("prefix cache hit: the prompts must be distinct")
        self._last = outs
        return [list(o.outputs[0].token_ids) for o in outs]

    def decode_rate(self, prompt: list[int], new: int) -> tuple[float, list[int]]:
        ids = self.generate([prompt], new)[0]
        return self._last[0].metrics["tokens_per_s"], ids


class _Stamps:
    """A logits processor that records when each generation step's logits arrive (synchronised)."""

    def __init__(self, device: str) -> None:
        self.t: list[float] = []
        self.device = device

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.t.append(time.perf_counter())
        return scores


class HF:
    name = "transformers"

    def __init__(self, folder: Path, device: str, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=DTYPES[dtype]).to(device).eval()
        self.device = device
        cfg = self.model.config
        self.impl = {
            "attn_implementation": cfg._attn_implementation,
            "experts_implementation": getattr(cfg, "_experts_implementation", None),
        }

    def generate(self, prompts: list[list[int]], new: int, stamps: _Stamps | None = None) -> list[list[int]]:
        from transformers import LogitsProcessorList

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), 2, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=2)
        if stamps is not None:
            kw["logits_processor"] = LogitsProcessorList([stamps])
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kw)
        return out[:, width:].tolist()

    def decode_rate(self, prompt: list[int], new: int) -> tuple[float, list[int]]:
        st = _Stamps(self.device)
        ids = self.generate([prompt], new, st)[0]
        return (len(st.t) - 1) / (st.t[-1] - st.t[0]), ids


def timed(fn, device: str, reps: int) -> list[float]:
    ts = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return ts


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def agreement(a: list[int], b: list[int]) -> str:
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{same}/{len(a)}"


def measure(e, s: dict, vocab: int, device: str, res: dict, save) -> dict:
    """Every figure for one engine; seeds differ per call so no prompt repeats."""
    r = res.setdefault(e.name, {})
    seed = iter(range(1000 * (1 + (e.name == "transformers")), 10**6))
    t0 = time.perf_counter()
    e.generate([random_prompt(32, vocab, next(seed)), random_prompt(20, vocab, next(seed))], 4)  # warm-up
    e.generate([random_prompt(s["prefill_len"], vocab, next(seed))], 1)
    sync(device)
    r["warmup_s"] = time.perf_counter() - t0
    ts = timed(lambda: e.generate([random_prompt(s["prefill_len"], vocab, next(seed))], 1), device, s["prefill_reps"])
    r["prefill_tok_s"], r["prefill_s"] = s["prefill_len"] / median(ts), ts
    print(f"  {e.name}: prefill {s['prefill_len']}: {r['prefill_tok_s']:.0f} tok/s", flush=True)
    save()
    rates, greedy = [], []
    for rep in range(s["dec_reps"]):
        rate, ids = e.decode_rate(random_prompt(s["dec_prompt"], vocab, 500 + rep), s["dec_new"])
        rates.append(rate)
        greedy.append(ids)
    r["decode_tok_s_b1"], r["decode_tok_s_b1_all"] = median(rates), rates
    print(f"  {e.name}: decode batch 1: {r['decode_tok_s_b1']:.1f} tok/s", flush=True)
    save()
    prompts = [random_prompt(s["conc_prompt"], vocab, next(seed)) for _ in range(s["conc"])]
    ts = timed(lambda: e.generate(prompts, s["conc_new"]), device, 1)
    r["output_tok_s_concurrent"], r["concurrent_s"] = s["conc"] * s["conc_new"] / ts[0], ts
    print(f"  {e.name}: {s['conc']} concurrent: {r['output_tok_s_concurrent']:.0f} output tok/s", flush=True)
    if device == "cuda":
        r["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    save()
    return {"greedy_b1": greedy}


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (torch.cuda.is_available() is False): nothing to measure on cuda")
        return
    s = QUICK if args.quick else FULL
    out = Path(args.out) if args.out else RESULTS_DIR / f"gpu-{args.dtype}{'-quick' if args.quick else ''}.json"
    import transformers

    res: dict = {
        "settings": s,
        "device": args.device,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "transformers_version": transformers.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "status": "running",
    }

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2, default=str))

    t0 = time.perf_counter()
    folder = ensure_model("standard", args.quick)
    res["model"] = {"folder": folder.name, "params": count_params(folder), "build_or_find_s": time.perf_counter() - t0}
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    save()
    greedy = {}
    engines = [("mlaserve", lambda: MlaServe(folder, args.device, args.dtype, s))]
    if not args.skip_hf:
        engines.append(("transformers", lambda: HF(folder, args.device, args.dtype)))
    for name, make in engines:
        print(f"[{name}] loading", flush=True)
        try:
            t = time.perf_counter()
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            e = make()
            res.setdefault(name, {})["load_s"] = time.perf_counter() - t
            if name == "transformers":
                res[name]["impl"] = e.impl
            greedy[name] = measure(e, s, vocab, args.device, res, save)["greedy_b1"]
        except Exception as exc:  # record and go on to the other engine
            res.setdefault(name, {})["error"] = f"{type(exc).__name__}: {exc}"
            res[name]["traceback"] = traceback.format_exc()
            print(res[name]["traceback"], flush=True)
        e = None
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        save()
    if len(greedy) == 2:
        res["greedy_agreement_b1"] = [agreement(a, b) for a, b in zip(greedy["mlaserve"], greedy["transformers"])]
    ml, hf = res.get("mlaserve", {}), res.get("transformers", {})
    for key in ("prefill_tok_s", "decode_tok_s_b1", "output_tok_s_concurrent"):
        if key in ml and key in hf:
            res.setdefault("ratio_mlaserve_over_transformers", {})[key] = ml[key] / hf[key]
    res["status"], res["wall_s"] = "done", time.perf_counter() - t0
    save()
    print(json.dumps({k: res.get(k) for k in ("ratio_mlaserve_over_transformers", "greedy_agreement_b1")}, indent=1))
    print(f"[results] wrote {out}")


if __name__ == "__main__":
    main()

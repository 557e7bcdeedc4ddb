"""GPU benchmark: mlaserve with CUDA graphs, mlaserve eager and Hugging Face transformers on a benchmark model
(common.py: `--model standard` or `dsa`), same random weights, same dtype, same device, in one run.

    python benchmarks/gpu_bench.py [--model standard|dsa] [--device cuda] [--dtype bfloat16] [--quick]
                                   [--engines graphs,graphs-triton,eager,transformers] [--long] [--out FILE]

Measures (the offline benchmark's definitions, on the device), per engine:
  prefill tokens/s        one 512-token prompt, end to end to its first token (median of reps)
  decode tokens/s (B=1)   128-token prompt, 64 new tokens: (n-1) / (last token time - first token time)
  output tokens/s (B=16, B=64)  16 / 64 concurrent requests, prompt 128, 128 new tokens: B*128 / wall time
  prefill 8K (--long)     one 8,000-token prompt, once, last (the part a short budget drops first)
  memory                  per engine: what its load holds (weights, cache pool: loaded_gpu_mem_gib) and per phase
                          the peak above what every loaded engine holds (<phase>_peak_above_loaded_gib); an engine's
                          peak is their sum
  graphs                  mlaserve with cuda_graphs on: graphs captured, capture seconds and memory reserved by the
                          captures (DecodeGraphs.summary), replayed steps
Engines: graphs and eager (mlaserve, attention_backend auto: torch), graphs-triton (cuda_graphs on with
attention_backend triton: the compiled Triton attention kernels replayed in the graphs; opt-in, name it in
--engines), transformers.
The mlaserve engines are loaded side by side and measured alternately (graphs, eager, graphs, ...: the same
conditions for both), transformers after them. Greedy, ignore_eos, distinct prompts (no prefix-cache hits). The JSON
is rewritten after every measurement, so a run cut short by a timeout still leaves what it measured. `--quick`: the
2-layer model and short runs (a smoke test of the script, e.g. on a CPU, where graphs are off: engine "eager" only).
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
    prefill_len=512,
    prefill_reps=3,
    dec_prompt=128,
    dec_new=64,
    dec_reps=2,
    conc=(16, 64),
    conc_prompt=128,
    conc_new=128,
    long_len=8000,
)
QUICK = dict(
    prefill_len=64,
    prefill_reps=1,
    dec_prompt=16,
    dec_new=8,
    dec_reps=1,
    conc=(4,),
    conc_prompt=16,
    conc_new=8,
    long_len=200,
)
PAGE_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--model", default="standard", choices=["standard", "dsa"])
    p.add_argument("--quick", action="store_true", help="2-layer model, short runs (a smoke test)")
    p.add_argument(
        "--engines",
        default=None,
        help="comma-separated of graphs, graphs-triton, eager, transformers (default: graphs,eager,transformers on "
        "cuda, eager,transformers on cpu)",
    )
    p.add_argument("--long", action="store_true", help="also one 8,000-token prefill per engine, last")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu-<dtype>[-quick].json)")
    return p.parse_args()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class MlaServe:
    def __init__(
        self, folder: Path, device: str, dtype: str, s: dict, graphs: bool, attention_backend: str = "auto"
    ) -> None:
        from mlaserve import LLM

        self.name = ("mlaserve-graphs" if graphs else "mlaserve-eager") + (
            "" if attention_backend == "auto" else f"-{attention_backend}"
        )
        need = max(s["conc"]) * math.ceil((s["conc_prompt"] + s["conc_new"]) / PAGE_SIZE)
        need = max(
            need, math.ceil((s["long_len"] + 1) / PAGE_SIZE), math.ceil((s["dec_prompt"] + s["dec_new"]) / PAGE_SIZE)
        )
        self.llm = LLM(
            model=str(folder),
            device=device,
            dtype=dtype,
            page_size=PAGE_SIZE,
            max_num_batched_tokens=2048,
            max_num_seqs=max(16, *s["conc"]),
            num_pages=need + 16,
            cuda_graphs="on" if graphs else "off",
            attention_backend=attention_backend,
        )
        self.device = device

    def extra(self) -> dict:
        """The graphs' figures (capture time and memory, graphs, replays) and the decode steps' refusal reasons."""
        graphs = self.llm.runner.graphs
        out = {"cuda_graphs": self.llm.loaded.config.runtime.cuda_graphs}
        if graphs is not None:
            out["graphs"] = graphs.summary()
        return out

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

    def extra(self) -> dict:
        return {"impl": self.impl}

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


def phases(s: dict, vocab: int, long: bool) -> list:
    """The measurements in order, each (key, fn(engine, seed) -> (value, extra fields)); the long prefill last."""

    def prefill(e, seed, n=s["prefill_len"], reps=s["prefill_reps"]):
        ts = timed(lambda: e.generate([random_prompt(n, vocab, next(seed))], 1), e.device, reps)
        return n / median(ts), {"s": ts}

    def decode(e, seed):
        rates, greedy = [], []
        for rep in range(s["dec_reps"]):
            rate, ids = e.decode_rate(random_prompt(s["dec_prompt"], vocab, 500 + rep), s["dec_new"])
            rates.append(rate)
            greedy.append(ids)
        return median(rates), {"all": rates, "greedy": greedy}

    def concurrent(b):
        def run(e, seed):
            prompts = [random_prompt(s["conc_prompt"], vocab, next(seed)) for _ in range(b)]
            ts = timed(lambda: e.generate(prompts, s["conc_new"]), e.device, 1)
            return b * s["conc_new"] / ts[0], {"s": ts}

        return run

    out = [("prefill_tok_s", prefill), ("decode_tok_s_b1", decode)]
    out += [(f"output_tok_s_concurrent_{b}", concurrent(b)) for b in s["conc"]]
    if long:
        out.append(("prefill_long_tok_s", lambda e, seed: prefill(e, seed, s["long_len"], 1)))
    return out


def warm_up(e, s: dict, vocab: int, seed) -> float:
    t0 = time.perf_counter()
    e.generate([random_prompt(32, vocab, next(seed)), random_prompt(20, vocab, next(seed))], 4)
    e.generate([random_prompt(s["prefill_len"], vocab, next(seed))], 1)
    sync(e.device)
    return time.perf_counter() - t0


def measure_alternating(engines: list, s: dict, vocab: int, res: dict, save, long: bool) -> None:
    """Every phase for each engine in turn (graphs, eager, graphs, ...): the mlaserve engines under the same
    conditions; a failing engine is recorded and dropped, the others go on."""
    seeds = {e.name: iter(range(1000 * (i + 1), 1000 * (i + 1) + 900)) for i, e in enumerate(engines)}
    live = list(engines)
    for e in list(live):
        try:
            res[e.name]["warmup_s"] = warm_up(e, s, vocab, seeds[e.name])
        except Exception as exc:
            _failed(res, e, exc, live)
    for key, fn in phases(s, vocab, long):
        for e in list(live):
            if e.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            try:
                value, extra = fn(e, seeds[e.name])
            except Exception as exc:
                _failed(res, e, exc, live)
                continue
            r = res[e.name]
            r[key] = value
            r.update({f"{key}_{k}": v for k, v in extra.items()})
            if e.device == "cuda":  # this phase's peak above what every loaded engine holds
                r[f"{key}_peak_above_loaded_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            r.update(e.extra())
            print(f"  {e.name}: {key}: {value:.1f}", flush=True)
            save()


def _failed(res: dict, e, exc: Exception, live: list) -> None:
    res[e.name]["error"] = f"{type(exc).__name__}: {exc}"
    res[e.name]["traceback"] = traceback.format_exc()
    print(res[e.name]["traceback"], flush=True)
    live.remove(e)


def engine_names(args) -> list[str]:
    if args.engines:
        return [n.strip() for n in args.engines.split(",") if n.strip()]
    return ["graphs", "eager", "transformers"] if args.device == "cuda" else ["eager", "transformers"]


def load(name: str, folder: Path, args, s: dict, res: dict):
    """One engine, its load time and the device memory it holds once loaded (weights, cache pool)."""
    print(f"[{name}] loading", flush=True)
    before, t = gpu_allocated(args.device), time.perf_counter()
    if name == "transformers":
        e = HF(folder, args.device, args.dtype)
    elif name in ("graphs", "eager"):
        e = MlaServe(folder, args.device, args.dtype, s, graphs=name == "graphs")
    elif name == "graphs-triton":
        e = MlaServe(folder, args.device, args.dtype, s, graphs=True, attention_backend="triton")
    else:
        raise SystemExit(f"--engines: unknown engine {name!r} (graphs, graphs-triton, eager, transformers)")
    r = res.setdefault(e.name, {})
    r["load_s"] = time.perf_counter() - t
    if args.device == "cuda":
        r["loaded_gpu_mem_gib"] = (gpu_allocated(args.device) - before) / 2**30
    return e


def gpu_allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (torch.cuda.is_available() is False): nothing to measure on cuda")
        return
    s = QUICK if args.quick else FULL
    tag = f"{args.model}-{args.dtype}{'-quick' if args.quick else ''}"
    out = Path(args.out) if args.out else RESULTS_DIR / f"gpu-{tag}.json"
    import transformers

    res: dict = {
        "settings": s,
        "model_kind": args.model,
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
    folder = ensure_model(args.model, args.quick)
    res["model"] = {"folder": folder.name, "params": count_params(folder), "build_or_find_s": time.perf_counter() - t0}
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    save()
    names = engine_names(args)
    ours = [n for n in names if n != "transformers"]
    # the mlaserve engines side by side, measured alternately; then transformers alone
    for group in (ours, [n for n in names if n == "transformers"]):
        engines = []
        for name in group:
            try:
                engines.append(load(name, folder, args, s, res))
            except Exception as exc:
                res.setdefault(name, {})["error"] = f"{type(exc).__name__}: {exc}"
                res[name]["traceback"] = traceback.format_exc()
                print(res[name]["traceback"], flush=True)
            save()
        if engines:
            measure_alternating(engines, s, vocab, res, save, args.long)
        engines = None
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        save()
    summarise(res)
    res["status"], res["wall_s"] = "done", time.perf_counter() - t0
    save()
    print(json.dumps({k: res.get(k) for k in ("ratios", "greedy_agreement_b1")}, indent=1))
    print(f"[results] wrote {out}")


def summarise(res: dict) -> None:
    """Ratios between engines on every shared figure, and greedy agreement of the batch-1 decodes."""
    keys = ("prefill_tok_s", "decode_tok_s_b1", "prefill_long_tok_s") + tuple(
        k
        for k in res.get("mlaserve-eager", res.get("mlaserve-graphs", res.get("mlaserve-graphs-triton", {})))
        if k.startswith("output_tok_s_concurrent_") and not k.endswith("_s")
    )
    pairs = [
        ("mlaserve-graphs-triton", "mlaserve-graphs"),
        ("mlaserve-graphs-triton", "mlaserve-eager"),
        ("mlaserve-graphs", "mlaserve-eager"),
        ("mlaserve-graphs", "transformers"),
        ("mlaserve-eager", "transformers"),
    ]
    for a, b in pairs:
        ra, rb = res.get(a, {}), res.get(b, {})
        for key in keys:
            if isinstance(ra.get(key), float) and isinstance(rb.get(key), float):
                res.setdefault("ratios", {}).setdefault(f"{a} / {b}", {})[key] = ra[key] / rb[key]
        ga, gb = ra.get("decode_tok_s_b1_greedy"), rb.get("decode_tok_s_b1_greedy")
        if ga and gb:
            res.setdefault("greedy_agreement_b1", {})[f"{a} vs {b}"] = [agreement(x, y) for x, y in zip(ga, gb)]


if __name__ == "__main__":
    main()

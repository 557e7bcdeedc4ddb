"""Offline benchmark: mlaserve vs Hugging Face transformers on the same random weights, same dtype,
same thread count, in one run (the two are interleaved metric by metric, so background load hits
both alike).

    python benchmarks/offline.py [--dtype float32|bfloat16] [--quick] [--threads 2]

Measures (see benchmarks/README.md for the exact definitions):
  prefill tokens/s        one 512-token prompt, end to end to its first token
  decode tokens/s (B=1)   128-token prompt, 64 new tokens: (n-1) / (last token time - first token time)
  output tokens/s (B=16)  16 concurrent requests, prompt 128, 128 new tokens: 16*128 / wall time
  KV bytes per token      mlaserve: its latent cache's allocated bytes / rows; transformers: what its
                          DynamicCache holds after a generate / (batch * cached tokens)
  decode step vs context  one single-token forward at context 128/512/1024/2048 over a synthetic
                          cache (same rows for both engines), logits for that token only
llama.cpp is measured when `llama_cpp` is importable and --gguf names a GGUF of the same weights.
Results: a table on stdout and benchmarks/results/offline-<dtype>[-quick].json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    RESULTS_DIR,
    count_params,
    ensure_model,
    environment,
    fill_mlaserve_cache,
    fmt,
    mem_available_gib,
    print_table,
    random_prompt,
    rss_gib,
    timed,
    write_json,
)

FULL = dict(
    prefill_len=512,
    prefill_reps=3,
    dec_prompt=128,
    dec_new=64,
    dec_reps=2,
    conc=16,
    conc_prompt=128,
    conc_new=128,
    conc_reps=1,
    contexts=[128, 512, 1024, 2048],
    step_reps=5,
    step_warmup=2,
)
QUICK = dict(
    prefill_len=128,
    prefill_reps=2,
    dec_prompt=32,
    dec_new=8,
    dec_reps=1,
    conc=16,
    conc_prompt=32,
    conc_new=8,
    conc_reps=1,
    contexts=[128, 512],
    step_reps=3,
    step_warmup=1,
)
PAGE_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--quick", action="store_true", help="2-layer model, short prompts: a smoke test, not a benchmark")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both engines (spec: 2)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--gguf", default=None, help="GGUF of the same weights for llama.cpp (used only if llama_cpp imports)"
    )
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/offline-<dtype>[-quick].json)")
    return p.parse_args()


# -- mlaserve --------------------------------------------------------------------------------------------
class MlaServe:
    name = "mlaserve"

    def __init__(self, folder, dtype: str, settings: dict) -> None:
        from mlaserve import LLM

        need = max(
            settings["conc"] * math.ceil((settings["conc_prompt"] + settings["conc_new"]) / PAGE_SIZE),
            math.ceil((max(settings["contexts"]) + 1) / PAGE_SIZE),
            math.ceil((settings["prefill_len"] + 1) / PAGE_SIZE),
        )
        self.llm = LLM(
            model=str(folder),
            dtype=dtype,
            page_size=PAGE_SIZE,
            max_num_batched_tokens=2048,
            max_num_seqs=max(16, settings["conc"]),
            num_pages=need + 16,
            threads=torch.get_num_threads(),  # the benchmark's --threads
            malloc_tuning=True,  # as the CLI and server run
        )
        self.vocab = self.llm.config.model.vocab_size

    def _params(self, n: int):
        from mlaserve.sampling.params import SamplingParams

        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def generate(self, prompts: list[list[int]], new: int):
        outs = self.llm.generate(prompts, self._params(new))
        cached = sum(o.metrics.get("num_cached_prompt_tokens", 0) or 0 for o in outs)
        if cached:
            raise RuntimeError(f"prefix cache hit ({cached} tokens): the prompts must be distinct")
        return outs

    def decode_rate(self, prompt: list[int], new: int) -> tuple[float, list[int]]:
        out = self.generate([prompt], new)[0]
        return out.metrics["tokens_per_s"], list(out.outputs[0].token_ids)

    def kv_bytes_per_token(self) -> dict:
        from mlaserve.executor.latent_cache import LatentCache

        cache = self.llm.runner.cache
        cfg = self.llm.config
        return {
            "measured": cache.measured_bytes_per_token(),
            "formula": LatentCache.bytes_per_token(cfg.model, cfg.dtype, with_indexer=cfg.sparse),
            "what": "allocated latent-cache tensor bytes / cache rows (all layers; [c_kv | k_pe] per token)",
        }

    def step_times(self, contexts: list[int], reps: int, warmup: int) -> tuple[dict, dict]:
        """Single-token decode forward over a synthetic cache at each context length."""
        from mlaserve.executor.forward_batch import SeqChunk

        n_max = max(contexts)
        pool = self.llm.engine.pool
        pages = pool.allocate(math.ceil((n_max + 1) / PAGE_SIZE))
        try:
            rows = fill_mlaserve_cache(self.llm, pages, n_max)
            out = {}
            for n in contexts:
                chunk = SeqChunk("ctx", (5,), n, tuple(pages[: math.ceil((n + 1) / PAGE_SIZE)]))
                out[n] = timed(lambda: self.llm.runner.execute([chunk]), reps, warmup)
        finally:
            pool.release(pages)
        return out, rows


# -- transformers ----------------------------------------------------------------------------------------
class _Stamps:
    """A logits processor that records when each generation step's logits arrive."""

    def __init__(self) -> None:
        self.t: list[float] = []

    def __call__(self, input_ids, scores):
        self.t.append(time.perf_counter())
        return scores


class HF:
    name = "transformers"

    def __init__(self, folder, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model, info = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=DTYPES[dtype], output_loading_info=True
        )
        bad = {k: v for k, v in info.items() if v}
        if bad:
            raise RuntimeError(f"transformers did not load the folder cleanly: {bad}")
        self.model.eval()
        cfg = self.model.config
        self.impl = {
            "attn_implementation": cfg._attn_implementation,
            "experts_implementation": getattr(cfg, "_experts_implementation", None),
        }

    def generate(self, prompts: list[list[int]], new: int, stamps: _Stamps | None = None, return_cache=False):
        from transformers import LogitsProcessorList

        # left padding + attention mask (a no-op when all prompts have the same length, as here)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), 2, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=2, return_dict_in_generate=True)
        if stamps is not None:
            kw["logits_processor"] = LogitsProcessorList([stamps])
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kw)
        return out

    def decode_rate(self, prompt: list[int], new: int) -> tuple[float, list[int], object]:
        st = _Stamps()
        out = self.generate([prompt], new, st)
        rate = (len(st.t) - 1) / (st.t[-1] - st.t[0])
        cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        return rate, out.sequences[0, len(prompt) :].tolist(), cache

    @staticmethod
    def kv_bytes_per_token(cache, batch: int) -> dict:
        total, seq = 0, None
        for layer in cache.layers:
            for t in (layer.keys, layer.values):
                total += t.numel() * t.element_size()
            seq = layer.get_seq_length()
        shapes = [tuple(cache.layers[0].keys.shape), tuple(cache.layers[0].values.shape)]
        return {
            "measured": total // (batch * seq),
            "cached_tokens": seq,
            "layer0_shapes": shapes,
            "what": "sum over DynamicCache layers of keys+values bytes / (batch * cached tokens)",
        }

    def step_times(self, contexts: list[int], rows: dict, reps: int, warmup: int) -> dict:
        from transformers import DynamicCache

        cfg = self.model.config
        r = cfg.kv_lora_rank
        out = {}
        for n in contexts:
            cache = DynamicCache(config=cfg)
            for i in range(cfg.num_hidden_layers):
                lat = rows[i][:n]
                cache.update(lat[:, :r].reshape(1, 1, n, r).clone(), lat[:, r:].reshape(1, 1, n, -1).clone(), i)
            ids, pos = torch.tensor([[5]]), torch.tensor([[n]])

            def step(cache=cache, ids=ids, pos=pos):
                with torch.inference_mode():
                    self.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
                cache.crop(-1)  # back to n tokens: every timed step sees the same context

            out[n] = timed(step, reps, warmup)
            assert cache.get_seq_length() == n
        return out


# -- llama.cpp -------------------------------------------------------------------------------------------
def llama_cpp_status(gguf: str | None) -> str | None:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "not installed"
    if not gguf:
        return "installed, no --gguf given"
    return None


def run_llama_cpp(gguf: str, settings: dict, threads: int) -> dict:
    """Untested here (llama_cpp was not installed where this was written): prefill and batch-1 decode."""
    from llama_cpp import Llama

    lm = Llama(model_path=gguf, n_threads=threads, n_ctx=4096, n_batch=512, verbose=False)
    prompt = random_prompt(settings["prefill_len"], lm.n_vocab(), 900)
    lm.reset()
    t0 = time.perf_counter()
    lm.eval(prompt)
    prefill = settings["prefill_len"] / (time.perf_counter() - t0)
    lm.reset()
    lm.eval(random_prompt(settings["dec_prompt"], lm.n_vocab(), 901))
    t0 = time.perf_counter()
    for _ in range(settings["dec_new"] - 1):
        lm.eval([int(lm.sample(temp=0.0))])
    decode = (settings["dec_new"] - 1) / (time.perf_counter() - t0)
    return {"prefill_tok_s": prefill, "decode_tok_s_b1": decode}


# -- the run ---------------------------------------------------------------------------------------------
def measure_prefill(engines, s: dict, vocab: int, seed, res: dict) -> None:
    print("[prefill]", flush=True)
    for e in engines:
        t = timed(lambda: e.generate([random_prompt(s["prefill_len"], vocab, next(seed))], 1), s["prefill_reps"], 0)
        res[e.name]["prefill_tok_s"] = s["prefill_len"] / t["median_s"]
        res[e.name]["prefill_s"] = t
        print(f"  {e.name}: {res[e.name]['prefill_tok_s']:.1f} tok/s", flush=True)


def measure_decode_b1(engines, ml: MlaServe, hf: HF | None, s: dict, vocab: int, res: dict) -> None:
    print("[decode batch 1]", flush=True)
    greedy = {}
    for e in engines:
        rates = []
        for rep in range(s["dec_reps"]):
            prompt = random_prompt(s["dec_prompt"], vocab, 500 + rep)
            if e is hf:
                rate, ids, cache = e.decode_rate(prompt, s["dec_new"])
                if rep == 0:
                    res[e.name]["kv_bytes_per_token"] = HF.kv_bytes_per_token(cache, 1)
                del cache
            else:
                rate, ids = e.decode_rate(prompt, s["dec_new"])
            rates.append(rate)
            greedy.setdefault(rep, {})[e.name] = ids
        res[e.name]["decode_tok_s_b1"] = sorted(rates)[len(rates) // 2]
        res[e.name]["decode_tok_s_b1_all"] = rates
        print(f"  {e.name}: {res[e.name]['decode_tok_s_b1']:.2f} tok/s", flush=True)
    res["mlaserve"]["kv_bytes_per_token"] = ml.kv_bytes_per_token()
    if hf is not None:
        res["greedy_agreement_b1"] = [_agreement(d["mlaserve"], d["transformers"]) for d in greedy.values()]


def _agreement(a: list[int], b: list[int]) -> str:
    """Leading identical tokens of two greedy continuations, as 'n/len'."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{same}/{len(a)}"


def measure_concurrent(engines, s: dict, vocab: int, seed, res: dict) -> None:
    print(f"[{s['conc']} concurrent requests]", flush=True)
    for e in engines:

        def run():
            e.generate([random_prompt(s["conc_prompt"], vocab, next(seed)) for _ in range(s["conc"])], s["conc_new"])

        t = timed(run, s["conc_reps"], 0)
        res[e.name]["output_tok_s_concurrent"] = s["conc"] * s["conc_new"] / t["median_s"]
        res[e.name]["concurrent_s"] = t
        print(f"  {e.name}: {res[e.name]['output_tok_s_concurrent']:.1f} tok/s ({t['median_s']:.0f} s)", flush=True)


def measure_steps(ml: MlaServe, hf: HF | None, s: dict, res: dict) -> None:
    print("[decode step vs context]", flush=True)
    ml_steps, rows = ml.step_times(s["contexts"], s["step_reps"], s["step_warmup"])
    res["mlaserve"]["step_ms"] = {n: v["median_s"] * 1e3 for n, v in ml_steps.items()}
    if hf is not None:
        hf_steps = hf.step_times(s["contexts"], rows, s["step_reps"], s["step_warmup"])
        res["transformers"]["step_ms"] = {n: v["median_s"] * 1e3 for n, v in hf_steps.items()}
    del rows
    gc.collect()


def measure_llama_cpp(args, s: dict, res: dict) -> str | None:
    """None when llama.cpp was measured (into res["llama.cpp"]); else why not."""
    lc_status = llama_cpp_status(args.gguf)
    if lc_status is None:
        try:
            res["llama.cpp"] = run_llama_cpp(args.gguf, s, args.threads)
        except Exception as ex:  # noqa: BLE001 -- report, don't lose the other numbers
            lc_status = f"failed: {ex}"
    return lc_status


def _row(res: dict, lc_status: str | None, label: str, key: str, better: str, sub=None) -> list:
    m, h, lc = res["mlaserve"], res.get("transformers", {}), res.get("llama.cpp", {})
    mv = m.get(key) if sub is None else m.get(key, {}).get(sub)
    hv = h.get(key) if sub is None else h.get(key, {}).get(sub)
    if isinstance(mv, dict):
        mv, hv = mv.get("measured"), (hv or {}).get("measured")
    ratio = f"{mv / hv:.2f}x" if mv and hv else "-"
    lcv = lc.get(key) if lc else None
    return [label, fmt(mv), fmt(hv), ratio, better, fmt(lcv) if lcv is not None else (lc_status or "-")]


def report(args, s: dict, res: dict, lc_status: str | None, env: dict, wall: float):
    """Print the comparison table and the run's conditions; returns the table."""
    rows_t = [
        _row(res, lc_status, f"prefill tok/s ({s['prefill_len']}-token prompt)", "prefill_tok_s", "higher"),
        _row(res, lc_status, f"decode tok/s, batch 1 ({s['dec_prompt']}+{s['dec_new']})", "decode_tok_s_b1", "higher"),
        _row(
            res,
            lc_status,
            f"output tok/s, {s['conc']} concurrent ({s['conc_prompt']}+{s['conc_new']})",
            "output_tok_s_concurrent",
            "higher",
        ),
        _row(res, lc_status, "KV cache bytes/token (all layers)", "kv_bytes_per_token", "lower"),
    ]
    for n in s["contexts"]:
        rows_t.append(_row(res, lc_status, f"decode step ms @ context {n}", "step_ms", "lower", sub=n))
    print()
    print(
        f"mlaserve vs transformers -- dtype {args.dtype}, {args.threads} threads, "
        f"{'QUICK (2 layers)' if args.quick else 'standard model (12 layers)'}; ratio = mlaserve / transformers"
    )
    table = print_table(["metric", "mlaserve", "transformers", "ratio", "better", "llama.cpp"], rows_t)
    if "greedy_agreement_b1" in res:
        print(f"greedy agreement (leading identical tokens, batch 1): {res['greedy_agreement_b1']}")
    env["loadavg_end"] = list(os.getloadavg())
    print(
        f"wall time {wall:.0f} s; loadavg start {env['loadavg_start']} end {env['loadavg_end']} "
        f"(other processes share the {env['cpus']} CPUs: absolute numbers are pessimistic)"
    )
    return table


def save_results(args, s: dict, res: dict, lc_status, env: dict, wall: float, folder: Path, hf, table) -> None:
    out = Path(args.out) if args.out else RESULTS_DIR / f"offline-{args.dtype}{'-quick' if args.quick else ''}.json"
    write_json(
        out,
        {
            "benchmark": "offline",
            "dtype": args.dtype,
            "quick": args.quick,
            "settings": s,
            "env": env,
            "wall_s": wall,
            "model": {
                "folder": str(folder),
                "params": count_params(folder),
                "config": json.loads((folder / "config.json").read_text()),
            },
            "transformers_impl": hf.impl if hf else None,
            "llama.cpp": lc_status or "measured",
            "results": res,
            "table": table,
            "notes": [
                "ratio = mlaserve / transformers; for times and bytes lower is better",
                "decode step vs context uses a synthetic cache (same rows for both engines), single token, "
                "logits of that token only; it excludes scheduling and sampling",
                "transformers 5.x caches the compressed latent ([c_kv], [k_pe]) too, but re-expands the whole "
                "cached context through kv_b_proj at every step",
            ],
        },
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    s = QUICK if args.quick else FULL
    wall0 = time.perf_counter()
    folder = ensure_model("standard", args.quick)
    env = environment(args.threads)
    print(
        f"[env] {env['cpu']}, {env['cpus']} CPUs, torch threads {args.threads}, loadavg {env['loadavg_start']}",
        flush=True,
    )
    ml = MlaServe(folder, args.dtype, s)
    vocab = ml.vocab
    hf = None if args.skip_transformers else HF(folder, args.dtype)
    print(f"[load] models loaded, RSS {rss_gib():.1f} GiB, available {mem_available_gib():.1f} GiB", flush=True)
    engines = [e for e in (ml, hf) if e is not None]
    res: dict = {e.name: {} for e in engines}
    seed = iter(range(1, 10_000))
    # warm-up (lazy initialisation, allocator) -- not measured
    for e in engines:
        e.generate([random_prompt(16, vocab, next(seed)), random_prompt(16, vocab, next(seed))], 2)
    measure_prefill(engines, s, vocab, seed, res)
    measure_decode_b1(engines, ml, hf, s, vocab, res)
    measure_concurrent(engines, s, vocab, seed, res)
    measure_steps(ml, hf, s, res)
    lc_status = measure_llama_cpp(args, s, res)
    wall = time.perf_counter() - wall0
    table = report(args, s, res, lc_status, env, wall)
    save_results(args, s, res, lc_status, env, wall, folder, hf, table)


if __name__ == "__main__":
    main()

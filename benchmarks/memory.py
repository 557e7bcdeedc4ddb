"""Where a GGUF engine's resident memory goes: RSS after load, peak during a prefill, after decode steps, split
into anonymous memory (copies, the cache pool, temporaries, the runtime) and file-backed pages (the mapped GGUF:
shared with the page cache and with every other process that maps the file), with the start time (load to
first token).

Each configuration runs in a fresh process (`--worker`), so the peak (VmHWM) is that configuration's own.
llama.cpp (llama-cpp-python's C API, its default mmap, n_batch 2048 / n_ubatch 512) runs the same prompt and
decode steps in its own process beside them, so every series has its reference from the same minutes.

    python benchmarks/memory.py --gguf PATH [--gguf PATH2] [--reps 2] [--prompt 512] [--threads 2]
            [--prefill-matmul auto float] [--torch-share]
        # every (gguf_mmap, malloc_tuning, prefill_matmul) triple and llama.cpp, alternating, each --reps times;
        # JSON to benchmarks/results/ (the GGUF named relative to the checkout)
    python benchmarks/memory.py --gguf PATH --pair
        # two engines on the file at once (mapped, then copied): the second one's Rss, Pss, shared pages

Figures (GiB unless named otherwise), read from /proc/self/smaps_rollup and /proc/self/status:
  rss / anon / file    Rss, Anonymous, and Rss - Anonymous (file-backed: the mapped GGUF, the libraries)
  pss                  proportional set size (file pages another process also maps count half)
  runtime              smaps after the engine's imports, before any model: Python + torch (+ mlaserve's
                       modules) for mlaserve, Python + numpy + the llama.cpp libraries for llama.cpp
  weights_copied       bytes of the model's parameters and buffers that live in anonymous memory
  weights_mapped       bytes of them that are views of the mapped file
  kv_pool              the paged cache pool's tensors
  torch_tensors        weights_copied + kv_pool: what torch itself holds after load (its own share of the
                       anonymous memory); load_rest = after-load anonymous - runtime anonymous - torch_tensors
                       (the native kernels' library, plans, tokenizer, allocator slack of the load)
  peak                 VmHWM after the prefill (the process's highest RSS so far)
  torch_prefill_peak   (--torch-share) the most bytes torch's allocator held at once during the prefill, above
                       what it held when the prefill began (torch.profiler's memory events: every tensor torch
                       allocates, none of oneDNN's own buffers, glibc's free lists or the runtime); with
                       torch_tensors, torch's own share of the peak; the rest of the anonymous peak is
                       the runtime, load_rest, and what the libraries and the allocator keep. The profiler's
                       own records raise the process's peak (+0.3-0.6 GiB measured on a 2,048-token prefill), so
                       run --torch-share as a series of its own: its peak and smaps are not the engine's
  prefill_matmul       the engine's resolved choice (auto: bf16_6bit on CPUs with AMX-BF16 / AVX512-BF16)
  start_s              load_s + the first token of a --prompt tokens prompt
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's mlaserve, not an installed copy of another one


def smaps() -> dict:
    """/proc/self/smaps_rollup in GiB (Rss, Pss, Anonymous, Shared_Clean, Private_Dirty, ...) plus file = Rss - Anon."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":").lower()] = int(parts[1]) / 2**20
    out["file"] = out["rss"] - out["anonymous"]
    return {k: round(v, 4) for k, v in out.items() if k in ("rss", "pss", "anonymous", "file", "shared_clean")}


def status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) / 2**20, 4)
    return float("nan")


def mapped_ranges(path: str) -> list[tuple[int, int]]:
    """Address ranges of this process's maps of `path`."""
    real, out = os.path.realpath(path), []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and os.path.realpath(fields[5]) == real:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi))
    return out


def weight_bytes(model, path: str) -> dict:
    """Parameter and buffer bytes (each storage once) inside the file's map vs elsewhere."""
    ranges, seen, mapped, copied = mapped_ranges(path), set(), 0, 0
    for t in list(model.parameters()) + list(model.buffers()):
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        if any(lo <= s.data_ptr() < hi for lo, hi in ranges):
            mapped += s.nbytes()
        else:
            copied += s.nbytes()
    return {"weights_mapped": round(mapped / 2**30, 4), "weights_copied": round(copied / 2**30, 4)}


def worker(spec: dict) -> dict:
    if spec.get("engine") == "llama.cpp":
        return llama_worker(spec)
    import torch

    torch.set_num_threads(spec["threads"])
    from mlaserve import LLM, SamplingParams

    runtime = smaps()  # Python + torch + mlaserve's modules, before any model
    t0 = time.perf_counter()
    llm = LLM(
        spec["gguf"],
        threads=spec["threads"],
        malloc_tuning=spec["malloc_tuning"],
        gguf_mmap=spec["gguf_mmap"],
        prefill_matmul=spec.get("prefill_matmul", "auto"),
        num_pages=spec["prompt"] // 16 + 8,
        max_num_batched_tokens=max(2048, spec["prompt"]),
    )
    load_s = time.perf_counter() - t0
    from mlaserve.kernels import ggml

    out = {"load_s": round(load_s, 3), "after_load": smaps(), **weight_bytes(llm.runner.model, spec["gguf"])}
    out["expert_decode_cap_mib"] = ggml.EXPERT_BYTES >> 20
    out["prefill_matmul_resolved"] = llm.config.kernels.prefill_matmul
    pool = llm.runner.cache
    kv = {s.data_ptr(): s.nbytes() for t in pool_tensors(pool) for s in [t.untyped_storage()]}
    out["kv_pool"] = round(sum(kv.values()) / 2**30, 4)
    out["runtime"], out["torch_tensors"] = runtime, round(out["weights_copied"] + out["kv_pool"], 4)
    out["load_rest"] = round(out["after_load"]["anonymous"] - runtime["anonymous"] - out["torch_tensors"], 4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(30000, llm.config.model.vocab_size), (spec["prompt"],), generator=g).tolist()
    t1 = time.perf_counter()
    if spec.get("torch_share"):
        with torch_allocations() as held:
            llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
        out["torch_prefill_peak"] = round(held["peak"] / 2**30, 4)
    else:
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    out["first_token_s"] = round(time.perf_counter() - t1, 3)
    out["start_s"] = round(load_s + out["first_token_s"], 3)
    out["peak"], out["after_prefill"] = status("VmHWM"), smaps()
    llm.generate([ids[:64]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    out["after_decode"], out["peak_end"] = smaps(), status("VmHWM")
    if spec.get("hold"):  # --pair: stay alive (pages mapped) until the parent closes stdin
        print(json.dumps(out), flush=True)
        sys.stdin.read()
    return out


@contextlib.contextmanager
def torch_allocations():
    """Within the block, torch.profiler's memory events (each allocation and free of torch's CPU allocator, with
    its time); on exit held["peak"] is the highest running sum of them in time order: the most bytes torch held
    at once above what it held on entry."""
    from torch.profiler import ProfilerActivity, profile

    held = {"peak": 0}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield held
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    now = 0
    for _, nbytes in events:
        now += nbytes
        held["peak"] = max(held["peak"], now)


def llama_worker(spec: dict) -> dict:
    """llama.cpp on the same file, prompt and decode steps: its runtime, load, first token, peak and smaps."""
    import llama_cpp as lc
    import numpy as np

    runtime = smaps()  # Python + numpy + llama.cpp's libraries, before any model
    keep_log = lc.llama_log_callback(lambda level, text, user: None)  # quiet: the figures are the output
    lc.llama_log_set(keep_log, None)
    lc.llama_backend_init()
    t0 = time.perf_counter()
    mp = lc.llama_model_default_params()
    mp.load_mode = lc.LLAMA_LOAD_MODE_MMAP  # the file mapped, as mlaserve's gguf_mmap (auto would pick it on a CPU)
    # no extra buffer types (llama-cli's --no-repack): with them this build (AMX) stops at context creation on
    # these models (GGML_ASSERT cur_backend_id != -1); without, its weights are the mapped file's pages
    mp.use_extra_bufts = False
    model = lc.llama_model_load_from_file(spec["gguf"].encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {spec['gguf']}")
    cp = lc.llama_context_default_params()
    cp.n_ctx = -(-(spec["prompt"] + 64) // 256) * 256
    cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.no_perf = 2048, 512, 1, True
    cp.n_threads = cp.n_threads_batch = spec["threads"]
    ctx = lc.llama_init_from_model(model, cp)
    load_s = time.perf_counter() - t0
    out = {"load_s": round(load_s, 3), "after_load": smaps(), "runtime": runtime}
    out["model_params"] = {"load_mode": int(mp.load_mode), "use_extra_bufts": bool(mp.use_extra_bufts)}
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(2048, 0, 1)

    def decode(tokens: list[int], pos0: int) -> int:
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos0 + i, 1, 0
            batch.seq_id[i][0] = 0
        batch.logits[len(tokens) - 1] = 1
        batch.n_tokens = len(tokens)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, len(tokens) - 1), shape=(n_vocab,))
        return int(logits.argmax())

    g = np.random.default_rng(0)  # the same lengths as mlaserve's run (the ids need not match: memory only)
    ids = [int(x) for x in g.integers(3, min(30000, n_vocab), spec["prompt"])]
    t1 = time.perf_counter()
    tok = decode(ids, 0)
    out["first_token_s"] = round(time.perf_counter() - t1, 3)
    out["start_s"] = round(load_s + out["first_token_s"], 3)
    out["peak"], out["after_prefill"] = status("VmHWM"), smaps()
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
    tok = decode(ids[:64], 0)
    for step in range(15):
        tok = decode([tok], 64 + step)
    out["after_decode"], out["peak_end"] = smaps(), status("VmHWM")
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return out


def pair(path: str, mmap_on: bool, args) -> dict:
    """Two engines on one file at once: the first loads, runs its prompt and stays; the second does the same
    and reports its own smaps, where pages both map count half in Pss."""
    spec = dict(gguf=path, gguf_mmap=mmap_on, malloc_tuning=False, prompt=args.prompt, threads=args.threads)
    first = subprocess.Popen(
        [sys.executable, __file__, "--worker", json.dumps({**spec, "hold": True})],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        a = json.loads(first.stdout.readline())
        res = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True)
        b = json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        first.communicate("")
    return {"gguf": checkout_relative(path), "gguf_mmap": mmap_on, "first": a, "second": b}


def pool_tensors(cache) -> list:
    """Every tensor the cache object holds (attributes, lists, dicts; one level of nested objects)."""
    import torch

    found, stack, seen = [], [cache], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("mlaserve.cache"):
            stack.extend(vars(obj).values())
    return found


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    want = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
                    return " ".join(x for x in line.split(":")[1].split() if x in want)
    except OSError:
        pass
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", action="append", default=[])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mmap", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--malloc-tuning", nargs="+", default=["off", "on"], choices=["on", "off"])
    ap.add_argument("--prefill-matmul", nargs="+", default=["auto"], choices=["auto", "float", "bf16", "bf16_6bit"])
    ap.add_argument("--torch-share", action="store_true", help="torch's allocations' peak during the prefill")
    ap.add_argument("--llama-cpp", default="on", choices=["on", "off"], help="llama.cpp's run beside each series")
    ap.add_argument("--out", default=None)
    ap.add_argument("--pair", action="store_true", help="two engines on one file at once (mapped, then copied)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.pair:
        out = Path(args.out or HERE / "results" / f"memory-pair-{time.strftime('%Y%m%d-%H%M%S')}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        runs = [pair(path, mm == "on", args) for path in args.gguf for mm in args.mmap]
        for r in runs:
            b = r["second"]["after_decode"]
            print(
                f"{Path(r['gguf']).name} mmap={r['gguf_mmap']}: second engine rss {b['rss']:.2f} pss {b['pss']:.2f} "
                f"anon {b['anonymous']:.2f} file {b['file']:.2f} shared {b['shared_clean']:.2f}"
            )
        write(out, runs)
        return
    runs: list[dict] = []
    out = Path(args.out or HERE / "results" / f"memory-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for rep in range(args.reps):
        for path in args.gguf:
            specs = [
                dict(
                    engine="mlaserve",
                    gguf_mmap=mm == "on",
                    malloc_tuning=mt == "on",
                    prefill_matmul=pm,
                    torch_share=args.torch_share,
                )
                for mm in args.mmap
                for mt in args.malloc_tuning
                for pm in args.prefill_matmul
            ]
            if args.llama_cpp == "on":  # in the middle of the series: alternating with mlaserve's runs
                specs.insert(len(specs) // 2, dict(engine="llama.cpp"))
            for spec in specs:
                spec.update(gguf=path, rep=rep, prompt=args.prompt, threads=args.threads)
                load = os.getloadavg()[0]
                cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
                res = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if res.returncode:
                    sys.exit(f"worker failed for {spec}:\n{res.stderr[-4000:]}")
                row = {**spec, "load_before": round(load, 2), **json.loads(res.stdout.strip().splitlines()[-1])}
                row["gguf"] = checkout_relative(path)
                runs.append(row)
                print(describe(row, load), flush=True)
                write(out, runs)  # after every run: a series stopped early keeps what it measured
    print(f"wrote {out}")


def describe(row: dict, load: float) -> str:
    """One run's line: the engine, RSS after load (anon / file) and its parts, peak, after decode, start."""
    a, rt = row["after_load"], row["runtime"]
    if row["engine"] == "llama.cpp":
        what, parts = "llama.cpp", ""
    else:
        what = (
            f"mlaserve mmap={'on' if row['gguf_mmap'] else 'off'} malloc_tuning={'on' if row['malloc_tuning'] else 'off'}"
            f" prefill_matmul={row.get('prefill_matmul_resolved', '?')}"
        )
        parts = (
            f"; torch tensors {row['torch_tensors']:.2f} (weights copied {row['weights_copied']:.2f}, kv "
            f"{row['kv_pool']:.3f}), load rest {row['load_rest']:.2f}, weights mapped {row['weights_mapped']:.2f}"
        )
    return (
        f"{Path(row['gguf']).name} {what} rep={row['rep']}: runtime {rt['rss']:.2f} (anon {rt['anonymous']:.2f}), "
        f"after load {a['rss']:.2f} (anon {a['anonymous']:.2f}, file {a['file']:.2f}){parts}; peak "
        f"{row['peak']:.2f}{torch_part(row)}, after decode {row['after_decode']['rss']:.2f}; load {row['load_s']:.1f} s, start "
        f"{row['start_s']:.1f} s (load avg {load:.1f})"
    )


def torch_part(row: dict) -> str:
    return (
        f" (under the profiler; torch's allocations during the prefill +{row['torch_prefill_peak']:.2f})"
        if "torch_prefill_peak" in row
        else ""
    )


def checkout_relative(path: str) -> str:
    """A result names its file relative to the checkout (no machine paths in committed results)."""
    return os.path.relpath(os.path.abspath(path), HERE.parent)


def write(out: Path, runs: list[dict]) -> None:
    env = {
        "cpu_flags": cpu_flags(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_after": os.getloadavg(),
    }
    out.write_text(json.dumps({"env": env, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()

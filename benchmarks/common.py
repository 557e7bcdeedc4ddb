"""Shared pieces of the benchmarks: the standard model's config, building it on first use,
synthetic cache fills, timing helpers and the environment record written into every JSON.

The standard benchmark model (random weights, seeded, DeepSeek-V3 layout, ~0.76B parameters):
  hidden 1024, 12 layers (layer 0 dense, 11 MoE), 16 heads, kv_lora_rank 256, q_lora_rank 384,
  qk_rope 64, qk_nope 128, v 128, 32 routed experts top-4 in n_group=4 / topk_group=2 (noaux_tc),
  1 shared expert, intermediate 2816, moe_intermediate 512, vocab 32768.
Its DSA variant (long_context.py) is the same model with model_type deepseek_v32 and a GLM-5-like
lightning indexer: index_n_heads 32, index_head_dim 128, index_topk 2048, one indexer per layer.
`--quick` variants keep every width and cut the depth to 2 layers (1 dense + 1 MoE).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
MODELS_DIR = BENCH_DIR / "models"  # gitignored
RESULTS_DIR = BENCH_DIR / "results"  # gitignored
SEED = 0

STANDARD = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_hidden_layers=12,
    first_k_dense_replace=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=256,
    q_lora_rank=384,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    topk_method="noaux_tc",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    scoring_func="sigmoid",
    hidden_act="silu",
    attention_bias=False,
    rms_norm_eps=1e-6,
    vocab_size=32768,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    rope_interleave=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    num_nextn_predict_layers=0,
)

DSA = dict(
    STANDARD,
    model_type="deepseek_v32",
    architectures=["DeepseekV32ForCausalLM"],
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    max_position_embeddings=65536,
)


def model_config(kind: str, quick: bool) -> dict:
    cfg = dict({"standard": STANDARD, "dsa": DSA}[kind])
    if quick:
        cfg["num_hidden_layers"] = 2
    return cfg


def model_folder(kind: str, quick: bool) -> Path:
    name = {"standard": "mla-std", "dsa": "mla-dsa"}[kind]
    return MODELS_DIR / f"{name}-{'l2-quick' if quick else 'l12'}-seed{SEED}"


def ensure_model(kind: str, quick: bool) -> Path:
    """Build the model folder (config.json + model.safetensors) with write_random_model if missing.
    A folder whose config.json differs from the wanted one is rebuilt."""
    from mlaserve.embedded.random_model import write_random_model

    folder = model_folder(kind, quick)
    want = model_config(kind, quick)
    cfg_path, weights = folder / "config.json", folder / "model.safetensors"
    if weights.exists() and cfg_path.exists() and json.loads(cfg_path.read_text()) == want:
        return folder
    t0 = time.perf_counter()
    print(
        f"[build] writing random {kind} model ({want['num_hidden_layers']} layers, seed {SEED}) to {folder} ...",
        flush=True,
    )
    write_random_model(folder, want, seed=SEED)
    print(f"[build] done in {time.perf_counter() - t0:.0f} s", flush=True)
    return folder


def count_params(folder: Path) -> int:
    from safetensors import safe_open

    n = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for k in f.keys():
            n += _prod(f.get_slice(k).get_shape())
    return n


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


# -- synthetic cache rows ------------------------------------------------------------------------------
def synthetic_latent_rows(n: int, attn, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """[n, r + dr] rows at the scale a prefill writes: c_kv = RMSNorm(~N(0,1)) * kv_a_layernorm.weight,
    k_pe ~ N(0,1) (a rotated projection of a normalised hidden state through N(0,1/fan_in) weights)."""
    r = attn.cfg.kv_lora_rank
    dr = attn.cfg.qk_rope_head_dim
    c = torch.randn(n, r, generator=g)
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.kv_a_layernorm.weight.float()
    k_pe = torch.randn(n, dr, generator=g)
    return torch.cat([c, k_pe], dim=-1).to(dtype)


def synthetic_index_keys(n: int, indexer, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """[n, Di] indexer keys: LayerNorm(~N(0,1)) with the model's own k_norm weight and bias."""
    k = torch.randn(n, indexer.cfg.head_dim, generator=g)
    k = torch.nn.functional.layer_norm(
        k, (k.shape[-1],), indexer.k_norm.weight.float(), indexer.k_norm.bias.float(), 1e-6
    )
    return k.to(dtype)


def slots_for(pages: list[int], n: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(n)
    table = torch.tensor(pages, dtype=torch.long)
    return table[pos // page_size] * page_size + pos % page_size


def fill_mlaserve_cache(llm, pages: list[int], n: int, seed: int = 1) -> dict:
    """Write synthetic rows for positions [0, n) of a request holding `pages` into every layer's
    latent cache (and indexer key cache where there is one). Returns the rows per layer (for reuse)."""
    cache = llm.runner.cache
    dtype = cache.layers[0].dtype
    g = torch.Generator().manual_seed(seed)
    slots = slots_for(pages, n, llm.config.page_size)
    rows = {}
    with torch.inference_mode():
        for i, layer in enumerate(llm.runner.model.model.layers):
            attn = layer.self_attn
            lat = synthetic_latent_rows(n, attn, dtype, g)
            cache.layers[i].index_copy_(0, slots, lat)
            rows[i] = lat
            if cache.index_keys[i] is not None:
                cache.index_keys[i].index_copy_(0, slots, synthetic_index_keys(n, attn.indexer, dtype, g))
    return rows


# -- timing --------------------------------------------------------------------------------------------
def timed(fn, reps: int, warmup: int = 1) -> dict:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "reps": reps, "all_s": ts}


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(10_000 + seed)
    return [0] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def cpu_busy_others() -> str:
    """Load average and the top other CPU consumers, to record contention next to the numbers."""
    la = os.getloadavg()
    return f"loadavg {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} on {os.cpu_count()} CPUs"


def contention_warning(threads: int) -> str | None:
    """A warning when other processes already load the CPUs this run wants (1-minute load average)."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5:
        omp = (
            f" With {threads} threads every parallel op waits for its slowest, possibly descheduled, thread"
            f" (measured here: 2 threads ~5x slower than 1 under load)."
            if threads > 1
            else ""
        )
        return (
            f"WARNING: 1-min load average is {load:.1f} on {cpus} CPUs before the run: other processes compete "
            f"for the cores.{omp} Absolute numbers are pessimistic; compare ratios, not absolutes."
        )
    return None


def environment(threads: int) -> dict:
    try:
        import transformers
    except ImportError:
        raise SystemExit("the benchmarks need the bench extra (transformers): pip install -e '.[bench]'") from None

    warn = contention_warning(threads)
    if warn:
        print(warn, flush=True)
    return {
        "contention_warning": warn,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": threads,
        "loadavg_start": list(os.getloadavg()),
    }


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
    print(f"[results] wrote {path}")


def fmt(v, nd=1) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{nd}f}"


def print_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    text = "\n".join(lines)
    print(text)
    return text

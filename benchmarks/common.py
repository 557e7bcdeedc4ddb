"""Shared pieces of the benchmarks: the standard model's config, building it on first use,
synthetic cache fills, timing helpers and the environment record written into every JSON.

The standard benchmark model (random weights, seeded, DeepSeek-V3 layout, ~0.76B parameters):
  hidden 1024, 12 layers (layer 0 dense, 11 MoE), 16 heads, kv_lora_rank 256, q_lora_rank 384,
  qk_rope 64, qk_nope 128, v 128, 32 routed experts top-4 in n_group=4 / topk_group=2 (noaux_tc),
  1 shared expert, intermediate 2816, moe_intermediate 512, vocab 32768.
Its DSA variant (long_context.py) is the same model with model_type deepseek_v32 and a GLM-5-like
lightning indexer: index_n_heads 32, index_head_dim 128, index_topk 2048, one indexer per layer.
`--quick` variants keep every width and cut the depth to 2 layers (1 dense + 1 MoE).
The real-shape models (DS_REAL, GLM_REAL, GLM_REAL_DSA below) carry released checkpoints' layer widths
at 4 layers, for the per-model benchmark matrix (matrix.py).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch

from mlaserve.config.cpu import cpu_flags

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


# The real-shape models: every width of the released checkpoints, 4 layers (1 dense + 3 MoE), vocab cut
# to the standard model's 32768 (the released 102400 / 154880 would add only embedding rows, which a
# decode step reads one of). Sizes: ~2.0B (DeepSeek-shaped) and ~2.1B (GLM-shaped) parameters, ~2 GiB at
# Q8_0; building one holds the float32 model in memory (~8 GiB).
DS_REAL = dict(  # DeepSeek-V2-Lite's widths (hidden 2048, 64 experts top-6, 2 shared) with V3's q_lora and router
    STANDARD,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=1536,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    n_group=1,
    topk_group=1,
)

GLM_REAL = dict(  # GLM-4.7-Flash's widths (llama.cpp reads glm4_moe_lite as its deepseek2 architecture)
    STANDARD,
    model_type="glm4_moe_lite",
    architectures=["Glm4MoeLiteForCausalLM"],
    hidden_size=2048,
    intermediate_size=10240,
    moe_intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=20,
    num_key_value_heads=20,
    kv_lora_rank=512,
    q_lora_rank=768,
    qk_rope_head_dim=64,
    qk_nope_head_dim=192,
    v_head_dim=256,
    n_routed_experts=64,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.8,
    rms_norm_eps=1e-5,
)

GLM_REAL_DSA = dict(  # the same layers as GLM-5 writes them: glm_moe_dsa with an indexer per layer
    GLM_REAL,
    model_type="glm_moe_dsa",
    architectures=["GlmMoeDsaForCausalLM"],
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    max_position_embeddings=65536,
)

MODELS = {  # --model name -> (config, folder stem)
    "standard": (STANDARD, "mla-std"),
    "dsa": (DSA, "mla-dsa"),
    "ds-real": (DS_REAL, "mla-ds-real"),
    "glm-real": (GLM_REAL, "mla-glm-real"),
    "glm-real-dsa": (GLM_REAL_DSA, "mla-glm-real-dsa"),
}


def model_config(kind: str, quick: bool) -> dict:
    cfg = dict(MODELS[kind][0])
    if quick:
        cfg["num_hidden_layers"] = 2
    return cfg


def model_folder(kind: str, quick: bool) -> Path:
    cfg, name = MODELS[kind]
    depth = "l2-quick" if quick else f"l{cfg['num_hidden_layers']}"
    return MODELS_DIR / f"{name}-{depth}-seed{SEED}"


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


def with_max_positions(folder: Path, max_positions: int) -> Path:
    """The folder's model allowed `max_positions` tokens of context: a sibling folder
    `<folder>-pos<max_positions>` whose config.json is the folder's with max_position_embeddings
    changed and whose model.safetensors is a link to the folder's (the same weights). The standard
    model says 8192; its rope is the default (theta 1e4, no scaling), so a longer limit changes no
    logit at any position, only what the engines (llama.cpp's n_ctx_train, the GGUF's
    context_length) accept."""
    out = folder.with_name(f"{folder.name}-pos{max_positions}")
    cfg = dict(json.loads((folder / "config.json").read_text()), max_position_embeddings=max_positions)
    out.mkdir(parents=True, exist_ok=True)
    link = out / "model.safetensors"
    if not link.is_symlink():
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(folder / "model.safetensors", out))
    cfg_path = out / "config.json"
    if not cfg_path.exists() or json.loads(cfg_path.read_text()) != cfg:
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return out


def count_params(folder: Path) -> int:
    from safetensors import safe_open

    n = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for k in f.keys():
            n += prod(f.get_slice(k).get_shape())
    return n


def prod(shape) -> int:
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
    dtype = cache.layers[0].latent.dtype
    g = torch.Generator().manual_seed(seed)
    slots = slots_for(pages, n, llm.config.cache.page_size)
    rows = {}
    with torch.inference_mode():
        for i, layer in enumerate(llm.runner.model.model.layers):
            attn = layer.self_attn
            lat = synthetic_latent_rows(n, attn, dtype, g)
            cache.layers[i].latent.index_copy_(0, slots, lat)
            rows[i] = lat
            if cache.layers[i].index_keys is not None:
                cache.layers[i].index_keys.index_copy_(0, slots, synthetic_index_keys(n, attn.indexer, dtype, g))
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


def default_activations() -> tuple[str, int]:
    """The engine's activations="auto" on a GGUF with the native kernels on this CPU (config/machine.choose_activations:
    int8_6bit_int16 where the CPU has the int16 products, else int8_6bit) and the holders' setting for it, so a
    product timed alone takes the route the engine's decode takes (ggml.linear_native with that setting)."""
    from mlaserve.config.machine import INT8_BITS, choose_activations
    from mlaserve.config.provenance import ProvenanceLog

    name = choose_activations("auto", "native", True, ProvenanceLog())
    return name, INT8_BITS[name]


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
        "cpu_simd": _cpu_simd(),
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


# The CPU flags that decide which kernels run fast (bf16 / int8 dot products, vector width): machines
# differ between runs, and a result means little without them.
SIMD_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")
SIMD_FLAGS += ("amx_bf16", "amx_int8", "amx_tile", "asimd", "sve", "bf16", "i8mm")


def _cpu_simd() -> list[str]:
    have = cpu_flags()
    return [f for f in SIMD_FLAGS if f in have]


def run_start() -> dict:
    """A run's JSON opening: the CPU's vector flags (which kernels run follows them) and the load before."""
    return {
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx"))),
        "loadavg_before": os.getloadavg(),
    }


def run_end(res: dict, name: str, threads: int) -> None:
    """A run's JSON closing (run_start opened it): the load after, the environment, written to
    benchmarks/results/<name>.json, and the flags and loads printed."""
    res["loadavg_after"] = os.getloadavg()
    res["environment"] = environment(threads)
    write_json(RESULTS_DIR / f"{name}.json", res)
    print(f"cpu flags: {' '.join(res['cpu_flags'])}; load {res['loadavg_before']} -> {res['loadavg_after']}")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(without_machine_paths(json.loads(json.dumps(data, default=str))), indent=2))
    print(f"[results] wrote {path}")


# an absolute path of two or more parts, not inside a word or a URL's "//" (GB/s, tok/s, file:///x stay)
ABSOLUTE_PATH = re.compile(r"(?<![\w.~/:])/(?:[\w.+-]+/)+([\w.+-]+)")


def without_machine_paths(obj):
    """Results keep no machine's paths: an absolute path in any string (a kernel library in the user's cache, a
    tool's source file in its abort message) becomes its last part; the checkout's files are already relative."""
    if isinstance(obj, dict):
        return {k: without_machine_paths(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [without_machine_paths(v) for v in obj]
    if isinstance(obj, str):
        return ABSOLUTE_PATH.sub(r"\1", obj)
    return obj


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

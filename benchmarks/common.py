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


# -- a GGUF of the standard model ----------------------------------------------------------------------
def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2: the configs' bos / eos / pad ids


def synthetic_tokenizer(vocab_size: int) -> dict:
    """A byte-level BPE tokenizer.json with exactly `vocab_size` tokens, for models with random
    weights and no tokenizer: ids 0-2 the special tokens, then the 256 byte tokens (GPT-2's byte
    alphabet), then merges of two byte tokens (printable ASCII pairs first) up to the vocab size.
    Plain GPT-2 pre-tokenizer (ByteLevel, its regex, no prefix space), so `mlaserve convert` writes
    tokenizer.ggml.pre = "gpt-2", which llama.cpp knows. Text round-trips; the ids mean nothing."""
    chars = _byte_chars()
    n_merges = vocab_size - len(SPECIAL_TOKENS) - 256
    if n_merges < 0 or n_merges > 256 * 256:
        raise ValueError(f"vocab_size {vocab_size}: a synthetic tokenizer needs 259..{259 + 65536} tokens")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab[c] = len(vocab)
    order = [b for b in range(32, 127)] + [b for b in range(256) if not 32 <= b < 127]
    merges = []
    for a in order:
        for b in order:
            if len(merges) == n_merges:
                break
            merges.append([chars[a], chars[b]])
            vocab[chars[a] + chars[b]] = len(vocab)
    assert len(vocab) == vocab_size
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def with_tokenizer(folder: Path) -> Path:
    """A sibling folder `<folder>-tok` holding links to the folder's config.json and
    model.safetensors plus a synthetic tokenizer.json (what `mlaserve convert` needs)."""
    out = folder.with_name(folder.name + "-tok")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        link = out / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(folder / name, out))
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tj = out / "tokenizer.json"
    if not tj.exists() or len(json.loads(tj.read_text())["model"]["vocab"]) != vocab:
        tj.write_text(json.dumps(synthetic_tokenizer(vocab), ensure_ascii=False))
    return out


def gguf_path(folder: Path, outtype: str) -> Path:
    return folder.with_name(f"{folder.name}-{outtype}.gguf")


def ensure_gguf(folder: Path, outtype: str = "q8_0") -> Path:
    """`mlaserve convert --outtype <outtype>` of the model folder (with a synthetic tokenizer), cached
    beside it; rebuilt when the folder's weights or config are newer than the file."""
    from mlaserve.gguf.convert.convert import convert_hf_to_gguf

    out = gguf_path(folder, outtype)
    newest = max((folder / n).stat().st_mtime for n in ("config.json", "model.safetensors"))
    if out.exists() and out.stat().st_mtime > newest:
        return out
    src = with_tokenizer(folder)
    tmp = out.with_suffix(".gguf.partial")
    t0 = time.perf_counter()
    print(f"[build] mlaserve convert {src.name} -> {out.name} (--outtype {outtype}) ...", flush=True)
    report = convert_hf_to_gguf(src, tmp, outtype)
    tmp.replace(out)
    types: dict[str, int] = {}
    for t in report.tensors.values():
        types[t] = types.get(t, 0) + 1
    print(
        f"[build] done in {time.perf_counter() - t0:.0f} s: {out.stat().st_size / 2**20:.0f} MiB, {types}", flush=True
    )
    return out


# -- the batch-1 roofline --------------------------------------------------------------------------------
def copy_bandwidth_gbs(threads: int, mib: int = 512, reps: int = 5) -> float:
    """Memory copy bandwidth (STREAM "copy" convention: bytes read + bytes written, per second) of
    `dst.copy_(src)` on float32 buffers far larger than the caches, best of `reps`."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = min(timed(lambda: dst.copy_(src), reps, 1)["all_s"])
    torch.set_num_threads(prev)
    return 2 * src.numel() * 4 / best / 1e9


def _active_share(name: str, cfg: dict) -> float:
    """The share of a tensor a batch-1 decode step reads: routed experts k of E, the embedding one row."""
    if ".mlp.experts." in name or "_exps." in name:
        return cfg["num_experts_per_tok"] / cfg["n_routed_experts"]
    if name in ("model.embed_tokens.weight", "token_embd.weight"):
        return 1 / cfg["vocab_size"]
    return 1.0


_Q_BYTES = {"int8": 34 / 32, "int4": 18 / 32}  # Q8_0 / Q4_0: a 2-byte scale per 32 values
_KEPT_FLOAT = (".kv_b_proj.weight", ".weights_proj.weight", ".mlp.gate.weight")


def _value_bytes(name: str, shape, dtype_bytes: int, quantization: str | None) -> float:
    """Bytes per value of a folder tensor in the engine's memory; with quantization=int8|int4, what
    mlaserve's quantize-at-load makes of it (quant/at_load.py: 2-D weights whose rows are whole
    32-blocks, experts, embedding and lm_head; int4 keeps the embedding and lm_head at int8; kv_b_proj,
    the indexer's weights_proj, the router and norms stay float)."""
    if quantization is None or len(shape) < 2 or shape[-1] % 32 or name.endswith(_KEPT_FLOAT):
        return dtype_bytes
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _Q_BYTES["int8"]
    return _Q_BYTES[quantization]


def active_weight_bytes(path: Path, dtype_bytes: int | None = None, quantization: str | None = None) -> dict:
    """Weight bytes (and parameters) a batch-1 decode step reads: every tensor but the routed
    experts (k of E per layer) and the embedding (one row). A model folder: its safetensors at
    `dtype_bytes` per value (the engine's dtype), or as quantized at load; a GGUF: each tensor's
    stored bytes."""
    params = nbytes = 0.0
    if path.is_dir():
        from safetensors import safe_open

        cfg = json.loads((path / "config.json").read_text())
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            for k in f.keys():
                shape = f.get_slice(k).get_shape()
                n = _prod(shape) * _active_share(k, cfg)
                params += n
                nbytes += n * _value_bytes(k, shape, dtype_bytes, quantization)
    else:
        from mlaserve.gguf.read.file import open_gguf

        gf = open_gguf(path)
        md = gf.metadata
        arch = md["general.architecture"]
        cfg = {
            "num_experts_per_tok": md[f"{arch}.expert_used_count"],
            "n_routed_experts": md[f"{arch}.expert_count"],
            "vocab_size": len(md["tokenizer.ggml.tokens"]),
        }
        for name, info in gf.tensors.items():
            share = _active_share(name, cfg)
            params += _prod(info.ne) * share
            nbytes += info.nbytes * share
        gf.close()
    return {"params": int(params), "bytes": int(nbytes)}

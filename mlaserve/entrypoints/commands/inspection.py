"""`mlaserve inspect`: every derived switch with its value and source, the layer kinds, the route, the cache
layout, the kernel plan; a DeepSeek-V4 folder's layer kinds without loading it."""

from __future__ import annotations

from pathlib import Path

from mlaserve.entrypoints.commands.progress import progress_bar
from mlaserve.entrypoints.engine_args import add_engine_args, make_llm


def add(sub) -> None:
    p = sub.add_parser("inspect", help="print every derived switch with its value and where it came from")
    p.add_argument("model_path", nargs="?", metavar="MODEL", help="model folder or .gguf (same as --model)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from mlaserve.config.cache_pool import pages_footprint
    from mlaserve.config.kv_cache import describe_layout
    from mlaserve.config.layer_kinds import describe, describe_route
    from mlaserve.config.provenance import format_table

    if _inspect_v4(args):  # a V4 folder without weights: its config shown, nothing to load
        return 0
    llm = make_llm(args, progress_bar)
    print(format_table(llm.config.all_provenance()))
    size = llm.config.runtime.dtype.itemsize
    # page-boundary snapshots of request states cost bytes per token only where the cache keeps them
    snap_page = llm.config.cache.page_size if llm.runner.cache.keeps_snapshots else None
    print("\nlayer kinds:\n  " + "\n  ".join(describe(llm.runner.layer_kinds, size, snap_page)))
    att = llm.config.attention
    print("attention route:\n  " + "\n  ".join(describe_route(llm.runner.layer_kinds, att.sparse, att.index_topk)))
    spec = llm.config.speculative
    if spec.method is not None:
        print("speculative:\n  " + "\n  ".join(_speculative_lines(llm.runner.layer_kinds, spec, size)))
    kv = llm.config.cache.kv_cache_dtype
    print(f"kv cache layout: {describe_layout(llm.runner.layer_kinds, kv, str(llm.config.runtime.dtype)[6:])}")
    print(f"cache pool: {pages_footprint(llm.config.cache.num_pages, *llm.runner.cache.measured_page_bytes())}")
    if llm.loaded.quant is not None:
        print("\nquantized weights:\n" + format_table(llm.loaded.quant.settings()))
    if llm.loaded.gguf is not None:
        print("\nGGUF weights:\n" + format_table(llm.loaded.gguf.settings()))
    if llm.loaded.quantized_at_load:
        print("\nquantized at load:\n" + format_table(llm.loaded.quantized_at_load))
    for echo in getattr(llm.runner, "rank_echoes", []):  # tensor parallel: every rank, as it reported
        print(
            f"rank {echo['rank']}: {echo['num_local_heads']} heads, {echo['vocab_rows']} vocabulary rows, "
            f"{echo['weight_bytes'] / 2**20:.1f} MiB of weights, {echo['num_threads']} threads, "
            "configuration identical to rank 0"
        )
        if echo.get("holders"):  # weights kept in their stored form on this rank
            held = ", ".join(f"{n} x{c}" for n, c in echo["holders"].items())
            print(f"  stored form: {held}; {echo['stored_bytes'] / 2**20:.2f} MiB; kernel plan {echo['kernel_plan']}")
        for note in echo.get("notes", ()):
            print(f"  {note}")
    plan = llm.loaded.kernel_plan
    if plan is not None:  # per op: which implementation runs which layers, and why (kernels/registry.py)
        print(f"\nkernel plan {plan.digest} (op, implementation, layers, why):\n" + plan.format())
    if llm.loaded.report.notes:
        print("\nload report:\n  " + "\n  ".join(llm.loaded.report.notes))
    return 0


def _speculative_lines(layers, spec, compute_bytes: int) -> list[str]:
    """`inspect`'s speculative section: the drafts per verify step and, for KDA layers (GLM-5.3-Flash), the
    rollback tape a verify step holds per verifying request (models/kda/rollback.py tape_bytes, from the config)."""
    from mlaserve.models.kda.rollback import tape_bytes

    n = 1 + spec.num_tokens
    lines = [f"{spec.method}: {spec.num_tokens} draft tokens per step, verified as {n} rows per request"]
    kda = [k.index for k in layers if k.attention == "kda"]
    if kda:
        lines.append(
            f"KDA rollback tape: {tape_bytes(layers, n, compute_bytes)} bytes per verifying request ({len(kda)} "
            f"KDA layers x (saved recurrent + conv states + {n} rows of inputs: mixed, g fp32, beta))"
        )
    return lines


def _inspect_v4(args) -> bool:
    """A DeepSeek-V4 folder: print its layer kinds (with the key they came from and what each keeps per token
    and per sequence). Returns True when the folder has no weights (then its config's provenance is printed
    and there is nothing to load); False otherwise (the engine's own inspection follows)."""
    from mlaserve.config.deepseek_v4 import DeepseekV4Config, is_v4
    from mlaserve.config.provenance import format_table
    from mlaserve.loading.model_loader import read_hf_config

    path = Path(args.model) if args.model else None
    if path is not None and path.suffix == ".gguf" and path.is_file():  # a deepseek4 GGUF: kinds from its keys
        from mlaserve.gguf.read.deepseek_v4 import ARCH, load_v4_gguf
        from mlaserve.loading.model_loader import _gguf_arch

        if _gguf_arch(path) != ARCH:
            return False
        ck = load_v4_gguf(path)
        ck.close()
        print(_v4_layer_lines(args, ck.config) + "\n")
        return False
    if path is None or not path.is_dir() or not (path / "config.json").is_file():
        return False
    raw = read_hf_config(path)
    if not is_v4(raw):
        return False
    cfg = DeepseekV4Config.from_hf(raw, source=f"{path.name}/config.json")
    print(_v4_layer_lines(args, cfg))
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        print()
        return False
    print(format_table(cfg.provenance))
    print(f"\nno weights in the folder: the config only ({path})")
    return True


def _v4_layer_lines(args, cfg) -> str:
    """The config-level layer kinds of a V4 model in the layout the command's options ask for: the states of
    declare_layers with kv_cache_dtype's 8-bit formats (quantize_states, as the runner computes them), values in
    --dtype (bfloat16 when not given), snapshots per token at the page size the engine would pick, when prefix
    caching is on."""
    from mlaserve.config.deepseek_v4_layers import describe_layers, v4_page_size
    from mlaserve.config.kv_cache import quantize_states
    from mlaserve.config.layer_kinds import declare_layers

    kv = args.kv_cache_dtype or "auto"
    layers = quantize_states(declare_layers(cfg, False), kv, cfg)
    dtype = args.dtype if args.dtype in ("float32", "bfloat16", "float16") else "bfloat16"
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    page = (args.page_size or v4_page_size(cfg)[0]) if args.enable_prefix_caching is not False else None
    return (
        f"DeepSeek-V4 layer kinds ({dtype} values, kv_cache_dtype {kv}; the engine's cache layout follows):\n  "
        + "\n  ".join(describe_layers(cfg, layers, size, page))
    )

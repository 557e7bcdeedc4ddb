"""The `mlaserve` command: generate | inspect | verify | convert | trace."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from mlaserve.entrypoints.engine_args import add_engine_args, make_llm
from mlaserve.entrypoints.openai.cli import add_serve
from mlaserve.sampling.params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlaserve", description="Inference engine for MLA models (DeepSeek, GLM, Kimi)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_inspect(sub)
    _add_verify(sub)
    _add_convert(sub)
    _add_trace(sub)
    add_serve(sub)
    args = parser.parse_args(argv)
    if getattr(args, "model_path", None) is not None:
        if args.model is not None and args.model != args.model_path:
            parser.error(f"two models given: {args.model_path} and --model {args.model}")
        args.model = args.model_path
    try:
        _check_trace_path(getattr(args, "trace", None))
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"mlaserve: error: {e}", file=sys.stderr)
        return 2


def _check_trace_path(trace: str | None) -> None:
    """Fail before the model loads, not after, when the trace cannot be written."""
    if trace is None or trace == "memory":
        return
    folder = Path(trace).parent
    if not folder.is_dir():
        raise ValueError(f"--trace {trace}: folder {folder} does not exist (create it first)")


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for one or more prompts, streamed to the terminal",
        description='Generate a continuation for each PROMPT. Example: mlaserve generate "Hello"',
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_engine_args(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy; default: the model's generation_config.json (else greedy)",
    )
    p.add_argument("--top-p", type=float, default=None, help="default: the model's generation_config.json (else 1)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (default 0: no limit)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for repeatable samples (default: none)")
    p.set_defaults(func=_generate)


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="print every derived switch with its value and where it came from")
    p.add_argument("model_path", nargs="?", metavar="MODEL", help="model folder or .gguf (same as --model)")
    add_engine_args(p)
    p.set_defaults(func=_inspect)


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="check the engine's identities on this model (absorbed == decompressed, ...)",
        description="Run one prompt through routes that must agree and report the logit differences.",
    )
    p.add_argument("model_path", nargs="?", metavar="MODEL", help="model folder or .gguf (same as --model)")
    add_engine_args(p)
    p.add_argument(
        "--prompt",
        default="The quick brown fox jumps over the lazy dog. " * 4,
        help="text to run (default: a short English sentence, repeated)",
    )
    p.add_argument(
        "--against",
        default=None,
        metavar="OTHER",
        help="compare MODEL layer by layer with OTHER (a HF folder or .gguf of the same model) on the same "
        "input ids and name the first layer and sub-block where they part ways (float32)",
    )
    p.add_argument("--json", action="store_true", help="with --against: print the report as JSON")
    p.set_defaults(func=_verify)


def _verify(args) -> int:
    from mlaserve.config.model import ConfigError
    from mlaserve.entrypoints.engine_args import engine_options
    from mlaserve.entrypoints.verify import format_checks, run_checks, tensor_parallel_check

    n = args.tensor_parallel_size or 1
    if args.against is not None:
        if n > 1:
            raise ConfigError("verify --against compares one process's layers: drop --tensor-parallel-size")
        return _verify_against(args)
    args.tensor_parallel_size = None  # the identities run on one process; TP=n is compared with it
    if args.dtype in (None, "auto"):  # judged in float32 (dtype=auto is bfloat16 on AVX512-BF16/AMX CPUs)
        args.dtype = "float32"

    if args.check_tensors:  # scanned here and reported as a check, not refused at load
        args.check_tensors = None
        bad = _scan_gguf_file(args.model)
        if bad:
            return bad
        llm = make_llm(args, _progress_bar)
        if _report_tensor_scan(llm):
            return 1
    else:
        llm = make_llm(args, _progress_bar)
    checks = run_checks(llm, llm.encode(args.prompt))
    if n > 1:
        checks.append(tensor_parallel_check(llm, llm.encode(args.prompt), n, engine_options(args)))
    print(format_checks(checks))
    return 0 if all(c.passed for c in checks) else 1


def _verify_against(args) -> int:
    import json

    from mlaserve.entrypoints.engine_args import engine_options
    from mlaserve.entrypoints.verify_against import format_report, to_json, verify_against

    if args.model is None:
        raise ValueError("verify --against needs MODEL (the copy to check) as well as OTHER")
    report = verify_against(args.model, args.against, args.prompt, **engine_options(args))
    print(json.dumps(to_json(report), indent=1) if args.json else format_report(report))
    return 0 if report.passed else 1


def _scan_gguf_file(model: str | None) -> int:
    """--check-tensors on a .gguf: the file is scanned before loading (a NaN can fail the load's own
    numeric checks less clearly). -> 1 when bad tensors were reported."""
    from mlaserve.gguf.read.file import open_gguf
    from mlaserve.loading.tensor_check import format_bad, scan_gguf

    if model is None or not model.endswith(".gguf") or not Path(model).is_file():
        return 0
    bad = scan_gguf(open_gguf(model))
    print(f"check tensors: {format_bad(bad)}" if bad else "check tensors: every tensor and block scale is finite")
    return 1 if bad else 0


def _report_tensor_scan(llm) -> bool:
    from mlaserve.loading.tensor_check import format_bad, scan_model

    bad = scan_model(llm.loaded.model)
    print(f"check tensors: {format_bad(bad)}" if bad else "check tensors: every weight is finite")
    return bool(bad)


def _add_convert(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="write a Hugging Face MLA or DeepSeek-V4 checkpoint as a GGUF file llama.cpp loads",
        description="Convert HF_DIR (config.json, *.safetensors, tokenizer.json) to OUT.gguf in "
        "llama.cpp's MLA layout, or its deepseek4 layout for a DeepSeek-V4 folder (what its "
        "convert_hf_to_gguf.py writes).",
    )
    p.add_argument("hf_dir", metavar="HF_DIR")
    p.add_argument("out", metavar="OUT.gguf")
    p.add_argument(
        "--outtype",
        default="f16",
        choices=["f32", "f16", "bf16", "q8_0"],
        help="type of the weight matrices (default f16); norms, biases and routers stay f32",
    )
    p.add_argument("--name", default=None, help="general.name (default: from the folder name)")
    p.add_argument(
        "--pre-tokenizer",
        default=None,
        metavar="NAME",
        help="tokenizer.ggml.pre when it is not recognized (e.g. deepseek-v3, glm4, gpt-2)",
    )
    p.set_defaults(func=_convert)


def _convert(args) -> int:
    from mlaserve.gguf.convert.convert import convert_hf_to_gguf
    from mlaserve.gguf.read.checkpoint import load_gguf

    report = convert_hf_to_gguf(args.hf_dir, args.out, args.outtype, name=args.name, pre_tokenizer=args.pre_tokenizer)
    counts = ", ".join(f"{n} {t}" for t, n in sorted(report.type_counts().items()))
    print(f"wrote {report.path} ({report.arch}, {len(report.tensors)} tensors: {counts})")
    for note in report.notes:
        print(f"  note: {note}")
    if report.arch != "deepseek4":  # a deepseek4 file is read back inside its converter (config compared)
        load_gguf(report.path).close()  # our reader maps it back onto the config (k_b/v_b orientation checked)
    return 0


def _add_trace(sub) -> None:
    p = sub.add_parser("trace", help="read a route ledger (written with --trace FILE)")
    tsub = p.add_subparsers(dest="trace_command", required=True)
    s = tsub.add_parser(
        "summarize",
        help="steps, tokens by phase x path x dense/sparse, prefix-cache hits, preemptions, effective top-k",
        description="Summarise a route ledger (JSON lines; fields in docs/LEDGER.md).",
    )
    s.add_argument("file", metavar="FILE")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.set_defaults(func=_trace_summarize)
    pl = tsub.add_parser(
        "plot",
        help="the route chart as a PNG: tokens per step by phase x path, effective top-k, hits, preemptions",
        description="Draw a route ledger (JSON lines) as the web page's route chart, for a bug report "
        "(needs matplotlib: pip install 'mlaserve[plot]'; docs/UI.md says what it shows).",
    )
    pl.add_argument("file", metavar="FILE")
    pl.add_argument("-o", "--output", default=None, metavar="PNG", help="where to write it (default: FILE with .png)")
    pl.set_defaults(func=_trace_plot)


def _trace_summarize(args) -> int:
    import json

    from mlaserve.observability.expert_load import summarize_expert_load
    from mlaserve.observability.summary import format_summary, read_ledger, summarize

    records = read_ledger(args.file)
    by_rank, experts = summarize(records), summarize_expert_load(records)
    if args.json:
        ranked = {str(r): s.to_json() for r, s in by_rank.items() if r is not None}
        whole = by_rank[None].to_json() if None in by_rank else None
        out = {"summary": whole, "ranks": ranked} if ranked else {"summary": whole}
        print(json.dumps(out | ({"expert_parallel": experts.to_json()} if experts else {}), indent=1))
    else:
        print(format_summary(by_rank, experts))
    return 0


def _trace_plot(args) -> int:
    from mlaserve.observability.route_plot import save_route_plot
    from mlaserve.observability.summary import read_ledger

    out = Path(args.output) if args.output else Path(args.file).with_suffix(".png")
    if not out.parent.is_dir():
        raise ValueError(f"-o {out}: folder {out.parent} does not exist (create it first)")
    records = read_ledger(args.file)
    print(f"wrote {save_route_plot(records, out, Path(args.file).name)} ({len(records)} records)")
    return 0


def _progress_bar(done: int, total: int) -> None:
    if not sys.stderr.isatty() and done != total:
        return  # only the final state when stderr is a log file
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\rloading weights [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _generate(args) -> int:
    from pathlib import Path

    # The ledger file is appended to: its summary covers this run's records only.
    start = Path(args.trace).stat().st_size if args.trace and Path(args.trace).exists() else 0
    # The flags the user gave are checked before the (slow) load; the model's defaults after it.
    SamplingParams(**_user_sampling(args, temperature=0.0, top_p=1.0))
    llm = make_llm(args, _progress_bar)
    params = SamplingParams(**_user_sampling(args, **_sampling_defaults(args, llm.loaded.generation_config)))
    with warnings.catch_warnings():  # the engine's notes (e.g. the context limit) as one plain line
        warnings.showwarning = _print_note
        for prompt in args.prompts:
            text = prompt
            if args.chat:
                text = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            _stream(llm, llm.encode(text), params, prompt)
    if args.trace:
        from mlaserve.observability.expert_load import summarize_expert_load
        from mlaserve.observability.summary import format_summary, read_ledger, summarize

        llm.runner.tracer.close()
        records = read_ledger(args.trace, start)
        print(format_summary(summarize(records), summarize_expert_load(records)), file=sys.stderr)
    return 0


def _print_note(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"\nmlaserve: note: {message}", file=sys.stderr)


def _user_sampling(args, temperature: float, top_p: float) -> dict:
    return dict(
        temperature=args.temperature if args.temperature is not None else temperature,
        top_p=args.top_p if args.top_p is not None else top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )


def _sampling_defaults(args, gen: dict) -> dict:
    """Options the user left unset come from the model's generation_config.json, as in vLLM/transformers;
    the note says where each value came from."""
    sampled = bool(gen.get("do_sample"))
    values, sources = {}, []
    for name, flag, fallback in (("temperature", "--temperature", 0.0), ("top_p", "--top-p", 1.0)):
        given = getattr(args, name)
        if given is not None:
            values[name], src = given, flag
        elif sampled and name in gen:
            values[name], src = gen[name], "generation_config.json"
        else:
            values[name] = fallback if name == "top_p" or not sampled else 1.0
            src = "default" if not sampled else "default (generation_config.json sets do_sample)"
        sources.append(f"{name} {values[name]} ({src})")
    if sampled and args.temperature is None:
        print(f"sampling: {', '.join(sources)}; --temperature 0 for greedy", file=sys.stderr)
    return values


def _stream(llm, ids: list[int], params: SamplingParams, shown: str) -> None:
    engine = llm.engine
    rid = engine.add_request(ids, params)
    sys.stdout.write(shown)
    printed = 0
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                text = out.outputs[0].text
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = len(text)
                final = out
                if out.finished and out.outputs[0].error:
                    print(f"\nmlaserve: request failed: {out.outputs[0].error}", file=sys.stderr)
    sys.stdout.write("\n")
    if final is not None:
        print(_speed_line(final), file=sys.stderr)


def _speed_line(out) -> str:
    """Prompt and generated token counts with their rates (like llama.cpp's timings line)."""
    m, n_out = out.metrics, len(out.outputs[0].token_ids)
    ttft = m.get("time_to_first_token")
    line = f"[{len(out.prompt_token_ids)} prompt tokens"
    if ttft:
        line += f" in {ttft:.2f} s ({len(out.prompt_token_ids) / ttft:.1f} tok/s)"
    line += f"; {n_out} generated"
    if "tokens_per_s" in m:
        line += f", {m['tokens_per_s']:.1f} tok/s after the first"
    if "acceptance_rate" in m:  # speculative decoding (--speculative mtp)
        line += (
            f"; MTP drafts {m['num_accepted_tokens']}/{m['num_draft_tokens']} accepted "
            f"({m['acceptance_rate']:.0%}), mean accepted length {m['mean_accepted_length']:.2f}"
        )
    if "num_spec_paused_steps" in m:  # the acceptance switch paused its drafting
        line += f"; drafting paused {m['num_spec_paused_steps']} steps ({m['num_spec_probes']} probes)"
    return line + f"; finish: {out.outputs[0].finish_reason}]"


def _inspect(args) -> int:
    from mlaserve.config.engine import pages_footprint
    from mlaserve.config.kv_cache import describe_layout
    from mlaserve.config.layer_kinds import describe, describe_route
    from mlaserve.config.provenance import format_table

    if _inspect_v4(args):  # a V4 folder without weights: its config shown, nothing to load
        return 0
    llm = make_llm(args, _progress_bar)
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
    from pathlib import Path

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


if __name__ == "__main__":
    raise SystemExit(main())

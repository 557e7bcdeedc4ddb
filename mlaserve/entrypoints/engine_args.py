"""The engine's command-line flags, generated from EngineOptions (the one home of every default).

Every front end that loads a model (generate, inspect, verify, serve) takes the same flags; an
option's default and help text are read from config/engine.py, so they cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from mlaserve.config.engine import EngineOptions


def add_engine_args(p: argparse.ArgumentParser, with_model_flag: bool = True) -> None:
    if with_model_flag:
        p.add_argument(
            "--model",
            default=None,
            help="a Hugging Face folder (config.json + safetensors) or a .gguf file (llama.cpp's layout; the "
            "first part of a split file); default: the embedded model",
        )
    for f in dataclasses.fields(EngineOptions):
        if not f.metadata.get("cli"):
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(f.type, str)
            p.add_argument(flag, type=kind, default=None, choices=f.metadata.get("choices"), help=help_text)
    p.add_argument(
        "--no-malloc-tuning",
        action="store_true",
        help="leave glibc's allocator as it is (the CLI otherwise keeps freed large blocks: ~+15%% prefill, "
        "RSS stays near its peak)",
    )
    p.add_argument("--trace", default=None, metavar="FILE", help="write each step's attention route as JSON lines")


def engine_options(args: argparse.Namespace) -> dict:
    """The options the user set on the command line (the rest keep EngineOptions' defaults)."""
    opts = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineOptions)
        if f.metadata.get("cli") and getattr(args, f.name, None) is not None
    }
    opts["malloc_tuning"] = not getattr(args, "no_malloc_tuning", False)
    return opts


def make_llm(args: argparse.Namespace, progress=None):
    from mlaserve.config.layer_kinds import attention_summary
    from mlaserve.entrypoints.llm import LLM

    _serve_if_torchrun_worker(args)
    print("loading model ...", file=sys.stderr, flush=True)
    llm = LLM(model=args.model, trace=args.trace, progress=progress, **engine_options(args))
    cfg = llm.config
    attention = attention_summary(cfg.model, cfg.attention.sparse)
    print(
        f"loaded {llm.loaded.path} ({cfg.model.model_type}, {cfg.model.num_layers} layers, "
        f"{attention} attention, {str(cfg.runtime.dtype).removeprefix('torch.')}, {cfg.runtime.device})",
        file=sys.stderr,
        flush=True,
    )
    return llm


def _serve_if_torchrun_worker(args: argparse.Namespace) -> None:
    """Under torchrun every process runs the same command; ranks >= 1 serve rank 0's steps and exit
    when it stops (rank 0 alone runs the front end)."""
    from mlaserve.distributed.launch import serve_torchrun_rank, torchrun_rank

    if not torchrun_rank():
        return
    from mlaserve.config.engine import make_options
    from mlaserve.embedded import default_model_path

    serve_torchrun_rank(args.model or default_model_path(), make_options(**engine_options(args)))
    raise SystemExit(0)

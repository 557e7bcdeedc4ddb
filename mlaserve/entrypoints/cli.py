"""The `mlaserve` command: generate | inspect | verify | convert | trace | serve (entrypoints/commands/, one
module per command; serve in entrypoints/openai/cli.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlaserve.entrypoints.commands import conversion, generation, inspection, ledger, verification
from mlaserve.entrypoints.openai.cli import add_serve

# every subcommand's add(sub), in the order `mlaserve --help` lists them
SUBCOMMANDS = (generation.add, inspection.add, verification.add, conversion.add, ledger.add, add_serve)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlaserve", description="Inference engine for MLA models (DeepSeek, GLM, Kimi)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
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


if __name__ == "__main__":
    raise SystemExit(main())

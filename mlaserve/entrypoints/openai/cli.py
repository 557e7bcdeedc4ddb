"""The `serve` subcommand: flags and startup (load, optional self-checks, serve)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlaserve.entrypoints.engine_args import add_engine_args, make_llm


def add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (default: the embedded model) at /v1/completions, /v1/chat/completions, ... "
        "Example: mlaserve serve --port 8000, then curl http://127.0.0.1:8000/v1/models",
    )
    p.add_argument("model_path", nargs="?", metavar="MODEL", help="model folder or .gguf (same as --model)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port, printed when ready)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (not on /health, /metrics)")
    p.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="comma-separated origins allowed cross-origin (CORS), or '*'; off by default",
    )
    p.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="serve /debug/routes, /debug/config and the /docs pages (off by default; behind --api-key if set)",
    )
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: folder name)")
    p.add_argument(
        "--max-queued",
        type=int,
        default=256,
        help="requests waiting beyond max-num-seqs running ones; past it 429 with Retry-After (default 256)",
    )
    p.add_argument("--chat-template", default=None, metavar="FILE", help="jinja chat template replacing the model's")
    p.add_argument(
        "--verify", action="store_true", help="run `mlaserve verify`'s checks before serving; fail if any fails"
    )
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight requests get on SIGTERM (default 10)")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    try:
        from mlaserve.entrypoints.openai.server import route_tap, run, setup_logging
    except ImportError as e:
        raise ValueError(
            f"`mlaserve serve` needs fastapi, uvicorn and prometheus-client: pip install -e . ({e})"
        ) from e

    if args.max_queued < 0:
        raise ValueError(f"--max-queued must be >= 0, got {args.max_queued}")
    template = Path(args.chat_template).read_text() if args.chat_template else None
    setup_logging()
    trace, args.trace = args.trace, None
    llm = make_llm(args)
    llm.runner.tracer = route_tap(trace)
    checks = _verified(llm) if args.verify else None
    if checks is False:
        return 1
    return run(args, llm, template, checks)


def _verified(llm):
    """-> the checks (all passed; /debug/verify shows them), or False when one failed."""
    from mlaserve.entrypoints.verify import format_checks, run_checks

    checks = run_checks(llm, llm.encode("The quick brown fox jumps over the lazy dog. " * 4))
    print(format_checks(checks), file=sys.stderr, flush=True)
    if not all(c.passed for c in checks):
        print("mlaserve: error: self-checks failed; not serving", file=sys.stderr)
        return False
    return checks

"""`mlaserve serve`: load the model, start the engine loop, serve HTTP with uvicorn.

Shutdown (SIGTERM or Ctrl-C): uvicorn stops accepting, waits up to the grace period for
in-flight responses, then cancels them (their engine requests are aborted); the engine loop
stops (its thread joined); the tensor-parallel workers are stopped (LLM.close); the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import uvicorn

from mlaserve.config.cache_pool import pages_footprint
from mlaserve.config.layer_kinds import attention_summary
from mlaserve.engine.engine_loop import EngineLoop
from mlaserve.entrypoints.openai.app import build_app
from mlaserve.entrypoints.openai.serving import OpenAIServing
from mlaserve.entrypoints.openai.tool_calls import set_chat_formats
from mlaserve.observability.metrics import RouteTap, ServerMetrics
from mlaserve.observability.trace import MemoryTracer, make_tracer

log = logging.getLogger("mlaserve.server")
ROUTE_RING = 2000  # step records kept for /debug/routes
SHUTDOWN_MARGIN_S = 3.0  # after the grace period, for cut responses to send their last event


def build_server(
    llm, served_name: str, max_queued: int, api_key: str | None = None, chat_template: str | None = None, **app_kw
):
    """-> (app, engine loop, serving) around a loaded LLM whose runner has a RouteTap tracer."""
    loop = EngineLoop(llm.engine)
    metrics = ServerMetrics(stats=lambda: loop.stats)
    tap = llm.runner.tracer
    if isinstance(tap, RouteTap):
        tap.on_record = metrics.on_route
    max_in_flight = llm.config.scheduler.max_num_seqs + max_queued
    serving = OpenAIServing(llm, loop, metrics, served_name, max_in_flight)
    serving.chat_template = chat_template
    ring = tap.ring if isinstance(tap, RouteTap) else None
    app_kw.setdefault("ui", llm.config.server.ui)  # the web page at / (engine option ui, recorded)
    app = build_app(serving, api_key, ring, **app_kw)
    return app, loop, serving


def route_tap(trace: str | None) -> RouteTap:
    """The server's ledger sink: a ring (+ the --trace file when given); metrics hook set later."""
    return RouteTap(MemoryTracer(ROUTE_RING), lambda rec: None, make_tracer(trace) if trace else None)


class _Server(uvicorn.Server):
    """uvicorn that prints the ready line once its socket is bound (the real port with --port 0)."""

    ready_line = staticmethod(lambda host, port: None)
    on_shutdown = staticmethod(lambda: None)

    async def shutdown(self, sockets=None) -> None:
        self.on_shutdown()
        await super().shutdown(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.ready_line(host, port)


def run(args, llm, chat_template: str | None, verify=None) -> int:
    """verify: the checks `--verify` ran before serving (shown at /debug/verify); None when not run."""
    served = args.served_model_name or Path(str(llm.loaded.path)).name
    origins = [o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()]
    app, loop, serving = build_server(
        llm,
        served,
        args.max_queued,
        args.api_key,
        chat_template,
        allowed_origins=origins or None,
        debug_endpoints=args.enable_debug_endpoints,
        verify=verify,
    )
    set_chat_formats(serving, getattr(args, "tool_call_parser", None), getattr(args, "reasoning_parser", None))
    loop.start()
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        # the grace period is ours (serving.cut_off_at): responses still running then end with a 503 /
        # an error event; uvicorn cancels only what is left a few seconds later
        timeout_graceful_shutdown=args.grace + SHUTDOWN_MARGIN_S,
        access_log=False,
        lifespan="off",
    )
    server = _Server(config)
    server.ready_line = lambda host, port: print(_ready(llm, served, host, port), flush=True)
    if llm.config.server.ui:
        server.ready_line = _with_page_line(server.ready_line, args.enable_debug_endpoints)
    server.on_shutdown = lambda: serving.cut_off_at(args.grace)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler makes that a
    # clean return, so SIGTERM exits 0 after the graceful stop.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        # the loop thread ends before the process does: one left inside a step's collective when the interpreter
        # finalizes aborts the process (distributed/heartbeat.py: Exit); then the workers are stopped
        loop.stop(timeout=None)
        llm.runner.tracer.close()
        llm.close()
    print("mlaserve: stopped", file=sys.stderr, flush=True)
    return 0


def _ready(llm, served: str, host: str, port: int) -> str:
    cfg, cache = llm.config, llm.runner.cache
    attention = attention_summary(cfg.model, cfg.attention.sparse)
    # request-addressed states (config/layer_kinds.py): a fixed block per running request, beside the pages
    slots = (
        f", state slots {cache.num_slots} x {cache.measured_bytes_per_request()} bytes/request"
        if cache.num_slots
        else ""
    )
    rows, snap = cache.measured_page_bytes()  # page-boundary snapshots (prefix caching on a hybrid stack)
    snapshots = f", cache pool {pages_footprint(cfg.cache.num_pages, rows, snap)}" if snap else ""
    return (
        f"mlaserve: serving {served} on http://{host}:{port} (dtype {str(cfg.runtime.dtype).removeprefix('torch.')}, "
        f"attention {attention}, mla_path {cfg.attention.mla_path}, KV pool {cfg.cache.num_pages} pages x {cfg.cache.page_size} tokens "
        f"({cache.measured_bytes_per_token()} bytes/token){snapshots}{slots}, max_model_len {llm.engine.max_model_len})"
    )


def _with_page_line(ready_line, debug_endpoints: bool):
    """The ready line, then where the page is (and what its route view needs)."""

    def lines(host, port) -> None:
        ready_line(host, port)
        views = "" if debug_endpoints else " (its route and configuration views need --enable-debug-endpoints)"
        print(f"mlaserve: web page at http://{host}:{port}/{views}; --no-ui turns it off", flush=True)

    return lines


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("mlaserve.server", "mlaserve.engine_loop"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO)
        lg.addHandler(handler)
        lg.propagate = False

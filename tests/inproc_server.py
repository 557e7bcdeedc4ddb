"""An `mlaserve serve` app in this process: uvicorn on 127.0.0.1 (any free port) in a thread, over
one loaded LLM. Quicker than a server process, and a test can reach the engine loop (inject a fault)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import uvicorn

from mlaserve.entrypoints.openai.server import build_server, route_tap


class InProcServer:
    def __init__(self, llm, served: str = "tiny", max_queued: int = 256, **app_kw) -> None:
        if not hasattr(llm.runner.tracer, "ring"):
            llm.runner.tracer = route_tap(None)
        self.app, self.loop, self.serving = build_server(llm, served, max_queued, **app_kw)
        self.model = served
        self.loop.start()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread ended before it started")
            self._thread.join(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def get(self, path: str, **kw) -> httpx.Response:
        return self.http.get(path, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.http.post(path, **kw)

    def metric(self, name: str, default: float | None = None) -> float:
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        if default is not None:
            return default
        raise KeyError(name)

    def wait_idle(self, timeout: float = 30.0) -> int:
        """Pages in use once every request has settled (0 when nothing leaked)."""
        done = threading.Event()
        for _ in range(int(timeout * 10)):
            if self.loop.stats.pages_used == 0 and self.serving.in_flight == 0:
                break
            done.wait(0.1)
        return self.loop.stats.pages_used

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self._thread.join(30)
        self.loop.stop()

"""A real `mlaserve serve` process on 127.0.0.1 (any free port), for the server tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"serving (\S+) on (http://[\d.]+:\d+)")


def _remove(log) -> None:
    log.close()
    Path(log.name).unlink(missing_ok=True)


class ServerProcess:
    def __init__(self, *args: str, startup_s: float = 180.0) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mlaserve-serve-", suffix=".log", delete=False)
        # readable while the object lives (a test reads it after stop()); removed with it, or at exit
        weakref.finalize(self, _remove, self.log)
        cmd = [sys.executable, "-m", "mlaserve.entrypoints.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT)
        self.url, self.model = self._wait_ready(startup_s)
        self.http = httpx.Client(timeout=120)  # one client: building an SSL context per call costs ~0.1-0.5 s
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, timeout: float) -> tuple[str, str]:
        found: list = []

        def read():
            for line in self.proc.stdout:
                m = READY.search(line)
                if m:
                    found.append((m.group(2), m.group(1)))
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if not found:
            self.proc.kill()
            raise RuntimeError(f"server did not start in {timeout}s:\n{self.logs()}")
        return found[0]

    def _drain(self) -> None:
        for _ in self.proc.stdout:
            pass

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def client(self, **kw):
        """The openai client (one shared instance unless keywords are given)."""
        from openai import OpenAI

        if not kw and getattr(self, "_client", None) is not None:
            return self._client
        client = OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=120, **kw)
        if not kw:
            self._client = client
        return client

    def get(self, path: str, **kw) -> httpx.Response:
        return self.http.get(self.url + path, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.http.post(self.url + path, **kw)

    def metric(self, name: str, default: float | None = None) -> float:
        """A sample's value from /metrics; `default` when the series does not exist (yet)."""
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        if default is not None:
            return default
        raise KeyError(name)

    def wait_idle(self, timeout: float = 30.0) -> float:
        """Pages in use once every request has settled (0 when nothing leaked)."""
        deadline = time.monotonic() + timeout
        used = self.metric("mlaserve_kv_pages_in_use")
        while used and time.monotonic() < deadline:
            time.sleep(0.1)
            used = self.metric("mlaserve_kv_pages_in_use")
        return used

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

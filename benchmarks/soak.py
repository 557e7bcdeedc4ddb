"""Soak: `mlaserve serve` under a steady mix of streaming clients, disconnects, aborts and bad requests
for a set time. Reports the server's RSS over time, the KV pages in use after each quiet moment (every
client paused, the server idle), answers by status, and p50/p99 TTFT / TPOT / e2e per window.

    python benchmarks/soak.py                              # standard model, 16 clients, 30 minutes
    python benchmarks/soak.py --embedded --duration 300    # the embedded model, 5 minutes
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid PID   # a server already running

Traffic goes to 127.0.0.1 only (the server this script starts, or --url, which must be local). Each
client loops: a streamed completion read to the end (most), a stream dropped after a few chunks
(disconnect), a non-streamed request given up on by the client (abort), or a request the server must
refuse (bad JSON, wrong types, unknown model, a prompt over the context, ids outside the vocabulary).
Every --quiet-every seconds the clients pause; once none is in flight, the server's
mlaserve_kv_pages_in_use must come back to 0.

Verdict (printed, and in the JSON): RSS growth after warm-up (the first quiet moment) under 2%, pages
back to 0 at every quiet moment, no 5xx, p99 TPOT of every window within 20% of their median.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parents[1]
MIX = (("stream", 0.78), ("disconnect", 0.08), ("abort", 0.06), ("bad", 0.08))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic (default 1800)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16; 16-32 intended)")
    p.add_argument("--quiet-every", type=float, default=60.0, help="seconds between quiet moments (default 60)")
    p.add_argument("--window", type=float, default=60.0, help="seconds per latency window (default 60)")
    p.add_argument("--embedded", action="store_true", help="serve the embedded model (default: the standard one)")
    p.add_argument("--url", default=None, help="a running local server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, for its RSS")
    p.add_argument("--threads", type=int, default=2, help="OMP threads of the server this script starts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the report as JSON here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- server


class Server:
    """`mlaserve serve` on 127.0.0.1, any free port."""

    def __init__(self, folder: str | None, threads: int, clients: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", "mlaserve.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
        cmd += [folder] if folder else []
        cmd += ["--max-num-seqs", str(clients), "--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        for line in self.proc.stdout:
            m = re.search(r"serving (\S+) on (http://\S+)", line)
            if m:
                self.model, self.url = m.group(1), m.group(2).rstrip(")")
                break
        else:
            raise RuntimeError("the server did not start")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        self.pid = self.proc.pid

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(120)


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---------------------------------------------------------------------------------------------- clients


class Soak:
    def __init__(self, url: str, model: str, vocab: int, context: int, args) -> None:
        host = urlparse(url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"the soak sends traffic to this machine only, not {host}")
        self.url, self.model, self.vocab, self.context, self.args = url, model, vocab, context, args
        self.lock = threading.Lock()
        self.statuses: Counter = Counter()  # "200", "400", ..., "disconnect", "abort", "transport"
        self.samples: list[tuple[float, float | None, float | None, float]] = []  # (t, ttft, tpot, e2e)
        self.running = threading.Event()  # clear = pause (a quiet moment)
        self.running.set()
        self.stop = threading.Event()
        self.busy = 0  # clients inside a request
        self.start = time.monotonic()

    def _count(self, key) -> None:
        with self.lock:
            self.statuses[str(key)] += 1

    def client(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        kinds, weights = zip(*MIX)
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not self.stop.is_set():
                if not self.running.is_set():
                    self.running.wait(1.0)
                    continue
                with self.lock:
                    self.busy += 1
                try:
                    kind = rng.choices(kinds, weights)[0]
                    getattr(self, "_" + kind)(http, rng)
                except httpx.TransportError:
                    self._count("transport")
                finally:
                    with self.lock:
                        self.busy -= 1

    def _prompt(self, rng: random.Random) -> list[int]:
        return [0] + [rng.randrange(3, self.vocab) for _ in range(rng.randrange(4, 64))]

    def _stream(self, http: httpx.Client, rng: random.Random, drop_after: int | None = None) -> None:
        body = {"model": self.model, "prompt": self._prompt(rng), "max_tokens": rng.randrange(8, 64)}
        body |= {"temperature": rng.choice([0, 0.8]), "ignore_eos": True, "stream": True}
        t0 = time.monotonic()
        first = last = None
        chunks = 0
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                self._count(r.status_code)
                return
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if '"error"' in line and '"choices"' not in line:
                    self._count("stream-error")
                    return
                now = time.monotonic()
                first = first or now
                last, chunks = now, chunks + 1
                if drop_after is not None and chunks >= drop_after:
                    self._count("disconnect")
                    return
        self._count(200)
        tpot = (last - first) / (chunks - 1) if first and chunks > 1 else None
        with self.lock:
            self.samples.append((t0 - self.start, (first - t0) if first else None, tpot, time.monotonic() - t0))

    def _disconnect(self, http, rng) -> None:
        self._stream(http, rng, drop_after=rng.randrange(1, 6))

    def _abort(self, http, rng) -> None:
        body = {"model": self.model, "prompt": self._prompt(rng), "max_tokens": 60, "ignore_eos": True}
        try:
            r = http.post("/v1/completions", json=body, timeout=httpx.Timeout(120, read=rng.uniform(0.01, 0.2)))
            self._count(r.status_code)
        except httpx.ReadTimeout:
            self._count("abort")

    def _bad(self, http, rng) -> None:
        bad = rng.choice(
            [
                b"{not json",
                {"model": self.model, "prompt": "x", "n": "two"},
                {"model": "no-such-model", "prompt": "x"},
                {"model": self.model, "prompt": [self.vocab + 5]},
                {"model": self.model, "prompt": [1] * (self.context + 1)},
                {"model": self.model, "prompt": "x", "max_tokens": -1},
                {"model": self.model, "messages": []},
            ]
        )
        path = "/v1/chat/completions" if isinstance(bad, dict) and "messages" in bad else "/v1/completions"
        r = http.post(path, content=bad) if isinstance(bad, bytes) else http.post(path, json=bad)
        self._count(r.status_code)

    def quiet_moment(self, http: httpx.Client) -> float:
        """Pause every client; once none is in flight, the pages the server still holds (bounded wait)."""
        self.running.clear()
        deadline = time.monotonic() + 60
        while self.busy and time.monotonic() < deadline:
            self.stop.wait(0.05)
        pages = metric(http, "mlaserve_kv_pages_in_use")
        settle = time.monotonic() + 10  # an aborted request's pages are freed on the engine's next pass
        while pages and time.monotonic() < settle:
            self.stop.wait(0.1)
            pages = metric(http, "mlaserve_kv_pages_in_use")
        self.running.set()
        return pages


def windows(samples, width: float) -> list[dict]:
    out = []
    for w in range(int(max((s[0] for s in samples), default=0) // width) + 1):
        rows = [s for s in samples if w * width <= s[0] < (w + 1) * width]
        if not rows:
            continue
        row = {"window": w, "start_s": w * width, "requests": len(rows)}
        for i, name in ((1, "ttft"), (2, "tpot"), (3, "e2e")):
            vals = sorted(s[i] for s in rows if s[i] is not None)
            if vals:
                row[f"{name}_p50_ms"] = 1000 * vals[len(vals) // 2]
                row[f"{name}_p99_ms"] = 1000 * vals[min(len(vals) - 1, int(0.99 * len(vals)))]
        out.append(row)
    return out


def run_soak(url: str, model: str, vocab: int, context: int, args, pid: int | None = None) -> dict:
    soak = Soak(url, model, vocab, context, args)
    http = httpx.Client(base_url=url, timeout=60)
    rss: list[tuple[float, float]] = []
    quiet: list[dict] = []
    threads = [threading.Thread(target=soak.client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    next_quiet = args.quiet_every
    next_rss = 0.0
    while (now := time.monotonic() - soak.start) < args.duration:
        if now >= next_rss:
            value = rss_mib(pid)
            if value is not None:
                rss.append((round(now, 1), round(value, 1)))
            next_rss = now + 5
        if now >= next_quiet:
            pages = soak.quiet_moment(http)
            quiet.append({"t_s": round(now, 1), "pages_in_use": pages, "rss_mib": rss_mib(pid)})
            print(f"[soak] {now:7.1f}s quiet moment: pages in use {pages:.0f}, statuses {dict(soak.statuses)}")
            next_quiet = time.monotonic() - soak.start + args.quiet_every
        soak.stop.wait(0.5)
    pages = soak.quiet_moment(http)  # the last one, after the traffic
    quiet.append({"t_s": round(time.monotonic() - soak.start, 1), "pages_in_use": pages, "rss_mib": rss_mib(pid)})
    soak.stop.set()
    for t in threads:
        t.join(120)
    http.close()
    return report(soak, rss, quiet, args)


def report(soak: Soak, rss, quiet, args) -> dict:
    wins = windows(soak.samples, args.window)
    statuses = dict(soak.statuses)
    five = {k: v for k, v in statuses.items() if k.isdigit() and int(k) >= 500}
    base = quiet[0]["rss_mib"] if quiet and quiet[0]["rss_mib"] else None
    end = quiet[-1]["rss_mib"] if quiet and quiet[-1]["rss_mib"] else None
    growth = (end - base) / base if base and end else None
    full = [w for w in wins if w["start_s"] + args.window <= args.duration]  # not the last partial one
    p99 = [w["tpot_p99_ms"] for w in full if "tpot_p99_ms" in w]
    med = statistics.median(p99) if p99 else None
    spread = max(abs(v - med) / med for v in p99) if med else None
    verdict = {
        "rss_growth_after_warmup": growth,
        "rss_ok": growth is None or growth < 0.02,
        "pages_back_to_zero": all(q["pages_in_use"] == 0 for q in quiet),
        "no_5xx": not five and not statuses.get("stream-error"),
        "tpot_p99_spread": spread,
        "tpot_stable": spread is None or spread <= 0.20,
    }
    return {
        "duration_s": args.duration,
        "clients": args.clients,
        "statuses": statuses,
        "server_errors": five,
        "quiet_moments": quiet,
        "rss_mib": rss,
        "windows": wins,
        "verdict": verdict,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    server = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    else:
        folder = None
        if not args.embedded:
            sys.path.insert(0, str(Path(__file__).parent))
            from common import ensure_model

            folder = str(ensure_model("standard", quick=False))
        server = Server(folder, args.threads, args.clients)
        url, pid, model = server.url, server.pid, server.model
    card = httpx.get(f"{url}/v1/models/{model}", timeout=30).json()
    vocab = _vocab(url)
    try:
        result = run_soak(url, model, vocab, card["max_model_len"], args, pid)
    finally:
        if server is not None:
            server.stop()
    for w in result["windows"]:
        print(
            f"[soak] window {w['window']:3d}: {w['requests']:5d} requests, "
            f"TTFT p50/p99 {w.get('ttft_p50_ms', 0):7.1f}/{w.get('ttft_p99_ms', 0):7.1f} ms, "
            f"TPOT p50/p99 {w.get('tpot_p50_ms', 0):6.1f}/{w.get('tpot_p99_ms', 0):6.1f} ms"
        )
    print(f"[soak] statuses: {result['statuses']}")
    print(f"[soak] verdict: {json.dumps(result['verdict'])}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    v = result["verdict"]
    return 0 if v["pages_back_to_zero"] and v["no_5xx"] and v["rss_ok"] and v["tpot_stable"] else 1


def _vocab(url: str) -> int:
    """The vocabulary size, from the OpenAPI document's bound on token ids."""
    doc = httpx.get(url + "/openapi.json", timeout=30).json()
    tokens = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]
    return int(tokens["items"]["maximum"]) + 1


if __name__ == "__main__":
    sys.exit(main())

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

Before the traffic the whole KV pool is made resident (--warmup: prefault starts the server with
--kv-prefault; fill writes every page once through requests; none), so the RSS baseline (the first
quiet moment) is not followed by the pool's first-touch growth. Every outcome the soak did not ask
for is listed with its cause (the server's error message, or the client's exception): a 5xx, an
error event in a stream, a failed choice, a stream cut without [DONE] or short of max_tokens, a
transport error; the server's log is kept (--server-log). The load average is recorded next to RSS
and per window (the cores may be shared).

Verdict (printed, and in the JSON): RSS growth after warm-up (the first quiet moment) under 2%, pages
back to 0 at every quiet moment, no 5xx and no unasked error, p99 TPOT of every window within 20% of
their median.
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
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parents[1]
MIX = (("stream", 0.78), ("disconnect", 0.08), ("abort", 0.06), ("bad", 0.08))
REQUEST_TIMEOUT_S = 120  # a client gives up on a silent server after this (a "transport" error, ReadTimeout)


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
    p.add_argument(
        "--warmup",
        choices=("prefault", "fill", "none"),
        default="prefault",
        help="have the whole KV pool resident before the RSS baseline: prefault (the default) starts the server with "
        "--kv-prefault (with --url, start yours with it); fill writes every page once with distinct prompts (any "
        "server, minutes); none: first-touch growth of the pool counts as growth",
    )
    p.add_argument("--page-size", type=int, default=16, help="with --url: the server's tokens per page (for the fill)")
    p.add_argument("--server-log", default=None, help="the server's log (stderr) goes here (default: a temporary file)")
    p.add_argument(
        "server_args",
        nargs="*",
        help="after --: more `mlaserve serve` options for the server it starts (--no-malloc-tuning)",
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- server


class Server:
    """`mlaserve serve` on 127.0.0.1, any free port."""

    def __init__(self, folder: str | None, threads: int, clients: int, extra=(), log: str | None = None) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", "mlaserve.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
        cmd += [folder] if folder else []
        cmd += ["--max-num-seqs", str(clients), "--threads", str(threads), *extra]
        # The server's log is kept: an error the soak counts is looked up there by its request id.
        self.log_path = log or tempfile.NamedTemporaryFile(prefix="soak-server-", suffix=".log", delete=False).name
        self.log = open(self.log_path, "w")  # noqa: SIM115 (open for the server's lifetime)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.page_size = None
        for line in self.proc.stdout:
            m = re.search(r"serving (\S+) on (http://\S+)", line)
            if m:
                self.model, self.url = m.group(1), m.group(2).rstrip(")")
                pool = re.search(r"KV pool (\d+) pages x (\d+) tokens", line)
                self.page_size = int(pool.group(2)) if pool else None
                self.start_s = round(time.monotonic() - t0, 1)  # to ready, the model load (and the prefault) included
                break
        else:
            raise RuntimeError("the server did not start")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        self.pid = self.proc.pid

    def stop(self) -> int:
        self.proc.terminate()
        code = self.proc.wait(120)
        self.log.close()
        return code


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
        self.errors: list[dict] = []  # every outcome not asked for, with its cause
        self.start = time.monotonic()

    def _count(self, key) -> None:
        with self.lock:
            self.statuses[str(key)] += 1

    def _error(self, outcome: str, kind: str, cause: str, t0: float, **more) -> None:
        """An outcome the soak did not ask for, with its cause (the server's error message, or the
        client's exception): counted under `outcome`, listed in the report's `errors`."""
        self._count(outcome)
        with self.lock:
            self.errors.append(
                {"t_s": round(t0 - self.start, 1), "outcome": outcome, "kind": kind, "cause": cause[:300], **more}
            )

    def client(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        kinds, weights = zip(*MIX)
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as http:
            while not self.stop.is_set():
                if not self.running.is_set():
                    self.running.wait(1.0)
                    continue
                with self.lock:
                    self.busy += 1
                kind = rng.choices(kinds, weights)[0]
                t0 = time.monotonic()
                try:
                    getattr(self, "_" + kind)(http, rng)
                except httpx.TransportError as e:
                    cause = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                    self._error("transport", kind, cause, t0, after_s=round(time.monotonic() - t0, 2))
                finally:
                    with self.lock:
                        self.busy -= 1

    def _prompt(self, rng: random.Random) -> list[int]:
        return [0] + [rng.randrange(3, self.vocab) for _ in range(rng.randrange(4, 64))]

    def _stream(self, http: httpx.Client, rng: random.Random, drop_after: int | None = None) -> None:
        body = {"model": self.model, "prompt": self._prompt(rng), "max_tokens": rng.randrange(8, 64)}
        body |= {"temperature": rng.choice([0, 0.8]), "ignore_eos": True, "stream": True}
        kind = "stream" if drop_after is None else "disconnect"
        t0 = time.monotonic()
        first = last = finish = None
        chunks, done = 0, False
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                self._error(str(r.status_code), kind, _message(r.text), t0)
                return
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event and "choices" not in event:  # the stream ended with an error event
                    err = event["error"]
                    cause = f"{err.get('code')}: {err.get('message')}"
                    self._error("stream-error", kind, cause, t0, chunks=chunks, after_s=round(time.monotonic() - t0, 2))
                    return
                for choice in event.get("choices", ()):
                    finish = choice.get("finish_reason") or finish
                    if choice.get("error"):  # one failed choice (the stream goes on)
                        err = choice["error"]
                        self._error("choice-error", kind, f"{err.get('code')}: {err.get('message')}", t0, chunks=chunks)
                now = time.monotonic()
                first = first or now
                last, chunks = now, chunks + 1
                if drop_after is not None and chunks >= drop_after:
                    self._count("disconnect")
                    return
        # A stream must end with a finish_reason and [DONE]; with ignore_eos it runs to max_tokens ("length").
        # One that just stops (the server dropped it, or it finished early) is an error, not a 200.
        if not done or finish != "length":
            cause = f"the stream ended after {chunks} chunks with finish_reason {finish!r}" + (
                "" if done else ", no [DONE]"
            )
            self._error("stream-cut", kind, cause, t0, after_s=round(time.monotonic() - t0, 2))
            return
        self._count(200)
        tpot = (last - first) / (chunks - 1) if first and chunks > 1 else None
        with self.lock:
            self.samples.append((t0 - self.start, (first - t0) if first else None, tpot, time.monotonic() - t0))

    def _disconnect(self, http, rng) -> None:
        self._stream(http, rng, drop_after=rng.randrange(1, 6))

    def _abort(self, http, rng) -> None:
        body = {"model": self.model, "prompt": self._prompt(rng), "max_tokens": 60, "ignore_eos": True}
        t0 = time.monotonic()
        try:
            r = http.post(
                "/v1/completions", json=body, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, read=rng.uniform(0.01, 0.2))
            )
        except httpx.ReadTimeout:
            self._count("abort")
            return
        if r.status_code == 200:
            self._count(200)
        else:
            self._error(str(r.status_code), "abort", _message(r.text), t0)

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
        t0 = time.monotonic()
        r = http.post(path, content=bad) if isinstance(bad, bytes) else http.post(path, json=bad)
        if 400 <= r.status_code < 500:
            self._count(r.status_code)  # refused, as it must be
        else:
            self._error(str(r.status_code), "bad", _message(r.text), t0)

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


def _message(text: str) -> str:
    """The message of an OpenAI error body, else the body's start."""
    try:
        err = json.loads(text)["error"]
        return f"{err.get('code')}: {err.get('message')}"
    except (ValueError, KeyError, TypeError):
        return text[:200]


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


def fill_pool(url: str, model: str, vocab: int, context: int, page_size: int, pid: int | None, seed: int) -> dict:
    """Write every KV page once before the soak, so that its RSS baseline has the whole pool resident.

    The cache tensors are zero pages of memory maps (cache/model_cache.py): a page costs memory when a row of it is first
    written, and the page pool hands out never-used pages first (FIFO; prefix caching keeps released full
    pages until no never-used page is left). Prompts of distinct random tokens (no prefix-cache hit) with
    max_tokens 1 write ceil(L / page_size) pages each; prompts of k pages minus one token leave no
    allocated page unwritten. They go on until the pages written cover the pool, plus one page per request
    for the pages that a request may release unwritten (they go to the end of the free list)."""
    http = httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S)
    total = int(metric(http, "mlaserve_kv_pages_total"))
    length = min(context - 1, 64 * page_size) // page_size * page_size - 1
    per = -(-length // page_size)
    count = -(-total // (per - 1))  # (per - 1): the slack page per request
    rng = random.Random(seed + 7)
    prompts = [[0] + [rng.randrange(3, vocab) for _ in range(length - 1)] for _ in range(count)]
    before, t0 = rss_mib(pid), time.monotonic()

    def one(prompt: list[int]) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        return http.post("/v1/completions", json=body).status_code

    with ThreadPoolExecutor(4) as pool:  # 4 at a time: a few prefills share a step, far from the pool's size
        codes = Counter(pool.map(one, prompts))
    http.close()
    out = {
        "pages_total": total,
        "requests": count,
        "prompt_tokens": count * length,
        "seconds": round(time.monotonic() - t0, 1),
        "rss_before_mib": before,
        "rss_after_mib": rss_mib(pid),
        "statuses": {str(k): v for k, v in codes.items()},
    }
    print(f"[soak] warm-up: every KV page written once: {json.dumps(out)}", flush=True)
    return out


def run_soak(url: str, model: str, vocab: int, context: int, args, pid: int | None = None, page_size=None) -> dict:
    warmup = None
    if getattr(args, "warmup", "none") == "fill":
        warmup = fill_pool(url, model, vocab, context, page_size or args.page_size, pid, args.seed)
    soak = Soak(url, model, vocab, context, args)
    http = httpx.Client(base_url=url, timeout=60)
    rss: list[tuple[float, float, float]] = []  # (t, MiB, 1-minute load average)
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
                rss.append((round(now, 1), round(value, 1), os.getloadavg()[0]))
            next_rss = now + 5
        if now >= next_quiet:
            pages = soak.quiet_moment(http)
            quiet.append({"t_s": round(now, 1), "pages_in_use": pages, "rss_mib": rss_mib(pid), "load": _load()})
            print(
                f"[soak] {now:7.1f}s quiet moment: pages in use {pages:.0f}, RSS {quiet[-1]['rss_mib']} MiB, "
                f"load {_load()}, statuses {dict(soak.statuses)}",
                flush=True,
            )
            next_quiet = time.monotonic() - soak.start + args.quiet_every
        soak.stop.wait(0.5)
    pages = soak.quiet_moment(http)  # the last one, after the traffic
    quiet.append(
        {
            "t_s": round(time.monotonic() - soak.start, 1),
            "pages_in_use": pages,
            "rss_mib": rss_mib(pid),
            "load": _load(),
        }
    )
    soak.stop.set()
    for t in threads:
        t.join(120)
    http.close()
    return report(soak, rss, quiet, args, warmup)


def _load() -> list[float]:
    """The machine's 1/5/15-minute load averages: what the server's cores shared with others."""
    return [round(x, 2) for x in os.getloadavg()]


def report(soak: Soak, rss, quiet, args, warmup: dict | None = None) -> dict:
    wins = windows(soak.samples, args.window)
    for w in wins:  # the load average while the window ran, next to its latencies
        loads = [r[2] for r in rss if w["start_s"] <= r[0] < w["start_s"] + args.window]
        w["load_avg_1m"] = round(statistics.mean(loads), 2) if loads else None
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
        "no_5xx": not five and not any(statuses.get(k) for k in ("stream-error", "choice-error", "stream-cut")),
        "no_transport_errors": not statuses.get("transport"),
        "tpot_p99_spread": spread,
        "tpot_stable": spread is None or spread <= 0.20,
    }
    return {
        "duration_s": args.duration,
        "clients": args.clients,
        "statuses": statuses,
        "server_errors": five,
        "errors": soak.errors,
        "error_causes": dict(Counter(f"{e['outcome']} ({e['kind']}): {e['cause']}" for e in soak.errors)),
        "warmup": warmup,
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
        extra = [*args.server_args, *(["--kv-prefault"] if args.warmup == "prefault" else [])]
        server = Server(folder, args.threads, args.clients, extra, args.server_log)
        url, pid, model = server.url, server.pid, server.model
        print(f"[soak] server ready in {server.start_s} s, RSS {rss_mib(pid)} MiB; log: {server.log_path}", flush=True)
    card = httpx.get(f"{url}/v1/models/{model}", timeout=30).json()
    vocab = _vocab(url)
    try:
        page_size = server.page_size if server is not None else None
        result = run_soak(url, model, vocab, card["max_model_len"], args, pid, page_size)
        if server is not None:
            result["server"] = {"args": extra, "ready_s": server.start_s, "log": server.log_path}
    finally:
        if server is not None:
            server.stop()
    for w in result["windows"]:
        print(
            f"[soak] window {w['window']:3d}: {w['requests']:5d} requests, "
            f"TTFT p50/p99 {w.get('ttft_p50_ms', 0):7.1f}/{w.get('ttft_p99_ms', 0):7.1f} ms, "
            f"TPOT p50/p99 {w.get('tpot_p50_ms', 0):6.1f}/{w.get('tpot_p99_ms', 0):6.1f} ms, load {w['load_avg_1m']}"
        )
    print(f"[soak] statuses: {result['statuses']}")
    for cause, n in result["error_causes"].items():
        print(f"[soak] {n:4d} x {cause}")
    print(f"[soak] verdict: {json.dumps(result['verdict'])}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    v = result["verdict"]
    ok = v["pages_back_to_zero"] and v["no_5xx"] and v["no_transport_errors"] and v["rss_ok"] and v["tpot_stable"]
    return 0 if ok else 1


def _vocab(url: str) -> int:
    """The vocabulary size, from the OpenAPI document's bound on token ids."""
    doc = httpx.get(url + "/openapi.json", timeout=30).json()
    tokens = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]
    return int(tokens["items"]["maximum"]) + 1


if __name__ == "__main__":
    sys.exit(main())

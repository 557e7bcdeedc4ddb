"""The engines of benchmarks/offline.py: an engine spec (`kind[@gguf type][:k=v,...]`) and the names it may use,
the parent's handle on one engine's worker process (Engine), and the loop that process serves (worker_main, run
as `offline.py --worker SPEC`; the workers that run each engine are in offline_workers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ik_llama_worker import IK_OPTIONS
from offline_workers import WORKERS, rss
from worker_protocol import error_reply, private_stdout, serve_calls

# the script a worker process runs (`offline.py --worker SPEC ...`): Engine.start starts it
OFFLINE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "offline.py")
KINDS = {  # engine kind -> which copy of the weights it reads
    "mlaserve": "folder",
    "mlaserve-gguf": "gguf",
    "llama.cpp": "gguf",
    "ik_llama.cpp": "gguf",
    "transformers": "folder",
}
# GGUF types an engine can name (`llama.cpp@q4_0`): q8_0 is written by `mlaserve convert`; the others by
# llama.cpp's own quantizer (llama_model_quantize) from that Q8_0 file, so they need llama-cpp-python.
# iq_mix: llama-quantize's IQ4_XS / IQ3_XXS / IQ2_XXS mix with an importance matrix, made by benchmarks/iq_mix.py
# (an imatrix cannot be passed through llama_model_quantize's Python binding), so it has no ftype here.
GGUF_TYPES = {"q8_0": 7, "q4_0": 2, "q4_k_m": 15, "q6_k": 18, "iq_mix": None}  # llama_ftype values
# llama.cpp's engine options: repack=false loads without its extra buffer types (AMX tiles, CPU repacked
# layouts), as `llama-bench --repack 0`; its default (true) aborts on MLA files on some CPUs (README).
LLAMA_CPP_OPTIONS = {"repack"}


def parse_spec(spec: str) -> tuple[str, str, dict]:
    """'kind[@gguf type][:k=v,k=v]' -> (kind, weights, options). weights: "folder", or the GGUF's type
    (q8_0 unless named). Option values: ints, floats, true/false/none, else strings."""
    head, _, rest = spec.partition(":")
    kind, at, qtype = head.partition("@")
    if kind not in KINDS:
        raise SystemExit(f"--engines: unknown engine {kind!r} (choose from {', '.join(KINDS)})")
    if KINDS[kind] == "folder":
        if at:
            raise SystemExit(f"--engines {spec}: {kind} reads the safetensors folder, not a GGUF type")
        weights = "folder"
    else:
        weights = qtype.lower() if at else "q8_0"
        if weights not in GGUF_TYPES:
            raise SystemExit(f"--engines {spec}: GGUF type {weights!r} (choose from {', '.join(GGUF_TYPES)})")
    opts: dict = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise SystemExit(f"--engines {spec}: options are key=value")
        low = v.lower()
        if low in ("true", "false", "none"):
            opts[k] = {"true": True, "false": False, "none": None}[low]
        else:
            for conv in (int, float, str):
                try:
                    opts[k] = conv(v)
                    break
                except ValueError:
                    pass
    if kind == "llama.cpp" and set(opts) - LLAMA_CPP_OPTIONS:
        raise SystemExit(f"--engines {spec}: llama.cpp takes only {', '.join(sorted(LLAMA_CPP_OPTIONS))}")
    if kind == "ik_llama.cpp" and set(opts) - set(IK_OPTIONS):
        raise SystemExit(f"--engines {spec}: ik_llama.cpp takes only {', '.join(IK_OPTIONS)}")
    if opts and kind == "transformers":
        raise SystemExit(f"--engines {spec}: only mlaserve, llama.cpp and ik_llama.cpp engines take options")
    return kind, weights, opts


def worker_main(spec: str, init: dict) -> None:
    """Serve calls from the parent: one JSON line in, one JSON line out, on a private copy of stdout
    (fd 1 itself goes to stderr, so nothing a library prints can garble the replies)."""
    proto = private_stdout()
    kind, _, options = parse_spec(spec)
    t0 = time.perf_counter()
    settings = {**init["settings"], "ik_llama_bin": init.get("ik_llama_bin")}  # a machine path: not in the JSON
    try:
        engine = WORKERS[kind](init["path"], init["dtype"], init["threads"], settings, options)
        engine_rss = getattr(engine, "rss", rss)  # a tool-driven engine: its child processes' memory
        proto.write(json.dumps({"ok": True, "load_s": time.perf_counter() - t0, "rss_gib": engine_rss()}) + "\n")
    except Exception as ex:  # noqa: BLE001 -- the parent reports it and goes on with the other engines
        proto.write(json.dumps(error_reply(ex)) + "\n")
        return
    serve_calls(proto, engine, engine_rss)


class Engine:
    """The parent's handle on one worker process."""

    def __init__(self, spec: str, path: Path, args, s: dict) -> None:
        self.spec, (self.kind, self.weights, self.options) = spec, parse_spec(spec)
        self.path, self.args, self.s = path, args, s
        self.proc = None
        self.status: str | None = None  # None: running or done; else why it has no numbers
        self.load: dict = {}
        self.last_rss: dict = {}

    def start(self) -> bool:
        init = {"path": str(self.path), "dtype": self.args.dtype, "threads": self.args.threads, "settings": self.s}
        init["ik_llama_bin"] = getattr(self.args, "ik_llama_bin", None)
        print(f"[load] {self.spec} <- {self.path.name}", flush=True)
        self.proc = subprocess.Popen(
            [sys.executable, OFFLINE_SCRIPT, "--worker", self.spec, "--worker-args", json.dumps(init)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        reply = self._read()
        if not reply.get("ok"):
            self.status = f"failed to load: {reply.get('error')}"
            print(f"  {self.spec}: {self.status}", flush=True)
            self.stop()
            return False
        self.load = reply
        print(
            f"  {self.spec}: loaded in {reply['load_s']:.1f} s, RSS {reply['rss_gib']['vmrss_gib']:.2f} GiB", flush=True
        )
        return True

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            return {"ok": False, "error": f"worker exited (code {rc})"}
        return json.loads(line)

    def call(self, op: str, *args):
        """The result, or None after printing why it failed."""
        if self.proc is None:
            return None
        self.proc.stdin.write(json.dumps({"op": op, "args": list(args)}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "vmhwm_gib" in reply:
            self.last_rss = {"vmrss_gib": reply["vmrss_gib"], "vmhwm_gib": reply["vmhwm_gib"]}
        if not reply.get("ok"):
            print(f"  {self.spec}: {op} failed: {reply.get('error')}", flush=True)
            if self.proc.poll() is not None:
                self.status, self.proc = f"died: {reply.get('error')}", None
            return None
        return reply["result"]

    def stop(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            self.proc.wait()
            self.proc = None

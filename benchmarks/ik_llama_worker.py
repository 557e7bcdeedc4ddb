"""ik_llama.cpp as an engine of benchmarks/offline.py, through its own tools: no Python binding drives it
(llama-cpp-python binds mainline llama.cpp's C API, which ik_llama.cpp's has diverged from), so each
call runs one of its binaries from `offline.py --ik-llama-bin DIR` and reads the figures it prints.

    generate([p], 1)        prefill: `llama-bench -p len(p) -n 0` (its prompt: random tokens)
    generate([p], n)        batch-1 decode at context len(p): `llama-bench -gp len(p),n-1`, the n-1 decode
                            steps after the prompt (its -gp times the generation only), random tokens
    generate(ps, n), B > 1  `llama-batched-bench -npp len(p) -ntg n-1 -npl B`: B prompts decoded in
                            n_batch chunks, then n-1 steps of B tokens (as offline_workers.py's llama.cpp worker).
                            Its tool feeds token 0 at every position of every sequence (not random): every
                            sequence routes to the same experts, which reads fewer expert weights per step
                            than B distinct requests would. The JSON and the table say so.
Start (load_s) is the wall time of the smallest whole run (`llama-batched-bench -npp 1 -ntg 1 -npl 1`: the
process, the model load, a context, two decodes), peak RSS the largest ru_maxrss of every run (the kernel's
VmHWM of each child; on Linux at least the worker's own resident set, which the child's record inherits when it
execs: the worker is a small process, so that floor is far below any model's figure). Options (engine spec `ik_llama.cpp@TYPE:k=v`): mla (default 3), fa (flash attention,
default true), fmoe (fused MoE up/gate, default true), rtr (run-time repack, default false; it turns mmap off).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

IK_OPTIONS = {"mla": 3, "fa": True, "fmoe": True, "rtr": False}
BATCHED_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|(.*)\|\s*$")
BATCHED_COLS = ("t_pp_s", "s_pp", "t_tg_s", "s_tg", "t_s", "s")


def parse_batched(text: str) -> dict:
    """The one result row of `llama-batched-bench`'s table: PP, TG, B, N_KV, then T_PP s, S_PP t/s,
    T_TG s, S_TG t/s, T s, S t/s (a rate of 0 tokens prints nan or inf: kept as None)."""
    rows = [m for line in text.splitlines() if (m := BATCHED_ROW.match(line.strip()))]
    if len(rows) != 1:
        raise RuntimeError(f"llama-batched-bench printed {len(rows)} result rows, expected 1:\n{text[-2000:]}")
    m = rows[0]
    vals = [v.strip() for v in m.group(5).split("|")]
    if len(vals) != len(BATCHED_COLS):
        raise RuntimeError(f"llama-batched-bench row has {len(vals)} timing columns, expected 6: {m.group(0)}")
    out = {"pp": int(m.group(1)), "tg": int(m.group(2)), "b": int(m.group(3)), "n_kv": int(m.group(4))}
    for k, v in zip(BATCHED_COLS, vals):
        try:
            f = float(v)
            out[k] = f if f == f and f not in (float("inf"), float("-inf")) else None
        except ValueError:
            out[k] = None
    return out


def parse_bench(text: str) -> float:
    """avg_ts of the one test in `llama-bench -o json`'s output (a JSON array)."""
    start = text.find("[")
    tests = json.loads(text[start:]) if start >= 0 else []
    if len(tests) != 1:
        raise RuntimeError(f"llama-bench printed {len(tests)} tests, expected 1:\n{text[-2000:]}")
    return float(tests[0]["avg_ts"])


class IkLlamaWorker:
    def __init__(self, path: str, dtype: str, threads: int, s: dict, options: dict) -> None:
        self.bin = Path(s.get("ik_llama_bin") or "")
        for tool in ("llama-bench", "llama-batched-bench"):
            if not (self.bin / tool).is_file():
                raise RuntimeError(f"--ik-llama-bin {self.bin}: no {tool} there (benchmarks/README.md builds it)")
        unknown = set(options) - set(IK_OPTIONS)
        if unknown:
            raise RuntimeError(f"ik_llama.cpp takes only {', '.join(IK_OPTIONS)}, not {', '.join(sorted(unknown))}")
        self.path, self.threads = path, threads
        # the tools' own files (llama-batched-bench writes llama.log into its working folder) stay out of the checkout
        self.workdir = tempfile.mkdtemp(prefix="ik_llama-")
        # removed with the worker (or at exit), a failed start included
        weakref.finalize(self, shutil.rmtree, self.workdir, ignore_errors=True)
        self.opts = {**IK_OPTIONS, **options}
        self.peak_kib = self.last_kib = 0
        self.runs: list[dict] = []
        self.generate([[0]], 2)  # the start: the smallest whole run (timed by the caller as the load)
        self.start_s = self.runs[-1]["wall_s"]

    def _run(self, tool: str, args: list[str]) -> str:
        cmd = [str(self.bin / tool), "-m", os.path.abspath(self.path), "-t", str(self.threads), *args]
        t0 = time.perf_counter()
        # errors="replace": the tools print the model's token pieces, which need not be whole UTF-8 sequences
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", cwd=self.workdir
        )
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        self.last_kib = usage.ru_maxrss
        self.peak_kib = max(self.peak_kib, usage.ru_maxrss)
        self.runs.append({"tool": tool, "args": args, "wall_s": wall, "maxrss_gib": usage.ru_maxrss / 2**20})
        if proc.returncode != 0:
            raise RuntimeError(f"{tool} exited {proc.returncode}: {out[-2000:]}")
        return out

    def _bench_flags(self) -> list[str]:
        o = self.opts
        return [
            "-mla",
            str(o["mla"]),
            "-fa",
            str(int(o["fa"])),
            "-fmoe",
            str(int(o["fmoe"])),
            "-rtr",
            str(int(o["rtr"])),
        ]

    def _batched_flags(self) -> list[str]:
        o = self.opts
        return (
            ["-mla", str(o["mla"]), "-fa", "on" if o["fa"] else "off"]
            + ([] if o["fmoe"] else ["-no-fmoe"])
            + (["-rtr"] if o["rtr"] else [])
        )

    def generate(self, prompts: list[list[int]], new: int) -> dict:
        n, pp = len(prompts), max(len(p) for p in prompts)
        if n == 1 and new == 1:  # prefill
            rate = parse_bench(
                self._run("llama-bench", ["-o", "json", "-r", "1", "-p", str(pp), "-n", "0", *self._bench_flags()])
            )
            return {"wall_s": pp / rate, "first_s": pp / rate, "rate_b1": None, "ids": None, "tool_tokens": "random"}
        if n == 1 and pp > 1:  # batch-1 decode at context pp
            args = ["-o", "json", "-r", "1", "-p", "0", "-n", "0", "-gp", f"{pp},{new - 1}", *self._bench_flags()]
            rate = parse_bench(self._run("llama-bench", args))
            return {"wall_s": None, "first_s": None, "rate_b1": rate, "ids": None, "tool_tokens": "random"}
        ctx = -(-n * (pp + new) // 256) * 256
        args = ["-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(pp), "-ntg", str(new - 1), "-npl", str(n)]
        r = parse_batched(self._run("llama-batched-bench", args + self._batched_flags()))
        return {
            "wall_s": r["t_s"],
            "first_s": r["t_pp_s"],
            "rate_b1": (new - 1) / r["t_tg_s"] if n == 1 and r["t_tg_s"] else None,
            "ids": None,
            "tool_tokens": "token 0 in every sequence (llama-batched-bench)",
        }

    def rss(self) -> dict:
        return {"vmrss_gib": self.last_kib / 2**20, "vmhwm_gib": self.peak_kib / 2**20}

    def kv_bytes(self) -> None:
        return None

    def step_times(self, contexts, reps, warmup) -> None:
        return None

    def info(self) -> dict:
        return {
            "tools": "llama-bench / llama-batched-bench",
            "options": self.opts,
            "start_s": self.start_s,
            "runs": self.runs,
        }

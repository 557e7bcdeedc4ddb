"""The benchmark matrix of issue #31: mlaserve vs llama.cpp (and ik_llama.cpp, given its tools) per (model, GGUF
file type), one offline.py run per cell, one JSON per run in docs/results/.

    python benchmarks/matrix.py [--models standard ds-real glm-real] [--types q8_0 q6_k q4_k_m q4_0 iq_mix]
                                [--phases prefill decode long c16] [--threads N] [--reps N] [--tag NAME]
                                [--ik-llama-bin DIR] [--date YYYY-MM-DD] [--run N] [--long-prefill]
                                [--llama-repack false|true] [--dry-run]

Each cell is `offline.py --model M --engines mlaserve-gguf@T llama.cpp@T:repack=false [ik_llama.cpp@T:...]
--phases ... --long-prompt 4096`: the engines load side by side and take each phase in turn (alternating, so
background load hits all alike); offline.py makes the Q8_0 file with `mlaserve convert` and Q6_K / Q4_K_M /
Q4_0 from it with llama.cpp's own quantizer; the IQ mix is made once by iq_mix.py. llama.cpp runs with
`repack=false` (`llama-bench --repack 0`): with its AMX / repacked buffers it aborts on MLA files on the AMX CPU
measured (benchmarks/README.md). `--llama-repack true` runs llama.cpp with its default repacked layouts instead, where
they load: on the AVX-512 EPYC measured (no AMX) they make its decode and 16-concurrent phases faster and its prefill
slower, so each phase there is measured against the faster setting, in parts (`--tag`). A cell whose JSON exists is skipped (`--run N` writes a repeat); a partial one
(a run stopped after some phases: offline.py writes the JSON after every phase, `"complete": false`) is run
again. `--tag` names a part of each cell (some phases now, others in another part): matrix_table.py unites the
parts. Cells run in the order given, models outer: the standard model first.
`python benchmarks/matrix_table.py docs/results/matrix-*.json` prints the table and plots the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from offline import MODEL_NAMES  # noqa: E402
from offline_engines import GGUF_TYPES  # noqa: E402

RESULTS = Path("docs") / "results"  # relative to the checkout


def cell_path(date: str, model: str, qtype: str, run: int, tag: str = "") -> Path:
    """docs/results/matrix-<date>-<model>-<type>[-<tag>][-runN].json (run 1 has no suffix; a tag names one
    part of a cell measured in parts, which matrix_table.py unites)."""
    return RESULTS / f"matrix-{date}-{model}-{qtype}{f'-{tag}' if tag else ''}{'' if run == 1 else f'-run{run}'}.json"


def cell_done(path: Path) -> bool:
    """A cell is done when its JSON exists and is not a partial one (offline.py writes one after every phase)."""
    return path.exists() and json.loads(path.read_text()).get("complete", True) is not False


LONG_PROMPT = 4096  # the long-context decode phase: batch-1 decode after a 4096-token prompt


def cell_command(
    model: str,
    qtype: str,
    phases: list[str],
    out: Path,
    threads: int = 2,
    reps: int = 2,
    ik_bin: str | None = None,
    long_prefill: bool = False,
    llama_repack: bool = False,
) -> list[str]:
    """offline.py's command for one cell: mlaserve, llama.cpp (repack=false) and, given its tools' folder,
    ik_llama.cpp (-mla 3 -fa -fmoe: its defaults, named) on the same file, alternating phase by phase. long_prefill:
    the prefill phase takes a prompt of LONG_PROMPT tokens, not 512 (matrix_table.py files it as its own column).
    llama_repack: llama.cpp with its repacked weight layouts (its default), not repack=false."""
    engines = [f"mlaserve-gguf@{qtype}", f"llama.cpp@{qtype}:repack={str(llama_repack).lower()}"]
    if ik_bin:
        engines.append(f"ik_llama.cpp@{qtype}:mla=3,fa=true,fmoe=true")
    return (
        [
            sys.executable,
            str(BENCH_DIR / "offline.py"),
            "--model",
            model,
            "--engines",
            *engines,
            "--phases",
            *phases,
            "--long-prompt",
            str(LONG_PROMPT),
            "--threads",
            str(threads),
            "--reps",
            str(reps),
            "--out",
            str(out),
        ]
        + (["--ik-llama-bin", ik_bin] if ik_bin else [])
        + (["--prefill-len", str(LONG_PROMPT)] if long_prefill else [])
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODEL_NAMES, default=["standard", "ds-real", "glm-real"])
    p.add_argument("--types", nargs="+", choices=list(GGUF_TYPES), default=list(GGUF_TYPES))
    p.add_argument("--phases", nargs="+", default=["prefill", "decode", "long", "c16"], help="offline.py --phases")
    p.add_argument("--date", default=datetime.date.today().isoformat(), help="the date in the JSON names")
    p.add_argument("--run", type=int, default=1, help="repeat number (names -runN for N > 1)")
    p.add_argument("--threads", type=int, default=2, help="threads of every engine (1 on a loaded machine: README)")
    p.add_argument("--reps", type=int, default=2, help="prompts per prefill / batch-1 decode measurement")
    p.add_argument(
        "--ik-llama-bin", default=None, metavar="DIR", help="ik_llama.cpp's tools: adds it as a third engine"
    )
    p.add_argument(
        "--tag", default="", help="name of this part of the cells (some --phases now, the rest in another part)"
    )
    p.add_argument(
        "--long-prefill",
        action="store_true",
        help=f"prefill a {LONG_PROMPT}-token prompt instead of 512 (issue #31's second prefill target; use a --tag)",
    )
    p.add_argument(
        "--llama-repack",
        choices=["false", "true"],
        default="false",
        help="llama.cpp's repacked weight layouts (its default; they abort on MLA files on AMX CPUs, see above)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = p.parse_args()
    root = BENCH_DIR.parent
    for model in args.models:
        for qtype in args.types:
            out = cell_path(args.date, model, qtype, args.run, args.tag)
            cmd = cell_command(
                model,
                qtype,
                args.phases,
                out,
                args.threads,
                args.reps,
                args.ik_llama_bin,
                args.long_prefill,
                args.llama_repack == "true",
            )
            if cell_done(root / out):
                print(f"[matrix] {out} exists: skipped", flush=True)
                continue
            print(f"[matrix] {model} {qtype}: {' '.join(cmd[1:])}", flush=True)
            if not args.dry_run:
                rc = subprocess.run(cmd, cwd=root, env=os.environ).returncode
                if rc != 0:
                    print(f"[matrix] {model} {qtype}: offline.py exited {rc}; going on", flush=True)


if __name__ == "__main__":
    main()

"""The benchmark matrix of issue #31: mlaserve vs llama.cpp per (model, GGUF file type), one offline.py run
per cell, one JSON per run in docs/results/.

    python benchmarks/matrix.py [--models standard ds-real glm-real] [--types q8_0 q6_k q4_k_m q4_0]
                                [--phases prefill decode c16] [--date YYYY-MM-DD] [--run N] [--dry-run]

Each cell is `offline.py --model M --engines mlaserve-gguf@T llama.cpp@T:repack=false --phases ...`: the two
engines load side by side and take each phase in turn (alternating, so background load hits both alike);
offline.py makes the Q8_0 file with `mlaserve convert` and the other types from it with llama.cpp's own
quantizer. llama.cpp runs with `repack=false` (`llama-bench --repack 0`): with its AMX / repacked buffers it
aborts on MLA files on the AMX CPU measured (benchmarks/README.md). A cell whose JSON exists is skipped
(`--run N` writes a repeat); a partial one (a run stopped after some phases: offline.py writes the JSON
after every phase, `"complete": false`) is run again. Cells run in the order given, models outer: the standard model first.
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
from offline import GGUF_TYPES, MODEL_NAMES  # noqa: E402

RESULTS = Path("docs") / "results"  # relative to the checkout


def cell_path(date: str, model: str, qtype: str, run: int) -> Path:
    """docs/results/matrix-<date>-<model>-<type>[-runN].json (run 1 has no suffix)."""
    return RESULTS / f"matrix-{date}-{model}-{qtype}{'' if run == 1 else f'-run{run}'}.json"


def cell_done(path: Path) -> bool:
    """A cell is done when its JSON exists and is not a partial one (offline.py writes one after every phase)."""
    return path.exists() and json.loads(path.read_text()).get("complete", True) is not False


def cell_command(model: str, qtype: str, phases: list[str], out: Path) -> list[str]:
    engines = [f"mlaserve-gguf@{qtype}", f"llama.cpp@{qtype}:repack=false"]
    return [
        sys.executable,
        str(BENCH_DIR / "offline.py"),
        "--model",
        model,
        "--engines",
        *engines,
        "--phases",
        *phases,
        "--out",
        str(out),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODEL_NAMES, default=["standard", "ds-real", "glm-real"])
    p.add_argument("--types", nargs="+", choices=list(GGUF_TYPES), default=["q8_0", "q6_k", "q4_k_m", "q4_0"])
    p.add_argument("--phases", nargs="+", default=["prefill", "decode", "c16"], help="offline.py --phases")
    p.add_argument("--date", default=datetime.date.today().isoformat(), help="the date in the JSON names")
    p.add_argument("--run", type=int, default=1, help="repeat number (names -runN for N > 1)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = p.parse_args()
    root = BENCH_DIR.parent
    for model in args.models:
        for qtype in args.types:
            out = cell_path(args.date, model, qtype, args.run)
            cmd = cell_command(model, qtype, args.phases, out)
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

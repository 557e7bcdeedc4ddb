"""The matrix's IQ mix file: llama.cpp's `llama-imatrix` on a short text, then `llama-quantize` with that
importance matrix to an IQ4_XS / IQ3_XXS / IQ2_XXS mix, from the model's Q8_0 GGUF.

    python benchmarks/iq_mix.py --llama-bin DIR [--model standard] [--text FILE] [--chunks 8]

DIR holds llama.cpp's tools (`llama-imatrix`, `llama-quantize`; a build of llama.cpp, e.g. its
`build/bin`). The mix (MIX below), as the DeepSeek "dynamic" quants do it: routed experts' gate / up in
IQ2_XXS (the base type), their down in IQ3_XXS, attention, the shared experts and the dense layer in IQ4_XS.
Rows whose width is not a multiple of 256 (the q_lora_rank 384 inputs, the per-head k_b / v_b products)
are given a fallback type by llama-quantize itself (it prints which). The text: the checkout's README.md
unless --text names another file (the model is random: any text gives a usable importance matrix).
Output: `<model>-iq_mix.gguf` beside the model folder (benchmarks/models/), and `<model>-iq_mix.imatrix`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from offline import MODEL_NAMES  # noqa: E402

BASE_TYPE = "IQ2_XXS"  # every tensor not named in MIX (the routed experts' gate and up)
MIX = (  # (tensor-name pattern, type), passed as --tensor-type
    ("ffn_down_exps", "iq3_xxs"),
    ("attn_", "iq4_xs"),
    ("_shexp", "iq4_xs"),
    (r"blk\.0\.ffn_", "iq4_xs"),  # the dense first layer (first_k_dense_replace = 1)
)


def tool(bin_dir: Path, name: str) -> Path:
    path = bin_dir / name
    if not path.is_file():
        raise SystemExit(f"--llama-bin {bin_dir}: no {name} there (build it: cmake --build BUILD --target {name})")
    return path


def imatrix_command(bin_dir: Path, src: Path, text: Path, out: Path, chunks: int, threads: int) -> list[str]:
    return [
        str(tool(bin_dir, "llama-imatrix")),
        "-m", str(src), "-f", str(text), "-o", str(out),
        "-c", "512", "--chunks", str(chunks), "-t", str(threads),
        "--no-repack",  # its AMX / repacked buffers abort on MLA files on AMX CPUs (README, "matrix.py")
    ]  # fmt: skip


def quantize_command(bin_dir: Path, src: Path, imatrix: Path, out: Path, threads: int) -> list[str]:
    cmd = [str(tool(bin_dir, "llama-quantize")), "--allow-requantize", "--imatrix", str(imatrix)]
    for pattern, qtype in MIX:
        cmd += ["--tensor-type", f"{pattern}={qtype}"]
    return cmd + [str(src), str(out), BASE_TYPE, str(threads)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-imatrix and llama-quantize")
    p.add_argument("--model", default="standard", choices=MODEL_NAMES)
    p.add_argument("--text", type=Path, default=BENCH_DIR.parent / "README.md", help="importance-matrix text")
    p.add_argument("--chunks", type=int, default=8, help="512-token chunks of the text to run")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from common import ensure_model
    from model_files import ensure_gguf, gguf_path

    folder = ensure_model(args.model, False)
    src = ensure_gguf(folder, "q8_0")
    out = gguf_path(folder, "iq_mix")
    imatrix = out.with_suffix(".imatrix")
    for name, cmd in (
        ("imatrix", imatrix_command(args.llama_bin, src, args.text, imatrix, args.chunks, args.threads)),
        ("quantize", quantize_command(args.llama_bin, src, imatrix, out, args.threads)),
    ):
        t0 = time.perf_counter()
        print(f"[iq_mix] {name}: {' '.join(Path(c).name if '/' in c else c for c in cmd)}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"[iq_mix] {name} failed (its output above says why)")
        print(f"[iq_mix] {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"[iq_mix] wrote {out.name} ({out.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()

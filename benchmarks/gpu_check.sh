#!/usr/bin/env bash
# GPU check, in one short run (under ~9 min on one H200 by construction: every part runs under `timeout`, so it
# always ends and keeps what it has, the parts' limits summing to ~8.5 min, 9.5 with carried wheels): the machine and
# versions, the GPU tests,
# the Triton kernels compiled on the GPU, then the GPU benchmark (mlaserve with CUDA graphs, mlaserve eager,
# transformers; bf16; the standard model, then the DSA model with what time is left). Run from the repository root:
#
#     bash benchmarks/gpu_check.sh            # results in $OUT, default benchmarks/results
#
# Python wheels in a .whl/ folder at the root (for a machine without a package index) are installed into /tmp/site
# first. Without a GPU the tests skip and the benchmark runs a --quick CPU smoke test (CUDA graphs off there): the
# script's own check (4 minutes on a 2-core CPU under load ~13). Limits (seconds; env overrides): T_TESTS 150, T_TRITON 45,
# T_BENCH 180 (on a fresh machine it includes building the standard model from its seed), T_BENCH_DSA 60 (run only
# where the DSA model is already built: building its ~2.8 GB would take the part's whole time); 60 each for the
# versions and the wheel install. Exit status: that of the GPU tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T_TESTS="${T_TESTS:-150}"        # the GPU tests
T_TRITON="${T_TRITON:-45}"       # the Triton tests, compiled for the GPU
T_BENCH="${T_BENCH:-180}"        # the standard model's benchmark
T_BENCH_DSA="${T_BENCH_DSA:-60}" # the DSA model's (mlaserve graphs vs eager only), if time is left
START=$(date +%s)
log() { echo "[gpu_check +$(($(date +%s) - START))s] $*"; }

{
  log "machine"
  date -u
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  nproc
  free -g 2>/dev/null | head -2
  cat /proc/loadavg
} >"$OUT/gpu-env.txt" 2>&1

if compgen -G ".whl/*.whl" >/dev/null; then
  log "installing carried wheels into /tmp/site"
  if timeout -k 10 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$OUT/gpu-env.txt" 2>&1; then
    export PYTHONPATH="/tmp/site:$PWD"
  else
    log "wheel install failed (see gpu-env.txt); going on with what is installed"
    export PYTHONPATH="$PWD"
  fi
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

log "versions"
timeout 60 python3 - >>"$OUT/gpu-env.txt" 2>&1 <<'PY'
import importlib, sys
import torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB")
for name in ["transformers", "triton", "safetensors", "tokenizers", "numpy", "huggingface_hub", "pytest", "xdist", "gguf", "fastapi", "pydantic", "mlaserve", "mlaserve.entrypoints.openai.server"]:
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", ""), getattr(m, "__file__", ""))
    except Exception as e:
        print(name, "NOT IMPORTABLE:", type(e).__name__, e)
PY
cat "$OUT/gpu-env.txt"
CUDA=0
if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then CUDA=1; fi

# Files that may not exist in this checkout are left out (named in the log), never an error.
existing() { for f in "$@"; do if [ -e "$f" ]; then echo "$f"; else log "not in this checkout: $f" >&2; fi; done; }

# The GPU tests: tests/gpu/ (cuda == cpu; CUDA graphs: replay == eager bit for bit per bucket, several steps,
# changing buckets), then tests whose engines take device "auto" (= cuda on a GPU machine) against transformers.
# Without a GPU only tests/gpu (which then skips, saying why): the CPU suite is not this script's business.
if [ "$CUDA" = 1 ]; then
  mapfile -t TESTS < <(existing tests/gpu tests/identities/test_attention_backends.py tests/unit/test_engine.py \
    tests/models/test_model_vs_transformers.py tests/unit/test_sampler.py tests/models/test_fp8.py)
else
  mapfile -t TESTS < <(existing tests/gpu)
fi
XDIST=()
if python3 -c "import xdist" 2>/dev/null; then XDIST=(-n 4 --dist loadfile); fi
log "tests: ${TESTS[*]}"
timeout -k 10 "$T_TESTS" python3 -m pytest "${TESTS[@]}" "${XDIST[@]}" -q -rs -p no:cacheprovider --durations=15 \
  -o junit_family=legacy --junitxml="$OUT/gpu-tests.xml" -s 2>&1 | tee "$OUT/gpu-tests.log"
TEST_RC=${PIPESTATUS[0]}
log "tests exit status $TEST_RC"

# The Triton kernels compiled for the GPU (TRITON_INTERPRET unset: tests/conftest.py sets it only where torch sees
# no GPU): the attention backends' triton cases against their references (the harness, and the backend's own
# cases at kv_lora 256 / 512, split-K, DSA; their CPU cases skip there: no interpreter), and the GEMM kernels compiled for sm_90
# (test_triton_gemm_compiles.py). test_triton_gemm.py is the interpreter's and skips here, saying so: the GEMM
# kernels' GPU results are held to their references by tests/gpu/test_cuda.py, in the tests above.
mapfile -t TRITON < <(existing tests/identities/test_attention_backends.py tests/identities/test_triton_attention.py \
  $(compgen -G "tests/kernels/test_triton_*.py"))
if [ "$CUDA" = 1 ] && [ "${#TRITON[@]}" -gt 0 ]; then
  log "triton tests: ${TRITON[*]}"
  env -u TRITON_INTERPRET timeout -k 10 "$T_TRITON" python3 -m pytest "${TRITON[@]}" -k triton -q -rs \
    -p no:cacheprovider --durations=10 2>&1 | tee "$OUT/gpu-triton.log"
  log "triton tests exit status ${PIPESTATUS[0]}"
else
  log "triton tests: not run (cuda $CUDA, files: ${TRITON[*]:-none})"
fi

if [ "$CUDA" = 1 ]; then
  BENCH=(--device cuda --dtype bfloat16 --out "$OUT/gpu-bench-standard.json")
  BENCH_DSA=(--model dsa --device cuda --dtype bfloat16 --engines graphs,eager --out "$OUT/gpu-bench-dsa.json")
else
  log "no CUDA device: the benchmark runs its --quick smoke test on the CPU"
  BENCH=(--device cpu --dtype float32 --quick --long --out "$OUT/gpu-bench-cpu-quick.json")
  BENCH_DSA=()
fi
log "benchmark: ${BENCH[*]}"
timeout -k 10 "$T_BENCH" python3 benchmarks/gpu_bench.py "${BENCH[@]}" 2>&1 | tee "$OUT/gpu-bench.log"
log "benchmark exit status ${PIPESTATUS[0]}"
# the DSA model's folder as gpu_bench.py finds it (common.model_folder): measured only if already built
DSA_BUILT=$(timeout 60 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from common import model_folder; \
print(int((model_folder('dsa', False) / 'model.safetensors').exists()))" 2>/dev/null || echo 0)
if [ "${#BENCH_DSA[@]}" -gt 0 ] && [ "$DSA_BUILT" != 1 ]; then
  log "DSA benchmark: not run (its model is not built in benchmarks/models; building it would take T_BENCH_DSA)"
elif [ "${#BENCH_DSA[@]}" -gt 0 ]; then
  log "benchmark, DSA model: ${BENCH_DSA[*]}"
  timeout -k 10 "$T_BENCH_DSA" python3 benchmarks/gpu_bench.py "${BENCH_DSA[@]}" 2>&1 | tee "$OUT/gpu-bench-dsa.log"
  log "DSA benchmark exit status ${PIPESTATUS[0]}"
fi
log "done; results in $OUT"
exit "$TEST_RC"

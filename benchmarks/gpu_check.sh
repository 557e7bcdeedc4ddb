#!/usr/bin/env bash
# GPU check, in one short run (~3-5 min on one GPU; every part under `timeout`, so it always ends and
# keeps what it has): the machine and versions, the GPU tests, then the GPU benchmark (mlaserve vs
# transformers, bf16, standard model). Run from the repository root:
#
#     bash benchmarks/gpu_check.sh            # results in $OUT, default benchmarks/results
#
# Python wheels in a .whl/ folder at the root (for a machine without a package index) are installed
# into /tmp/site first. Without a GPU the tests skip and the benchmark runs a --quick CPU smoke test.
# Exit status: that of the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T_TESTS="${T_TESTS:-150}"  # seconds for the tests
T_BENCH="${T_BENCH:-180}"  # seconds for the benchmark
START=$(date +%s)
log() { echo "[gpu_check +$(($(date +%s) - START))s] $*"; }

{
  log "machine"
  date -u
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  nproc
  free -g 2>/dev/null | head -2
} >"$OUT/gpu-env.txt" 2>&1

if compgen -G ".whl/*.whl" >/dev/null; then
  log "installing carried wheels into /tmp/site"
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
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
timeout 60 python3 - >>"$OUT/gpu-env.txt" 2>&1 <<'EOF'
import importlib, sys
import torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB")
for name in ["transformers", "safetensors", "tokenizers", "numpy", "huggingface_hub", "pytest", "xdist", "gguf", "fastapi", "pydantic", "mlaserve", "mlaserve.entrypoints.openai.server"]:
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", ""), getattr(m, "__file__", ""))
    except Exception as e:
        print(name, "NOT IMPORTABLE:", type(e).__name__, e)
EOF
cat "$OUT/gpu-env.txt"

# The GPU tests (test_cuda: cuda == cpu; the attention backends, also over cuda), then tests whose
# engines take device "auto" (= cuda on a GPU machine) against transformers or each other.
TESTS=(tests/gpu/test_cuda.py tests/identities/test_attention_backends.py tests/unit/test_engine.py tests/models/test_model_vs_transformers.py
  tests/unit/test_sampler.py tests/models/test_fp8.py tests/models/test_embedded_model.py tests/kernels/test_kernels.py tests/identities/test_speculative.py
  tests/unit/test_spec_switch.py tests/models/test_quantize_at_load.py tests/gguf/test_gguf_quantized.py)
XDIST=()
if python3 -c "import xdist" 2>/dev/null; then XDIST=(-n 4); fi
log "tests: ${TESTS[*]}"
timeout -k 10 "$T_TESTS" python3 -m pytest "${TESTS[@]}" "${XDIST[@]}" -q -rs -p no:cacheprovider --durations=10 \
  -o junit_family=legacy --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log"
TEST_RC=${PIPESTATUS[0]}
log "tests exit status $TEST_RC"

if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  BENCH=(--device cuda --dtype bfloat16 --out "$OUT/gpu-bench.json")
else
  log "no CUDA device: the benchmark runs its --quick smoke test on the CPU"
  BENCH=(--device cpu --dtype float32 --quick --out "$OUT/gpu-bench-cpu-quick.json")
fi
log "benchmark: ${BENCH[*]}"
timeout -k 10 "$T_BENCH" python3 benchmarks/gpu_bench.py "${BENCH[@]}" 2>&1 | tee "$OUT/gpu-bench.log"
log "benchmark exit status ${PIPESTATUS[0]}"
log "done; results in $OUT"
exit "$TEST_RC"

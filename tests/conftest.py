from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

# Triton kernels run under Triton's interpreter where torch sees no GPU (mlaserve/platform/triton_runtime.py):
# set before any test imports a kernel module, since Triton reads it when a kernel is defined. A GPU run
# compiles them (TRITON_INTERPRET unset), unless the caller sets it.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# The suite is grouped by room (unit/, identities/, models/, kernels/, gguf/, server/, distributed/, gpu/,
# robustness/); the shared helpers (hf_models, gguf_helpers, server_process, ...) live here, and a test may
# import a helper of another test's module: every room is on sys.path, whatever order pytest collects in.
TESTS = Path(__file__).parent
ROOMS = ("unit", "identities", "models", "kernels", "gguf", "server", "distributed", "gpu", "robustness")
for _path in (TESTS, *(TESTS / room for room in ROOMS)):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
# Markers (pyproject.toml registers them): `gpu` for gpu/, `slow` for the rooms and files that start processes
# or sweep many inputs, `fixtures` for modules that read ../shared/fixtures. For development:
# `python -m pytest -m "not slow"`; CI runs everything.
SLOW_ROOMS = ("server", "distributed")
SLOW_FILES = (
    "test_fuzz_hf.py",
    "test_fuzz_gguf.py",
    "test_gguf_convert.py",
    "test_model_vs_transformers.py",
    "test_lifecycle.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        room = path.parent.name
        if room == "gpu":
            item.add_marker(pytest.mark.gpu)
        if room in SLOW_ROOMS or path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        module = getattr(item, "module", None)
        if module is not None and "fixture_dir" in vars(module):
            item.add_marker(pytest.mark.fixtures)


# dtype="auto" picks bfloat16 on CPUs with AVX512-BF16/AMX (mlaserve/config/cpu.py): the suite runs the exact
# float32 default on every machine (also in the processes it starts), and tests of that choice set both values.
os.environ["MLASERVE_FAST_BF16"] = "0"
os.environ["MLASERVE_AMX_INT8"] = "0"  # the same for prefill_matmul="auto"'s int8 tiles
os.environ["MLASERVE_INT8_ROWS"] = "0"  # and its int8 row kernels on CPUs without the tiles
os.environ["MLASERVE_INT16_ROWS"] = "0"  # and activations="auto"'s int16 products (tests ask for them by name)

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"

# Engine logits against an fp32 reference (transformers, or transformers on a file's dequantized weights) on the
# tiny test models: both sides round every op to fp32 (unit roundoff 6e-8), in a different order, through 2-4
# layers of O(1) random weights to logits of std ~1 and |max| ~5. Measured max |diff| over these models, paths
# and fixtures: 1.1e-6 to 5.4e-6. 1e-5 is about twice the worst; a real slip shows above it: building the
# q_a / kv_a latent norms with rms_norm_eps (1e-5 on the GLM models) instead of transformers' 1e-6 moves the
# logits by 4.6e-5 to 4.9e-5.
FP32_LOGITS_TOL = 1e-5


def skip_unless_triton_runs(device: str) -> None:
    """Skip a Triton case on a device where its kernels cannot run: CPU tensors need the interpreter, which this
    conftest turns on only where torch sees no GPU (a GPU run compiles, and takes the CUDA cases)."""
    from mlaserve.platform.triton_runtime import triton_mode

    mode = triton_mode(device)
    if mode.mode is None:
        pytest.skip(f"Triton kernels do not run on {device} here: {mode.reason}")


def fp32_logits_tol(ref) -> float:
    """FP32_LOGITS_TOL for logits up to |max| 8; rounding is relative, so larger logits get a proportionally
    larger bound. v3_tied's tied std-1 embeddings give |max| 62 (std 8.5): there the engine is 1.8e-5 from
    transformers (2.3e-5 on int8 / int4 weights quantized at load), whose own fp32 run is 2.0e-5 from fp64;
    the bound is 7.7e-5."""
    return FP32_LOGITS_TOL * max(1.0, ref.abs().max().item() / 8)


def compare_logits(got, ref) -> tuple[float, float]:
    """(max |got - ref|, top-1 agreement), printed so that a run with -s shows the measured error."""
    diff = (got - ref).abs().max().item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"max |logit diff| {diff:.2e}, top-1 {top1:.3f}")
    return diff, top1


def finishes_within(timeout: float, fn, *args, **kwargs):
    """fn(...) in a daemon thread: its result, or its exception raised here. Fails if it has not returned within
    `timeout` s: a bound that turns a hang into a failure, not a claim about speed (keep it generous)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 -- handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {timeout} s (a hang)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def fixture_dir(name: str) -> Path:
    """A folder of ../shared/fixtures/, or skip naming it (a user's clone has no shared/)."""
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f"../shared/fixtures/{name} not found (the shared fixtures folder is absent)")
    return path


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """kind -> (folder, transformers model); each tiny model is built once per session."""
    from hf_models import save_hf_model

    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            folder = tmp_path_factory.mktemp(kind)
            cache[kind] = (folder, save_hf_model(kind, folder))
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def embedded_server():
    """One `mlaserve serve` on the embedded model with the default options, shared by the server test files
    that only send it requests (no options, metrics, logs or shutdown of their own): each start is an
    interpreter, a torch import and a model load, ~5 s on 2 cores. It must still exit cleanly."""
    from server_process import ServerProcess

    srv = ServerProcess()
    yield srv
    assert srv.stop() == 0, srv.logs()


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny test models are dominated by per-op overhead, where one thread is fastest and immune
    to another process holding the second core (two threads then slow every op several-fold)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

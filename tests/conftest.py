from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# dtype="auto" picks bfloat16 on CPUs with AVX512-BF16/AMX (mlaserve/config/cpu.py): the suite runs the exact
# float32 default on every machine (also in the processes it starts), and tests of that choice set both values.
os.environ["MLASERVE_FAST_BF16"] = "0"

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"


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


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny test models are dominated by per-op overhead, where one thread is fastest and immune
    to another process holding the second core (two threads then slow every op several-fold)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

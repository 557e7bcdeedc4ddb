"""kv_prefault: the KV pool is resident from the start instead of page by page as rows are first written.

The cache tensors are zero pages of their own memory maps (cache/model_cache.py `_zeros`), so without the option a pool costs
almost nothing until requests write to it, and a soak's RSS rises for minutes as traffic walks the pool
(benchmarks/README.md). With it every byte is written once at allocation. Measured here as the growth of
this process's RSS over a 96 MiB pool (12 layers x 4096 rows x 512 fp32 values): ~96 MiB with the option,
~0 without. Bounds: >= 90% of the pool with it (what the allocator may have had resident already is the
slack), <= 25% without (room for unrelated allocations of the test process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hf_models import make_config

from mlaserve.config.engine import ConfigError, make_options, resolve
from mlaserve.config.model import ModelConfig

POOL_MIB = 12 * 256 * 16 * 512 * 4 / 2**20  # 96 MiB: 256 pages x 16 tokens per layer


_MEASURE = """
import sys
from pathlib import Path
import torch

from mlaserve.cache.model_cache import ModelCache
from mlaserve.config.layer_kinds import LayerKind, StateSpec


def rss_mib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

layers = tuple(LayerKind(i, "mla", None, (StateSpec("latent", 512),)) for i in range(12))
before = rss_mib()
cache = ModelCache(layers, num_pages=256, page_size=16, dtype=torch.float32, prefault=sys.argv[1] == "1")
grown = rss_mib() - before
zero = all(bool((t == 0).all()) for s in cache.layers for t in s.tensors.values())
print(grown, zero)
"""


@pytest.mark.parametrize("prefault", [True, False])
def test_prefault_makes_the_pool_resident(prefault):
    """Measured in a fresh interpreter: in the test process an earlier test may have turned on the
    process-wide malloc tuning (platform/allocator.py), after which a large calloc can reuse memory that is
    already resident, and the growth would say nothing about the option."""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc/self/status")
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, "1" if prefault else "0"], capture_output=True, text=True, check=True
    ).stdout.split()
    grown, zero = float(out[0]), out[1] == "True"
    if prefault:
        assert grown >= 0.9 * POOL_MIB, f"RSS +{grown:.1f} MiB for a {POOL_MIB:.0f} MiB pool"
    else:
        assert grown <= 0.25 * POOL_MIB, f"RSS +{grown:.1f} MiB for an untouched {POOL_MIB:.0f} MiB pool"
    assert zero  # still zero


def test_engine_option_reaches_the_config():
    model = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    assert resolve(model, make_options(kv_prefault=True), False).cache.kv_prefault is True
    assert resolve(model, make_options(), False).cache.kv_prefault is False
    with pytest.raises(ConfigError, match="kv_prefault must be a bool"):
        resolve(model, make_options(kv_prefault="yes"), False)

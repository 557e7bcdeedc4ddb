"""The memory of page-boundary snapshots (Kimi-Linear's KDA states; GLM-5.3-Flash's, DeepSeek-V4's rings alike):
with prefix caching on, every page of the pool keeps a snapshot row of each snapshotted request state, hundreds of
times the page's own rows on a hybrid model. Two guarantees are held here:

- nothing is touched at start: the snapshot rows and the request-state slots are zero pages that become resident
  only where written (cache/model_cache.py `_zeros`), so an engine's resident memory at start is what it uses.
  Measured with mincore(2) over each tensor's own memory (the kernel's answer, not our accounting); kv_prefault
  is the control that makes every page resident, so the measurement is shown to see residency.
- the default pool is bounded: a stack that keeps snapshots gets at most config/engine.py
  DEFAULT_SNAPSHOT_POOL_GIB of cache, rows and snapshot rows counted (a rows-only stack keeps 16 x 2048 tokens),
  and the provenance states pages, the bytes of a page's rows and of its snapshots, and the total. The shape
  is the Kimi-Linear-shaped stack the defect was found on (3 KDA + 1 MLA, hidden 2304, 32 KDA heads x 128):
  12.9 GiB of snapshots before the bound, allocated by torch.zeros at start.
"""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch
from kimi_linear_models import RAW_CONFIG

from mlaserve.cache.model_cache import ModelCache
from mlaserve.config.cache_pool import DEFAULT_SNAPSHOT_POOL_GIB
from mlaserve.config.engine import EngineOptions, resolve
from mlaserve.config.layer_kinds import declare_layers
from mlaserve.config.model import ModelConfig

K, M = "linear_attention", "full_attention"
SHAPED = RAW_CONFIG | dict(  # the Kimi-Linear-shaped 4-layer stack of the defect: 3 KDA + 1 MLA
    hidden_size=2304,
    intermediate_size=64,
    num_attention_heads=32,
    num_key_value_heads=32,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    layer_types=[K, K, K, M],
    linear_num_heads=32,
    linear_head_dim=128,
)
ROWS = 16 * 2304  # a 16-token page of the MLA layer's fp32 latent rows [512 | 64]
SNAPSHOT = 3 * (32 * 128 * 128 * 4 + 3 * 32 * 128 * 3 * 4)  # per KDA layer: recurrent [H, d, d] + conv [3, W, K - 1]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def resident_fraction(t: torch.Tensor) -> float:
    """The fraction of the memory pages under t's bytes that are resident (mincore(2)); the partial pages at
    either end are counted, so a tensor of a few pages reads a little above zero."""
    start, n = t.data_ptr(), t.numel() * t.element_size()
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    pages = -(-(start + n - first) // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    if _libc.mincore(first, pages * mmap.PAGESIZE, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec.raw) / pages


def _config(**kw):
    return resolve(ModelConfig.from_hf(SHAPED), EngineOptions(**kw), has_indexer_weights=False)


def _num_pages_source(cfg) -> str:
    return next(s.source for s in cfg.provenance if s.name == "num_pages")


def test_the_default_pool_counts_the_snapshots_and_states_them():
    cfg = _config()
    budget = DEFAULT_SNAPSHOT_POOL_GIB * 2**30
    pages = cfg.cache.num_pages
    assert pages == budget // (ROWS + SNAPSHOT) == 634
    source = _num_pages_source(cfg)
    assert f"{pages} pages x ({ROWS} bytes of rows + {SNAPSHOT} bytes of page-boundary snapshots)" in source, source
    # the cache the runner allocates from this config holds what the provenance states (virtual memory only)
    kinds = declare_layers(cfg.model, cfg.attention.sparse)
    cache = ModelCache(kinds, pages, cfg.cache.page_size, torch.float32, num_slots=4, snapshots=True)
    assert cache.measured_page_bytes() == (ROWS, SNAPSHOT)
    assert cache.measured_bytes_per_token() * cfg.cache.page_size == ROWS + SNAPSHOT
    assert pages * (ROWS + SNAPSHOT) <= budget < (pages + 1) * (ROWS + SNAPSHOT)


def test_without_snapshots_the_default_pool_is_unchanged():
    cfg = _config(enable_prefix_caching=False)
    assert cfg.cache.num_pages == 16 * 2048 // 16
    assert "snapshots" not in _num_pages_source(cfg)


def test_the_bound_keeps_one_sequence():
    """A budget smaller than one 2048-token sequence's pages still holds one (stated as such)."""
    big = dict(SHAPED, linear_num_heads=512)  # 16x the state: 105 MiB of snapshots per page
    cfg = resolve(ModelConfig.from_hf(big), EngineOptions(), has_indexer_weights=False)
    assert cfg.cache.num_pages == 2048 // 16, _num_pages_source(cfg)


@pytest.mark.parametrize("prefault", [False, True])
def test_snapshot_rows_and_slots_are_not_resident_at_start(prefault):
    """64 pages of the shaped stack: 431 MB of snapshot rows and 64 slots of 6.4 MiB, nothing resident until
    written; kv_prefault (the control) makes all of it resident."""
    cfg = _config(num_pages=64)
    kinds = declare_layers(cfg.model, cfg.attention.sparse)
    cache = ModelCache(kinds, 64, 16, torch.float32, num_slots=64, snapshots=True, prefault=prefault)
    tensors = [t for pair in cache.snapshot_pairs() for t in pair]
    assert len(tensors) == 12  # 3 KDA layers x (recurrent, conv) x (slots, snapshot rows)
    for t in tensors:
        frac = resident_fraction(t)
        assert (frac == 1.0) if prefault else (frac < 0.01), (tuple(t.shape), frac)
    if not prefault:  # a written snapshot row becomes resident, and only it (or the huge pages around it)
        _, snap = cache.snapshot_pairs()[0]
        snap[5].fill_(1.0)
        row = snap[0].numel() * snap.element_size()
        bound = (row + 2 * 2**21) / (snap.numel() * snap.element_size())  # two 2 MiB huge pages at most
        assert 0.0 < resident_fraction(snap) <= bound


def test_a_default_engine_keeps_its_snapshots_untouched_at_start(tmp_path):
    """A tiny Kimi-Linear with a large pool (20,000 pages: 160 MiB of snapshot rows): after the engine starts
    nothing of the snapshot rows or the slots is resident; a request then makes its own pages' rows resident."""
    pytest.importorskip("transformers")
    from kimi_linear_models import save_hf_kimi

    from mlaserve import LLM, SamplingParams

    save_hf_kimi("kda_mla_kda", tmp_path)
    llm = LLM(str(tmp_path), num_pages=20000)
    cache = llm.runner.cache
    assert cache.keeps_snapshots
    pairs = cache.snapshot_pairs()
    for _, snap in pairs:
        assert resident_fraction(snap) < 0.01, tuple(snap.shape)
    # the footprint stated where the server says it is ready: pages x (rows + snapshots of a page)
    from mlaserve.entrypoints.openai.server import _ready

    rows, snaps = cache.measured_page_bytes()
    assert rows > 0 and snaps > 0
    assert f"cache pool 20000 pages x ({rows} bytes of rows + {snaps} bytes" in _ready(llm, "k", "h", 1)
    llm.generate([list(range(1, 40))], SamplingParams(max_tokens=2, temperature=0.0))
    # 39 prompt tokens reach two page boundaries: two snapshot rows of 20,001 written
    _, snap = pairs[0]
    assert 0.0 < resident_fraction(snap) < 0.01

"""gguf_mmap: a GGUF's kept blocks are views of a read-only shared map of the file (no copy at load), the
copy path (gguf_mmap=False) gives the same logits bit for bit (same blocks, same kernels), and a second
process on the same file reads the first one's physical pages (smaps byte counts, not timings)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf_helpers import need_fixtures

ROOT = Path(__file__).resolve().parents[2]
IDS = list(range(3, 43))


def _file(model: str, kind: str) -> Path:
    path = need_fixtures() / model / f"model-{kind}.gguf"
    if not path.is_file():
        pytest.skip(f"fixture {path.name} of {model} not present")
    return path


def _maps(path: Path, shared_only: bool) -> list[tuple[int, int]]:
    """This process's address ranges mapping `path` (shared_only: the read-only shared maps, perms r--s)."""
    real, out = os.path.realpath(path), []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and os.path.realpath(fields[5]) == real and (not shared_only or fields[1][3] == "s"):
                out.append(tuple(int(x, 16) for x in fields[0].split("-")))
    return out


def _storages(model) -> dict[int, tuple[str, int]]:
    """data_ptr -> (first parameter name, bytes) for each storage of the model's parameters and buffers."""
    out: dict[int, tuple[str, int]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        s = t.untyped_storage()
        out.setdefault(s.data_ptr(), (name, s.nbytes()))
    return out


_HOLDERS = ("weight", "gate_proj", "up_proj", "down_proj", "k_b", "v_b")  # the kept holders' block tensors


@pytest.mark.fixtures
@pytest.mark.parametrize("kind", ["q8_0", "q4_k_m"])
def test_mapped_equals_copied_bitwise(kind):
    """Both paths read the same blocks with the same kernels, so the logits are equal bit for bit (no bound:
    any difference is a different byte read). Break check: reading the shared map one byte further
    (GGUFShard.view with offset + 1) makes this fail."""
    from mlaserve import LLM

    path = _file("ds3", kind)
    mapped, copied = LLM(str(path), gguf_mmap=True), LLM(str(path), gguf_mmap=False)
    assert mapped.config.kernels.gguf_mmap is True and copied.config.kernels.gguf_mmap is False
    recorded = {s.name: s for s in copied.config.provenance}["gguf_mmap"]
    assert recorded.value is False and "user option" in recorded.source
    a, b = mapped.prompt_logits(IDS), copied.prompt_logits(IDS)
    assert torch.equal(a, b), f"max |diff| {(a - b).abs().max().item()}"


@pytest.mark.fixtures
def test_kept_blocks_are_views_of_the_file():
    """With gguf_mmap every kept holder (the routed experts' gate, up and down stacks included) lies inside the
    read-only shared map of the file; without it none does. Break check: BlockSource.in_place returning False
    fails the first half; GGUFExperts.checkpoint_slots giving slices of one fused stack (the copied gate_up
    layout) fails it for the gate_proj / up_proj stacks."""
    from mlaserve import LLM
    from mlaserve.quant.ggml_heads import GGUFHeads
    from mlaserve.quant.ggml_linear import GGUFExperts, GGUFLinear

    path = _file("ds3", "q4_k_m")
    for on in (True, False):
        llm = LLM(str(path), gguf_mmap=on)
        ranges = _maps(path, shared_only=True)
        model = llm.runner.model
        inside = {n for p, (n, _) in _storages(model).items() if any(lo <= p < hi for lo, hi in ranges)}
        holders = [
            (f"{m}.{attr}", getattr(mod, attr))
            for m, mod in model.named_modules()
            for attr in _HOLDERS
            if isinstance(mod, (GGUFLinear, GGUFExperts, GGUFHeads)) and hasattr(mod, attr)
        ]
        assert any(isinstance(m, GGUFExperts) for m in model.modules()) and any(
            isinstance(getattr(m, "kept_heads", None), GGUFHeads) for m in model.modules()
        ), "the fixture should exercise expert stacks and kept heads"
        for name, t in holders:
            in_map = any(lo <= t.data_ptr() < hi for lo, hi in ranges)
            assert in_map == on, (name, on, in_map)
        if not on:
            assert not inside


_CHILD = r"""
import json, os, sys
from mlaserve import LLM
path, ids = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(path, gguf_mmap=sys.argv[3] == "on")
llm.prompt_logits(ids)
real, totals, key = os.path.realpath(path), {}, None
with open("/proc/self/smaps") as f:
    for line in f:
        head = line.split()
        if "-" in head[0] and len(head) >= 5:
            key = len(head) >= 6 and os.path.realpath(head[5]) == real and head[1][3] == "s"
        elif key and len(head) == 3 and head[2] == "kB":
            totals[head[0].rstrip(":")] = totals.get(head[0].rstrip(":"), 0) + int(head[1]) * 1024
print(json.dumps(totals))
"""


def _child_smaps(path: Path, mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), json.dumps(IDS), mode],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.fixtures
def test_second_process_shares_the_pages():
    """This process holds an engine on the file and has run the prompt; a second process then loads the same
    file and runs the same prompt. Every page of the file it has resident is one this process maps too:
    its shared map's Rss is (nearly) all Shared_Clean, nothing of it is written (no Private_Dirty, no
    Anonymous), and its Pss counts each shared page half (two mappers).
    The figures are bytes from the child's /proc/self/smaps. Break check: mapping privately and copying
    (gguf_mmap=False in the child) leaves no shared map at all (Rss 0), which fails the first assertion."""
    from mlaserve import LLM

    path = _file("ds3", "q8_0")
    gc.collect()  # engines of earlier tests would be third mappers
    llm = LLM(str(path), gguf_mmap=True)
    llm.prompt_logits(IDS)
    here = _maps(path, shared_only=True)
    assert here, "this process should map the file read-only and shared"
    child = _child_smaps(path, "on")
    weights = sum(n for p, (name, n) in _storages(llm.runner.model).items() if any(lo <= p < hi for lo, hi in here))
    # the child's resident file pages: at least the bytes every prompt reads (the linears and heads)
    assert child.get("Rss", 0) >= 0.5 * weights, (child, weights)
    # Shared: mapped by this process too. Not all of them: a page fault maps up to 16 neighbouring pages that
    # happen to be in the page cache (the kernel's fault-around), so the two resident sets differ at their
    # edges (measured: 17 of 312 pages private in the child). A copy would be Anonymous / Private_Dirty.
    assert child["Shared_Clean"] >= 0.9 * child["Rss"], child
    assert child.get("Private_Dirty", 0) == 0 and child.get("Anonymous", 0) == 0, child
    # Pss: a shared page counts 1/2 in each of the two mappers (smaps rounds per map: allow 16 pages)
    assert child["Pss"] <= child["Shared_Clean"] / 2 + child.get("Private_Clean", 0) + 16 * 4096, child
    off = _child_smaps(path, "off")
    assert off.get("Rss", 0) == 0, f"the copy path should not keep a shared map: {off}"


def _present_pages(lo: int, hi: int) -> tuple[int, int]:
    """(present, total) pages wholly inside [lo, hi), from /proc/self/pagemap's present bit (bit 63)."""
    first, last = -(-lo // 4096), hi // 4096
    if last <= first:
        return 0, 0
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first) * 8)
    words = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]
    return sum(w >> 63 for w in words), len(words)


@pytest.mark.fixtures
def test_copied_bytes_leave_no_resident_pages():
    """A tensor the loader copies out of the shared map (here each expert's gate slice, as a holder whose slot
    is not the whole stored tensor copies it: a tensor-parallel rank's columns, a float model's fused stack) has its pages
    dropped from this process once copied (madvise), so it is not resident twice (copy + file page).
    Checked right after the release, by the present bit of each page wholly inside the tensor (no fault
    in between: in a whole load, a nearby fault may map neighbours back, the kernel's fault-around).
    Break check: BlockSource.release skipping tensors of the mapped file, or GGUFFile.release dropping
    only the private map's pages, leaves every page present."""
    from mlaserve.gguf.read.checkpoint import load_gguf
    from mlaserve.quant.ggml_plan import BlockSource

    ck = load_gguf(_file("ds3", "q8_0"))
    names = [n for n in ck.tensors.names() if ".mlp.experts." in n and ".gate_proj." in n]
    source = BlockSource(ck.tensors, frozenset(names), mapped=True)
    present = total = 0
    for name in names:
        blocks = source.get(name)
        lo = blocks.data_ptr()
        assert int(blocks.sum()) >= 0  # read every byte: the pages are present now
        before, t = _present_pages(lo, lo + blocks.numel())
        assert before == t
        source.release(name)
        p, t = _present_pages(lo, lo + blocks.numel())
        present, total = present + p, total + t
    assert total >= 8, "the fixture's experts should span whole pages"
    assert present == 0, f"{present} of {total} pages of copied expert slices still resident"


@pytest.mark.fixtures
def test_the_option_is_checked_and_recorded():
    """A non-bool is refused naming the option; with gguf_weights="dequantized" there are no kept blocks to map,
    and the record says so (and nothing lies in a shared map)."""
    from mlaserve import LLM
    from mlaserve.config.model import ConfigError

    path = _file("ds3", "q8_0")
    with pytest.raises(ConfigError, match="gguf_mmap must be a bool"):
        LLM(str(path), gguf_mmap="yes")
    dense = LLM(str(path), gguf_weights="dequantized")
    recorded = {s.name: s for s in dense.config.provenance}["gguf_mmap"]
    assert recorded.value is False and "dequantized" in recorded.source
    assert dense.config.kernels.gguf_mmap is False

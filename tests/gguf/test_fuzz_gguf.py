"""Bounded, seeded GGUF mutator: truncations, byte flips in header and metadata, bad lengths and
counts, offsets out of range or overlapping, retyped or reshaped tensors, non-finite scales and
values, edited metadata numbers. Every mutant either fails with a GGUFError / ValueError naming the
file (and its key or tensor), or loads with check_tensors and gives the original file's logits and
tokens exactly. Nothing else: no other exception type, no NaN logits, no silently changed model."""

from __future__ import annotations

import random
import struct
from collections import Counter

import numpy as np
import pytest
import torch
from robustness_helpers import patched, tiny_model, walk_header

from mlaserve import LLM, SamplingParams

SEED, N_MUTANTS = 17, 110


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return tiny_model(tmp_path_factory)[1].read_bytes()


def _data_start(h) -> int:
    return -(-h.end // 32) * 32


def _tensor_rel(data, t) -> int:
    return struct.unpack_from("<Q", data, t.offset_at)[0]


def _mutate(data: bytes, h, rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(
        [
            "truncate",
            "flip_header",
            "flip_metadata",
            "string_length",
            "count",
            "offset_range",
            "offset_overlap",
            "retype",
            "reshape",
            "nan_scale",
            "nonfinite_value",
            "metadata_number",
        ]
    )
    if kind == "truncate":
        return kind, data[: rng.randrange(0, len(data))]
    if kind == "flip_header":
        at = rng.randrange(0, h.end)
        return kind, patched(data, at, bytes([data[at] ^ (1 << rng.randrange(8))]))
    if kind == "flip_metadata":
        kv = rng.choice(list(h.kvs.values()))
        at = kv.value_at + rng.randrange(0, 4)
        return kind, patched(data, at, bytes([rng.randrange(256)]))
    if kind == "string_length":  # a key's length field
        kv = rng.choice(list(h.kvs.values()))
        at = kv.type_at - len(kv.key) - 8
        return kind, patched(data, at, struct.pack("<Q", rng.choice([0, 2**63, len(data), 10**6])))
    if kind == "count":
        at = rng.choice([h.n_tensors_at, h.n_kv_at])
        return kind, patched(data, at, struct.pack("<Q", rng.choice([0, 1, 2**63, 2**64 - 1, 5000])))
    t = rng.choice(h.tensors)
    if kind == "offset_range":
        value = rng.choice([len(data), 2**63, _tensor_rel(data, t) + rng.choice([1, 32, 4096])])
        return kind, patched(data, t.offset_at, struct.pack("<Q", value))
    if kind == "offset_overlap":
        other = rng.choice(h.tensors)
        return kind, patched(data, t.offset_at, data[other.offset_at : other.offset_at + 8])
    if kind == "retype":
        return kind, patched(data, t.type_at, struct.pack("<I", rng.choice([0, 1, 2, 8, 12, 30, 4, 99])))
    if kind == "reshape":
        at = rng.choice(t.ne_at)
        return kind, patched(data, at, struct.pack("<Q", rng.choice([0, 1, 31, 32, 256, 2**40])))
    if kind == "nan_scale":
        q8 = [x for x in h.tensors if struct.unpack_from("<I", data, x.type_at)[0] == 8]
        t = rng.choice(q8)
        block = rng.randrange(0, 4)
        value = np.float16(rng.choice([np.nan, np.inf, -np.inf])).tobytes()
        return kind, patched(data, _data_start(h) + _tensor_rel(data, t) + 34 * block, value)
    if kind == "nonfinite_value":
        f32 = [x for x in h.tensors if struct.unpack_from("<I", data, x.type_at)[0] == 0]
        t = rng.choice(f32)
        value = np.float32(rng.choice([np.nan, np.inf])).tobytes()
        return kind, patched(data, _data_start(h) + _tensor_rel(data, t) + 4 * rng.randrange(0, 8), value)
    numeric = [kv for kv in h.kvs.values() if kv.vtype in (4, 6)]
    kv = rng.choice(numeric)
    if kv.vtype == 4:
        payload = struct.pack("<I", rng.choice([0, 1, 2, 3, 7, 1000, 2**32 - 1]))
    else:
        payload = struct.pack("<f", rng.choice([0.0, -1.0, float("nan"), float("inf"), 1e-30, 1e30]))
    return kind, patched(data, kv.value_at, payload)


IDS = [5, 6, 7, 8]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _reference(path) -> tuple[torch.Tensor, list[int]]:
    llm = LLM(str(path))
    return llm.prompt_logits(IDS), llm.generate([IDS], GREEDY)[0].outputs[0].token_ids


def _run(path, want: tuple[torch.Tensor, list[int]]) -> str:
    """Load with check_tensors and look at the logits; the outcome, or raise on a forbidden result. A mutant
    that loads must be the original model: with this seed each one that loads changes only bytes that do not
    reach the logits (a metadata value that is read and found equal, or not read at all), so anything but the
    original's logits, bit for bit, is a corruption the loader let through."""
    try:
        llm = LLM(str(path), check_tensors=True)
    except ValueError as e:  # GGUFError, ConfigError and WeightError are ValueErrors
        assert path.name in str(e), f"error does not name the file: {e}"
        return "rejected: " + type(e).__name__
    ids = IDS[: llm.engine.max_model_len - 1]
    if not ids:
        return "loaded (no room for a prompt)"
    logits = llm.prompt_logits(ids)
    assert torch.isfinite(logits).all(), "non-finite logits from a model that passed check_tensors"
    diff = (logits - want[0][: len(ids)]).abs().max().item()
    assert torch.equal(logits, want[0][: len(ids)]), f"loaded, but the logits moved by {diff:.3g}"
    out = llm.generate([ids], GREEDY)[0].outputs[0]
    assert out.finish_reason in ("length", "stop"), out
    if ids == IDS:
        assert out.token_ids == want[1], (out.token_ids, want[1])
    return "loaded, the original logits"


def test_gguf_mutants(original, tmp_path):
    h, rng, outcomes, by_kind = walk_header(original), random.Random(SEED), Counter(), Counter()
    path = tmp_path / "mutant.gguf"
    path.write_bytes(original)
    want = _reference(path)
    for i in range(N_MUTANTS):
        kind, data = _mutate(original, h, rng)
        path.write_bytes(data)
        try:
            outcome = _run(path, want)
        except AssertionError as e:
            raise AssertionError(f"mutant {i} ({kind}): {e}") from e
        except Exception as e:  # any other exception type is a finding
            raise AssertionError(f"mutant {i} ({kind}): {type(e).__name__}: {e}") from e
        outcomes[outcome] += 1
        by_kind[(kind, outcome.split(":")[0])] += 1
    print(f"\nGGUF fuzz, {N_MUTANTS} mutants (seed {SEED}): {dict(outcomes)}")
    print("  by mutation: " + ", ".join(f"{k}/{o}: {n}" for (k, o), n in sorted(by_kind.items())))
    assert sum(outcomes.values()) == N_MUTANTS
    assert any(o.startswith("rejected") for o in outcomes) and any(o.startswith("loaded") for o in outcomes)

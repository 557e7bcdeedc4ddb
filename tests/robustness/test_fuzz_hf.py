"""Bounded, seeded Hugging Face folder mutator: config.json values retyped, zeroed, negated,
non-finite or removed, the file made a list or broken JSON; tensors dropped, added, reshaped,
retyped, renamed or given NaN/Inf. Every mutant either fails with a ValueError (ConfigError,
WeightError) naming a config key, a tensor or the file, or loads with check_tensors and gives the
original folder's logits and tokens exactly, or, for a valid other configuration, transformers' logits on the
same folder."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections import Counter

import pytest
import torch
from conftest import fp32_logits_tol
from hf_models import hf_logits
from robustness_helpers import tiny_model
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams

SEED, N_MUTANTS = 23, 70
VALUES = [None, -1, 0, 1, 2, 3, 7, 1000, "7", 7.5, True, [], {}, math.nan, math.inf, -math.inf, 1e-9]


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return tiny_model(tmp_path_factory)[0]


def _mutate_config(folder, rng: random.Random) -> tuple[str, str]:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    roll = rng.random()
    if roll < 0.05:
        path.write_text(json.dumps(list(cfg.items())))
        return "config_list", "config.json"
    if roll < 0.1:
        path.write_text(path.read_text()[: rng.randrange(1, 200)])
        return "config_broken_json", "config.json"
    key = rng.choice(sorted(cfg))
    value = rng.choice(VALUES)
    if value is None:
        cfg.pop(key)
    elif key == "rope_parameters" and rng.random() < 0.7:
        cfg[key] = dict(cfg[key], rope_theta=value)
    else:
        cfg[key] = value
    path.write_text(json.dumps(cfg))
    return "config_value", key


def _mutate_tensors(folder, rng: random.Random) -> tuple[str, str]:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    name = rng.choice(sorted(tensors))
    t = tensors[name]
    kind = rng.choice(["drop", "add", "reshape", "retype", "rename", "nonfinite"])
    if kind == "drop":
        tensors.pop(name)
    elif kind == "add":
        tensors[name.replace("weight", "extra")] = torch.zeros(2)
    elif kind == "reshape":
        tensors[name] = t.reshape(-1) if t.dim() > 1 else t[:-1].clone()
    elif kind == "retype":
        tensors[name] = t.to(rng.choice([torch.float16, torch.bfloat16, torch.int32]))
    elif kind == "rename":
        tensors[name.replace("layers.1", "layers.7").replace("model.", "model.x.", 1)] = tensors.pop(name)
    else:
        t = t.clone()
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([math.nan, math.inf, -math.inf])
        tensors[name] = t
    save_file(tensors, str(path))
    return "tensor_" + kind, name


def _named(message: str, folder) -> bool:
    cfg_keys = set(json.loads((folder.parent / "original-keys.json").read_text()))
    return (
        any(k in message for k in cfg_keys)
        or "config.json" in message
        or "model.safetensors" in message
        or "model." in message  # a tensor name
        or "lm_head" in message
        or "tokenizer.json" in message
    )


IDS = [5, 6, 7, 8]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _reference(folder) -> tuple[torch.Tensor, list[int]]:
    llm = LLM(str(folder))
    return llm.prompt_logits(IDS), llm.generate([IDS], GREEDY)[0].outputs[0].token_ids


def _transformers_logits(folder, ids: list[int]) -> torch.Tensor | None:
    """transformers (fp32, eager) on the mutant folder, or None where it does not load or run it."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
        return hf_logits(model, ids)
    except Exception:  # noqa: BLE001 -- transformers refusing a mutant is not what is tested here
        return None


def _run(folder, want: tuple[torch.Tensor, list[int]]) -> str:
    """A mutant that loads must be a model: the original one, bit for bit (a key the model does not read, or one
    set to the value it already implied), or, when the mutation is a valid other configuration (a rope_theta, a
    number of groups), the model transformers builds from the same folder, to fp32 rounding. With this seed 4 of
    the 6 that load are the original and 2 are other models (n_group 1, rope_theta 7); anything else is a
    corruption let through (norm_topk_prob [] was: read as false, a different model transformers refuses)."""
    try:
        llm = LLM(str(folder), check_tensors=True)
    except ValueError as e:  # ConfigError, WeightError
        assert _named(str(e), folder), f"error names no key, tensor or file: {e}"
        return "rejected: " + type(e).__name__
    ids = IDS[: llm.engine.max_model_len - 1]
    if not ids:
        return "loaded (no room for a prompt)"
    logits = llm.prompt_logits(ids)
    assert torch.isfinite(logits).all(), "non-finite logits from a model that passed check_tensors"
    out = llm.generate([ids], GREEDY)[0].outputs[0]
    assert out.finish_reason in ("length", "stop"), out
    if torch.equal(logits, want[0][: len(ids)]):
        if ids == IDS:
            assert out.token_ids == want[1], (out.token_ids, want[1])
        return "loaded, the original logits"
    ref = _transformers_logits(folder, ids)
    moved = (logits - want[0][: len(ids)]).abs().max().item()
    assert ref is not None, f"loaded, the logits moved by {moved:.3g}, and transformers does not load the folder"
    diff = (logits - ref).abs().max().item()
    assert diff <= fp32_logits_tol(ref), f"loaded, the logits moved by {moved:.3g}, {diff:.3g} from transformers"
    return "loaded, another model (= transformers)"


def test_hf_folder_mutants(original, tmp_path):
    rng, outcomes, by_kind = random.Random(SEED), Counter(), Counter()
    keys = list(json.loads((original / "config.json").read_text()))
    (tmp_path / "original-keys.json").write_text(json.dumps(keys))
    want = _reference(original)
    for i in range(N_MUTANTS):
        folder = tmp_path / "mutant"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(original, folder)
        kind, target = (_mutate_config if rng.random() < 0.6 else _mutate_tensors)(folder, rng)
        try:
            outcome = _run(folder, want)
        except AssertionError as e:
            raise AssertionError(f"mutant {i} ({kind} {target}): {e}") from e
        except Exception as e:  # any other exception type is a finding
            raise AssertionError(f"mutant {i} ({kind} {target}): {type(e).__name__}: {e}") from e
        outcomes[outcome] += 1
        by_kind[(kind, outcome.split(":")[0])] += 1
    print(f"\nHF folder fuzz, {N_MUTANTS} mutants (seed {SEED}): {dict(outcomes)}")
    print("  by mutation: " + ", ".join(f"{k}/{o}: {n}" for (k, o), n in sorted(by_kind.items())))
    assert any(o.startswith("rejected") for o in outcomes) and any(o.startswith("loaded") for o in outcomes)

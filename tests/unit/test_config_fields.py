"""Every config field is honoured or refused naming it: booleans are JSON booleans (a string "false" used to be
read as True), fields with a vocabulary take one of its values (topk_method "bogus", hidden_act "gelu" used to
load, the latter running SiLU), impossible values are refused at load (yarn factor 0 used to become 1,
max_position_embeddings 1 loaded), and inconsistent MoE layouts name the key instead of failing in a tensor."""

from __future__ import annotations

import pytest
from gguf_helpers import rewrite_gguf
from robustness_helpers import copy_folder, edit_config, tiny_model

from mlaserve import LLM
from mlaserve.config.model import ConfigError
from mlaserve.gguf.read.file import GGUFError


@pytest.fixture
def folder(tmp_path_factory, tmp_path):
    return copy_folder(tiny_model(tmp_path_factory)[0], tmp_path / "m")


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
        ({"attention_bias": "false"}, "attention_bias must be true or false, got 'false'"),
        ({"norm_topk_prob": 1}, "norm_topk_prob must be true or false, got 1"),
        ({"rope_interleave": "yes"}, "rope_interleave must be true or false"),
        ({"topk_method": "bogus"}, "topk_method 'bogus' is not supported"),
        ({"scoring_func": "relu"}, "scoring_func 'relu' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; one of \\('silu', 'swish'\\)"),
        ({"hidden_act": "bogus_act"}, "hidden_act 'bogus_act' is not supported"),
        ({"max_position_embeddings": 1}, "max_position_embeddings must be >= 2, got 1"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 0, "original_max_position_embeddings": 64}}, "factor must be a finite number > 0, got 0.0"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2, "original_max_position_embeddings": 64, "truncate": "no"}}, "truncate must be true or false"),
        ({"n_routed_experts": 0}, "are MoE layers .* but n_routed_experts is 0 or absent"),
        ({"first_k_dense_replace": 9}, "first_k_dense_replace=9 exceeds num_hidden_layers=3"),
    ],
)  # fmt: skip
def test_refused_naming_the_field(folder, changes, message):
    edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=message):
        LLM(str(folder))


def test_honoured_values_load_and_show_their_source(folder):
    edit_config(folder, hidden_act="swish", tie_word_embeddings=False, attention_bias=False)
    settings = {s.name: s for s in LLM(str(folder)).config.all_provenance()}
    assert settings["hidden_act"].value == "swish" and settings["hidden_act"].source == "config.json:hidden_act"
    cfg = folder / "config.json"
    edit_config(folder, hidden_act=None)
    assert {s.name: s for s in LLM(str(cfg.parent)).config.all_provenance()}["hidden_act"].source.startswith(
        "class default (silu"
    )


def test_gguf_bool_key_is_a_bool(tmp_path_factory, tmp_path):
    """expert_weights_norm stored as the string "false" used to be read as True (bool("false"))."""
    import gguf

    src = tiny_model(tmp_path_factory)[1]
    arch = gguf.GGUFReader(src).fields["general.architecture"].contents()
    key = f"{arch}.expert_weights_norm"
    bad = rewrite_gguf(src, tmp_path / "bad.gguf", set_keys={key: ("false", gguf.GGUFValueType.STRING)})
    with pytest.raises(GGUFError, match=f"metadata key '{key}' = 'false': must be a bool"):
        LLM(str(bad))
    ok = rewrite_gguf(src, tmp_path / "ok.gguf", set_keys={key: (False, gguf.GGUFValueType.BOOL)})
    assert LLM(str(ok)).config.model.moe.norm_topk_prob is False

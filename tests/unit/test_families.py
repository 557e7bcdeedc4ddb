"""The family registry (config/families): lookups, deltas, and that its defaults are transformers'."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mlaserve.config import families
from mlaserve.config.families import FAMILIES, by_model_type, gguf_readers


def test_lookup_by_model_type_and_alias():
    assert [f.name for f in FAMILIES] == [
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "glm_moe_dsa",
        "glm4_moe_lite",
        "deepseek_v4",
        "sarvam_mla",
        "kimi_k25",
        "longcat_flash",
        "kimi_linear",
        "glm5_next_text",
        "glm5_next",
    ]
    assert by_model_type("kimi_k2") is by_model_type("deepseek_v3")
    assert by_model_type("llama") is None
    assert families.model_types()[-1] == "kimi_k2"
    assert by_model_type("sarvam_mla").base is by_model_type("deepseek_v3")


def test_lookup_by_gguf_arch():
    assert families.gguf_arches() == ("deepseek2", "deepseek32", "glm-dsa", "kimi-linear")
    assert [f.name for f in gguf_readers("deepseek2")] == ["deepseek_v2", "deepseek_v3"]  # told apart by gating
    assert [f.name for f in gguf_readers("glm-dsa")] == ["glm_moe_dsa"]
    assert gguf_readers("llama") == ()
    # every MLA family's arch reads back as some family (glm4_moe_lite's as deepseek_v3); deepseek4 has its own
    # reader (gguf/read/deepseek_v4.py), not this lookup's; longcat_flash and glm5_next have no llama.cpp arch
    # at all (gguf_arch "")
    readable = [f for f in FAMILIES if f.reader == "mla" and f.gguf_arch]
    assert all(gguf_readers(f.gguf_arch) for f in readable)
    assert [f.name for f in FAMILIES if not f.gguf_arch] == ["longcat_flash", "glm5_next_text", "glm5_next"]
    assert [f.name for f in gguf_readers("kimi-linear")] == ["kimi_linear"]
    assert gguf_readers("deepseek4") == ()


def test_glm5_is_a_delta_on_v32():
    glm, v32 = by_model_type("glm_moe_dsa"), by_model_type("deepseek_v32")
    assert glm.base is v32 and v32.base is by_model_type("deepseek_v3")
    assert glm.is_dsa and glm.layer_kinds == v32.layer_kinds == "mla_dsa"
    assert glm.aliases == () and glm.rope_rule == v32.rope_rule
    changed = {k for k in glm.defaults if glm.defaults[k] != v32.defaults.get(k)}
    assert changed == {"rms_norm_eps", "n_group", "topk_group", "q_lora_rank", "index_n_heads"}
    with pytest.raises(TypeError):
        glm.defaults["n_group"] = 2  # frozen tables


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_defaults_are_the_reference_class_defaults(family):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoConfig.for_model(family.name)
    if family.text_config:  # a wrapper: its defaults are its text part's (and its own tie default)
        assert ref.tie_word_embeddings is family.tie_default
        ref = ref.text_config
    for key, value in family.defaults.items():
        assert getattr(ref, key) == value, key


def test_families_import_no_implementation():
    """A family file is plain data: it imports only the standard library and its own package."""
    folder = Path(families.__file__).parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mlaserve"):
                assert node.module.startswith("mlaserve.config.families"), (path.name, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("mlaserve") for a in node.names), path.name


def test_a_rule_the_readers_lack_is_refused():
    with pytest.raises(ValueError, match="scoring_func 'sqrtsoftplus'"):
        by_model_type("deepseek_v3").derive("deepseek_v4", scoring_func="sqrtsoftplus")

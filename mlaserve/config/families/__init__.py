"""The model families, one file each, and lookups over them (by config.json model_type, by GGUF
architecture). Adding a family: a file here (a `Family`, or a `derive` delta on a close one), its
entry in FAMILIES, and its tests.

For later families: a deepseek_v3 checkpoint under another name (sarvam_mla) is an alias; a
multimodal wrapper whose text part is a known type (kimi_k25) reads that part; families with other
layer kinds (DeepSeek-V4's compressed attention, linear-attention layers) declare them in
`layer_kinds` once config/layer_kinds.py knows them (`attention_kind` refuses a kind it does not).
A family whose config.json is not MLA-shaped names its own `reader` (DeepSeek-V4: config/deepseek_v4.py).
"""

from __future__ import annotations

from mlaserve.config.families.deepseek_v2 import DEEPSEEK_V2
from mlaserve.config.families.deepseek_v3 import DEEPSEEK_V3
from mlaserve.config.families.deepseek_v4 import DEEPSEEK_V4
from mlaserve.config.families.deepseek_v32 import DEEPSEEK_V32
from mlaserve.config.families.family import Family
from mlaserve.config.families.glm4_moe_lite import GLM4_MOE_LITE
from mlaserve.config.families.glm5_next import GLM5_NEXT, GLM5_NEXT_TEXT
from mlaserve.config.families.glm_moe_dsa import GLM_MOE_DSA
from mlaserve.config.families.kimi_k25 import KIMI_K25
from mlaserve.config.families.kimi_linear import KIMI_LINEAR
from mlaserve.config.families.longcat_flash import LONGCAT_FLASH
from mlaserve.config.families.sarvam_mla import SARVAM_MLA

__all__ = [
    "FAMILIES",
    "Family",
    "by_model_type",
    "gguf_arches",
    "gguf_readers",
    "model_types",
    "tokenizer_pre_names",
]

# The order is the one error messages list them in.
FAMILIES: tuple[Family, ...] = (
    DEEPSEEK_V2,
    DEEPSEEK_V3,
    DEEPSEEK_V32,
    GLM_MOE_DSA,
    GLM4_MOE_LITE,
    DEEPSEEK_V4,
    SARVAM_MLA,
    KIMI_K25,
    LONGCAT_FLASH,
    KIMI_LINEAR,
    GLM5_NEXT_TEXT,
    GLM5_NEXT,
)

_BY_TYPE = {f.name: f for f in FAMILIES} | {a: f for f in FAMILIES for a in f.aliases}


def by_model_type(model_type: str) -> Family | None:
    """The family of a config.json model_type (an alias included); None when unknown."""
    return _BY_TYPE.get(model_type)


def model_types() -> tuple[str, ...]:
    """Every model_type accepted: the families', then their aliases."""
    return tuple(f.name for f in FAMILIES) + tuple(a for f in FAMILIES for a in f.aliases)


def gguf_arches() -> tuple[str, ...]:
    """The GGUF architectures a file may have, in family order, each once."""
    return tuple(dict.fromkeys(f.gguf_arch for f in FAMILIES if f.gguf_reads_back))


def gguf_readers(arch: str) -> tuple[Family, ...]:
    """The families a GGUF file of `arch` may read back as (several when llama.cpp shares the arch)."""
    return tuple(f for f in FAMILIES if f.gguf_reads_back and f.gguf_arch == arch)


def tokenizer_pre_names() -> dict[str, str]:
    """llama.cpp's pre-tokenizer name by tokenizer hash, over every family's shipped tokenizers."""
    return {h: name for f in FAMILIES for h, name in f.tokenizer_pre.items()}

"""Family: everything the engine knows about one model family (a config.json `model_type`), in one
frozen object. The generic readers ask it instead of testing names: the config.json adapter
(config/model.py and config/mla_reader/), the GGUF metadata reader (gguf/read/config.py) and the converter
(gguf/convert/metadata.py, tokenizer.py). Plain data only: this module imports nothing of the
implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

SCORING_FUNCS = ("softmax", "sigmoid")
# The config.json readers: "mla" (config/mla_reader/, every MLA family) and "deepseek_v4" (config/deepseek_v4.py);
# each knows its own routers' scoring functions.
READERS = {"mla": SCORING_FUNCS, "deepseek_v4": ("sqrtsoftplus",)}
NEXTN_KEY_RULES = ("never", "if_set", "if_kept")


def frozen_map(values: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    """A read-only mapping, so that a family's tables cannot be edited after registration."""
    return MappingProxyType(dict(values or {}))


@dataclass(frozen=True, eq=False)  # one object per family: identity is equality
class Family:
    name: str  # config.json model_type
    hf_architecture: str  # transformers class written as `architectures` for a GGUF read back
    gguf_arch: str  # general.architecture llama.cpp writes for this family
    # Class defaults of the reference implementation (transformers 5.x) for optional fields.
    defaults: Mapping[str, Any] = field(default_factory=frozen_map)
    aliases: tuple[str, ...] = ()  # other model_type values read as this family (kimi_k2)
    base: Family | None = None  # the family this one is a delta on
    # The attention kind of its layers that have an indexer role, else "mla" (config/layer_kinds.py: attention_kind).
    layer_kinds: str = "mla"
    reader: str = "mla"  # which config.json reader builds its config (READERS)

    # --- config.json rules (config/mla_reader/) ------------------------------------------
    # "softmax": the V2 router (topk_method greedy | group_limited_greedy from the config;
    # transformers ignores norm_topk_prob). "sigmoid": + e_score_correction_bias, noaux_tc.
    scoring_func: str = "sigmoid"
    # Why the main rope is always interleaved (a family rule); None: config's rope_interleave.
    rope_rule: str | None = None
    default_theta: float = 10000.0  # rope_theta when the config gives none (transformers' default_theta)
    # Legacy config.json keys read as their current name (legacy -> current; both given and different
    # is an error), keys the reference drops (key -> why), and rope types read as another (type -> type).
    legacy_keys: Mapping[str, str] = field(default_factory=frozen_map)
    # The family's own names for fields the engine reads under another (transformers' attribute_map:
    # LongCat's ffn_hidden_size is intermediate_size), read like legacy keys and recorded as the family's names.
    own_keys: Mapping[str, str] = field(default_factory=frozen_map)
    dropped_keys: Mapping[str, str] = field(default_factory=frozen_map)
    rope_type_aliases: Mapping[str, str] = field(default_factory=frozen_map)
    # A multimodal wrapper: its config.json's `text_config` is a model of another family, whose tensors are
    # under `text_prefix`; tensors under `skipped_prefixes` (vision tower, projector) are skipped and reported.
    text_config: bool = False
    text_prefix: str = ""
    # what a text tensor's name is served under after text_prefix is cut (GLM-5.3-Flash: model.language_model.X ->
    # model.X), and the wrapper's own tensors that are the text model's as named (its top-level lm_head.weight)
    text_served_prefix: str = ""
    text_top_level: tuple[str, ...] = ()
    skipped_prefixes: tuple[str, ...] = ()
    tie_default: bool = False  # the wrapper class's tie_word_embeddings default (the loader decides by weights)
    reads_mlp_layer_types: bool = False  # config.json's mlp_layer_types decides dense/MoE layers
    # Without mlp_layer_types: this many leading dense layers (the class default), or None to
    # derive them from first_k_dense_replace.
    first_dense_layers: int | None = None
    # Attention sublayers per decoder layer (LongCat-Flash: 2, each with its own latent row per token);
    # config.json then gives `num_layers` and transformers derives num_hidden_layers = sublayers x num_layers.
    sublayers: int = 1
    # The router scores `zero_expert_num` zero-computation identity experts after the real ones (LongCat-Flash).
    zero_experts: bool = False
    # Checkpoint tensors under these prefixes are skipped and reported (prefix -> why): a layer not built.
    skipped_tensor_prefixes: Mapping[str, str] = field(default_factory=frozen_map)
    # Engine options refused for this family (option -> why), before any weight is read.
    unsupported: Mapping[str, str] = field(default_factory=frozen_map)
    has_indexer: bool = False  # DSA: a lightning indexer (needs q_lora_rank: it reads the query latent)
    indexer_rope_interleaved: bool = False  # else half-split, as transformers
    # Linear-attention (KDA) layers beside the MLA ones, read by config/mla_reader/kimi_linear.py (Kimi-Linear)
    kda: bool = False
    # the KDA forget gate's lower bound is read from config.json's linear_lower_bound (GLM-5.3-Flash's "safe gate");
    # False: the gate has none (Kimi-Linear's softplus gate, whatever the config says, as transformers reads it)
    kda_lower_bound: bool = False
    # GLM-5.3-Flash: the layer / MLP / indexer schedules, KDA widths, index_kpool, mHC and swiglu_limit are read by
    # config/glm5_next.py (read_glm5_next) instead of the generic MLA reader's rules
    glm5_next: bool = False
    # NoPE MLA: why its rope slice is never rotated (the rope table is the identity), or None (rotated)
    nope: str | None = None
    # The checkpoint's tensor names read as the model's: (regex, replacement) applied in order by the strict
    # fill (loading/weights.py); errors still name the checkpoint's tensor
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    # --- GGUF (gguf/read/config.py, gguf/convert/metadata.py) -------------------------------
    # A file of gguf_arch reads back as this family. False where llama.cpp files the family under
    # another one's arch with nothing to tell them apart (glm4_moe_lite reads as deepseek_v3).
    gguf_reads_back: bool = True
    gguf_keeps_mtp: bool = False  # the converter writes the MTP (nextn) layers as blocks
    # When the converter writes nextn_predict_layers, as llama.cpp's converter class does:
    # "never", "if_set" (config.json has the key, even 0) or "if_kept" (MTP blocks were written).
    gguf_nextn_key: str = "never"
    gguf_indexer_types: bool = False  # attention.indexer.types (per layer full/shared) is stored
    # The converter scales rope.dimension_count by rope partial_rotary_factor (GLM's converter).
    gguf_rope_dim_partial: bool = False

    # --- tokenizer (gguf/convert/tokenizer.py) ---------------------------------------------
    # llama.cpp's pre-tokenizer names by hash of the family's shipped tokenizers (its chkhsh table).
    tokenizer_pre: Mapping[str, str] = field(default_factory=frozen_map)
    # Special tokens llama.cpp fills in by text when the tokenizer files name none (GLM's vocab).
    tokenizer_specials: Mapping[str, str] = field(default_factory=frozen_map)

    def __post_init__(self) -> None:
        # The readers know these rules only; a family with another one must teach them first.
        if self.reader not in READERS:
            raise ValueError(f"family {self.name}: reader {self.reader!r} not in {tuple(READERS)}")
        if self.scoring_func not in READERS[self.reader]:
            raise ValueError(
                f"family {self.name}: scoring_func {self.scoring_func!r} not in {READERS[self.reader]} "
                f"(what the {self.reader} reader knows)"
            )
        if self.sublayers not in (1, 2):
            raise ValueError(f"family {self.name}: sublayers {self.sublayers} (the models know 1 or 2)")
        if self.gguf_nextn_key not in NEXTN_KEY_RULES:
            raise ValueError(f"family {self.name}: gguf_nextn_key {self.gguf_nextn_key!r} not in {NEXTN_KEY_RULES}")

    @property
    def is_dsa(self) -> bool:
        return self.has_indexer

    def derive(
        self, name: str, *, defaults: Mapping[str, Any] | None = None, without: tuple[str, ...] = (), **changes: Any
    ) -> Family:
        """A family that differs from this one only in `changes`. `defaults` are merged over this
        family's and `without` drops defaults its reference class lacks, so the delta lists only what
        differs. Aliases are not inherited (an alias names one family)."""
        merged = {k: v for k, v in {**self.defaults, **(defaults or {})}.items() if k not in without}
        changes.setdefault("aliases", ())
        return replace(self, name=name, base=self, defaults=frozen_map(merged), **changes)

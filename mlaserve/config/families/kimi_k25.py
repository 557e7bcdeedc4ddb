"""Kimi-K2.5 / K2.6 (kimi_k25): a multimodal wrapper whose `text_config` is DeepSeek-V3 (a `kimi_k2`
model_type is read as deepseek_v3, as transformers' configuration_kimi_k25.py rewrites it). The text
model's tensors are under `language_model.` (the released checkpoint: language_model.model.layers.N;
transformers' own save writes language_model.model.blocks.N); the vision tower and its projector are not
served: their tensors are skipped and reported by name and size. The wrapper's tie_word_embeddings
defaults to True even where the text config says False, so the loader decides from the weights present
(language_model.lm_head.weight). No llama.cpp arch of its own."""

from __future__ import annotations

from mlaserve.config.families.deepseek_v3 import DEEPSEEK_V3

KIMI_K25 = DEEPSEEK_V3.derive(
    "kimi_k25",
    hf_architecture="Kimi_K25ForConditionalGeneration",
    text_config=True,
    text_prefix="language_model.",
    # the released names and the ones transformers' save writes (model.mm_projector.pre_norm)
    skipped_prefixes=("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector."),
    tie_default=True,  # Kimi_K25Config.tie_word_embeddings
    gguf_reads_back=False,
)

"""Tokenizer facts shared by families: llama.cpp's pre-tokenizer names (its convert_hf_to_gguf.py
table: sha256 of the token ids of a check text -> name; the reference checkpoint in each comment)
and the special tokens llama.cpp's GLM vocabulary fills in by text."""

from __future__ import annotations

from mlaserve.config.families.family import frozen_map

DEEPSEEK_V3_PRE = frozen_map(
    {"877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3"}  # DeepSeek-V3
)
# DeepSeek-V2's tokenizer lineage: the DeepSeek LLM and DeepSeek Coder tokenizers.
DEEPSEEK_LLM_PRE = frozen_map(
    {
        "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",  # deepseek-llm-7b-base
        "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",  # deepseek-coder-6.7b-base
    }
)
GLM_PRE = frozen_map(
    {
        "9ca2dd618e8afaf09731a7cf6e2105b373ba6a1821559f258b272fe83e6eb902": "glm4",  # GLM-4.5-Air
        "cdf5f35325780597efd76153d4d1c16778f766173908894c04afc20108536267": "glm4",  # GLM-4.7-Flash
        "a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2": "glm4",  # glm-4-9b-hf
    }
)
# llama.cpp's _set_vocab_glm: bos = [gMASK], eot = <|user|>, unk = <|endoftext|>, eom = <|observation|>.
GLM_SPECIALS = frozen_map({"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"})

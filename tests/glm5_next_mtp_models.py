"""Tiny random GLM-5.3-Flash checkpoints *with an MTP layer* (tests/glm5_next_models.py's trunks + layer N).

transformers builds no GLM-5.3-Flash MTP layer (it ignores layer N = num_hidden_layers on load), so the block is made
here: transformers' model with one layer more (an MLA+DSA layer with a MoE: the released MTP block's kind, vLLM's
and SGLang's GLM-5.3 MTP) gives the block's tensors under the Hub names save_pretrained writes, minus its mHC tensors
(attn_hc / ffn_hc: the released block has none, its residual is plain); the MTP-only tensors (enorm, hnorm, eh_proj,
shared_head.norm; no shared_head.head: lm_head is shared) are drawn at O(1) scale like hf_models.reinit_. The
folder's text_config says num_hidden_layers = trunk depth and num_nextn_predict_layers = 1, the block is saved as
model.language_model.layers.{N}.*.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from glm5_next_models import EXTRA, SPARSE, SPECS, TEXT, VISION, save_hf_glm5_next
from hf_models import reinit_

MTP_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _with_block(spec: str) -> dict:
    """The text config of the trunk plus one MLA+DSA MoE layer (the MTP block's kind) at index N."""
    text = dict(TEXT) | (SPECS | EXTRA | SPARSE)[spec]
    n = text["num_hidden_layers"]
    text["num_hidden_layers"] = n + 1
    text["layer_types"] = list(text["layer_types"]) + ["indexed_attention"]
    text["mlp_layer_types"] = list(text["mlp_layer_types"]) + ["sparse"]
    if "indexer_types" in text:
        text["indexer_types"] = list(text["indexer_types"]) + ["full"]
    return text


def mtp_tensors(spec: str, seed: int):
    """-> (the MTP layer's tensors under their Hub names (model.language_model.layers.N.*), transformers' model of
    N + 1 layers whose layer N holds the block's weights: the reference's modules, tests/models/test_glm5_next_mtp.py)."""
    from safetensors.torch import load_file
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    text = _with_block(spec)
    n = text["num_hidden_layers"] - 1
    torch.manual_seed(seed + 500)
    full = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=VISION)).eval()
    reinit_(full, seed + 500)
    with tempfile.TemporaryDirectory() as tmp:
        full.save_pretrained(tmp)
        hub = load_file(f"{tmp}/model.safetensors")
    prefix = f"model.language_model.layers.{n}."
    block = {k: v for k, v in hub.items() if k.startswith(prefix) and not k[len(prefix) :].startswith("hc_")}
    d = text["hidden_size"]
    g = torch.Generator().manual_seed(seed + 77)
    block[prefix + "enorm.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    block[prefix + "hnorm.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    block[prefix + "eh_proj.weight"] = torch.randn(d, 2 * d, generator=g) * (2 * d) ** -0.5
    block[prefix + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    return block, full


def save_glm5_next_with_mtp(spec: str, folder: Path, seed: int = 0):
    """-> (the transformers trunk, the MTP layer's tensors, transformers' N + 1 layer model holding the block); the
    checkpoint (trunk + layer N) at `folder`."""
    from safetensors.torch import load_file, save_file

    trunk = save_hf_glm5_next(spec, folder, seed)
    block, full = mtp_tensors(spec, seed)
    path = folder / "model.safetensors"
    save_file(load_file(str(path)) | block, str(path), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return trunk, block, full

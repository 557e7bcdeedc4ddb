"""Tiny random MLA models *with an MTP layer* (DeepSeek-V3 checkpoint layout), built from transformers.

transformers does not run MTP, so the layer is made here: a transformers model with one layer more
than the trunk gives the MTP block (its last layer, with the family's attention, indexer and MoE), and
the MTP-only tensors (enorm, hnorm, eh_proj, shared_head.norm, shared_head.head) are drawn at O(1)
scale like hf_models.reinit_. The folder's config says num_hidden_layers = trunk depth and
num_nextn_predict_layers = 1, as the releases do; the block is saved as model.layers.{N}.*.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hf_models import BASE, SPECS, reinit_

MTP_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight")


def _config(kind: str, num_layers: int, **over):
    from transformers import AutoConfig

    model_type, extra = SPECS[kind]
    kwargs = {**BASE, **extra, "num_hidden_layers": num_layers, **over}
    for key in ("mlp_layer_types", "indexer_types"):
        if key in kwargs and kwargs[key] is not None and len(kwargs[key]) != num_layers:
            kwargs[key] = (list(kwargs[key]) + [kwargs[key][-1]] * num_layers)[:num_layers]
    return AutoConfig.for_model(model_type, **kwargs)


def mtp_only_tensors(d: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 77)
    return {
        "enorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
        "eh_proj.weight": torch.randn(d, 2 * d, generator=g) * (2 * d) ** -0.5,
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(d, generator=g),
        "shared_head.head.weight": torch.randn(vocab, d, generator=g) * d**-0.5,
    }


def save_mtp_model(kind: str, folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a trunk of BASE depth + one MTP layer to folder, in the Hub layout save_pretrained writes
    (one tensor per expert); -> the tensors under transformers' in-memory names (for the references)."""
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    n = BASE["num_hidden_layers"]
    torch.manual_seed(seed)
    full = AutoModelForCausalLM.from_config(_config(kind, n + 1), dtype=torch.float32, attn_implementation="eager")
    reinit_(full, seed)
    extra = {
        f"model.layers.{n}.{k}": v for k, v in mtp_only_tensors(BASE["hidden_size"], BASE["vocab_size"], seed).items()
    }
    tensors = {k: v.contiguous() for k, v in full.state_dict().items()} | extra
    with tempfile.TemporaryDirectory() as tmp:
        full.save_pretrained(tmp)
        hub = load_file(f"{tmp}/model.safetensors")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(hub | extra, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = _config(kind, n).to_dict()
    cfg.pop("head_dim", None)
    cfg["num_nextn_predict_layers"] = 1
    cfg["architectures"] = [type(full).__name__]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return tensors


_FOLDERS: dict[str, tuple[Path, dict[str, torch.Tensor]]] = {}


def mtp_model_folder(kind: str, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Each tiny MTP model is written once per test session."""
    if kind not in _FOLDERS:
        folder = tmp_path_factory.mktemp(f"mtp_{kind}")
        _FOLDERS[kind] = (folder, save_mtp_model(kind, folder))
    return _FOLDERS[kind]


def hf_trunk(kind: str, tensors: dict[str, torch.Tensor]):
    """The transformers trunk (BASE depth) holding the checkpoint's trunk weights."""
    from transformers import AutoModelForCausalLM

    n = BASE["num_hidden_layers"]
    model = AutoModelForCausalLM.from_config(_config(kind, n), dtype=torch.float32, attn_implementation="eager")
    keep = {k: v for k, v in tensors.items() if not k.startswith(f"model.layers.{n}.")}
    model.load_state_dict(keep, strict=True)
    return model.eval()


def hf_block_model(kind: str, tensors: dict[str, torch.Tensor]):
    """A one-layer transformers model whose layer is the MTP block, whose final norm is shared_head.norm
    and whose lm_head is shared_head.head: model(inputs_embeds=x).logits = shared_head(Block(x))."""
    from transformers import AutoModelForCausalLM

    n = BASE["num_hidden_layers"]
    over = {"first_k_dense_replace": 0}
    if SPECS[kind][0] in ("glm_moe_dsa", "glm4_moe_lite", "deepseek_v32"):
        over["mlp_layer_types"] = ["sparse"]
        over["indexer_types"] = None
    model = AutoModelForCausalLM.from_config(_config(kind, 1, **over), dtype=torch.float32, attn_implementation="eager")
    state = {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"]}
    state |= {
        "model.layers.0." + k[len(f"model.layers.{n}.") :]: v
        for k, v in tensors.items()
        if k.startswith(f"model.layers.{n}.") and k[len(f"model.layers.{n}.") :] not in MTP_ONLY
    }
    state["model.norm.weight"] = tensors[f"model.layers.{n}.shared_head.norm.weight"]
    state["lm_head.weight"] = tensors[f"model.layers.{n}.shared_head.head.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()

"""Tiny random DeepSeek-V4 models *with an MTP layer* (the release's `mtp.0.*` layout), and the layer's logits
computed independently of mlaserve.

transformers 5.24 does not build V4's MTP layer (it ignores `mtp.*`), so the reference is written here from
the release's description (its inference code's MTPBlock; vLLM's DeepSeekV4MultiTokenPredictorLayer runs the
same): x = e_proj(enorm(Emb(t_{i+1}))) added to every stream of h_proj(hnorm(H_i)), H_i the trunk's mHC streams
after its last layer (before hc_head); a full V4 decoder layer (sliding window only, learned routing); the
layer's own hc_head (sigmoid weights over the streams), its own norm, the trunk's head. The block is
transformers' own DeepseekV4DecoderLayer: layer N of a transformers model one layer deeper than the trunk
(the trunk is that model's first N layers), so only the combine and the head are written out here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from v4_models import CSA, HCA, SW, make_v4_config, reinit_v4_  # noqa: F401

# the block's tensors under the release's names (transformers' module name -> released name)
RELEASED = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
} | {f"{s}_hc.{p}": f"hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")}


def _deeper_config(kind: str):
    base = make_v4_config(kind)
    n = base.num_hidden_layers
    over = {"num_hidden_layers": n + 1, "experts_implementation": "eager"}
    raw = json.loads(base.to_json_string())
    if raw.get("compress_ratios") is not None and kind == "hc3_hash":
        over["compress_ratios"] = list(raw["compress_ratios"]) + [0]
    else:
        over["layer_types"] = list(base.layer_types) + [SW]
    if base.mlp_layer_types is not None:
        over["mlp_layer_types"] = list(base.mlp_layer_types) + ["moe"]
    return make_v4_config(kind, **over), n


def build_v4_with_mtp(kind: str, seed: int = 0):
    """-> (trunk: transformers' DeepseekV4ForCausalLM of the spec's depth N, block: the MTP block as
    transformers' DeepseekV4DecoderLayer, extras: the MTP-only tensors under their released names)."""
    from transformers import DeepseekV4ForCausalLM

    cfg, n = _deeper_config(kind)
    torch.manual_seed(seed)
    full = DeepseekV4ForCausalLM(cfg).float()
    reinit_v4_(full, seed)
    trunk = DeepseekV4ForCausalLM(make_v4_config(kind, experts_implementation="eager")).float()
    state = {k: v for k, v in full.state_dict().items() if not k.startswith(f"model.layers.{n}.")}
    trunk.load_state_dict(state, strict=True)
    block = full.model.layers[n].eval()
    d, hc = cfg.hidden_size, cfg.hc_mult
    g = torch.Generator().manual_seed(seed + 77)
    extras = {
        "e_proj.weight": torch.randn(d, d, generator=g) * d**-0.5,
        "h_proj.weight": torch.randn(d, d, generator=g) * d**-0.5,
        "enorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
        "norm.weight": 1 + 0.1 * torch.randn(d, generator=g),
        "hc_head_fn": torch.randn(hc, hc * d, generator=g) * (hc * d) ** -0.5,
        "hc_head_base": 0.1 * torch.randn(hc, generator=g),
        "hc_head_scale": 1 + 0.1 * torch.randn(1, generator=g),
    }
    return trunk.eval(), block, extras


def mtp_tensors(block, extras: dict, layout: str) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors under `mtp.0.`: layout "released" (the release's names, one tensor per expert
    and projection) or "module" (the module names, stacked experts, `hc_head.hc_*`)."""
    out = {}
    for k, v in block.state_dict().items():
        if layout == "module":
            out[k] = v
        elif k == "mlp.experts.gate_up_proj":
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"ffn.experts.{e}.w1.weight"] = v[e, :inter]
                out[f"ffn.experts.{e}.w3.weight"] = v[e, inter:]
        elif k == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[f"ffn.experts.{e}.w2.weight"] = v[e]
        else:
            out[RELEASED[k]] = v
    for k, v in extras.items():
        out[k.replace("hc_head_", "hc_head.hc_") if layout == "module" else k] = v
    return {f"mtp.0.{k}": v.contiguous().clone() for k, v in out.items()}


def save_v4_with_mtp(kind: str, folder: Path, seed: int = 0, layout: str = "released"):
    """The trunk as transformers' save_pretrained writes it, plus the MTP layer's tensors in the same file;
    config.json says num_nextn_predict_layers 1, as the releases do. -> (trunk, block, extras)."""
    from safetensors.torch import load_file, save_file

    trunk, block, extras = build_v4_with_mtp(kind, seed)
    trunk.save_pretrained(folder)
    path = Path(folder) / "model.safetensors"
    tensors = load_file(path) | mtp_tensors(block, extras, layout)
    save_file(tensors, path, metadata={"format": "pt"})
    raw = json.loads((Path(folder) / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (Path(folder) / "config.json").write_text(json.dumps(raw))
    return trunk, block, extras


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def trunk_streams(trunk, ids: list[int]) -> torch.Tensor:
    """[S, N, D]: transformers' residual streams after the trunk's last layer (one pass, no cache)."""
    seen = {}
    hook = trunk.model.layers[-1].register_forward_hook(lambda mod, args, out: seen.setdefault("h", out))
    try:
        with torch.no_grad():
            trunk(torch.tensor([ids]), use_cache=False)
    finally:
        hook.remove()
    return seen["h"][0]


def reference_mtp(trunk, block, extras: dict, ids: list[int], streams: torch.Tensor | None = None):
    """The MTP layer over positions 0 .. S-2 (row i reads H_i and t_{i+1}, predicts t_{i+2}), one pass:
    -> (logits [S-1, V], the block's output streams [S-1, N, D]). streams: H (default: the trunk's)."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    cfg = trunk.config
    eps, hc_eps = cfg.rms_norm_eps, cfg.hc_eps
    h = trunk_streams(trunk, ids) if streams is None else streams
    with torch.no_grad():
        nxt = torch.tensor(ids[1:])
        e = _rms(trunk.model.embed_tokens(nxt), extras["enorm.weight"], eps) @ extras["e_proj.weight"].T
        x = e[:, None, :] + _rms(h[: len(ids) - 1], extras["hnorm.weight"], eps) @ extras["h_proj.weight"].T
        x = x[None]  # [1, S-1, N, D]
        pos = torch.arange(len(ids) - 1)[None]
        emb = trunk.model.embed_tokens(nxt)[None]
        rope = {t: trunk.model.rotary_emb(emb, position_ids=pos, layer_type=t) for t in ("main", "compress")}
        mask = create_sliding_window_causal_mask(
            config=cfg, inputs_embeds=emb, attention_mask=None, cache=None, position_ids=pos
        )
        g = block(x, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=nxt[None], cache=None)
        g = g[0]  # [S-1, N, D]
        flat = g.flatten(1).float()
        mixes = (flat @ extras["hc_head_fn"].T) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
        pre = torch.sigmoid(mixes * extras["hc_head_scale"] + extras["hc_head_base"]) + hc_eps
        y = (pre[..., None] * g).sum(1)
        logits = _rms(y, extras["norm.weight"], eps) @ trunk.lm_head.weight.T
    return logits.float(), g

"""DeepSeek-V4's MTP layer (models/deepseek_v4/mtp.py) against an independent computation of the release's
layer (tests/v4_mtp_models.py: transformers' trunk streams and decoder layer, the combine and the head written
out), loaded from the release's `mtp.0.*` names and from the module names.

Bound: 1e-5 max abs on fp32 logits of magnitude ~3: the trunk's own logits sit within 3e-6 of transformers'
here (tests/models/test_deepseek_v4.py) and the MTP adds one layer of the same ops; measured 8e-7 .. 1.5e-6.
A defect (the hidden collapsed before hnorm, e_proj and h_proj swapped, the trunk's hc_head or norm used for
the layer's own, the embedding of t_i instead of t_{i+1}) moves them by 1e-1 .. 1.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from v4_mtp_models import reference_mtp, save_v4_with_mtp, trunk_streams  # noqa: E402

from mlaserve.config.model import ConfigError  # noqa: E402
from mlaserve.loading.deepseek_v4 import load_folder  # noqa: E402
from mlaserve.models.deepseek_v4.state import SlidingRing, SlidingState  # noqa: E402

BOUND = 1e-5


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def ours_mtp(model, ids: list[int], chunks: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Our trunk's streams in one pass, then our MTP layer over positions 0 .. S-2 in `chunks` (sizes; one
    pass by default) through its sliding ring -> (logits [S-1, V], its output streams)."""
    s = len(ids)
    state = model.new_state(s)
    t = torch.tensor(ids)
    with torch.no_grad():
        h = model.forward_spans(t, torch.arange(s), [(0, s, 0, state.layers)], streams=True)
        mtp = model.mtp[0]
        a = model.config.attention
        ring = SlidingState(SlidingRing(a.sliding_window, a.head_dim, h.dtype))
        out, done = [], 0
        for n in chunks or [s - 1]:
            nxt = t[done + 1 : done + n + 1]
            g = mtp.draft(
                model.model.embed_tokens(nxt),
                h[done : done + n],
                nxt,
                torch.arange(done, done + n),
                [(0, n, done, ring)],
                model.tables,
            )
            out.append(g)
            done += n
        g = torch.cat(out)
        return model.lm_head(mtp.collapse(g)).float(), g


@pytest.mark.parametrize("kind", ["all_kinds", "hc2_learned", "hc3_hash"])
@pytest.mark.parametrize("layout", ["released", "module"])
def test_mtp_layer_equals_release_formula(tmp_path, kind, layout):
    trunk, block, extras = save_v4_with_mtp(kind, tmp_path, seed=3, layout=layout)
    model, report = load_folder(tmp_path, mtp=True)
    assert report.skipped == []  # every mtp.0.* tensor filled the layer
    ids = _ids(19, trunk.config.vocab_size, seed=5)  # 18 MTP rows: the ring (5-7 rows) wraps 2-3 times
    ref, ref_g = reference_mtp(trunk, block, extras, ids)
    got, g = ours_mtp(model, ids)
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err <= BOUND, f"{kind}/{layout}: MTP logits {err:.2e} from the reference"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (g - ref_g).abs().max().item() <= BOUND  # the streams a deeper draft re-reads


def test_mtp_deeper_draft_reads_its_own_streams(tmp_path):
    """A second draft runs the layer on its own output streams G_i and the first draft's token."""
    trunk, block, extras = save_v4_with_mtp("all_kinds", tmp_path, seed=4)
    model, _ = load_folder(tmp_path, mtp=True)
    ids = _ids(12, trunk.config.vocab_size, seed=6)
    _, g = reference_mtp(trunk, block, extras, ids)
    # depth 2 at positions 1 .. S-2 reads G_{i-1}; the reference gets those streams as its H
    ref2, _ = reference_mtp(trunk, block, extras, ids[1:], streams=g)
    streams = trunk_streams(trunk, ids)
    assert (g - streams[:-1]).abs().max() > 0.1  # G is not the trunk's H: the check below can fail
    got_logits, got_g = ours_mtp(model, ids)
    assert (got_g - g).abs().max().item() <= BOUND
    mtp, t = model.mtp[0], torch.tensor(ids[1:])
    a = model.config.attention
    ring = SlidingState(SlidingRing(a.sliding_window, a.head_dim, got_g.dtype))
    with torch.no_grad():
        n = len(t) - 1
        g2 = mtp.draft(
            model.model.embed_tokens(t[1:]), got_g[:n], t[1:], torch.arange(n), [(0, n, 0, ring)], model.tables
        )
        got2 = model.lm_head(mtp.collapse(g2)).float()
    assert (got2 - ref2).abs().max().item() <= BOUND


@pytest.mark.parametrize("chunks", [[1] * 14, [3, 5, 6], [4, 4, 4, 2]])
def test_mtp_chunked_equals_one_pass(tmp_path, chunks):
    trunk, block, extras = save_v4_with_mtp("hc3_hash", tmp_path, seed=2)
    model, _ = load_folder(tmp_path, mtp=True)
    ids = _ids(15, trunk.config.vocab_size, seed=7)
    ref, _ = reference_mtp(trunk, block, extras, ids)
    got, _ = ours_mtp(model, ids, chunks)
    assert (got - ref).abs().max().item() <= BOUND


def test_mtp_tensors_skipped_without_speculation(tmp_path):
    save_v4_with_mtp("hc2_learned", tmp_path, seed=1)
    model, report = load_folder(tmp_path)
    assert not hasattr(model, "mtp")
    assert report.skipped and all(n.startswith("mtp.0.") for n in report.skipped)


def test_mtp_missing_or_unknown_tensor_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from mlaserve.loading.safetensors_source import WeightError

    save_v4_with_mtp("hc2_learned", tmp_path, seed=1)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if k != "mtp.0.h_proj.weight"}, path)
    with pytest.raises(WeightError, match=r"mtp\.0\.h_proj\.weight"):
        load_folder(tmp_path, mtp=True)
    save_file(tensors | {"mtp.0.attn.compressor.wkv.weight": torch.zeros(2, 2)}, path)
    with pytest.raises(WeightError, match=r"mtp\.0\.attn\.compressor\.wkv"):
        load_folder(tmp_path, mtp=True)
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, path)
    with pytest.raises(ConfigError, match="MTP layer"):
        load_folder(tmp_path, mtp=True)


def test_release_compress_ratios_list_the_mtp_layer(tmp_path):
    """The release's config.json lists num_hidden_layers + num_nextn_predict_layers compress_ratios (V4-Flash:
    43 + 1, the last 0): the main layers' kinds from the first N, the MTP layer's recorded; a compressed MTP
    kind is refused when the layer is built (the release's block has no compressor)."""
    import json

    from mlaserve.config.deepseek_v4 import DeepseekV4Config

    save_v4_with_mtp("hc3_hash", tmp_path, seed=1)  # compress_ratios [4, 0, 4]
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("layer_types", None)
    raw["compress_ratios"] = [4, 0, 4, 0]
    cfg = DeepseekV4Config.from_hf(raw)
    assert cfg.layer_kinds == ("csa", "sliding", "csa") and cfg.mtp_layer_kinds == ("sliding",)
    assert any(s.name == "mtp_layer_kinds" and "compress_ratios[3:]" in s.source for s in cfg.provenance)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model, _ = load_folder(tmp_path, mtp=True)
    assert model.config.mtp_layer_kinds == ("sliding",)
    raw["compress_ratios"] = [4, 0, 4, 4]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="MTP layer the kind 'csa'"):
        load_folder(tmp_path, mtp=True)
    raw["compress_ratios"] = [4, 0, 4, 0, 0]  # neither N nor N + num_nextn_predict_layers entries
    with pytest.raises(ConfigError, match="compress_ratios must be a list of 3 entries"):
        DeepseekV4Config.from_hf(raw)


def test_fp8_folder_keeps_the_mtp_layer_quantized(tmp_path):
    """The project's FP8 writer (ue8m0, 16x16 blocks) stores the MTP layer's projections and experts as the
    trunk's; loaded with the MTP, they sit in the FP8 holders (no dequantized copy) and the MTP logits equal our
    float model on the dequantized weights (pinned above against the reference) within the bound (measured
    7e-7: the holders dequantize the same blocks, then the same products)."""
    import json

    from safetensors.torch import load_file, save_file

    from mlaserve.quant import fp8_block
    from mlaserve.quant.deepseek_v4 import FP8V4Experts
    from mlaserve.quant.linear import FP8Linear
    from mlaserve.quant.writer import write_fp8_folder

    block = (16, 16)
    trunk, _, _ = save_v4_with_mtp("all_kinds", tmp_path / "float", seed=3)
    write_fp8_folder(tmp_path / "float", tmp_path / "fp8", block=block, keep_dtype=torch.float32, scale_fmt="ue8m0")
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    assert stored["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    deq = {}
    for name, t in stored.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = stored.get(name.removesuffix("weight") + "weight_scale_inv")
        deq[name] = t if scale is None else fp8_block.dequantize_reference(t, scale.float(), block)
    (tmp_path / "deq").mkdir()
    save_file(deq, tmp_path / "deq" / "model.safetensors")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config.pop("quantization_config")
    (tmp_path / "deq" / "config.json").write_text(json.dumps(config))
    quantized, _ = load_folder(tmp_path / "fp8", mtp=True)
    mtp = quantized.mtp[0]
    assert isinstance(mtp.e_proj, FP8Linear) and isinstance(mtp.h_proj, FP8Linear)
    assert isinstance(mtp.self_attn.q_a_proj, FP8Linear) and isinstance(mtp.mlp.experts, FP8V4Experts)
    assert mtp.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    floats, _ = load_folder(tmp_path / "deq", mtp=True)
    ids = _ids(19, trunk.config.vocab_size, seed=5)
    got, _ = ours_mtp(quantized, ids)
    want, _ = ours_mtp(floats, ids)
    assert (got - want).abs().max().item() <= BOUND
    assert torch.equal(got.argmax(-1), want.argmax(-1))

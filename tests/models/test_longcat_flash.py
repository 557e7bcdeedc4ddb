"""LongCat-Flash (longcat_flash) vs transformers' LongcatFlashForCausalLM on tiny random fp32 models made here.

Shapes: "pow2" (both latent scales sqrt(64/16) = 2, folded into the weights; untied), "odd" (hidden 72, 3 heads,
vocabulary 257, q scale sqrt(72/24) = sqrt(3) applied at run time, kv scale sqrt(72/18) = 2 folded; tied
embeddings), "yarn" (pow2 with YaRN rope, factor 4, mscale_all_dim 1). Routing cases, set through the router's e_score_correction_bias (it steers the choice only, so
the weights stay the softmax scores): "mixed" (random bias: tokens pick real and identity experts),
"identity_only" (+10 on the identity experts: every token picks only them), "real_only" (-10 on them).
The bound is conftest's fp32_logits_tol (1e-5 for |logits| <= 8), measured max |diff| per test below.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compare_logits, fp32_logits_tol
from hf_models import hf_logits, random_ids, reinit_
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.config.model import ConfigError, ModelConfig

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    ffn_hidden_size=96,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    head_dim=8,
    v_head_dim=12,
    moe_topk=3,
    n_routed_experts=4,
    zero_expert_num=3,
    expert_ffn_hidden_size=24,
    routed_scaling_factor=2.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
SHAPES = {
    "pow2": {},
    "odd": dict(
        vocab_size=257,
        hidden_size=72,
        num_attention_heads=3,
        ffn_hidden_size=100,
        q_lora_rank=24,
        kv_lora_rank=18,
        expert_ffn_hidden_size=40,
        n_routed_experts=5,
        zero_expert_num=2,
        moe_topk=2,
        tie_word_embeddings=True,
    ),
}
SHAPES["yarn"] = dict(  # YaRN with mscale_all_dim: the softmax scale and cos/sin factors of transformers' yarn
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=64,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)
ROUTING = {"mixed": None, "identity_only": 10.0, "real_only": -10.0}


def _build(shape: str, routing: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**BASE, **SHAPES[shape]}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("longcat_flash", **kwargs), dtype=torch.float32, attn_implementation="eager"
    )
    reinit_(model, 0)
    bias = ROUTING[routing]
    if bias is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                b = layer.mlp.router.e_score_correction_bias
                b.zero_()
                b[kwargs["n_routed_experts"] :] = bias
    if kwargs["tie_word_embeddings"]:
        # reinit_'s std-1 embedding is the lm_head too when tied: logits reach ~43 and transformers' own fp32 run
        # is then 6.5e-5 from an fp64 run of the same weights (measured), so a comparison of two fp32 runs says
        # nothing at 1e-5. At std 0.25 the logits stay ~10 and the fp32 runs agree to ~1e-5 of their size.
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.25)
        model.tie_weights()
    return model.eval()


@pytest.fixture(scope="module")
def longcat(tmp_path_factory):
    """(shape, routing) -> (folder, transformers model)."""
    cache = {}

    def get(shape: str, routing: str = "mixed"):
        if (shape, routing) not in cache:
            folder = tmp_path_factory.mktemp(f"longcat_{shape}_{routing}")
            model = _build(shape, routing)
            model.save_pretrained(folder)
            cache[shape, routing] = (folder, model)
        return cache[shape, routing]

    return get


def _bound(model, ids: list[int], ref: torch.Tensor) -> float:
    """The bound for the engine's fp32 logits against transformers' fp32 logits `ref`: conftest's fp32_logits_tol,
    or transformers' own distance from an fp64 run of the same weights where that is larger. Two fp32 runs of one
    function, each within e of the exact result, may differ by up to 2e; the bound allows e only. This model's
    LoRA-rank scales (x sqrt(hidden / rank) on q and c_kv) sharpen the attention scores of random weights, so
    its rounding is larger than DeepSeek's at the same widths: transformers' fp32 is 7.8e-6 (pow2) and 1.6e-5
    (odd) from fp64, measured."""
    import copy

    with torch.no_grad():
        exact = copy.deepcopy(model).double()(torch.tensor([ids]), use_cache=False).logits[0]
    own = (ref.double() - exact).abs().max().item()
    print(f"transformers fp32 vs fp64: {own:.2e}")
    return max(fp32_logits_tol(ref), own)


def _routes(llm: LLM, ids: list[int]) -> list[torch.Tensor]:
    """Each layer's chosen experts [T, k] for a prompt, from the engine's routers."""
    got = []
    hooks = [
        layer.mlp.router.register_forward_hook(lambda m, i, out: got.append(out[1]))
        for layer in llm.loaded.model.model.layers
    ]
    try:
        llm.prompt_logits(ids)
    finally:
        for h in hooks:
            h.remove()
    return got


def test_config_is_read_with_provenance(longcat, capsys):
    folder, ref = longcat("odd")
    raw = json.loads((folder / "config.json").read_text())
    assert "num_hidden_layers" not in raw and raw["num_layers"] == 2  # transformers' save: num_layers only
    cfg = ModelConfig.from_hf(raw)
    assert cfg.num_layers == ref.config.num_layers == 2 and ref.config.num_hidden_layers == 4
    assert cfg.intermediate_size == 100 and cfg.moe.moe_intermediate_size == 40 and cfg.moe.num_experts_per_tok == 2
    assert cfg.moe.zero_experts == 2 and cfg.moe.scored_experts == 7 and not cfg.moe.norm_topk_prob
    assert cfg.rope.interleaved and cfg.tie_word_embeddings and cfg.sublayers == 2
    s = cfg.latent_scale
    assert (s.q, s.q_folded, s.kv, s.kv_folded) == ((72 / 24) ** 0.5, False, 2.0, True)
    prov = {st.name: (st.value, st.source) for st in cfg.provenance}
    assert prov["num_hidden_layers"][0] == 4 and prov["num_hidden_layers"][1].startswith("derived: 2 x num_layers")
    assert "ffn_hidden_size (longcat_flash's name for intermediate_size)" in prov["intermediate_size"][1]
    assert "not a power of two" in prov["q_latent_scale"][1] and "folded" in prov["kv_latent_scale"][1]
    from mlaserve.entrypoints.cli import main

    main(["inspect", str(folder)])
    out = capsys.readouterr().out
    assert "derived: 2 x num_layers" in out and "latent [26] + latent_1 [26]" in out, out


def test_config_errors_name_the_field():
    raw = {**BASE, "model_type": "longcat_flash"}
    ModelConfig.from_hf(raw)
    # the original release's keys, as it writes them (transformers ignores them; these values are what it runs)
    ModelConfig.from_hf(
        {
            **raw,
            "zero_expert_type": "identity",
            "mla_scale_q_lora": True,
            "mla_scale_kv_lora": True,
            "attention_method": "MLA",
        }
    )
    for bad, match in (
        ({"num_hidden_layers": 6}, "num_hidden_layers=6 but num_layers=2"),
        ({"num_layers": "2"}, "num_layers must be an integer"),
        ({"zero_expert_num": 1.5}, "zero_expert_num must be an integer"),
        ({"moe_topk": "3"}, r"num_experts_per_tok \(longcat_flash key moe_topk\) must be an integer"),
        ({"moe_topk": 8}, r"num_experts_per_tok must be in \[1, n_routed_experts \+ zero_expert_num = 7\]"),
        ({"head_dim": 16}, "head_dim=16 must equal qk_rope_head_dim=8"),
        ({"router_bias": True}, "router_bias true is not supported"),
        ({"router_bias": "no"}, "router_bias must be true or false"),
        ({"q_lora_rank": None}, "q_lora_rank must be set for longcat_flash"),
        ({"ffn_hidden_size": 96, "intermediate_size": 50}, "ffn_hidden_size .longcat_flash's name for"),
        ({"zero_expert_type": "zero"}, "zero_expert_type 'zero' is not supported"),
        ({"mla_scale_kv_lora": False}, "mla_scale_kv_lora=False: longcat_flash is run with the scale"),
        ({"attention_method": "MHA"}, "attention_method 'MHA' is not supported"),
    ):
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_hf({**raw, **bad})
    no_layers = {k: v for k, v in raw.items() if k != "num_layers"}
    with pytest.raises(ConfigError, match="missing required field 'num_layers'"):
        ModelConfig.from_hf(no_layers)
    with pytest.raises(ConfigError, match="not a multiple of 2"):
        ModelConfig.from_hf({**no_layers, "num_hidden_layers": 5})
    cfg = ModelConfig.from_hf({**no_layers, "num_hidden_layers": 4})  # transformers' setter: num_layers = 4 // 2
    assert cfg.num_layers == 2


@pytest.mark.parametrize("mla_path", ["auto", "absorbed", "decompressed"])
@pytest.mark.parametrize(
    ("shape", "routing"), [("pow2", "mixed"), ("odd", "mixed"), ("yarn", "mixed"), ("pow2", "real_only")]
)
def test_logits_match_transformers(longcat, shape, routing, mla_path):
    """fp32, 48 positions in chunks of 16 over pages of 8; the bound is _bound's (1e-5, or transformers' own
    distance from fp64 where larger: 1.6e-5 on odd). Measured max |diff| (auto = decompressed / absorbed):
    pow2 1.4e-6 / 5.4e-6, odd 3.1e-6 / 1.1e-5, yarn 1.3e-6 / 6.5e-6, pow2 real_only 0 / 8.5e-6; the absorbed
    path is the farthest (it multiplies q by W_UK before the scores: another association of the same
    products); 100% top-1. "mixed" really mixes: some tokens choose identity experts, some only real ones."""
    folder, ref_model = longcat(shape, routing)
    ids = random_ids(48, ref_model.config.vocab_size)
    ref = hf_logits(ref_model, ids)
    llm = LLM(str(folder), mla_path=mla_path, max_num_batched_tokens=16, page_size=8)
    diff, top1 = compare_logits(llm.prompt_logits(ids), ref)
    assert diff <= _bound(ref_model, ids, ref) and top1 == 1.0, (shape, routing, mla_path, diff, top1)
    n_real = ref_model.config.n_routed_experts
    picks = torch.cat(_routes(llm, ids))
    identity = (picks >= n_real).any(-1)
    if routing == "mixed":
        assert identity.any() and not identity.all() and (picks >= n_real).sum() < picks.numel()
    else:
        assert not identity.any()


def test_tokens_that_pick_only_identity_experts_compute_no_real_expert(longcat, monkeypatch):
    """Every token picks only identity experts: logits still match transformers (measured 1.4e-6), and the routed
    experts' grouped GEMMs receive 0 rows in every layer and step (no real expert is computed)."""
    folder, ref_model = longcat("pow2", "identity_only")
    ids = random_ids(40, ref_model.config.vocab_size)
    ref = hf_logits(ref_model, ids)
    llm = LLM(str(folder), max_num_batched_tokens=16, page_size=8)
    picks = torch.cat(_routes(llm, ids))
    assert (picks >= ref_model.config.n_routed_experts).all()
    rows = []
    grouped_mm = torch._grouped_mm

    def counting(x, w, offs=None, **kw):
        rows.append(x.shape[0])
        return grouped_mm(x, w, offs=offs, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    diff, top1 = compare_logits(llm.prompt_logits(ids), ref)
    assert diff <= _bound(ref_model, ids, ref) and top1 == 1.0, diff
    # 3 chunks x 2 layers x (gate_up, down); all empty
    assert len(rows) == 12 and set(rows) == {0}, rows


def test_chunked_prefill_greedy_and_batch(longcat):
    """Chunks of 8 == one pass of 64 (the same math over other row groups and paths: fp32 rounding, measured
    1.0e-5 with |logits| ~8, within _bound's 1.6e-5, transformers' own distance from fp64 here);
    greedy decoding through the engine's two-latent-row cache == transformers' greedy generate (its own cache);
    three prompts decoded together == each alone."""
    folder, ref_model = longcat("odd")
    ids = random_ids(48, ref_model.config.vocab_size)
    one = LLM(str(folder), max_num_batched_tokens=64, page_size=8)
    chunked = LLM(str(folder), max_num_batched_tokens=8, page_size=8)
    whole = one.prompt_logits(ids)
    diff, top1 = compare_logits(chunked.prompt_logits(ids), whole)
    assert diff <= _bound(ref_model, ids, whole) and top1 == 1.0, (diff, top1)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = chunked.generate([ids[:12]], greedy)[0].outputs[0].token_ids
    with torch.no_grad():
        want = ref_model.generate(
            torch.tensor([ids[:12]]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=2
        )[0, 12:].tolist()
    assert list(got) == want
    prompts = [ids[:5], ids[5:22], ids[22:31]]
    together = chunked.generate(prompts, greedy)
    alone = [one.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in together] == [list(a) for a in alone]


def test_route_and_ledger_name_each_sublayer_and_the_cache_keeps_two_rows(longcat):
    folder, _ = longcat("pow2")
    llm = LLM(str(folder), max_num_batched_tokens=16, page_size=8, trace="memory")
    llm.generate([random_ids(20)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    records = list(llm.runner.tracer.records)
    assert records
    subs = [{"sublayer": 0, "state": "latent"}, {"sublayer": 1, "state": "latent_1"}]
    for rec in records:
        (kind,) = rec["kinds"]
        assert kind["kind"] == "mla" and kind["layers"] == "0-1" and kind["sublayers"] == subs, kind
        assert all(seg["sublayers"] == ["latent", "latent_1"] for seg in rec["segments"])
    cache = llm.runner.cache
    row = 16 + 8  # kv_lora_rank + qk_rope_head_dim
    assert cache.measured_bytes_per_token() == 2 * 2 * row * 4  # two layers x two sublayers x fp32 rows
    assert type(cache).bytes_per_token(cache.kinds, torch.float32) == 2 * 2 * row * 4  # the declared specs
    for layer in cache.layers:
        assert set(layer.tensors) == {"latent", "latent_1"}
        assert layer.tensors["latent"].data_ptr() != layer.tensors["latent_1"].data_ptr()


def test_prefix_cache_hit_restores_both_sublayers_rows(longcat):
    """A prompt whose first 16 tokens (two pages) are cached: the hit serves both sublayers' rows of those pages
    (one block table for every paged state), and the greedy tokens equal a run without the prefix cache."""
    folder, _ = longcat("pow2")
    ids = random_ids(28)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cold = LLM(str(folder), page_size=8, enable_prefix_caching=False).generate([ids], greedy)[0]
    llm = LLM(str(folder), page_size=8, trace="memory")
    llm.generate([ids[:20]], greedy)
    warm = llm.generate([ids], greedy)[0]
    cached = [q["cached_tokens"] for r in llm.runner.tracer.records for q in r["requests"] if q["cached_tokens"]]
    assert cached == [16], cached
    assert list(warm.outputs[0].token_ids) == list(cold.outputs[0].token_ids)


def test_checkpoint_extras_are_skipped_and_reported(longcat, tmp_path):
    """The MTP layer (model.mtp.*, which transformers ignores) and the identity experts' unused gate/up rows that
    transformers' save writes are skipped by name; a checkpoint without the router's correction bias loads with
    zeros (as transformers starts it) and says so; any other extra tensor is an error naming it."""
    from mlaserve.loading.safetensors_source import WeightError

    folder, ref_model = longcat("pow2", "real_only")
    tensors = load_file(str(folder / "model.safetensors"))
    n_real, n_zero = ref_model.config.n_routed_experts, ref_model.config.zero_expert_num
    unused = sorted(n for n in tensors if any(f".experts.{e}." in n for e in range(n_real, n_real + n_zero)))
    assert len(unused) == 2 * 2 * n_zero and not any("down_proj" in n for n in unused)
    tensors["model.mtp.layers.0.eh_proj.weight"] = torch.zeros(4, 4)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        del tensors[name]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    llm = LLM(str(tmp_path))
    report = llm.loaded.report
    assert sorted(report.skipped) == sorted(unused + ["model.mtp.layers.0.eh_proj.weight"])
    notes = "\n".join(report.notes)
    assert "under model.mtp.: the MTP layer" in notes and "identity expert 4" in notes
    assert "2 optional tensor(s) absent" in notes and "mlp.router.e_score_correction_bias" in notes
    # real_only's bias (-10 on the identity experts) is gone: the reference with a zero bias is the model loaded
    biases = [layer.mlp.router.e_score_correction_bias for layer in ref_model.model.layers]
    kept = [b.clone() for b in biases]
    ids = random_ids(24, ref_model.config.vocab_size)
    try:
        with torch.no_grad():
            for b in biases:
                b.zero_()
        diff, _ = compare_logits(llm.prompt_logits(ids), hf_logits(ref_model, ids))
    finally:
        with torch.no_grad():
            for b, k in zip(biases, kept):
                b.copy_(k)
    assert diff <= fp32_logits_tol(hf_logits(ref_model, ids)), diff  # real_only had 1.4e-6..5.4e-6 with its bias
    tensors["model.layers.0.mlp.experts.9.gate_proj.weight"] = torch.zeros(24, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match=r"experts.9.gate_proj.weight"):
        LLM(str(tmp_path))


@pytest.mark.parametrize(
    ("option", "value"), [("tensor_parallel_size", 2), ("quantization", "int8"), ("speculative", "mtp")]
)
def test_options_it_does_not_run_are_refused(longcat, option, value):
    folder, _ = longcat("pow2")
    with pytest.raises(ConfigError, match=f"longcat_flash with {option}={value!r}: not supported"):
        LLM(str(folder), **{option: value})


def test_convert_to_gguf_is_refused(longcat, tmp_path):
    """llama.cpp has no LongCat architecture (gguf-py's MODEL_ARCH_NAMES lists none): nothing to write it as."""
    gguf = pytest.importorskip("gguf")
    from mlaserve.gguf.convert.convert import convert_hf_to_gguf
    from mlaserve.gguf.convert.tokenizer import ConvertError

    assert not any("longcat" in a.lower() for a in gguf.constants.MODEL_ARCH_NAMES.values())
    folder, _ = longcat("pow2")
    with pytest.raises(ConvertError, match="longcat_flash has no llama.cpp architecture"):
        convert_hf_to_gguf(folder, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_verify_identities_hold(longcat):
    """`mlaserve verify`'s identities on LongCat (absorbed vs decompressed, chunked and token-by-token vs one pass,
    torch vs the reference backend): each within its tolerance (measured up to 2.1e-5 on odd, the absorbed vs
    decompressed pair: both paths' rounding, which test_logits_match_transformers holds to transformers)."""
    from mlaserve.entrypoints.verify import run_checks

    folder, ref_model = longcat("odd")
    checks = run_checks(LLM(str(folder), page_size=8), random_ids(37, ref_model.config.vocab_size))
    assert len(checks) >= 5 and all(c.passed and c.tolerance is not None for c in checks), checks


def test_an_8bit_cache_quantizes_both_sublayers_latent_rows(longcat):
    """kv_cache_dtype int8 stores every attention sublayer's latent rows as 8-bit codes (latent and latent_1),
    and the bytes per token count both (the 8-bit attention itself is held to its derived bound in
    tests/identities/test_kv8_attention.py)."""
    from mlaserve.cache.quantized_rows import QuantizedRows

    folder, _ = longcat("pow2")
    llm = LLM(str(folder), max_num_batched_tokens=16, page_size=8, kv_cache_dtype="int8")
    llm.generate([random_ids(20)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    for layer in llm.runner.cache.layers:
        assert all(isinstance(layer.tensors[name], QuantizedRows) for name in ("latent", "latent_1")), layer
    # per sublayer row: 16 int8 codes + one fp32 scale + 8 fp32 rope values; two layers x two sublayers
    assert llm.runner.cache.measured_bytes_per_token() == 2 * 2 * (16 + 4 + 8 * 4)

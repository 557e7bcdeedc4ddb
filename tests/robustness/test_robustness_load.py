"""Nothing silently wrong at load: NaN/Inf weights and impossible configs or files are caught and
named (config key, tensor, GGUF block), and the command line fails early and says where values came from."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from robustness_helpers import copy_folder, edit_config, patched, tiny_model, walk_header
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.config.model import ConfigError
from mlaserve.entrypoints.cli import main
from mlaserve.gguf.read.file import GGUFError
from mlaserve.loading.safetensors_source import WeightError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture
def folder(tiny, tmp_path):
    return copy_folder(tiny[0], tmp_path / "model")


def _edit_tensor(folder, name, fn):
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors[name])
    save_file(tensors, str(folder / "model.safetensors"))


def _gguf_with(tiny, tmp_path, edit) -> str:
    data = tiny[1].read_bytes()
    path = tmp_path / "bad.gguf"
    path.write_bytes(edit(data, walk_header(data)))
    return str(path)


def _data_start(h) -> int:
    return -(-h.end // 32) * 32


# ------------------------------------------------------------------ non-finite numbers (finding 4)


def test_nan_norm_weight_named_by_check_tensors_and_caught_at_run_time(folder):
    _edit_tensor(folder, "model.layers.1.post_attention_layernorm.weight", lambda t: t.__setitem__(3, math.nan))
    with pytest.raises(WeightError, match=r"model\.layers\.1\.post_attention_layernorm\.weight: 1 NaN"):
        LLM(str(folder), check_tensors=True)
    llm = LLM(str(folder))  # loads: the check is opt-in at load, but the run never serves NaN as a token
    out = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0]
    assert out.finish_reason == "error" and "non-finite logits" in out.error and "--check-tensors" in out.error


def test_inf_embedding_row(folder):
    _edit_tensor(folder, "model.embed_tokens.weight", lambda t: t[6].fill_(math.inf))
    with pytest.raises(WeightError, match=r"model\.embed_tokens\.weight: 0 NaN, \d+ Inf"):
        LLM(str(folder), check_tensors=True)
    out = LLM(str(folder)).generate([[5, 6, 7]], GREEDY)[0].outputs[0]
    assert out.finish_reason == "error" and "non-finite" in out.error


def _nan_scale(data: bytes, h, block: int) -> bytes:
    t = next(t for t in h.tensors if t.name == "blk.1.attn_q_a.weight")
    assert struct.unpack_from("<I", data, t.type_at)[0] == 8  # Q8_0
    rel = struct.unpack_from("<Q", data, t.offset_at)[0]
    return patched(data, _data_start(h) + rel + 34 * block, np.float16(np.nan).tobytes())


def test_nan_q8_0_block_scale_is_named_with_its_block(tiny, tmp_path, capsys):
    path = _gguf_with(tiny, tmp_path, lambda d, h: _nan_scale(d, h, 5))
    with pytest.raises(GGUFError, match=r"blk\.1\.attn_q_a\.weight: block scale NaN/Inf in blocks 5 \(1 of"):
        LLM(path, check_tensors=True)
    assert main(["verify", path, "--check-tensors"]) == 1
    assert "blk.1.attn_q_a.weight: block scale NaN/Inf in blocks 5" in capsys.readouterr().out


def test_verify_check_tensors_passes_a_clean_model(tiny, capsys):
    assert main(["verify", str(tiny[0]), "--check-tensors", "--prompt", "abc"]) == 0
    assert "check tensors: every weight is finite" in capsys.readouterr().out


@pytest.mark.parametrize(
    "changes, key",
    [
        (dict(rms_norm_eps=math.nan), "rms_norm_eps"),
        (dict(rms_norm_eps=-1e-6), "rms_norm_eps"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 0.0}), "rope_theta"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": math.nan}), "rope_theta"),
        (dict(routed_scaling_factor=math.inf), "routed_scaling_factor"),
    ],
)
def test_config_values_that_cannot_be_right(folder, changes, key):
    edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=key):
        LLM(str(folder))


# ------------------------------------------------------------------ impossible configs and files (finding 5)


def test_fewer_layers_than_the_checkpoint_is_an_error(folder):
    edit_config(folder, num_hidden_layers=2, num_nextn_predict_layers=0)
    with pytest.raises(WeightError, match=r"layers >= 2 .*model\.layers\.2\."):
        LLM(str(folder))


@pytest.mark.parametrize("k", [0, 9])
def test_experts_per_token_out_of_range(folder, k):
    edit_config(folder, num_experts_per_tok=k)
    with pytest.raises(ConfigError, match="num_experts_per_tok must be"):
        LLM(str(folder))


def _set_u32(key: str, value: int):
    def edit(data, h):
        kv = h.kvs[key]
        assert kv.vtype == 4
        return patched(data, kv.value_at, struct.pack("<I", value))

    return edit


def test_gguf_expert_used_count_zero(tiny, tmp_path):
    with pytest.raises(ConfigError, match="num_experts_per_tok must be"):
        LLM(_gguf_with(tiny, tmp_path, _set_u32("deepseek2.expert_used_count", 0)))


def test_gguf_offset_into_another_tensor(tiny, tmp_path):
    def edit(data, h):
        a, b = h.tensors[3], h.tensors[4]
        return patched(data, b.offset_at, data[a.offset_at : a.offset_at + 8])  # b's data = a's data

    with pytest.raises(GGUFError, match=f"tensor '{walk_header(tiny[1].read_bytes()).tensors[4].name}'.*overlap"):
        LLM(_gguf_with(tiny, tmp_path, edit))


def test_gguf_size_disagrees_with_type(tiny, tmp_path):
    def edit(data, h):  # an F32 norm retyped F16: half the bytes, the next tensor's offset no longer follows
        t = next(t for t in h.tensors if t.name == "blk.0.attn_norm.weight")
        assert struct.unpack_from("<I", data, t.type_at)[0] == 0
        return patched(data, t.type_at, struct.pack("<I", 1))

    with pytest.raises(GGUFError, match="data offset .* should be"):
        LLM(_gguf_with(tiny, tmp_path, edit))


# ------------------------------------------------------------------ unclear errors (finding 6)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(hidden_size="128"), "hidden_size must be an integer"),
        (dict(hidden_size=128.0), "hidden_size must be an integer"),
        (dict(kv_lora_rank=-4), "kv_lora_rank must be >= 1"),
        (dict(norm_topk_prob=[]), r"norm_topk_prob must be true or false, got \[\]"),
        (dict(bos_token_id=10**6), "bos_token_id 1000000 is outside the vocabulary"),
        (dict(topk_group=3), "topk_group must be in"),
        (dict(n_group=3), "n_group=3 must divide n_routed_experts=8"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok must be in"),
    ],
)
def test_config_errors_name_the_key(folder, changes, match):
    edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=match):
        LLM(str(folder))


def test_config_json_that_is_a_list(folder):
    (folder / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="config.json: must hold a JSON object"):
        LLM(str(folder))


def test_broken_tokenizer_json(folder):
    (folder / "tokenizer.json").write_text('{"model": 7}')
    with pytest.raises(ConfigError, match="tokenizer.json: cannot build the tokenizer"):
        LLM(str(folder))


def test_gguf_block_count_as_a_string(tiny, tmp_path):
    def edit(data, h):  # retype the u32 value as a string of length 3 would shift the header: rebuild it
        kv = h.kvs["deepseek2.block_count"]
        value = struct.unpack_from("<I", data, kv.value_at)[0]
        text = str(value).encode()
        new = struct.pack("<I", 8) + struct.pack("<Q", len(text)) + text
        return data[: kv.type_at] + new + data[kv.value_at + 4 :]

    with pytest.raises(GGUFError, match="block_count' must be an integer, got '3'"):
        LLM(_gguf_with(tiny, tmp_path, edit))


def test_gguf_absurd_tensor_count(tiny, tmp_path):
    def edit(data, h):
        return patched(data, h.n_tensors_at, struct.pack("<Q", 2**63))

    with pytest.raises(GGUFError, match=r"n_tensors=9223372036854775808"):
        LLM(_gguf_with(tiny, tmp_path, edit))


# ------------------------------------------------------------------ the command line (finding 7 items)


@pytest.mark.parametrize("flags", [["--max-tokens", "-1"], ["--temperature", "-2"], ["--top-p", "2"]])
def test_sampling_flags_checked_before_loading(flags, capsys):
    assert main(["generate", *flags, "Hello"]) == 2
    err = capsys.readouterr().err
    assert "mlaserve: error:" in err and "loading model" not in err


def test_trace_into_a_missing_folder_fails_before_loading(tmp_path, capsys):
    assert main(["generate", "--trace", str(tmp_path / "nope" / "t.jsonl"), "Hello"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "loading model" not in err


def test_sampling_note_says_where_each_value_came_from(capsys):
    assert main(["generate", "--max-tokens", "2", "--top-p", "0.5", "Hello"]) == 0
    err = capsys.readouterr().err
    assert "top_p 0.5 (--top-p)" in err and "temperature 0.8 (generation_config.json)" in err


def test_model_help_mentions_gguf(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert ".gguf" in out and "--check-tensors" in out


def test_weights_stay_finite_after_check(tiny):
    llm = LLM(str(tiny[0]), check_tensors=True)
    assert "check_tensors: every weight is finite" in llm.loaded.report.notes
    assert torch.isfinite(llm.prompt_logits([5, 6, 7])).all()


def _set_f32(key: str, value: float):
    def edit(data, h):
        kv = h.kvs[key]
        assert kv.vtype == 6
        return patched(data, kv.value_at, struct.pack("<f", value))

    return edit


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("deepseek2.attention.layer_norm_rms_epsilon", math.nan, "rms_norm_eps"),
        ("deepseek2.attention.layer_norm_rms_epsilon", -1e-6, "rms_norm_eps"),
        ("deepseek2.rope.freq_base", 0.0, "rope_theta"),
        ("deepseek2.rope.freq_base", math.nan, "rope_theta"),
        ("deepseek2.expert_weights_scale", math.inf, "routed_scaling_factor"),
    ],
)
def test_gguf_metadata_values_that_cannot_be_right(tiny, tmp_path, key, value, named):
    with pytest.raises(ValueError, match=named):
        LLM(_gguf_with(tiny, tmp_path, _set_f32(key, value)))


def test_cli_says_once_that_the_context_limit_cut_generation(capsys):
    # 2 pages of 16 tokens: a 32-token context, less than the 64 tokens asked for
    assert main(["generate", "--num-pages", "2", "--max-tokens", "64", "--temperature", "0", "Hello"]) == 0
    err = capsys.readouterr().err
    assert err.count("mlaserve: note:") == 1 and "context limit (max_model_len 32 tokens" in err

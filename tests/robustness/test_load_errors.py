"""Broken inputs that used to load silently wrong or fail unclearly: each is refused (or warned
about, where llama.cpp documents a default) naming the file and the key, tensor or field."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import re
import struct
import warnings

import pytest
import torch
from conftest import fixture_dir
from gguf_helpers import rewrite_gguf
from robustness_helpers import copy_folder, patched, tiny_model, walk_header

from mlaserve import LLM, SamplingParams
from mlaserve.config.model import ConfigError
from mlaserve.gguf.read.checkpoint import GGUFError, load_gguf
from mlaserve.loading.safetensors_source import WeightError

gguf = pytest.importorskip("gguf")


def _ds3_f16():
    return fixture_dir("ds3") / "model-f16.gguf"


def test_gguf_without_merges_is_refused_naming_the_key(tmp_path):
    bad = rewrite_gguf(_ds3_f16(), tmp_path / "nomerges.gguf", drop_keys=["tokenizer.ggml.merges"])
    with pytest.raises(
        GGUFError, match=r"nomerges\.gguf: tokenizer\.ggml\.merges is missing, but the vocabulary has merged tokens"
    ):
        load_gguf(bad, validate_numeric=False).build_tokenizer()


def test_gguf_without_pre_warns_once_naming_the_key_and_uses_the_default(tmp_path):
    bad = rewrite_gguf(_ds3_f16(), tmp_path / "nopre.gguf", drop_keys=["tokenizer.ggml.pre"])
    ck = load_gguf(bad, validate_numeric=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        ck.build_tokenizer()
        ck.build_tokenizer()
    msgs = [str(w.message) for w in caught if "tokenizer.ggml.pre" in str(w.message)]
    assert len(msgs) == 1 and "nopre.gguf" in msgs[0] and "'default'" in msgs[0], msgs


def test_gguf_without_token_list_is_refused_naming_the_key(tmp_path):
    bad = rewrite_gguf(_ds3_f16(), tmp_path / "notokens.gguf", drop_keys=["tokenizer.ggml.tokens"])
    with pytest.raises(GGUFError, match=r"notokens\.gguf: tokenizer\.ggml\.tokens is missing or empty"):
        load_gguf(bad, validate_numeric=False).build_tokenizer()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory)


def test_prompt_logits_refuses_nan_like_generate(tiny):
    """NaN in a weight (set after the load): generate fails the request naming --check-tensors;
    prompt_logits raises the same advice instead of returning NaN."""
    with LLM(str(tiny[0])) as llm:
        llm.runner.model.model.embed_tokens.weight.data[6] = float("nan")
        with pytest.raises(FloatingPointError, match=r"prompt position 1 on .*--check-tensors"):
            llm.prompt_logits([5, 6, 7])
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        assert out.outputs[0].finish_reason == "error" and "--check-tensors" in out.outputs[0].error
        assert torch.isfinite(llm.prompt_logits([5, 7])).all()  # a prompt that avoids it is fine


# --- files that are not what they say -------------------------------------------------------


@pytest.fixture
def folder(tiny, tmp_path):
    return copy_folder(tiny[0], tmp_path / "model")


def test_broken_generation_config_names_the_file(folder):
    (folder / "generation_config.json").write_text("{ broken")
    with pytest.raises(ConfigError, match=r"generation_config\.json: not valid JSON"):
        LLM(str(folder))


def test_broken_tokenizer_config_names_that_file(folder):
    (folder / "tokenizer_config.json").write_text("{ broken")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: not valid JSON"):
        LLM(str(folder))


def test_model_safetensors_as_a_directory_is_named(folder):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    with pytest.raises(WeightError, match=r"model\.safetensors: is a directory, not a regular file"):
        LLM(str(folder))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_symlink_loop_is_named_as_one(folder, name):
    (folder / name).unlink()
    os.symlink(name, folder / name)
    with pytest.raises(ValueError, match=rf"{re.escape(name)}: is a symbolic link loop"):
        LLM(str(folder))


def test_a_model_path_that_is_a_symlink_loop_is_named(tmp_path):
    os.symlink("loop", tmp_path / "loop")
    with pytest.raises(ConfigError, match=r"loop is a symbolic link loop"):
        LLM(str(tmp_path / "loop"))


def _load_in_child(folder, result):
    try:
        LLM(str(folder))
        result.put("loaded")
    except Exception as e:  # noqa: BLE001 -- the message is the result
        result.put(f"{type(e).__name__}: {e}")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_fifo_is_refused_not_opened(folder, name):
    """A FIFO blocks whoever opens it until a writer comes: the load runs in a child process with
    a bounded wait, so a hang fails the test instead of the suite."""
    (folder / name).unlink()
    os.mkfifo(folder / name)
    ctx = multiprocessing.get_context("fork")
    result = ctx.Queue()
    child = ctx.Process(target=_load_in_child, args=(folder, result))
    child.start()
    try:
        msg = result.get(timeout=120)
    except queue.Empty:
        msg = "no answer: the load hung"
    finally:
        child.kill()
        child.join()
    assert re.search(rf"{re.escape(name)}: is a FIFO \(named pipe\), not a regular file", msg), msg


# --- safetensors headers: the tensor at fault, not a neighbour ---------------------------------


def _rewrite_header(path, edit):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8 : 8 + n]), data[8 + n :]
    body = edit(header, body)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    return header


def _middle_tensor(header) -> str:
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    return names[len(names) // 2]


def test_safetensors_shifted_offsets_name_the_tensor(folder):
    picked = []

    def shift(header, body):
        name = _middle_tensor(header)
        picked.append(name)
        header[name]["data_offsets"] = [o + 4 for o in header[name]["data_offsets"]]
        return body

    _rewrite_header(folder / "model.safetensors", shift)
    with pytest.raises(WeightError) as err:
        LLM(str(folder))
    assert f"tensor {picked[0]!r}: data_offsets" in str(err.value), str(err.value)


def test_safetensors_wrong_shape_names_the_tensor_and_sizes(folder):
    picked = []

    def reshape(header, body):
        name = _middle_tensor(header)
        picked.append(name)
        header[name]["shape"] = [header[name]["shape"][0] * 2, *header[name]["shape"][1:]]
        return body

    _rewrite_header(folder / "model.safetensors", reshape)
    with pytest.raises(WeightError, match=rf"tensor {re.escape(repr(picked[0]))}: F32 \[.*\] needs \d+ bytes"):
        LLM(str(folder))


def test_safetensors_truncated_names_the_last_tensor(folder):
    _rewrite_header(folder / "model.safetensors", lambda header, body: body[:-100])
    with pytest.raises(WeightError, match=r"ends at \d+ but the file holds \d+ bytes of data \(truncated"):
        LLM(str(folder))


# --- GGUF header fields checked against the data ----------------------------------------------


@pytest.mark.parametrize("count", [0, 2])
def test_gguf_wrong_leading_dense_block_count_names_the_key(tmp_path, count):
    key = "deepseek2.leading_dense_block_count"  # the ds3 fixture: layer 0 dense, layers 1.. MoE
    bad = rewrite_gguf(_ds3_f16(), tmp_path / "dense.gguf", set_keys={key: (count, gguf.GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match=rf"'{key}'={count} but the first layer with experts .* should be 1"):
        LLM(str(bad))


@pytest.mark.parametrize("claimed", [16, 8])
def test_gguf_alignment_that_does_not_match_the_data_is_refused(tmp_path, claimed):
    """Written with alignment 32 (its header ending 4 bytes past a multiple of 32, so a smaller
    alignment starts the data early), then general.alignment patched: every tensor would be read
    shifted. The data section's end gives it away."""
    good = rewrite_gguf(_ds3_f16(), tmp_path / "good.gguf", alignment=32)
    data = good.read_bytes()
    header = walk_header(data)
    assert 0 < header.end % 32 <= 16  # so the data starts early for 16 and for 8
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(patched(data, header.kvs["general.alignment"].value_at, struct.pack("<I", claimed)))
    with pytest.raises(GGUFError, match=rf"follow the last tensor's data .* with general.alignment={claimed}"):
        load_gguf(bad)
    load_gguf(good)


def test_verify_reports_nan_logits_under_tensor_parallelism_as_a_failed_check(folder):
    """`mlaserve verify --tensor-parallel-size 2` on a model with a NaN weight: the TP comparison is
    a failed check (prompt_logits now refuses NaN), not an uncaught error."""
    from safetensors.torch import load_file, save_file

    from mlaserve.entrypoints.verify import tensor_parallel_check

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.embed_tokens.weight"][6] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"))
    with LLM(str(folder)) as llm:
        check = tensor_parallel_check(llm, [5, 6, 7], 2, {})
    assert not check.passed and check.max_abs_diff != check.max_abs_diff  # NaN

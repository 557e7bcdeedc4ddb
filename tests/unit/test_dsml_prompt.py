"""A DeepSeek-V3.2 / V4 checkpoint without a chat template is prompted with the encoding its release publishes
(engine/dsml_encoding.py; the strings themselves are held to DeepSeek's examples in
tests/identities/test_dsml_official_encoding.py): decided once at load (tools/select.py choose_encoding: the
model type, no template, the encoding's special tokens in the vocabulary), recorded with the reasoning parser
it implies, and used by the chat endpoint for a request with tool calls, tool results and chat_template_kwargs.
A tokenizer without those tokens (the embedded model's) keeps the plain transcript."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer as HFTokenizer

from mlaserve.config.engine import make_options
from mlaserve.embedded import default_model_path
from mlaserve.loading.model_loader import open_checkpoint
from mlaserve.tools.select import choose_encoding, choose_reasoning

BOS = "<｜begin▁of▁sentence｜>"
SPECIALS = [BOS, "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]


def test_choose_encoding():
    has_all, has_none = (lambda t: True), (lambda t: False)
    assert choose_encoding("deepseek_v32", None, has_all) == "deepseek_v32"
    assert choose_encoding("deepseek_v4", "", has_all) == "deepseek_v4"
    assert choose_encoding("deepseek_v32", "{{ messages }}", has_all) is None  # a template wins
    assert choose_encoding("deepseek_v3", None, has_all) is None  # V3 / V3.1 publish templates
    assert choose_encoding("deepseek_v32", None, has_none) is None
    assert choose_encoding("deepseek_v4", None, lambda t: t != "<｜Assistant｜>") is None
    assert choose_reasoning(None, None, "deepseek_v4") == (
        "think",
        "deepseek_v4 encoding (no chat template) writes </think>",
    )
    assert choose_reasoning(None, "none", "deepseek_v4")[0] == "none"


def test_embedded_model_keeps_the_plain_transcript():
    tok = open_checkpoint(default_model_path(), make_options()).tokenizer
    assert tok.encoding is None
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


@pytest.fixture(scope="module")
def v32_llm(tmp_path_factory):
    """The embedded deepseek_v32 model with DeepSeek's chat tokens added to its tokenizer (ids past the model's
    vocabulary: these tests encode prompts, they run no forward pass)."""
    from mlaserve import LLM

    folder = tmp_path_factory.mktemp("v32") / "model"
    shutil.copytree(default_model_path(), folder)
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": BOS}))
    return LLM(str(folder))


def test_decided_at_load_and_recorded(v32_llm):
    assert v32_llm.tokenizer.encoding == "deepseek_v32"
    got = {s.name: (s.value, s.source) for s in v32_llm.config.all_provenance()}
    assert got["tool_call_parser"][0] == "deepseek_v32"
    assert got["reasoning_parser"] == ("think", "deepseek_v32 encoding (no chat template) writes </think>")


def test_chat_request_is_encoded(v32_llm):
    """The server's chat prompt for a call and its result, thinking on: DeepSeek-V3.2's text (a user turn opened
    with <think>, the call in DSML after the empty reasoning, <function_results>, <think> reopened), BOS once."""
    from mlaserve.entrypoints.openai.protocol import ChatCompletionRequest
    from mlaserve.entrypoints.openai.serving import OpenAIServing

    serving = OpenAIServing(v32_llm, None, None, "tiny", 1)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    req = ChatCompletionRequest(
        model="tiny",
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        chat_template_kwargs={"thinking": True},
    )
    ids = serving.chat_prompt(req)
    assert v32_llm.tokenizer.decode(ids, skip_special_tokens=False) == (
        f"{BOS}<｜User｜>Weather?<｜Assistant｜><think></think>\n\n<｜DSML｜function_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜function_calls><｜end▁of▁sentence｜>\n\n<function_results>\n<result>sunny</result>"
        "\n</function_results>\n\n<think>"
    )
    assert ids.count(v32_llm.tokenizer.tok.token_to_id(BOS)) == 1

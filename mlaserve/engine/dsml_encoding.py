"""The prompts of DeepSeek-V3.2 and DeepSeek-V4. These releases publish no Jinja chat template: their Hugging Face
repositories ship a Python encoder instead (`encoding/encoding_dsv32.py`, `encoding/encoding_dsv4.py`, with
`thinking_mode` "chat" or "thinking"). This module writes the same text from the chat transcript that
mlaserve hands a template (tools/request.py `transcript`), so a checkpoint of either family without a template
reads what it was trained on instead of a plain "role: content" transcript.

    encode(ENCODINGS["deepseek_v32"], messages, tools, thinking) -> prompt text

The two encodings, as their encoders write them (BOS first; DSML: tools/formats/deepseek_v32.py):

    V3.2  system    CONTENT [+ "\\n\\n" + tools prompt]
          user      <｜User｜>CONTENT<｜Assistant｜> + (<think> for the last user turn when thinking, else </think>)
          assistant [REASONING</think> after the last user turn, when thinking] CONTENT [\\n\\n<｜DSML｜function_calls>
                    \\n INVOKES \\n</｜DSML｜function_calls>] <｜end▁of▁sentence｜>
          tool      \\n\\n<function_results> (first of a run) \\n<result>CONTENT</result> ... \\n</function_results>
                    \\n\\n + (<think> | </think>) after the run's last result
    V4    system    as V3.2, with V4's tools prompt
          user      <｜User｜>CONTENT, then <｜Assistant｜> + (<think> | </think>) where an assistant turn (or the
                    generation) follows
          tool      results merged into one user turn: <tool_result>CONTENT</tool_result> blocks joined by
                    \\n\\n, in the order of the calls they answer
          assistant as V3.2 with <｜DSML｜tool_calls>; when thinking, reasoning is kept for every turn if the
                    conversation has tools, else only after the last user turn

Request tools ride on the first system message (one is put first when there is none), as the encoders read
them from a system message's `tools`. Not written: V4's "Reasoning Effort" prefix, `latest_reminder` and task
tokens, `response_format`, developer messages (no request field asks for them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlaserve.tools.formats.base import ToolCall
from mlaserve.tools.formats.deepseek_v32 import render_dsml

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"

_V32_TOOLS = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{dsml}function_calls>" block like the following as part of your reply to the user:
<{dsml}function_calls>
<{dsml}invoke name="$FUNCTION_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$FUNCTION_NAME2">
...
</{dsml}invoke>
</{dsml}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{dsml}function_calls>
...
</{dsml}function_calls>
<function_results>
...
</function_results>
{think}...thinking about results{end_think}
Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""

_V4_TOOLS = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside {think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


@dataclass(frozen=True)
class Encoding:
    name: str  # the tool-call format it goes with (tools/formats)
    calls_block: str  # the DSML element around the calls
    tools_prompt: str
    results_in_user_turn: bool  # V4: tool results are a user turn; V3.2: <function_results> in the assistant's


ENCODINGS = {
    "deepseek_v32": Encoding("deepseek_v32", "function_calls", _V32_TOOLS, results_in_user_turn=False),
    "deepseek_v4": Encoding("deepseek_v4", "tool_calls", _V4_TOOLS, results_in_user_turn=True),
}


def encode(enc: Encoding, messages: list[dict], tools: list[dict] | None = None, thinking: bool = False) -> str:
    """messages: the transcript (role, content, tool_calls with function.arguments as JSON text or an object,
    tool_call_id, reasoning_content); tools: the request's OpenAI tools; thinking: the encoders' "thinking" mode."""
    msgs = _with_tools([dict(m) for m in messages], tools)
    if enc.results_in_user_turn:
        return BOS + _encode_v4(enc, _merge_results(msgs), thinking)
    return BOS + _encode_v32(enc, msgs, thinking)


def _with_tools(msgs: list[dict], tools: list[dict] | None) -> list[dict]:
    if not tools:
        return msgs
    at = next((i for i, m in enumerate(msgs) if m["role"] == "system"), None)
    if at is None:
        msgs.insert(0, {"role": "system", "content": ""})
        at = 0
    msgs[at]["tools"] = tools
    return msgs


def _system(enc: Encoding, m: dict) -> str:
    out = m.get("content") or ""
    if m.get("tools"):
        schemas = "\n".join(_json(t["function"]) for t in m["tools"])
        out += "\n\n" + enc.tools_prompt.format(dsml=DSML, think=THINK, end_think=END_THINK, schemas=schemas)
    return out


def _assistant(enc: Encoding, m: dict, reasoning: str | None) -> str:
    """reasoning: None writes no thinking part; text (maybe empty) writes TEXT</think>."""
    calls = ""
    if m.get("tool_calls"):
        block = f"<{DSML}{enc.calls_block}>"
        calls = render_dsml([_call(c["function"]) for c in m["tool_calls"]], block, block.replace("<", "</", 1))
    head = "" if reasoning is None else reasoning + END_THINK
    return head + (m.get("content") or "") + calls + EOS


def _call(fn: dict) -> ToolCall:
    args = fn.get("arguments")  # JSON text, or the object (the formats whose templates iterate arguments)
    return ToolCall(fn["name"], args if isinstance(args, str) else _json(args or {}))


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _last_user(msgs: list[dict]) -> int:
    return max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)


def _encode_v32(enc: Encoding, msgs: list[dict], thinking: bool) -> str:
    last_user, out = _last_user(msgs), []
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system":
            out.append(_system(enc, m))
        elif role == "user":
            out.append(
                USER + (m.get("content") or "") + ASSISTANT + (THINK if thinking and i == last_user else END_THINK)
            )
        elif role == "assistant":
            reasoning = (m.get("reasoning_content") or "") if thinking and i > last_user else None
            out.append(_assistant(enc, m, reasoning))
        elif role == "tool":
            k, calls = _answered_call(msgs, i)
            text = ("\n\n<function_results>" if k == 0 else "") + f"\n<result>{m.get('content') or ''}</result>"
            if k == len(calls) - 1:
                text += "\n</function_results>\n\n" + (THINK if thinking and i >= last_user else END_THINK)
            out.append(text)
        else:
            raise ValueError(f"messages[{i}]: role {role!r} is not written by the {enc.name} encoding")
    return "".join(out)


def _answered_call(msgs: list[dict], i: int) -> tuple[int, list]:
    """(which call of the assistant turn before it tool message i answers, that turn's calls): V3.2 counts the
    results after an assistant turn in order, one per call."""
    j = i
    while j > 0 and msgs[j - 1]["role"] == "tool":
        j -= 1
    calls = msgs[j - 1].get("tool_calls") if j > 0 and msgs[j - 1]["role"] == "assistant" else None
    if not calls or i - j >= len(calls):
        raise ValueError(f"messages[{i}]: a tool result with no assistant tool call before it to answer")
    return i - j, calls


def _merge_results(msgs: list[dict]) -> list[dict]:
    """V4: user messages and tool results that follow one another are one user turn of blocks, joined by a
    blank line: text as it is, each result as <tool_result>...</tool_result>, results in the order of the
    calls they answer (by tool_call_id)."""
    out, order = [], {}
    for m in msgs:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            order = {c.get("id"): k for k, c in enumerate(m["tool_calls"]) if c.get("id")}
        if role in ("user", "tool"):
            kind, at = ("result", order.get(m.get("tool_call_id"), 0)) if role == "tool" else ("text", 0)
            block = (kind, m.get("content") or "", at)
            if out and out[-1]["role"] == "user":
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block]})
        else:
            out.append(m)
    for m in out:
        if m["role"] == "user":  # results sorted into the result slots, text blocks stay where they are
            results = iter(sorted((b for b in m["blocks"] if b[0] == "result"), key=lambda b: b[2]))
            m["content"] = "\n\n".join(
                f"<tool_result>{next(results)[1]}</tool_result>" if b[0] == "result" else b[1] for b in m["blocks"]
            )
    return out


def _encode_v4(enc: Encoding, msgs: list[dict], thinking: bool) -> str:
    last_user, out = _last_user(msgs), []
    keep_reasoning = any(m.get("tools") for m in msgs)  # V4 keeps every turn's thinking when tools are given
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system":
            out.append(_system(enc, m))
        elif role == "user":
            out.append(USER + (m.get("content") or ""))
        elif role == "assistant":
            keep = thinking and (keep_reasoning or i > last_user)
            out.append(_assistant(enc, m, (m.get("reasoning_content") or "") if keep else None))
        else:
            raise ValueError(f"messages[{i}]: role {role!r} is not written by the {enc.name} encoding")
        if role == "user" and (i + 1 == len(msgs) or msgs[i + 1]["role"] == "assistant"):
            opens = thinking and (keep_reasoning or i >= last_user)
            out.append(ASSISTANT + (THINK if opens else END_THINK))
    return "".join(out)

"""An agent framework nobody here wrote (the `openai-agents` SDK, over Chat Completions) drives a real
server on the embedded model end to end, offline: the first turn must call the test's function tool
(`tool_choice="required"`: the tiny model would not choose one), the SDK parses the call and runs the
function, sends its result back as a `role: tool` message, and the next turn (the SDK resets the tool
choice after a tool ran) ends the run with an answer. Every request the SDK sends is recorded on its
way to the server, so the test sees the transcript the server saw."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI
from pydantic import Field

agents = pytest.importorskip("agents")
agents.set_tracing_disabled(True)  # nothing is exported: the run stays offline

RESULT = "sunny, 31 degrees"


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server  # the session's (conftest.py): these tests only send it requests


def _run(server, seed: int):
    calls: list[dict] = []
    sent: list[dict] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather forecast for a city."""
        calls.append({"city": city, "days": days})
        return RESULT

    async def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.content))

    async def main():
        http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120)
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, http_client=http)
        agent = agents.Agent(
            name="forecaster",
            instructions="Answer with the weather.",
            model=agents.OpenAIChatCompletionsModel(model=server.model, openai_client=client),
            # no max_tokens: each turn may use the rest of the 512-token context (a call takes ~230)
            model_settings=agents.ModelSettings(
                tool_choice="required",
                parallel_tool_calls=False,
                temperature=1.0,
                extra_args={"seed": seed},
            ),
            tools=[get_weather],
        )
        try:
            return await asyncio.wait_for(
                agents.Runner.run(agent, "What is the weather in Jerusalem?", max_turns=4), 300
            )
        finally:
            await http.aclose()

    return asyncio.run(main()), calls, sent, get_weather.params_json_schema


SEEDS = (0, 1)


@pytest.fixture(scope="module")
def runs(server):
    """seed -> the future of its run: the runs go to the server at once (its batch holds both; one after the
    other they took twice the time), each test takes its own seed's result or exception."""
    pool = ThreadPoolExecutor(len(SEEDS))
    yield {seed: pool.submit(_run, server, seed) for seed in SEEDS}
    pool.shutdown()


@pytest.mark.parametrize("seed", SEEDS)
def test_agent_calls_the_tool_and_answers(server, runs, seed):
    result, calls, sent, schema = runs[seed].result()
    # the function ran once, on arguments the SDK parsed from the call, and they fit its schema
    assert len(calls) == 1, (calls, [i.type for i in result.new_items])
    jsonschema.validate(calls[0], schema)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert result.new_items[1].output == RESULT
    # two requests: the required call, then the transcript with the tool's result and no forced call
    assert len(sent) == 2, [s.get("tool_choice") for s in sent]
    assert sent[0]["tool_choice"] == "required" and not any(m["role"] == "tool" for m in sent[0]["messages"])
    assert sent[1].get("tool_choice") in (None, "auto")
    call = next(m for m in sent[1]["messages"] if m["role"] == "assistant")["tool_calls"][0]
    tool = next(m for m in sent[1]["messages"] if m["role"] == "tool")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == calls[0]
    assert tool["tool_call_id"] == call["id"] and RESULT in str(tool["content"])
    tokens = server.post("/tokenize", json={"messages": sent[1]["messages"]}).json()["tokens"]
    assert RESULT in server.post("/detokenize", json={"tokens": tokens}).json()["prompt"]  # rendered, not dropped
    # the run finished with an answer (whatever text the random-weight model wrote)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert result.raw_responses[-1].usage.input_tokens > result.raw_responses[0].usage.input_tokens

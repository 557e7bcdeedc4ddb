"""Structured output under tensor parallelism (CPU, gloo, 2 processes) on the embedded model (it has a
tokenizer, which a grammar needs): the engine, its grammar matchers and the bitmask live on rank 0, which
samples from the gathered logits; workers only run the forward. The constrained output validates
(jsonschema) and equals one process's, greedy and seeded."""

from __future__ import annotations

import json

import jsonschema

from mlaserve import LLM, SamplingParams, StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["name", "n"],
}


def test_tp2_constrained_output_validates_and_equals_tp1():
    params = [
        SamplingParams(max_tokens=48, temperature=0.0, structured=StructuredOutputs(json=SCHEMA)),
        SamplingParams(max_tokens=48, temperature=1.0, seed=7, structured=StructuredOutputs(json=SCHEMA)),
    ]
    prompts = ["In the beginning", "And Jesus said unto them,"]
    one = [o.outputs[0] for o in LLM().generate(prompts, params)]
    with LLM(tensor_parallel_size=2) as llm:
        two = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [c.text for c in two] == [c.text for c in one]
    for c in two:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)

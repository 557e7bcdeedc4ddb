"""Structured output: constrain a request's tokens to a JSON schema, a regex, a choice or a grammar.

    spec.py     StructuredOutputs, the request's constraint (pure data)
    backend.py  the grammar engine behind one small interface: compile (cached), a matcher per
                request, and the batched token bitmask the sampler applies in its one step
    utf8.py     the UTF-8 automaton each matcher also follows: its mask keeps the output well-formed UTF-8

The grammar engine is xgrammar: its JSON-schema compiler covers the schema keywords the OpenAI API
documents, it compiles each grammar once against the whole vocabulary (the cache makes repeated
schemas free), fills a batch's bitmask row by row into one tensor, and its matcher can roll tokens back
(what speculative decoding needs).
"""

from mlaserve.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]

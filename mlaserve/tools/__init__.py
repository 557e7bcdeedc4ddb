"""Tool calls: each model family's own tool-call format (one file per format in formats/), the grammar
that makes a call valid by construction (xgrammar's structural tag for that format, built from the tools'
JSON schemas), and the parse of the model's text back into OpenAI `tool_calls`.

    formats/      one module per format: START marker, parse(text, tools), render(calls)
    select.py     which format a checkpoint uses (model type + chat template), or --tool-call-parser
    request.py    OpenAI tools / tool_choice / parallel_tool_calls -> a StructuredOutputs; transcript messages
"""

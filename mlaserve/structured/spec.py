"""What a request constrains its output to (`SamplingParams(structured=StructuredOutputs(...))`).

Pure data, checked on construction; no grammar engine is imported here (see backend.py).
Exactly one of the kinds is set:

    json         a JSON schema (dict, or its JSON text): the output is one JSON value valid against it
    json_object  True: the output is one JSON object (any keys)
    regex        the output matches this regular expression (whole output)
    choice       the output is exactly one of these strings
    grammar      an EBNF grammar (GBNF-style, `root ::= ...`)
    structural_tag  an xgrammar structural tag (dict or JSON text): free text with constrained
                 sections, e.g. a model's tool calls (mlaserve/tools/)

`after_reasoning` ("inside" | "optional"; default None) puts a reasoning block before the constraint: the
model reasons freely up to `</think>`, then the constraint holds (structured/reasoning.py; a chat request sets
it from its prompt when the reasoning parser is on).

The field names are vLLM's `structured_outputs` names. `strict` (json only; default True): the output must
validate, so a schema with a part the grammar engine does not enforce (structured/strict.py) is refused;
False is OpenAI's `strict: false`, best effort (the grammar holds what it enforces, the rest is not promised).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# where a thinking request's constraint starts (structured/reasoning.py builds the grammar of each): "inside" a
# reasoning block the prompt opened, or after an "optional" one the model may open
REASONING_MODES = ("inside", "optional")

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: Any = None
    strict: bool = True
    after_reasoning: str | None = None  # None | "inside" | "optional" (REASONING_MODES; structured/reasoning.py)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured json: the schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured json: the schema must be a JSON object, got {type(schema).__name__}")
            set_("json", json.dumps(schema))  # text: a cache key; property order kept (generation order)
        if self.structural_tag is not None:
            tag = self.structural_tag
            if isinstance(tag, str):
                try:
                    tag = json.loads(tag)
                except ValueError as e:
                    raise ValueError(f"structured structural_tag: not valid JSON: {e}") from None
            if not isinstance(tag, dict):
                raise ValueError(f"structured structural_tag must be a JSON object, got {type(tag).__name__}")
            set_("structural_tag", json.dumps(tag))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured choice must hold only non-empty strings, got {self.choice!r}")
            set_("choice", tuple(self.choice))
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError(f"structured outputs need exactly one of {', '.join(KINDS)}; got {kinds or 'none'}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"structured strict must be a bool, got {self.strict!r}")
        if self.strict and self.json is not None:
            check_strict(self.schema, "structured json")
        if self.after_reasoning is not None:
            if self.after_reasoning not in REASONING_MODES:
                raise ValueError(
                    f"structured after_reasoning must be one of {', '.join(REASONING_MODES)}, "
                    f"got {self.after_reasoning!r}"
                )

    def kinds(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    @property
    def schema(self) -> Any:
        """The JSON schema as a Python object (json kind only)."""
        return json.loads(self.json) if self.json is not None else None

    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar is cached under."""
        k = self.kind
        value = getattr(self, k)
        if k == "choice":
            value = json.dumps(list(value))
        elif k == "json_object":
            value = ""
        if self.after_reasoning is not None:  # another grammar: the reasoning block comes first
            k = f"{k}+after_reasoning={self.after_reasoning}"
        return k, value


def choice_regex(choice) -> str:
    """A regex that matches exactly one of the strings (xgrammar's regex dialect: every metacharacter escaped)."""
    return "|".join("(" + "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/-" else ch for ch in s) + ")" for s in choice)


def check_strict(schema, where: str) -> None:
    """ValueError naming each part of `schema` the grammar would not enforce (a strict request must validate)."""
    from mlaserve.structured.strict import unenforced

    bad = unenforced(schema)
    if bad:
        raise ValueError(
            f"{where}: the grammar engine does not enforce {'; '.join(bad)}: the output could not be "
            "guaranteed to validate (strict); set strict: false for best effort"
        )

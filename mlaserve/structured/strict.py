"""Which parts of a JSON schema the grammar engine does not enforce exactly.

xgrammar compiles most of JSON Schema into the grammar, but a few keywords it approximates or skips
(measured on xgrammar 0.2: each one below let an invalid string through its grammar):

    not                          ignored
    if / then / else             ignored
    allOf with 2+ subschemas     only partly merged
    oneOf                        read as anyOf unless its branches are provably disjoint (we accept
                                 distinct single types other than integer + number)
    multipleOf on a non-integer  ignored ("not supported for type: number")
    multipleOf with min / max    multipleOf ignored (integer 59 passes multipleOf 5 with a minimum)
    min/maxLength with a pattern the lengths ignored ("pattern combined with minLength/maxLength is not
                                 supported"; with a format likewise)

One more it gets wrong is worked around instead (`plain_length_strings`, applied to every schema the
grammar engine compiles, tools' parameters included): a string with only minLength / maxLength.

A strict request (`strict: true`, or no `strict`: the default here) must get an output that validates,
so such a schema is refused naming the keyword and where it is; `strict: false` is OpenAI's best effort:
the grammar holds what it enforces and the rest is not guaranteed.
"""

from __future__ import annotations

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> subschema
_ONE = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties", "additionalItems")
_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")


def unenforced(schema, where: str = "#") -> list[str]:
    """-> ["#/properties/a: not", ...]: every place the grammar would not enforce, in schema order."""
    if not isinstance(schema, dict):
        return []
    out: list[str] = []
    for key in ("not", "if", "then", "else"):
        if key in schema:
            out.append(f"{where}: {key}")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        out.append(f"{where}: allOf with {len(schema['allOf'])} subschemas")
    if isinstance(schema.get("oneOf"), list) and not _disjoint(schema["oneOf"]):
        out.append(f"{where}: oneOf whose branches may overlap")
    if "multipleOf" in schema and (schema.get("type") != "integer" or not _whole(schema["multipleOf"])):
        out.append(f"{where}: multipleOf {schema['multipleOf']!r} on a non-integer")
    elif "multipleOf" in schema and any(k in schema for k in _BOUNDS):
        out.append(f"{where}: multipleOf with a minimum or maximum")
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        out.append(f"{where}: minLength / maxLength with a pattern or format")
    for key in _MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                out += unenforced(sub, f"{where}/{key}/{name}")
    for key in _ONE:
        if isinstance(schema.get(key), list):  # items as a list (draft 4's tuple form)
            for i, sub in enumerate(schema[key]):
                out += unenforced(sub, f"{where}/{key}/{i}")
        else:
            out += unenforced(schema.get(key), f"{where}/{key}")
    for key in _LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                out += unenforced(sub, f"{where}/{key}/{i}")
    return out


def _whole(x) -> bool:
    return isinstance(x, int) or (isinstance(x, float) and x.is_integer())


def _disjoint(branches: list) -> bool:
    types = [b.get("type") if isinstance(b, dict) else None for b in branches]
    if len(branches) < 2:
        return True
    if not all(isinstance(t, str) for t in types) or len(set(types)) != len(types):
        return False
    return not {"integer", "number"} <= set(types)


def plain_length_strings(schema):
    """xgrammar's grammar for a string with only minLength / maxLength lets raw control characters through
    (U+0000..U+001F unescaped: not JSON; found by tests/identities/test_structured_fuzz.py, and in tool calls' arguments by
    test_tool_grammar_formats.py); the same
    lengths as a pattern of non-control characters are exact (neither form writes escapes). Values under
    enum / const / default / examples are data and stay as they are."""
    if isinstance(schema, list):
        return [plain_length_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: (v if k in ("enum", "const", "default", "examples") else plain_length_strings(v)) for k, v in schema.items()
    }
    lengths = ("minLength" in out or "maxLength" in out) and "pattern" not in out and "format" not in out
    if out.get("type") == "string" and lengths:
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")  # xgrammar reads a pattern or lengths
        out["pattern"] = f"^[^\\x00-\\x1f]{{{lo},{hi}}}$"
    return out

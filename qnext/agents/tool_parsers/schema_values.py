"""Text parameter values (Qwen3.5's XML calls) to JSON, with the types in the tool's JSON schema.

The XML format writes every value as raw text: objects and arrays as JSON, everything else as plain text, so `3`
and `"3"` look alike and only the schema says which one was meant."""
from __future__ import annotations

import json
import re

_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def schema_types(schema: dict | None) -> list[str]:
    """The JSON types a (sub)schema allows, in its order (`type`, a list of types, or anyOf / oneOf branches)."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    if "enum" in schema and schema["enum"]:
        return [_json_type(v) for v in schema["enum"]]
    types = []
    for branch in (schema.get("anyOf") or schema.get("oneOf") or []):
        types += [x for x in schema_types(branch) if x not in types]
    return types


def _json_type(v) -> str:
    return ("null" if v is None else "boolean" if isinstance(v, bool) else "integer" if isinstance(v, int)
            else "number" if isinstance(v, float) else "string" if isinstance(v, str)
            else "array" if isinstance(v, list) else "object")


def value_to_json(text: str, schema: dict | None) -> str:
    """The JSON text of one parameter value. Types are tried in the schema's order, strings last; a value that
    fits none of them (or a parameter the schema does not declare) stays a string."""
    types = schema_types(schema)
    for t in sorted(types, key=lambda t: t == "string"):
        converted = _as(t, text)
        if converted is not None:
            return converted
    return json.dumps(text, ensure_ascii=False)


def _as(json_type: str, text: str) -> str | None:
    s = text.strip()
    if json_type == "string":
        return json.dumps(text, ensure_ascii=False)
    if json_type == "integer" and _INTEGER.fullmatch(s):
        return str(int(s))
    if json_type == "number" and _NUMBER.fullmatch(s):
        return s
    if json_type == "boolean" and s.lower() in ("true", "false"):
        return s.lower()
    if json_type == "null" and s.lower() in ("null", "none"):
        return "null"
    if json_type in ("object", "array"):
        try:
            value = json.loads(s)
        except ValueError:
            return None
        if isinstance(value, dict if json_type == "object" else list):
            return json.dumps(value, ensure_ascii=False)
    return None

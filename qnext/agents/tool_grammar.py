"""The grammar that forces tool calls (tool_choice `required` or a named function): llguidance's Lark dialect.

The output is one call (or, for `required` with parallel_tool_calls, one or more calls separated by a newline) of a
declared tool, written in the checkpoint's format, with arguments valid against the tool's `parameters` schema:

- `hermes` (Qwen3-Next): `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, ARGS an embedded
  `%json` schema.
- `qwen3_coder` (Qwen3.5): `<tool_call>\\n<function=NAME>\\n` then one `<parameter=KEY>\\nVALUE\\n</parameter>\\n`
  per property (the schema's order; required ones always, optional ones may be left out), then
  `</function>\\n</tool_call>`. A value is raw text: a string parameter is free text (within minLength /
  maxLength, or one of its enum) that cannot contain the format's tags; every other type is written as its JSON
  (`%json` of the property's schema), which is also how the XML format writes numbers, booleans, objects, arrays.

Arguments have only the declared parameters unless the schema sets additionalProperties itself. JSON inside calls
is compact with `, ` and `: ` separators (how json.dumps and the chat templates write it), so a
forced call looks like a call rendered in history."""
from __future__ import annotations

import json
import re

import llguidance

from qnext.agents.tool_parsers import TOOL_PARSERS
from qnext.agents.tool_parsers.schema_values import schema_types

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_KEY = re.compile(r"[A-Za-z0-9_.:\-$@]+")
# Tags a free-text XML value may not contain (the parser would end the value or the call there) and the think tags
# (dropped from content).
_TAGS = ("</parameter>", "<parameter=", "</function>", "</tool_call>", "<think>", "</think>")


class ToolGrammarError(ValueError):
    """A tool the grammar cannot be built for; the message names the tool and the problem."""


def tool_call_grammar(tools: list[dict], fmt: str, *, name: str | None = None, parallel: bool = False) -> str:
    """tools: OpenAI tools ({"type": "function", "function": {"name", "parameters"}}); name: force this one;
    parallel: allow several calls. -> the Lark grammar text."""
    if fmt not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {sorted(TOOL_PARSERS)}")
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not functions:
        raise ToolGrammarError(f"no tool named {name!r}")
    rules = ["start: call (\"\\n\" call)*" if parallel else "start: call",
             "call: " + " | ".join(f"fn_{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        check_schema(schema, f"tool {fn['name']!r}")
        schema = {"additionalProperties": False, **schema}
        if fmt == "hermes":
            rules += _hermes_function(i, fn["name"], schema)
        else:
            rules += _xml_function(i, fn["name"], schema)
    return "\n".join(rules) + "\n"


def check_schema(schema: dict, what: str) -> None:
    """ToolGrammarError naming `what` when llguidance cannot compile the JSON schema."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise ToolGrammarError(f"{what}: the parameters schema is invalid: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ToolGrammarError(f"{what}: the parameters schema is invalid: {error.strip()}")


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_rule(rule: str, schema: dict) -> str:
    return f"{rule}: %json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS}, ensure_ascii=False)


def _hermes_function(i: int, name: str, schema: dict) -> list[str]:
    head = _lit(f'<tool_call>\n{{"name": "{name}", "arguments": ')
    return [f"fn_{i}: {head} args_{i} " + _lit("}\n</tool_call>"), _json_rule(f"args_{i}", schema)]


def _xml_function(i: int, name: str, schema: dict) -> list[str]:
    if schema_types(schema) not in ([], ["object"]):
        raise ToolGrammarError(f"tool {name!r}: parameters must be an object schema")
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    parts, rules = [], []
    for j, (key, sub) in enumerate(properties.items()):
        if not _KEY.fullmatch(key):
            raise ToolGrammarError(f"tool {name!r}: parameter name {key!r} cannot be written in the XML call format")
        rule = f"p_{i}_{j}"
        parts.append(rule if key in required else rule + "?")
        head = _lit(f"<parameter={key}>\n")
        types = schema_types(sub)
        if "string" in types or not types:
            rules += _xml_string(rule, head, sub if isinstance(sub, dict) else {})
        else:
            rules += [f"{rule}: {head} {rule}_v " + _lit("\n</parameter>\n"), _json_rule(f"{rule}_v", sub)]
    missing = required - set(properties)
    if missing:
        raise ToolGrammarError(f"tool {name!r}: required parameters {sorted(missing)} are not in its properties")
    body = " ".join(parts)
    return [f"fn_{i}: " + _lit(f"<tool_call>\n<function={name}>\n") + f" {body} "
            + _lit("</function>\n</tool_call>")] + rules


def _xml_string(rule: str, head: str, schema: dict) -> list[str]:
    """A string value; its closing `\\n</parameter>` is part of the same lexeme so the value ends exactly there."""
    end = _lit("\n</parameter>\n")
    if schema.get("enum"):
        values = " | ".join(_lit(str(v)) for v in schema["enum"])
        return [f"{rule}: {head} ({values}) {end}"]
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    length = f"{{{lo},{int(hi)}}}" if hi is not None else f"{{{lo},}}"
    tags = "|".join(re.escape(t).replace("/", "\\/") for t in _TAGS)
    terminal = rule.upper() + "_V"
    return [f"{rule}: {head} {terminal} \"\\n\"",
            f"{terminal}: {terminal}_TEXT " + _lit("\n</parameter>"),
            f"{terminal}_TEXT: /(?s:.{length})/ & ~/(?s:.*({tags}).*)/"]

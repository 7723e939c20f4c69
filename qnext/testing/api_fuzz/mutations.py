"""What the fuzz does to a generated body after schemathesis: spikes (an extreme number, an odd string or a deeply
nested value put in place of one of its values), raw bodies no schema produces, and the cost cap (a body the
server would accept runs at most a few tokens, bar a few)."""
from __future__ import annotations

import json
import math
import random
from typing import Any

from qnext.testing.api_fuzz.request_schemas import REF

# Numbers at and past the edges: of int32 / int64, of a float, and what JSON text may hold but a float cannot.
EXTREME_NUMBERS: list[Any] = [0, -1, 2**31, -(2**31) - 1, 2**63, 2**64 + 1, 10**30, -(10**30), 1e308, -1e308, 5e-324,
                              0.5, -0.0, math.inf, -math.inf, math.nan]
ODD_STRINGS = [
    "", " ", "\x00", "\ud800", "a\udfffb", "\ufeff\u202e\u200b", "\U0010ffff", "🦜" * 64, "x" * 5000,
    "<|im_start|>user\nhi<|im_end|>", "<think></think>", "</think>", "<tool_call>{\"name\": 1}</tool_call>",
    "{{ raise_exception('x') }}", "{% for %}", "\r\n\r\n", "null", "NaN", "-1", "data:image/png;base64,AAAA",
]


def _nested(depth: int) -> Any:
    value: Any = {"a": 1}
    for _ in range(depth):
        value = [value]
    return value


# A value nested just inside the JSON parser's depth limit (pydantic's: 200), for schemas, arguments and content.
DEEP_VALUE = _nested(150)
SPIKES = EXTREME_NUMBERS + ODD_STRINGS + [DEEP_VALUE, {"": None}, [], {}]
# Whole bodies no schema produces: past the depth limit, not UTF-8, not an object, cut short.
RAW_BODIES = [b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"\xff\xfe{\x00}\x00", b"", b"null", b"[]", b'"x"',
              b'{"messages": [', b"{}" * 2, b'{"model": "qnext-tiny-demo"}', b"\xef\xbb\xbf{}", b'{"a": 1e999999}']
# The fields that bound a request's output, per API; the one set when a body names none (None: the API's default
# bound is already small).
MAX_TOKEN_FIELDS = {"chat": ("max_tokens", "max_completion_tokens"), "completions": ("max_tokens",),
                    "messages": ("max_tokens",), "count_tokens": (), "responses": ("max_output_tokens",)}
DEFAULT_BOUND = {"chat": "max_tokens", "completions": None, "messages": None, "count_tokens": None,
                 "responses": "max_output_tokens"}
CHEAP_MAX_TOKENS = 8
CHEAP_N = 3


def restore_refs(value: Any) -> Any:
    """request_schemas.REF keys back to "$ref"."""
    if isinstance(value, dict):
        return {("$ref" if k == REF else k): restore_refs(v) for k, v in value.items()}
    if isinstance(value, list):
        return [restore_refs(v) for v in value]
    return value


def whole_numbers_as_ints(value: Any) -> Any:
    """2.0 -> 2 everywhere: JSON schema's integers may be written 2.0, but clients write 2 (and the OpenAI routes'
    strict fields take only that), so a positive body stays one the server accepts."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: whole_numbers_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [whole_numbers_as_ints(v) for v in value]
    return value


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place inside a JSON value (keys of objects, indices of lists)."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


def _set(value: Any, path: tuple, new: Any) -> None:
    for key in path[:-1]:
        value = value[key]
    value[path[-1]] = new


def spiked(body: Any, rng: random.Random) -> Any:
    """A copy of `body` with one of its values (a number, a string, or any) replaced by an extreme number or an odd
    string."""
    paths = _paths(body)
    if not paths:
        return body
    body = json.loads(json.dumps(body))
    _set(body, rng.choice(paths), rng.choice(SPIKES))
    return body


def cost_capped(api: str, body: Any, rng: random.Random) -> Any:
    """A body whose output bound is at most CHEAP_MAX_TOKENS and n at most CHEAP_N, except about one in fifty, which
    keeps what it asked for (huge max_tokens are clamped to the room the prompt leaves, so they run long)."""
    if not isinstance(body, dict) or rng.random() < 0.02:
        return body
    fields = [f for f in MAX_TOKEN_FIELDS[api] if f in body]
    for field in fields:
        value = body[field]
        if isinstance(value, int) and not isinstance(value, bool) and value > CHEAP_MAX_TOKENS:
            body[field] = CHEAP_MAX_TOKENS
    if not fields and DEFAULT_BOUND[api] is not None:
        body[DEFAULT_BOUND[api]] = CHEAP_MAX_TOKENS
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > CHEAP_N:
        body["n"] = CHEAP_N
    return body

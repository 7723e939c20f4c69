"""The agent routes' JSON bodies (Anthropic Messages, Responses) are parsed as strictly as the OpenAI routes' models
parse theirs: what cannot be answered back in JSON, or would exhaust the parser, is a 400 that says why."""
from __future__ import annotations

import pytest

from qnext.server.agent_serving import json_object
from qnext.server.errors import APIError


@pytest.mark.parametrize("raw, words", [
    (b'{"input": "hi", "temperature": NaN}', "not valid JSON"),
    (b'{"input": "hi", "user": -Infinity}', "not valid JSON"),
    (b'{"input": "hi", "top_p": 1e400}', "top_p: a number beyond the range of a 64-bit float"),
    (b'{"input": [{"content": [1, 2e999]}]}', "input.0.content.1: a number beyond"),
    (b'{"input": "a\\ud800b"}', "not valid JSON"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1]", "must be a JSON object"),
])
def test_bodies_json_cannot_carry_are_refused(raw, words):
    with pytest.raises(APIError) as e:
        json_object(raw)
    assert e.value.status == 400 and words in e.value.message


def test_a_plain_body_parses():
    assert json_object('{"input": "h\\u00e9 \U0001F99C", "n": 184467440737095516161, "t": 0.5}'.encode()) == \
        {"input": "hé 🦜", "n": 184467440737095516161, "t": 0.5}

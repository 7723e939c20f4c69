"""Tool calls and structured outputs through the official openai client against `qnext serve` on a tiny
Qwen3-Next checkpoint with a Qwen3-Next-Instruct-style template (JSON calls in `<tool_call>`, the `hermes` parser
chosen from the template; no thinking). One server for the module."""
from __future__ import annotations

import json

import pytest

from qnext.testing.tiny_tokenizer import TINY_HERMES_CHAT_TEMPLATE
from tests.support.agent_server_cases import (BLOCK_SIZE, MESSAGES, TOOLS, agent_server, assemble_stream,
                                              check_many_forced, write_checkpoint)

MODEL = "tiny-qwen3-next"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next",
                                  chat_template=TINY_HERMES_CHAT_TEMPLATE)
    with agent_server(checkpoint, MODEL, tmp_path_factory.mktemp("server")) as c:
        yield c


def test_forced_outputs_parse_and_validate(client):
    check_many_forced(client, MODEL, 24)


def test_streamed_calls_equal_the_non_streamed_ones(client):
    for tool_choice, parallel in (("required", True), ({"type": "function", "function": {"name": "search"}}, False)):
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, temperature=1.0,
                      max_tokens=600, seed=21, parallel_tool_calls=parallel)
        whole = client.chat.completions.create(**kwargs)
        streamed = assemble_stream(client.chat.completions.create(stream=True, **kwargs))
        calls = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
        assert streamed["tool_calls"] == calls and streamed["finish_reason"] == whole.choices[0].finish_reason
        assert whole.choices[0].finish_reason == "tool_calls"


def test_auto_and_no_reasoning_without_think(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=1.0, max_tokens=24, seed=4,
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    whole = client.chat.completions.create(**kwargs).choices[0].message
    streamed = assemble_stream(client.chat.completions.create(stream=True, **kwargs))
    assert streamed["content"] == (whole.content or "") and streamed["reasoning"] is None
    assert "reasoning_content" not in whole.model_extra


def test_tool_result_turn_renders_and_reuses_the_cache(client):
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=1.0,
                                           max_tokens=200, seed=8, tool_choice="required",
                                           parallel_tool_calls=False)
    message = first.choices[0].message
    messages = MESSAGES + [message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                           {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21 C, sunny"},
                           {"role": "user", "content": "Thanks. And tomorrow?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=200, seed=9,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = second.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - BLOCK_SIZE

"""Anthropic Messages <-> the chat pipeline, without a server: request bodies -> OpenAI-shaped chat requests, and
parser events -> Anthropic's stream events and message."""
from __future__ import annotations

import json

import pytest

from qnext.agents.events import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from qnext.server.event_sink import Finish, dispatch
from qnext.server.anthropic_request import chat_inputs, translate
from qnext.server.anthropic_response import AnthropicMessageBuilder
from qnext.server.errors import APIError


def test_history_with_thinking_tool_use_and_results():
    body = {"model": "m", "max_tokens": 100,
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "Use tools."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "I should call the tool.", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
                    {"type": "tool_result", "tool_use_id": "toolu_3", "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]},
                    {"type": "tool_result", "tool_use_id": "toolu_4", "content": [
                        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                                        "data": "AA=="}}]},
                    {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]}],
            "tools": [{"name": "weather", "description": "Weather now", "cache_control": {"type": "ephemeral"},
                       "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "stop_sequences": ["END"], "temperature": 0, "top_p": 0.9, "top_k": 20, "metadata": {"user_id": "u"}}
    inputs, params = translate(body)
    assert inputs.messages == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "tool", "tool_call_id": "toolu_3",           # the image travels as an OpenAI image_url part
         "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
        {"role": "tool", "tool_call_id": "toolu_4", "content": "[document omitted: this server reads no documents]"},
        {"role": "user", "content": "And tomorrow?"}]
    assert inputs.tools == [{"type": "function", "function": {
        "name": "weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    assert inputs.tool_choice == "required" and inputs.parallel_tool_calls is False
    assert inputs.chat_template_kwargs == {"enable_thinking": True}
    assert params.thinking_token_budget == 1024            # a hard cap on the reasoning, forced by the engine
    assert translate({**body, "thinking": {"type": "disabled"}})[1].thinking_token_budget is None
    assert (params.max_tokens, params.stop, params.temperature, params.top_p, params.top_k) == \
        (100, ["END"], 0.0, 0.9, 20)


@pytest.mark.parametrize("choice, expected", [({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
                                              ({"type": "tool", "name": "weather"},
                                               {"type": "function", "function": {"name": "weather"}})])
def test_tool_choice(choice, expected):
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tool_choice": choice,
            "tools": [{"name": "weather", "input_schema": {"type": "object"}}], "thinking": {"type": "disabled"}}
    inputs, _ = translate(body)
    assert inputs.tool_choice == expected and inputs.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "hi"}]}, "messages.0.role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages.0.content.0"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.source"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}},
     "tool_choice"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "text", "text": 7}]}]},
     "messages.0.content.0.text"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": {}}]}]},
     "messages.0.content.0.thinking"),
])
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        translate(body)
    assert e.value.status == 400 and e.value.param == param


def test_count_only_needs_no_max_tokens():
    assert chat_inputs({"messages": [{"role": "user", "content": "hi"}]}).messages == \
        [{"role": "user", "content": "hi"}]


def _run(builder, events, finish):
    out = builder.start(40, 32)
    for e in events:
        out += dispatch(builder, e)
    return out + builder.end(finish)


def _parse_sse(text: str) -> list[dict]:
    events = []
    for chunk in text.strip().split("\n\n"):
        kind, data = chunk.split("\n")
        payload = json.loads(data[len("data: "):])
        assert kind == f"event: {payload['type']}"
        events.append(payload)
    return events


EVENTS = [ReasoningDelta("Let me "), ReasoningDelta("think."), ContentDelta("Calling."),
          ToolCallStart(0, "call_1", "weather"), ToolCallArgsDelta(0, '{"city": '), ToolCallArgsDelta(0, '"Oslo"}'),
          ToolCallEnd(0, '{"city": "Oslo"}')]


def test_stream_sequence_and_message():
    builder = AnthropicMessageBuilder("claude-x")
    sse = "".join(_run(builder, EVENTS, Finish("stop", None, 17)))
    events = _parse_sse(sse)
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert events[0]["message"]["usage"] == {"input_tokens": 8, "output_tokens": 0, "cache_read_input_tokens": 32,
                                             "cache_creation_input_tokens": 0}
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "thinking_delta", "signature_delta", "text_delta", "input_json_delta", "input_json_delta"]
    assert events[9]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "weather", "input": {}}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 17
    message = builder.message()
    assert message["content"] == [{"type": "thinking", "thinking": "Let me think.", "signature": "qnext"},
                                  {"type": "text", "text": "Calling."},
                                  {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Oslo"}}]
    assert message["stop_reason"] == "tool_use"


@pytest.mark.parametrize("finish, stops, expected", [
    (Finish("length", None, 5), [], ("max_tokens", None)),
    (Finish("stop", "END", 5), ["END"], ("stop_sequence", "END")),
    (Finish("stop", 7, 5), [], ("end_turn", None))])
def test_stop_reasons(finish, stops, expected):
    builder = AnthropicMessageBuilder("m", stops)
    _run(builder, [ContentDelta("hi")], finish)
    assert builder.stop_reason() == expected


def test_claude_code_first_request_translates():
    from pathlib import Path
    fixture = json.loads((Path(__file__).parent / "fixtures" / "claude_code_first_request.json").read_text())
    inputs, _ = translate(fixture["body"])
    roles = [m["role"] for m in inputs.messages]
    assert roles[0] == "system" and roles.count("system") == 1        # the mid-conversation one became a user turn
    assert "Say hello" in inputs.messages[1]["content"]
    assert len(inputs.tools) == len(fixture["body"]["tools"])
    assert inputs.chat_template_kwargs == {"enable_thinking": True}   # thinking: adaptive


def test_a_cut_output_stops_with_max_tokens_even_after_a_call():
    builder = AnthropicMessageBuilder("m")
    events = _parse_sse("".join(_run(builder, EVENTS, Finish("length", None, 17))))
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert builder.message()["stop_reason"] == "max_tokens"
    assert builder.message()["content"][-1]["input"] == {"city": "Oslo"}

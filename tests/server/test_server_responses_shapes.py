"""OpenAI Responses <-> the chat pipeline, without a server: request bodies (Codex's recorded first request
among them) -> OpenAI-shaped chat requests, parser events -> Responses stream events and the response object, and
the previous_response_id store."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from qnext.agents.events import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from qnext.server.event_sink import Finish, dispatch
from qnext.server.errors import APIError
from qnext.server.responses_request import translate
from qnext.server.responses_response import ResponseBuilder
from qnext.server.responses_store import ResponseStore

FIXTURES = Path(__file__).parent / "fixtures"


def test_items_become_chat_messages():
    body = {"model": "m", "instructions": "Be brief.",
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
                      {"role": "user", "content": "List files."},
                      {"type": "reasoning", "id": "rs_1", "summary": [],
                       "content": [{"type": "reasoning_text", "text": "Use ls."}]},
                      {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "ls"}'},
                      {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"},
                      {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
                      {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text",
                                                                                      "text": "done"}]},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}],
            "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": False},
                      {"type": "custom", "name": "apply_patch", "description": "Patch files.",
                       "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
                      {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn"}]},
                      {"type": "web_search", "external_web_access": False}],
            "tool_choice": "auto", "max_output_tokens": 64, "temperature": 0.5, "reasoning": {"effort": "none"}}
    inputs, params, freeform = translate(body)
    assert inputs.messages == [
        {"role": "system", "content": "Be brief.\n\nRules."},
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": "", "reasoning_content": "Use ls.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}},
            {"id": "c2", "type": "function", "function": {"name": "apply_patch",
                                                          "arguments": '{"input": "*** Begin"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "done"},
        {"role": "assistant", "content": "Done."}]
    assert [t["function"]["name"] for t in inputs.tools] == ["shell", "apply_patch", "spawn"]
    assert inputs.tools[1]["function"]["parameters"]["required"] == ["input"]
    assert "start: /.+/" in inputs.tools[1]["function"]["description"]
    assert freeform == {"apply_patch"}
    assert (params.max_tokens, params.temperature, inputs.chat_template_kwargs) == \
        (64, 0.5, {"enable_thinking": False})


def test_codex_first_request_translates():
    body = json.loads((FIXTURES / "codex_first_request.json").read_text())["body"]
    inputs, _, freeform = translate(body)
    roles = [m["role"] for m in inputs.messages]
    assert roles[0] == "system" and roles.count("system") == 1 and roles[-1] == "user"
    assert inputs.messages[-1]["content"] == "Say hello"
    assert "exec_command" in [t["function"]["name"] for t in inputs.tools]


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "local_shell_call", "call_id": "x"}]}, "input.0.type"),
    ({"input": "hi", "tools": [{"type": "file_search"}]}, "tools.0.type"),
    ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]},
     "input.0.content.0.image_url"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": 9}}, "text.format"),
    ({"input": "hi", "tools": [{"type": "custom", "name": "x", "description": 1.5}]}, "tools.0.description"),
    ({"input": "hi", "tools": [{"type": "custom", "name": "x", "format": ["grammar"]}]}, "tools.0.format"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}, {"type": "custom", "name": "x", "format": {
        "type": "grammar", "definition": 7}}]}, "tools.1.format.definition"),
    ({}, "input"),
])
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        translate(body)
    assert e.value.status == 400 and e.value.param == param


def _parse_sse(chunks: list[str]) -> list[dict]:
    events = []
    for chunk in "".join(chunks).strip().split("\n\n"):
        kind, data = chunk.split("\n")
        payload = json.loads(data[len("data: "):])
        assert kind == f"event: {payload['type']}"
        events.append(payload)
    return events


def _run(builder, events, finish):
    out = builder.start(100, 64)
    for e in events:
        out += dispatch(builder, e)
    return _parse_sse(out + builder.end(finish))


def test_stream_sequence_numbers_items_and_usage():
    builder = ResponseBuilder("m", {"tools": []}, {"apply_patch"}, count_tokens=lambda text: len(text.split()))
    events = _run(builder, [ReasoningDelta("think "), ReasoningDelta("hard"), ContentDelta("Hi."),
                            ToolCallStart(0, "call_1", "shell"), ToolCallArgsDelta(0, '{"cmd": "ls"}'),
                            ToolCallEnd(0, '{"cmd": "ls"}'),
                            ToolCallStart(1, "call_2", "apply_patch"), ToolCallArgsDelta(1, '{"input": "*** Be'),
                            ToolCallArgsDelta(1, 'gin"}'), ToolCallEnd(1, '{"input": "*** Begin"}')],
                  Finish("stop", None, 30))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
        "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call", "custom_tool_call"]
    assert final["output"][2]["arguments"] == '{"cmd": "ls"}' and final["output"][3]["input"] == "*** Begin"
    assert final["usage"] == {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 64}, "output_tokens": 30,
                              "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 130}
    assert builder.response() == final


def test_max_output_tokens_makes_an_incomplete_response():
    builder = ResponseBuilder("m", {}, set())
    events = _run(builder, [ContentDelta("Hi")], Finish("length", None, 1))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_store_keeps_the_conversation_and_forgets_the_oldest():
    store = ResponseStore(capacity=2)
    builder = ResponseBuilder("m", {}, set())
    _run(builder, [ContentDelta("Hello!"), ToolCallStart(0, "c1", "shell"), ToolCallEnd(0, "{}")],
         Finish("stop", None, 3))
    asked = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    store.put("r1", asked, builder.items)
    history = store.get("r1")
    assert history == asked + [{"role": "assistant", "content": "Hello!", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]}]
    inputs, _, _ = translate({"input": [{"type": "function_call_output", "call_id": "c1", "output": "ok"}]}, history)
    assert [m["role"] for m in inputs.messages] == ["system", "user", "assistant", "tool"]
    store.put("r2", asked, [])
    store.put("r3", asked, [])
    assert store.get("r1") is None and store.get("r3") is not None


def test_a_cut_output_is_incomplete_even_after_a_call():
    builder = ResponseBuilder("m", {}, set())
    events = _run(builder, [ToolCallStart(0, "c1", "shell"), ToolCallArgsDelta(0, "{}"), ToolCallEnd(0, "{}")],
                  Finish("length", None, 9))
    assert events[-1]["type"] == "response.incomplete"
    assert [i["status"] for i in events[-1]["response"]["output"]] == ["completed"]

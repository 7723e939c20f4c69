"""Tools, reasoning and structured outputs through the official openai client against `qnext serve` on a tiny
Qwen3.5 checkpoint with the demo's chat template (XML tool calls, `<think>`; random weights; 2048 positions so a
prompt with tool schemas fits the tiny tokenizer). One server for the module."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from qnext.sampling_params import StructuredOutputsParams
from qnext.structured import GrammarCompiler
from qnext.tokenizer import Tokenizer
from tests.support.agent_server_cases import (BLOCK_SIZE, MESSAGES, SCHEMAS, TOOLS, WEATHER, agent_server,
                                              assemble_stream, check_many_forced, write_checkpoint)

MODEL = "tiny-qwen35"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen35"), "qwen3_5")


@pytest.fixture(scope="module")
def client(checkpoint, tmp_path_factory):
    with agent_server(checkpoint, MODEL, tmp_path_factory.mktemp("server")) as c:
        yield c


def test_forced_outputs_parse_and_validate_over_many_random_requests(client):
    check_many_forced(client, MODEL, 54)


def test_json_object_output_is_an_object_or_a_prefix_of_one(client, checkpoint):
    """Any object: random weights write keys and strings of any length, so an output may end at max_tokens; every
    token is still one the grammar allowed."""
    tok = Tokenizer.from_pretrained(checkpoint)
    compiler = GrammarCompiler.for_tokenizer(tok, 512, tok.eos_token_ids)
    finished = 0
    for seed in range(4):
        choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, seed=seed,
                                                response_format={"type": "json_object"},
                                                extra_body={"return_token_ids": True}).choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            finished += 1
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
        ids = choice.model_extra["token_ids"]
        assert compiler.compile(StructuredOutputsParams(json_object=True)).validate_tokens(ids) == len(ids)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_equals_the_non_streamed_one(client, tool_choice):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, temperature=1.0,
                  max_tokens=200, seed=77, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs)
    streamed = assemble_stream(client.chat.completions.create(stream=True, **kwargs))
    calls = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert streamed["tool_calls"] == calls and streamed["finish_reason"] == "tool_calls"
    assert streamed["content"] == "" and streamed["reasoning"] is None


def test_tool_choice_none_and_auto_answer_in_text(client):
    for tool_choice in ("none", "auto"):
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, temperature=1.0,
                      max_tokens=24, seed=3)
        whole = client.chat.completions.create(**kwargs).choices[0]
        streamed = assemble_stream(client.chat.completions.create(stream=True, **kwargs))
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert (streamed["content"], streamed["tool_calls"]) == (whole.message.content or "", calls)
        if tool_choice == "none":
            assert not calls and whole.finish_reason != "tool_calls" and whole.message.content


def test_thinking_on_splits_reasoning_off_has_none(client, checkpoint):
    tok = Tokenizer.from_pretrained(checkpoint)
    for seed in range(4):
        kwargs = dict(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=40, seed=seed,
                      extra_body={"chat_template_kwargs": {"enable_thinking": True}, "return_token_ids": True})
        choice = client.chat.completions.create(**kwargs).choices[0]
        text = tok.decode(choice.model_extra["token_ids"])
        reasoning, _, after = text.partition("</think>")
        assert choice.message.model_extra["reasoning_content"] == choice.message.model_extra["reasoning"] == reasoning
        content = choice.message.content or ""
        assert "<think>" not in content and "</think>" not in content
        assert content == after.lstrip().replace("<think>", "").replace("</think>", "")
        streamed = assemble_stream(client.chat.completions.create(stream=True, **kwargs))
        assert (streamed["reasoning"] or "", streamed["content"]) == (reasoning, content)
    for enable in (False, None):
        extra = {"chat_template_kwargs": {"enable_thinking": enable}} if enable is not None else {}
        kwargs = dict(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=16, seed=1, extra_body=extra)
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert "reasoning" not in message.model_extra and "reasoning_content" not in message.model_extra
        assert assemble_stream(client.chat.completions.create(stream=True, **kwargs))["reasoning"] is None
    hidden = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body={
        "chat_template_kwargs": {"enable_thinking": True}, "include_reasoning": False}).choices[0].message
    assert "reasoning" not in hidden.model_extra


def test_forced_call_with_thinking_comes_after_the_reasoning(client):
    """The grammar starts after `</think>`, and the request cannot end before it (eos is masked while the grammar
    waits). Random weights rarely close their reasoning on their own: thinking_token_budget forces `</think>`, so
    every seed makes its call after a reasoning of at most the budget."""
    for seed in range(6):
        choice = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=400, seed=seed, extra_body={"chat_template_kwargs": {"enable_thinking": True},
                                                   "thinking_token_budget": 24}).choices[0]
        message = choice.message
        assert message.model_extra["reasoning"] and not message.content
        assert choice.finish_reason == "tool_calls", (seed, choice.finish_reason, message)
        call = message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_multi_turn_tool_conversation_reuses_the_cache(client):
    messages = [{"role": "system", "content": MESSAGES[0]["content"] * 4}, MESSAGES[1]]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=1.0,
                                           max_tokens=200, seed=11,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    jsonschema_ok = json.loads(call.function.arguments)
    assert set(jsonschema_ok) <= set(WEATHER["properties"])
    messages += [first.choices[0].message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", "c": 21})},
                 {"role": "user", "content": "And in Rome?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=1.0,
                                            max_tokens=200, seed=12, tool_choice="required")
    assert second.choices[0].message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - BLOCK_SIZE


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "bogus"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "book_flight"}}},
     "tool_choice", "book_flight"),
    ({"tools": [{"type": "custom", "custom": {"name": "apply_patch"}}]}, "tools.0.type", "custom"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "both constrain"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "bogus"}}}}}], "tool_choice": "required"}, "tools", "'f'"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs", "regex"),
]


@pytest.mark.parametrize("body,param,words", BAD)
def test_bad_agent_requests_are_400_and_the_server_keeps_serving(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **body)
    error = e.value.body
    assert error["param"] == param and words in error["message"], error
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        max_tokens=200, seed=1)
    assert ok.choices[0].message.tool_calls

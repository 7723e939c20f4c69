"""ChatTranslator: an OpenAI-shaped chat request -> prompt, constraint and parsers (no engine needed)."""
from __future__ import annotations

import pytest

from qnext.sampling_params import SamplingParams
from qnext.server.chat_request import ChatInputs, ChatTranslator
from qnext.server.errors import APIError
from qnext.testing.tiny_tokenizer import (TINY_CHAT_TEMPLATE, TINY_EOS_TOKEN, TINY_HERMES_CHAT_TEMPLATE,
                                          build_tiny_tokenizer)
from qnext.tokenizer import Tokenizer

TOOL = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 5}}, "required": ["q"]}}}
USER = [{"role": "user", "content": "Find lighthouses"}]


@pytest.fixture(scope="module")
def backend():
    return build_tiny_tokenizer(512)


def translator(backend, template=TINY_CHAT_TEMPLATE, **kw) -> ChatTranslator:
    return ChatTranslator(Tokenizer(backend, eos_token=TINY_EOS_TOKEN, chat_template=template), **kw)


def test_forced_call_starts_after_the_reasoning(backend):
    t = translator(backend)
    assert (t.tool_call_parser, t.reasoning_parser) == ("qwen3_coder", "qwen3")
    chat = t.translate(ChatInputs(USER, tools=[TOOL], tool_choice="required",
                                  chat_template_kwargs={"enable_thinking": True}), SamplingParams())
    so = chat.params.structured_outputs
    assert chat.prompt.endswith("<|im_start|>assistant\n<think>\n") and chat.reasoning
    assert so.start_after == [t.think_end_id] and "<function=search>" in so.grammar
    assert chat.prompt_token_ids == t.tokenizer.encode(chat.prompt)
    parsed = chat.new_output_parser().parse_whole("hmm</think>\n\n<tool_call>\n<function=search>\n<parameter=q>\n"
                                                  "5\n</parameter>\n</function>\n</tool_call>")
    assert parsed.reasoning == "hmm" and parsed.tool_calls[0].arguments == '{"q": "5"}'
    off = t.translate(ChatInputs(USER, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "search"}},
                                 chat_template_kwargs={"enable_thinking": False}), SamplingParams())
    assert off.params.structured_outputs.start_after is None and not off.reasoning


def test_constraints_and_parsers_by_request(backend):
    t = translator(backend, TINY_HERMES_CHAT_TEMPLATE)
    assert (t.tool_call_parser, t.reasoning_parser) == ("hermes", None)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
              "json", schema),
             ({"response_format": {"type": "json_object"}}, "json_object", True),
             ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
             ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", ["x", "y"])]
    for fields, kind, value in cases:
        so = t.translate(ChatInputs(USER, **fields), SamplingParams()).params.structured_outputs
        assert so.kind == kind and getattr(so, kind) == value
    plain = t.translate(ChatInputs(USER, tools=[TOOL], response_format={"type": "text"}), SamplingParams())
    assert plain.params.structured_outputs is None and plain.tool_parser == "hermes" and plain.tool_choice == "auto"
    assert t.translate(ChatInputs(USER, tools=[TOOL], tool_choice="none"), SamplingParams()).tool_parser is None


def test_history_calls_render_from_openai_json_arguments(backend):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "light"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 results"},
        {"role": "developer", "content": [{"type": "text", "text": "ignored?"}]}]
    with pytest.raises(APIError, match="system message must be the first"):
        translator(backend).translate(ChatInputs(messages, tools=[TOOL]), SamplingParams())
    prompt = translator(backend).translate(ChatInputs(messages[:3], tools=[TOOL]), SamplingParams()).prompt
    assert "<function=search>\n<parameter=q>\nlight\n</parameter>\n</function>" in prompt
    assert "<|im_start|>user\n<tool_response>\n3 results\n</tool_response><|im_end|>" in prompt


BAD = [
    (dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "'nope'"),
    (dict(tools=[{"type": "custom", "custom": {"name": "x"}}]), "tools.0.type", "'custom'"),
    (dict(tools=[TOOL], tool_choice="required", structured_outputs={"regex": "a"}), "structured_outputs",
     "both constrain"),
    (dict(tool_choice="required"), "tool_choice", "at least one tool"),
    (dict(structured_outputs={"structural_tag": "x"}), "structured_outputs", "unknown fields"),
    (dict(structured_outputs={"choice": -1}), "structured_outputs", "non-empty list"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "schema"),
    (dict(tools=[TOOL, TOOL]), "tools", "same name"),
]


@pytest.mark.parametrize("fields,param,words", BAD)
def test_bad_requests_say_what_is_wrong(backend, fields, param, words):
    with pytest.raises(APIError) as e:
        translator(backend).translate(ChatInputs(USER, **fields), SamplingParams())
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


def test_bad_history_arguments(backend):
    messages = USER + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{not json"}}]}]
    with pytest.raises(APIError, match=r"messages\[1\].tool_calls\[0\].function.arguments is not valid JSON"):
        translator(backend).translate(ChatInputs(messages, tools=[TOOL]), SamplingParams())


def test_tool_calls_that_are_not_a_list(backend):
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": 1.5}]
    with pytest.raises(APIError, match=r"messages\[1\].tool_calls must be a list") as e:
        translator(backend).translate(ChatInputs(messages), SamplingParams())
    assert e.value.status == 400 and e.value.param == "messages.1.tool_calls"


def test_parser_flags_override_the_template(backend):
    from qnext.server.cli import build_parser

    args = build_parser()[0].parse_args(["serve", "--tool-call-parser", "hermes", "--reasoning-parser", "none"])
    t = translator(backend, tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    assert (t.tool_call_parser, t.reasoning_parser) == ("hermes", None)
    chat = t.translate(ChatInputs(USER, tools=[TOOL], tool_choice="required",
                                  chat_template_kwargs={"enable_thinking": True}), SamplingParams())
    grammar = chat.params.structured_outputs.grammar
    assert not chat.reasoning and '\\"arguments\\": ' in grammar and "<function=" not in grammar
    off = translator(backend, tool_call_parser="none")
    with pytest.raises(APIError, match="no tool-call format"):
        off.translate(ChatInputs(USER, tools=[TOOL]), SamplingParams())
    assert off.translate(ChatInputs(USER, tools=[TOOL], tool_choice="none"), SamplingParams()).tool_parser is None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        translator(backend, tool_call_parser="mistral")

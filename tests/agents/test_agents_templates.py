"""The tiny checkpoints' chat templates in Qwen3.5's format (tools, XML calls, thinking) and Qwen3-Next's (JSON
calls): what they render, and that a call rendered in history is what the parser reads back."""
from __future__ import annotations

import json

import pytest

from qnext.agents import OutputParser
from qnext.testing.tiny_tokenizer import TINY_CHAT_TEMPLATE, TINY_HERMES_CHAT_TEMPLATE
from qnext.tokenizer import compile_chat_template

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}, "days": {"type": "integer"},
                                             "opts": {"type": "object"}}, "required": ["city"]}}}
ARGS = {"city": "Paris", "days": 3, "opts": {"unit": "C"}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def render(template: str, messages, **kw) -> str:
    return compile_chat_template(template).render(messages=messages, add_generation_prompt=True, **kw)


def test_qwen35_tools_calls_results_and_thinking():
    text = render(TINY_CHAT_TEMPLATE, CONVERSATION, tools=[TOOL], enable_thinking=True)
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert "<tools>\n" + json.dumps(TOOL, ensure_ascii=False) + "\n</tools>" in text
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text
    # the assistant turn after the last user query keeps its reasoning; both calls in XML, values raw
    assert ("<|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n"
            '{"unit": "C"}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n'
            "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
    # a later user query drops the old reasoning
    later = render(TINY_CHAT_TEMPLATE, CONVERSATION + [{"role": "user", "content": "And tomorrow?"}], tools=[TOOL])
    assert "I should call the tool" not in later and later.endswith("<|im_start|>assistant\n")
    assert render(TINY_CHAT_TEMPLATE, CONVERSATION[:2], enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_qwen35_history_call_parses_back_to_its_arguments():
    text = render(TINY_CHAT_TEMPLATE, CONVERSATION[:3] + [{"role": "user", "content": "x"}], tools=[TOOL])
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = OutputParser(tool_parser="qwen3_coder", tools=[TOOL]).parse_whole(turn)
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [ARGS, {"city": "Rome"}]
    assert parsed.content == ""


def test_hermes_tools_calls_and_results():
    text = render(TINY_HERMES_CHAT_TEMPLATE, CONVERSATION, tools=[TOOL])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert turn.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3')
    parsed = OutputParser(tool_parser="hermes", tools=[TOOL]).parse_whole(turn)
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [ARGS, {"city": "Rome"}]
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("template", [TINY_CHAT_TEMPLATE, TINY_HERMES_CHAT_TEMPLATE])
def test_each_turn_extends_the_previous_prompt(template):
    """Prefix caching across an agent's turns: without reasoning, turn n+1's prompt starts with turn n's prompt
    plus the model's output."""
    first = render(template, CONVERSATION[:2], tools=[TOOL])
    second = render(template, CONVERSATION[:2] + [{**CONVERSATION[2], "reasoning_content": None}] + CONVERSATION[3:],
                    tools=[TOOL])
    assert second.startswith(first)

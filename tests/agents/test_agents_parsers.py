"""Reasoning and tool-call parsers on text: whole outputs, malformed ones, and every stream split of them."""
from __future__ import annotations

import itertools
import json

import pytest

from qnext.agents import OutputParser, ParsedOutput, ToolCall
from qnext.agents.events import ContentDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, assemble
from qnext.agents.tool_parsers import default_tool_parser
from qnext.agents.reasoning import default_reasoning_parser, prompt_ends_in_reasoning

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "metric": {"type": "boolean"}, "ratio": {"type": "number"},
                                         "opts": {"type": "object"}, "tags": {"type": "array"},
                                         "code": {"type": "string"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}},
]


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def json_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def parser(fmt: str | None, reasoning: bool = False, **kw) -> OutputParser:
    ids = itertools.count()
    return OutputParser(reasoning=reasoning, tool_parser=fmt, tools=TOOLS, call_id=lambda: f"call_{next(ids)}", **kw)


def whole(text: str, fmt: str | None, reasoning: bool = False, **kw) -> ParsedOutput:
    return parser(fmt, reasoning, **kw).parse_whole(text)


def streamed(pieces: list[str], fmt: str | None, reasoning: bool = False, **kw) -> ParsedOutput:
    p = parser(fmt, reasoning, **kw)
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    # tool-call events in OpenAI's order: a start, then fragments, then the end whose arguments they spell
    for start in (e for e in events if isinstance(e, ToolCallStart)):
        own = [e for e in events if getattr(e, "index", None) == start.index]
        assert own[0] is start and isinstance(own[-1], ToolCallEnd)
        assert "".join(e.fragment for e in own if isinstance(e, ToolCallArgsDelta)) == own[-1].arguments
    return assemble(events, p.has_reasoning)


def calls(*pairs) -> list[ToolCall]:
    return [ToolCall(f"call_{i}", name, args) for i, (name, args) in enumerate(pairs)]


# (format, reasoning, output text, expected parse)
CASES = [
    ("qwen3_coder", False, "Let me check.\n\n" + xml_call("get_weather", city="Paris", days="3", metric="True",
                                                           ratio="0.5", opts='{"a": [1, "x"]}', tags="[1,2]"),
     ParsedOutput(None, "Let me check.", calls(("get_weather", '{"city": "Paris", "days": 3, "metric": true, '
                                                 '"ratio": 0.5, "opts": {"a": [1, "x"]}, "tags": [1, 2]}')))),
    ("qwen3_coder", False, xml_call("get_weather", city="3", code="if a < b:\n    return '</tool'\n") + "\n"
     + xml_call("search", query="lighthouses") + "\n",
     ParsedOutput(None, "", calls(("get_weather",
                                   json.dumps({"city": "3", "code": "if a < b:\n    return '</tool'\n"})),
                                  ("search", '{"query": "lighthouses"}')))),
    # an undeclared parameter and a mistyped integer stay strings; a call without parameters has `{}`
    ("qwen3_coder", False, xml_call("get_weather", days="three", unknown="7") + xml_call("search"),
     ParsedOutput(None, "", calls(("get_weather", '{"days": "three", "unknown": "7"}'), ("search", "{}")))),
    # a missing </parameter>, a missing </function> and a call cut off at the end of the output
    ("qwen3_coder", False, "<tool_call>\n<function=search>\n<parameter=query>\nfoo\n</tool_call>"
     "<tool_call><function=get_weather><parameter=city>Rome</parameter><parameter=days>\n12",
     ParsedOutput(None, "", calls(("search", '{"query": "foo"}'), ("get_weather", '{"city": "Rome", "days": 12}')))),
    # a literal <tool_call> in prose, the other format, and a tag at the very end stay content
    ("qwen3_coder", False, "Write <tool_call> to call a tool, e.g. " + json_call("search", "{}") + " or <tool_call>",
     ParsedOutput(None, "Write <tool_call> to call a tool, e.g. " + json_call("search", "{}") + " or <tool_call>", [])),
    ("qwen3_coder", False, "a <tool_call><function=bad name> b <tool_call>\n<function=search>\n</function>\ntail",
     ParsedOutput(None, "a <tool_call><function=bad name> b\ntail", calls(("search", "{}")))),
    # a call inside the reasoning stays reasoning; the one after </think> is parsed
    ("qwen3_coder", True,
     "maybe " + xml_call("search", query="x") + "\n</think>\n\nOK " + xml_call("search", query="y"),
     ParsedOutput("maybe " + xml_call("search", query="x") + "\n", "OK", calls(("search", '{"query": "y"}')))),
    ("hermes", False, "Sure.\n" + json_call("get_weather", '{"city": "Pa}ris\\"", "days": [1, {"x": 2}]}') + "\n"
     + json_call("search", '{}'),
     ParsedOutput(None, "Sure.", calls(("get_weather", '{"city": "Pa}ris\\"", "days": [1, {"x": 2}]}'),
                                       ("search", "{}")))),
    # hermes: a header that is not a call, arguments that are not an object, junk after the arguments, a cut-off call
    ("hermes", False, '<tool_call>\n{"arguments": {}, "name": "search"}\n</tool_call>\n<tool_call>{"name": "search", '
     '"arguments": 5}</tool_call>x' + '<tool_call>{"name":"search","arguments":{"q":1} oops'
     + json_call("search", '{"q": "a'),
     ParsedOutput(None, '<tool_call>\n{"arguments": {}, "name": "search"}\n</tool_call>5}</tool_call>x oops',
                  calls(("search", "{}"), ("search", '{"q":1}'), ("search", '{"q": "a}\n</tool_call>')))),
    ("hermes", True, "<think>" + json_call("search", "{}") + "</think>Done </think>.",
     ParsedOutput("<think>" + json_call("search", "{}"), "Done .", [])),
    # a call right at the end of the reasoning
    ("qwen3_coder", True, "plan</think>" + xml_call("search", query="z"),
     ParsedOutput("plan", "", calls(("search", '{"query": "z"}')))),
    (None, True, "hmm</think>\n\n" + xml_call("search", query="q"),
     ParsedOutput("hmm", xml_call("search", query="q"), [])),
    (None, False, "no <think>reasoning</think> here  \n", ParsedOutput(None, "no reasoning here  \n", [])),
]


@pytest.mark.parametrize("fmt,reasoning,text,expected", CASES)
def test_whole_output(fmt, reasoning, text, expected):
    assert whole(text, fmt, reasoning) == expected


@pytest.mark.parametrize("fmt,reasoning,text,expected", CASES)
def test_every_split_gives_the_whole_parse(fmt, reasoning, text, expected):
    for i in range(len(text) + 1):
        assert streamed([text[:i], text[i:]], fmt, reasoning) == expected, i
    assert streamed(list(text), fmt, reasoning) == expected
    for i in range(len(text)):
        for j in range(i + 1, min(len(text), i + 12) + 1):
            assert streamed([text[:i], text[i:j], text[j:]], fmt, reasoning) == expected, (i, j)


def test_arguments_stream_before_the_call_ends():
    p = parser("hermes")
    events = p.feed('<tool_call>\n{"name": "search", "arguments": {"query": "ab')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta]
    assert events[0].name == "search" and events[1].fragment == '{"query": "ab'
    p = parser("qwen3_coder")
    events = p.feed(xml_call("get_weather", city="Oslo", days="2")[:-30])
    assert events[0].name == "get_weather"
    assert "".join(e.fragment for e in events[1:]) == '{"city": "Oslo"'
    # a string value streams as it is written (a newline that may end it is held back); other types when complete
    p = parser("qwen3_coder")
    events = p.feed('<tool_call>\n<function=get_weather>\n<parameter=code>\nif a:\n    b = "x"\n')
    assert "".join(e.fragment for e in events[1:]) == '{"code": "if a:\\n    b = \\"x\\"'
    events = p.feed("</parameter>\n<parameter=days>\n1")
    assert "".join(e.fragment for e in events) == '"'


def test_prose_after_a_literal_tag_is_not_held_back():
    p = parser("qwen3_coder")
    out = p.feed("use <tool_call> then ") + p.feed("more text")
    assert "".join(e.text for e in out) == "use <tool_call> then more text"


def test_include_reasoning_false_drops_it():
    assert whole("secret</think>answer", None, True, include_reasoning=False) == ParsedOutput(None, "answer", [])


def test_defaults_from_the_template():
    from qnext.testing.tiny_tokenizer import TINY_CHAT_TEMPLATE, TINY_HERMES_CHAT_TEMPLATE

    assert default_tool_parser(TINY_CHAT_TEMPLATE) == "qwen3_coder"
    assert default_tool_parser(TINY_HERMES_CHAT_TEMPLATE) == "hermes"
    assert default_tool_parser("{{ messages }}") is None
    assert default_reasoning_parser(TINY_CHAT_TEMPLATE) == "qwen3"
    assert prompt_ends_in_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert not prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_in_reasoning("<think>x</think><|im_start|>assistant\n")


CUT_CASES = [  # (format, output text cut by max_tokens, the calls that ended)
    ("qwen3_coder", xml_call("search", query="a") + "\n" + xml_call("get_weather", city="Oslo", days="2")[:-40],
     calls(("search", '{"query": "a"}'))),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n", []),
    ("qwen3_coder", "<tool_call>\n<function=search>\n</function>\n", calls(("search", "{}"))),
    ("hermes", json_call("search", '{"query": "a"}') + json_call("search", '{"query": "b')[:-14],
     calls(("search", '{"query": "a"}'))),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": ', []),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"query": "a"}', calls(("search", '{"query": "a"}'))),
]


@pytest.mark.parametrize("fmt,text,ended", CUT_CASES)
def test_whole_calls_drops_a_call_the_output_ended_inside(fmt, text, ended):
    assert whole(text, fmt, whole_calls=True) == ParsedOutput(None, "", ended)
    for i in range(len(text) + 1):
        p = parser(fmt, whole_calls=True)
        events = p.feed(text[:i]) + p.feed(text[i:]) + p.finish()
        assert assemble(events, False) == ParsedOutput(None, "", ended), i
        assert p.num_tool_calls == len(ended) and p.num_cut_calls == (len(ended) < text.count("<tool_call>"))
    # without whole_calls the cut call is reported with what was read, marked as not complete
    p = parser(fmt)
    ends = [e for e in p.feed(text) + p.finish() if isinstance(e, ToolCallEnd)]
    assert [e.complete for e in ends] == [True] * len(ended) + [False] * (len(ends) - len(ended))


def test_whole_calls_holds_a_call_until_it_ends():
    p = parser("qwen3_coder", whole_calls=True)
    text = xml_call("get_weather", city="Oslo", days="2")
    assert p.feed("Sure. " + text[:-12]) == [ContentDelta("Sure.")]
    events = p.feed(text[-12:])
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta, ToolCallEnd]
    assert events[-1].arguments == '{"city": "Oslo", "days": 2}' and events[-1].complete

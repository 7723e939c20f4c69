"""What the output parsers report: stream events, and the parsed whole output.

A request's output text goes through `OutputParser.feed(delta)` as it arrives; each call returns the events that
text settled. Concatenating the `ToolCallArgsDelta` fragments of one call gives its `ToolCallEnd.arguments`."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclasses.dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclasses.dataclass(frozen=True)
class ToolCallStart:
    index: int          # 0, 1, ... in the order the calls appear in the output
    id: str
    name: str


@dataclasses.dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    fragment: str       # JSON text; the fragments of a call concatenated are its arguments


@dataclasses.dataclass(frozen=True)
class ToolCallEnd:
    index: int
    arguments: str      # the whole arguments JSON text
    complete: bool = True   # False: the output ended inside the call (max_tokens); arguments are what was read


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str      # a JSON object as text (OpenAI's `function.arguments`)


@dataclasses.dataclass(frozen=True)
class ParsedOutput:
    reasoning: str | None           # None: the request had no reasoning section
    content: str
    tool_calls: list[ToolCall]


def assemble(events: list[Event], with_reasoning: bool) -> ParsedOutput:
    """The whole output that a sequence of events describes."""
    reasoning, content, starts, args = [], [], {}, {}
    for e in events:
        if isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            starts[e.index], args[e.index] = e, []
        elif isinstance(e, ToolCallArgsDelta):
            args[e.index].append(e.fragment)
    calls = [ToolCall(s.id, s.name, "".join(args[i])) for i, s in sorted(starts.items())]
    return ParsedOutput("".join(reasoning) if with_reasoning else None, "".join(content), calls)

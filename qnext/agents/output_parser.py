"""One request's output parser: reasoning, then tool calls in the content, as events.

    parser = OutputParser(reasoning=True, tool_parser="qwen3_coder", tools=[...])
    for delta in stream: send(parser.feed(delta))
    send(parser.finish())
    # or, for a whole output:  OutputParser(...).parse_whole(text) -> ParsedOutput

Calls written inside the reasoning stay reasoning. `<think>` / `</think>` never reach the content (outside tool
calls): a model that writes them again after its reasoning has them dropped.

whole_calls=True (the server's choice): a call's events are held until the call ends and then released together;
a call the output ended inside (cut by max_tokens) is dropped, so no client ever sees a cut call as a finished
one."""
from __future__ import annotations

import uuid
from typing import Callable

from qnext.agents.events import (ContentDelta, Event, ParsedOutput, ReasoningDelta, ToolCallArgsDelta,
                                 ToolCallEnd, ToolCallStart, assemble)
from qnext.agents.reasoning import THINK_END, THINK_START, Qwen3ReasoningParser
from qnext.agents.text_scan import find_first, settled_length
from qnext.agents.tool_parsers import TOOL_PARSERS


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_parameter_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """OpenAI tools ({"type": "function", "function": {name, parameters}}) -> name -> parameters schema."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function") or {}
        if isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") or {}
    return out


class OutputParser:
    """reasoning: the output starts inside `<think>` (the prompt ended there). tool_parser: a name from
    TOOL_PARSERS, or None to leave calls as content. include_reasoning: False drops the reasoning events.
    whole_calls: report only calls that ended, each at its end (module docstring)."""

    def __init__(self, *, reasoning: bool = False, tool_parser: str | None = None, tools: list[dict] | None = None,
                 include_reasoning: bool = True, call_id: Callable[[], str] = new_call_id, whole_calls: bool = False):
        if tool_parser is not None and tool_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_parser!r}; known: {sorted(TOOL_PARSERS)}")
        self.has_reasoning = reasoning and include_reasoning
        self._reasoning = Qwen3ReasoningParser(reasoning)
        self._include_reasoning = include_reasoning
        self._tools = TOOL_PARSERS[tool_parser](tool_parameter_schemas(tools), call_id) if tool_parser else None
        self._think_tags = _TagFilter((THINK_START, THINK_END))
        self._whole_calls = whole_calls
        self._held: list[Event] = []             # the open call's events (whole_calls)
        self.num_tool_calls = 0                  # calls reported
        self.num_cut_calls = 0                   # calls dropped because the output ended inside them (whole_calls)

    def feed(self, text: str) -> list[Event]:
        return self._route(self._reasoning.feed(text), final=False)

    def finish(self) -> list[Event]:
        return self._route(self._reasoning.finish(), final=True)

    def parse_whole(self, text: str) -> ParsedOutput:
        """A whole output, parsed by the same scan as a stream (so both give the same result)."""
        return assemble(self.feed(text) + self.finish(), self.has_reasoning)

    def _route(self, pieces: list[tuple[bool, str]], final: bool) -> list[Event]:
        events: list[Event] = []
        for is_reasoning, text in pieces:
            if is_reasoning:
                if self._include_reasoning:
                    events.append(ReasoningDelta(text))
            elif self._tools is not None:
                events += self._tools.feed(text)
            else:
                events.append(ContentDelta(text))
        if final and self._tools is not None:
            events += self._tools.finish()
        out: list[Event] = []
        for e in self._gate_calls(events):
            if isinstance(e, ContentDelta):
                e = ContentDelta(self._think_tags.feed(e.text))
            elif isinstance(e, ToolCallStart):
                self.num_tool_calls += 1
            _append(out, e)
        if final:
            _append(out, ContentDelta(self._think_tags.finish()))
        return [e for e in out if not (isinstance(e, (ContentDelta, ReasoningDelta)) and not e.text)]


    def _gate_calls(self, events: list[Event]) -> list[Event]:
        if not self._whole_calls:
            return events
        out: list[Event] = []
        for e in events:
            if isinstance(e, (ToolCallStart, ToolCallArgsDelta)):
                self._held.append(e)
            elif isinstance(e, ToolCallEnd):
                if e.complete:
                    out += self._held + [e]
                else:
                    self.num_cut_calls += 1
                self._held = []
            else:
                out.append(e)
        return out


def _append(events: list[Event], e: Event) -> None:
    """Appends e, merging it into the previous event when both are text of the same kind."""
    last = events[-1] if events else None
    if isinstance(e, ContentDelta) and isinstance(last, ContentDelta):
        events[-1] = ContentDelta(last.text + e.text)
    elif isinstance(e, ReasoningDelta) and isinstance(last, ReasoningDelta):
        events[-1] = ReasoningDelta(last.text + e.text)
    elif isinstance(e, ToolCallArgsDelta) and isinstance(last, ToolCallArgsDelta) and e.index == last.index:
        events[-1] = ToolCallArgsDelta(e.index, last.fragment + e.fragment)
    else:
        events.append(e)


class _TagFilter:
    """Drops whole occurrences of some tags from a stream of text."""

    def __init__(self, tags: tuple[str, ...]):
        self._tags, self._buf = tags, ""

    def feed(self, text: str, final: bool = False) -> str:
        self._buf += text
        out = []
        while (found := find_first(self._buf, self._tags)) is not None:
            out.append(self._buf[:found[0]])
            self._buf = self._buf[found[0] + len(found[1]):]
        n = settled_length(self._buf, self._tags, final)
        out.append(self._buf[:n])
        self._buf = self._buf[n:]
        return "".join(out)

    def finish(self) -> str:
        return self.feed("", final=True)

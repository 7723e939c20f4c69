"""An OutputSink for the agent APIs (Anthropic Messages, Responses), which build their answers from parser events:
the sink sees the request's prompt size and prefix-cache hit with the first output (start), the parsed output as it
arrives (reasoning, content, tool calls), and the finish (end). One choice per request."""
from __future__ import annotations

import dataclasses

from qnext.agents.events import (ContentDelta, Event, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd,
                                 ToolCallStart)
from qnext.server.request_stream import StreamDelta
from qnext.server.stream_driver import OutputSink


@dataclasses.dataclass
class Finish:
    finish_reason: str | None           # the engine's: "stop" or "length"
    stop_reason: str | int | None       # the stop string or stop token id that ended it
    num_output_tokens: int


class EventSink(OutputSink):
    """Every method returns the stream events (SSE text) the call produced, maybe none."""

    _started = False

    def start(self, num_prompt_tokens: int, num_cached_tokens: int) -> list[str]:
        raise NotImplementedError

    def reasoning(self, text: str) -> list[str]:
        raise NotImplementedError

    def content(self, text: str) -> list[str]:
        raise NotImplementedError

    def tool_start(self, index: int, call_id: str, name: str) -> list[str]:
        raise NotImplementedError

    def tool_args(self, index: int, fragment: str) -> list[str]:
        raise NotImplementedError

    def tool_end(self, index: int, arguments: str) -> list[str]:
        raise NotImplementedError

    def end(self, finish: Finish) -> list[str]:
        raise NotImplementedError

    def delta(self, d: StreamDelta, events: list[Event]) -> list[str]:
        out = []
        if not self._started:
            self._started = True
            out += self.start(len(d.output.prompt_token_ids), d.output.num_cached_tokens)
        for event in events:
            out += dispatch(self, event)
        if d.output.finished:
            c = d.output.outputs[0]
            out += self.end(Finish(c.finish_reason, c.stop_reason, len(c.token_ids)))
        return out


def dispatch(sink: EventSink, event: Event) -> list[str]:
    if isinstance(event, ContentDelta):
        return sink.content(event.text)
    if isinstance(event, ReasoningDelta):
        return sink.reasoning(event.text)
    if isinstance(event, ToolCallStart):
        return sink.tool_start(event.index, event.id, event.name)
    if isinstance(event, ToolCallArgsDelta):
        return sink.tool_args(event.index, event.fragment)
    if isinstance(event, ToolCallEnd):
        return sink.tool_end(event.index, event.arguments)
    raise TypeError(f"unknown output event {event!r}")

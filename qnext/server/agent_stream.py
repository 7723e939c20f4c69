"""The one stream driver of the agent APIs: engine output -> the request's OutputParser -> events -> an
OutputSink that speaks one API (Anthropic Messages, OpenAI Responses).

A streamed request sends what the sink returns as it returns it; a non-streamed one runs the same driver to the end
and answers with the sink's whole body. The sink sees the request's prompt size and prefix-cache hit with the first
output (start), the parsed output as it arrives, and the finish (end)."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from qnext.agents.events import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from qnext.server.chat_request import parsed_deltas
from qnext.server.engine_loop import EngineStepError, EngineStoppedError
from qnext.server.errors import APIError
from qnext.server.request_stream import RequestStream

DISCONNECT_POLL_SECONDS = 0.1


@dataclasses.dataclass
class Finish:
    finish_reason: str | None           # the engine's: "stop" or "length"
    stop_reason: str | int | None       # the stop string or stop token id that ended it
    num_output_tokens: int


class OutputSink:
    """One API's shapes. Every method returns the stream events (SSE text) the call produced, maybe none."""

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

    def error(self, error: APIError) -> list[str]:
        raise NotImplementedError


def dispatch(sink: OutputSink, event) -> list[str]:
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


async def drive(stream: RequestStream, parser, sink: OutputSink) -> AsyncIterator[str]:
    """Runs the request to its end, yielding the sink's events. Engine failures propagate (EngineStepError,
    EngineStoppedError)."""
    started = False
    async for delta, events in parsed_deltas(stream, parser):       # the chat route's loop too
        out = delta.output
        if not started:
            started = True
            for e in sink.start(len(out.prompt_token_ids), out.num_cached_tokens):
                yield e
        for event in events:
            for e in dispatch(sink, event):
                yield e
        if out.finished:
            c = out.outputs[0]
            for e in sink.end(Finish(c.finish_reason, c.stop_reason, len(c.token_ids))):
                yield e


def engine_error(e: Exception) -> APIError:
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), type="server_error", code="engine_step_failed")
    return APIError(503, str(e), type="server_error", code="engine_stopped")


def streaming_response(stream: RequestStream, parser, sink: OutputSink, on_done=None) -> StreamingResponse:
    """The sink's events as server-sent events; on_done() once the request has finished."""
    async def events():
        try:
            async for e in drive(stream, parser, sink):
                yield e
            if on_done is not None:
                on_done()
        except (EngineStepError, EngineStoppedError) as e:
            for event in sink.error(engine_error(e)):
                yield event
        finally:
            stream.close()
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def run_to_end(stream: RequestStream, parser, sink: OutputSink, request: Request) -> bool:
    """Runs a non-streamed request through the sink; False if the client disconnected first (the request is
    aborted). An engine failure raises its APIError."""
    async def drain():
        async for _ in drive(stream, parser, sink):
            pass

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if not task.done() and await request.is_disconnected():
                return False
        task.result()
    except (EngineStepError, EngineStoppedError) as e:
        raise engine_error(e) from e
    finally:
        task.cancel()
        stream.close()
    return True

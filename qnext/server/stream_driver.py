"""The one stream driver of every API: a request's engine output -> its choice's OutputParser -> events -> the
API's OutputSink, which speaks that API's shapes (chat completions, completions, Anthropic Messages, Responses).

    sink = ChatSink(...)                      # or CompletionSink, AnthropicMessageBuilder, ResponseBuilder
    return await respond(stream, ChoiceParsers(chat.new_output_parser), sink, request, streaming=req.stream)

A streamed request sends what the sink returns as it returns it; a non-streamed one runs the same driver to the end
(aborted if the client disconnects first) and answers with the sink's whole body. However a stream ends (finished,
failed, or the client left), the request is closed, which aborts it in the engine if it was still live."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from qnext.agents import OutputParser
from qnext.agents.events import Event
from qnext.server.engine_errors import EngineStepError, EngineStoppedError, RequestError
from qnext.server.errors import APIError, engine_error
from qnext.server.request_stream import RequestStream, StreamDelta

DISCONNECT_POLL_SECONDS = 0.1
CLIENT_CLOSED_REQUEST = 499


class OutputSink:
    """One API's shapes. delta / close / error return the stream events (SSE text) they produced, maybe none."""

    def open(self) -> list[str]:
        """Before the first output (OpenAI's first chunk, with the role)."""
        return []

    def delta(self, d: StreamDelta, events: list[Event]) -> list[str]:
        """d: the engine's new output for one choice; events: what its text settled in the choice's parser."""
        raise NotImplementedError

    def close(self) -> list[str]:
        """After the last delta (OpenAI's `data: [DONE]`)."""
        return []

    def error(self, error: APIError) -> list[str]:
        """The engine failed the request mid-stream."""
        raise NotImplementedError

    def body(self) -> dict:
        """The whole answer of a non-streamed request, after the last delta."""
        raise NotImplementedError


class ChoiceParsers:
    """One OutputParser per choice index (n > 1: each sample is parsed on its own), made on first use."""

    def __init__(self, new_parser: Callable[[], OutputParser]):
        self._new_parser = new_parser
        self._parsers: dict[int, OutputParser] = {}

    def __getitem__(self, index: int) -> OutputParser:
        if index not in self._parsers:
            self._parsers[index] = self._new_parser()
        return self._parsers[index]


async def drive(stream: RequestStream, parsers: ChoiceParsers | None, sink: OutputSink) -> AsyncIterator[str]:
    """Runs the request to its end, yielding the sink's events; parsers None: no parsing (completions). Engine
    failures propagate (EngineStepError, EngineStoppedError, RequestError)."""
    for e in sink.open():
        yield e
    async for d in stream:
        events: list[Event] = []
        if parsers is not None:
            parser = parsers[d.index]
            events = parser.feed(d.text) if d.text else []
            if d.output.outputs[d.index].finish_reason is not None:
                events += parser.finish()
        for e in sink.delta(d, events):
            yield e
    for e in sink.close():
        yield e


async def respond(stream: RequestStream, parsers: ChoiceParsers | None, sink: OutputSink, request: Request, *,
                  streaming: bool, on_done: Callable[[], None] | None = None) -> Response:
    """The sink's events as server-sent events, or its whole body; on_done() once the request has finished."""
    if streaming:
        return StreamingResponse(_events(stream, parsers, sink, on_done), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    if not await _run_to_end(stream, parsers, sink, request):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if on_done is not None:
        on_done()
    return JSONResponse(sink.body())


async def _events(stream: RequestStream, parsers: ChoiceParsers | None, sink: OutputSink,
                  on_done: Callable[[], None] | None) -> AsyncIterator[str]:
    try:
        async for e in drive(stream, parsers, sink):
            yield e
        if on_done is not None:
            on_done()
    except (EngineStepError, EngineStoppedError, RequestError) as e:
        for event in sink.error(engine_error(e)):
            yield event
    finally:
        stream.close()


async def _run_to_end(stream: RequestStream, parsers: ChoiceParsers | None, sink: OutputSink,
                      request: Request) -> bool:
    """False if the client disconnected first (the request is aborted). An engine failure raises its APIError."""
    async def drain():
        async for _ in drive(stream, parsers, sink):
            pass

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if not task.done() and await request.is_disconnected():
                return False
        task.result()
    except (EngineStepError, EngineStoppedError, RequestError) as e:
        raise engine_error(e) from e
    finally:
        task.cancel()
        stream.close()
    return True

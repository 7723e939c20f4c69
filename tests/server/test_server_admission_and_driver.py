"""The one admission and the one stream driver, without a server: the room check (clamp on chat-style APIs, strict
on completions), and a driven stream whose engine fails mid-way (the sink's error event, the request closed) or
whose tool call is cut by max_tokens (never shown to the sink)."""
from __future__ import annotations

import asyncio
import types

import pytest

from qnext.agents import OutputParser
from qnext.agents.events import ContentDelta, ToolCallStart
from qnext.outputs import CompletionOutput, RequestOutput
from qnext.sampling_params import SamplingParams
from qnext.served_engine import ServedModel
from qnext.server.admission import Admission
from qnext.server.engine_errors import EngineStepError
from qnext.server.errors import APIError
from qnext.server.request_stream import StreamDelta
from qnext.server.stream_driver import ChoiceParsers, OutputSink, drive, respond

LIMIT = 100


def admission() -> Admission:
    model = ServedModel(None, max_model_len=LIMIT, vocab_size=1000, block_size=16, num_blocks=10)
    return Admission(types.SimpleNamespace(served_model=model), "m")


@pytest.mark.parametrize("asked, expected", [(32000, 10), (None, 10), (4, 4)])
def test_clamp_cuts_max_tokens_to_the_room_left(asked, expected):
    params = SamplingParams(max_tokens=asked)
    admission().fit(list(range(1, 91)), params, clamp=True)
    assert params.max_tokens == expected


def test_strict_and_no_room_are_400s_with_both_numbers():
    with pytest.raises(APIError) as e:
        admission().fit(list(range(1, 91)), SamplingParams(max_tokens=11), clamp=False)
    assert e.value.status == 400 and e.value.param == "max_tokens" and "at most 10 tokens" in e.value.message
    for clamp in (True, False):
        with pytest.raises(APIError) as e:
            admission().fit(list(range(1, LIMIT + 1)), SamplingParams(max_tokens=1), clamp=clamp)
        assert "100 tokens" in e.value.message and f"max_model_len {LIMIT}" in e.value.message


class FakeStream:
    """A RequestStream's iterator over given deltas, then optionally an engine failure."""

    def __init__(self, deltas: list[StreamDelta], error: Exception | None = None):
        self.deltas, self.error, self.closed = deltas, error, False

    def __aiter__(self):
        return self._items()

    async def _items(self):
        for d in self.deltas:
            yield d
        if self.error is not None:
            raise self.error

    def close(self):
        self.closed = True


class RecordingSink(OutputSink):
    def __init__(self):
        self.events = []

    def delta(self, d, events):
        self.events += events
        return [f"delta {d.text!r}"]

    def close(self):
        return ["closed"]

    def error(self, error):
        return [f"error {error.status} {error.code}"]


def delta(text: str, finish: str | None = None) -> StreamDelta:
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, [3], None, None, finish)], finish is not None)
    return StreamDelta(text, [3], None, out, final=finish is not None)


async def collect(events) -> list[str]:
    return [e async for e in events]


def test_a_cut_call_never_reaches_the_sink():
    sink = RecordingSink()
    parsers = ChoiceParsers(lambda: OutputParser(tool_parser="qwen3_coder", whole_calls=True))
    stream = FakeStream([delta("Sure. <tool_call>\n<function=search>\n"),
                         delta("<parameter=query>\nlight", finish="length")])
    out = asyncio.run(collect(drive(stream, parsers, sink)))
    assert out[-1] == "closed" and len(out) == 3
    assert sink.events == [ContentDelta("Sure.")]
    assert not any(isinstance(e, ToolCallStart) for e in sink.events)


def test_an_engine_failure_mid_stream_is_the_sinks_error_and_closes_the_request():
    sink, stream = RecordingSink(), FakeStream([delta("Hel")], EngineStepError("step failed"))

    async def streamed():
        response = await respond(stream, None, sink, None, streaming=True)
        return await collect(response.body_iterator)
    out = asyncio.run(streamed())
    assert out == ["delta 'Hel'", "error 500 engine_step_failed"] and stream.closed


def test_a_stream_of_two_choices_ends_after_the_last_delta_not_the_first():
    """The soak's n=2 500s: the engine thread pushes one delta per choice, each carrying the finished output, each
    in its own loop callback. The stream used to end on the first (output.finished) when the consumer ran before
    the second arrived, and the body had no final output."""
    from qnext.server.request_stream import RequestStream

    async def run():
        loop = asyncio.get_running_loop()
        stream = RequestStream("r", loop, on_abort=lambda rid: None)
        out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "a", [3], None, None, "stop"),
                                                CompletionOutput(1, "b", [4], None, None, "stop")], True)
        stream.push(StreamDelta("a", [3], None, out, index=0))
        got = [await stream.__anext__()]             # the consumer runs between the two pushes
        stream.push(StreamDelta("b", [4], None, out, index=1, final=True))
        got += [d async for d in stream]
        return [(d.index, d.final) for d in got]
    assert asyncio.run(run()) == [(0, False), (1, True)]

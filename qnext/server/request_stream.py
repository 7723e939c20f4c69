"""One request's side of the engine loop: the asyncio queue its outputs arrive on, as an async iterator."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable

from qnext.outputs import RequestOutput, SampleLogprobs


@dataclasses.dataclass
class StreamDelta:
    text: str                          # text released since the previous delta
    token_ids: list[int]               # tokens generated since the previous delta
    logprobs: SampleLogprobs | None    # their logprob entries, when the request asked for logprobs
    output: RequestOutput              # the request's output so far (finish reason, cached tokens)
    index: int = 0                     # the choice (sample) these tokens belong to (n > 1: one delta per choice)
    final: bool = False                # the request's last delta: every choice has finished


class RequestStream:
    """One request's outputs, as an async iterator of StreamDelta. close() aborts it if it has not finished."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, on_abort: Callable[[str], None]):
        self.request_id = request_id
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_abort = on_abort
        self.admitted: asyncio.Future = loop.create_future()
        # engine-thread bookkeeping
        self.num_tokens_sent: dict[int, int] = {}      # per choice index
        self.num_logprobs_sent: dict[int, int] = {}
        self.finished_choices: set[int] = set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamDelta:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.final:         # not item.output.finished: with n > 1 every choice's delta carries the finished
            self.finished = True   # output, and the stream must not end before the last of them has arrived
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._on_abort(self.request_id)

    # ---- called from the engine thread ----------------------------------------------------------------------
    def deltas(self, out: RequestOutput, text_of: Callable[[str, int], str]) -> list[StreamDelta]:
        """What `out` adds to what this stream has sent: one delta per choice that has new tokens or has just
        finished (n > 1: choices advance apart). text_of(request_id, index): the engine's new text of a choice."""
        deltas = []
        for completion in out.outputs:
            i = completion.index
            new_tokens = completion.token_ids[self.num_tokens_sent.get(i, 0):]
            new_logprobs = None
            if completion.logprobs is not None:
                new_logprobs = list(completion.logprobs[self.num_logprobs_sent.get(i, 0):])
                self.num_logprobs_sent[i] = self.num_logprobs_sent.get(i, 0) + len(new_logprobs)
            self.num_tokens_sent[i] = len(completion.token_ids)
            just_finished = completion.finish_reason is not None and i not in self.finished_choices
            if just_finished:
                self.finished_choices.add(i)
            text = text_of(out.request_id, i)
            if new_tokens or text or just_finished or len(out.outputs) == 1:
                deltas.append(StreamDelta(text, list(new_tokens), new_logprobs, out, index=i))
        return deltas

    def push(self, item: StreamDelta | BaseException) -> None:
        _call_in_loop(self._loop, self._queue.put_nowait, item)

    def resolve_admission(self, error: BaseException | None) -> None:
        def resolve():
            if not self.admitted.done():
                if error is None:
                    self.admitted.set_result(None)
                else:
                    self.admitted.set_exception(error)
        _call_in_loop(self._loop, resolve)


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:        # the loop has closed: the client is gone
        pass

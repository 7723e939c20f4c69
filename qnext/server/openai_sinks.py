"""OpenAI's shapes of a request's output: chat completions (parsed: reasoning, content, tool calls) and
completions (raw text), each as `chat.completion.chunk` / `text_completion` stream chunks ending in `data: [DONE]`,
or as one body. n > 1: every choice is streamed under its index and kept apart for the body."""
from __future__ import annotations

import collections

from qnext.agents.events import Event, assemble
from qnext.outputs import RequestOutput
from qnext.server import responses as R
from qnext.server.errors import APIError
from qnext.server.request_stream import StreamDelta
from qnext.server.stream_driver import ChoiceParsers, OutputSink


def finish_reason(out: RequestOutput, num_tool_calls: int, index: int = 0) -> str | None:
    """The choice's finish reason from the engine, with "stop" reported as "tool_calls" when it made calls."""
    reason = out.outputs[index].finish_reason
    return "tool_calls" if reason == "stop" and num_tool_calls else reason


class _OpenAISink(OutputSink):
    """What both keep: per choice the generated token ids and logprob entries, and the final output."""

    def __init__(self, env: R.Envelope, streaming: bool, logprobs: int | None, include_usage: bool,
                 return_token_ids: bool):
        self.env, self.streaming, self.k = env, streaming, logprobs
        self.include_usage, self.return_token_ids = include_usage, return_token_ids
        self.token_ids: dict[int, list[int]] = collections.defaultdict(list)
        self.logprobs: dict[int, list] = collections.defaultdict(list)
        self.final: RequestOutput | None = None

    def keep(self, d: StreamDelta) -> None:
        self.token_ids[d.index].extend(d.token_ids)
        self.logprobs[d.index].extend(d.logprobs or [])
        if d.final:
            self.final = d.output

    def close(self) -> list[str]:
        return [R.sse("[DONE]")] if self.streaming else []

    def error(self, error: APIError) -> list[str]:
        return [R.sse(error.body())]


class CompletionSink(_OpenAISink):
    def __init__(self, env: R.Envelope, streaming: bool, logprobs: int | None, include_usage: bool,
                 return_token_ids: bool):
        super().__init__(env, streaming, logprobs, include_usage, return_token_ids)
        self._text_offset: dict[int, int] = {}

    def delta(self, d: StreamDelta, events: list[Event]) -> list[str]:
        self.keep(d)
        if not self.streaming:
            return []
        out, lp = [], None
        if self.k is not None and d.logprobs:
            lp = R.completion_logprobs(d.token_ids, d.logprobs, self.k, self._text_offset.get(d.index, 0))
            self._text_offset[d.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        finish = d.output.outputs[d.index].finish_reason
        ids = d.token_ids if self.return_token_ids else None
        if d.text or lp or finish or ids:
            out.append(R.sse(R.completion_chunk(self.env, d.text, lp, finish, self.include_usage, ids, d.index)))
        if d.final and self.include_usage:
            out.append(R.sse(R.usage_chunk(self.env, "text_completion", d.output)))
        return out

    def body(self) -> dict:
        out = self.final
        lp = [R.completion_logprobs(self.token_ids[c.index], self.logprobs[c.index], self.k)
              if self.k is not None else None for c in out.outputs]
        return R.completion_body(self.env, out, lp, self.return_token_ids)


class ChatSink(_OpenAISink):
    """num_choices: n; prompt_token_ids: sent on the first chunk when return_token_ids (as vLLM does)."""

    def __init__(self, env: R.Envelope, streaming: bool, logprobs: int | None, include_usage: bool,
                 return_token_ids: bool, parsers: ChoiceParsers, num_choices: int, prompt_token_ids: list[int]):
        super().__init__(env, streaming, logprobs, include_usage, return_token_ids)
        self.parsers, self.num_choices, self.prompt_token_ids = parsers, num_choices, prompt_token_ids
        self.events: dict[int, list[Event]] = collections.defaultdict(list)

    def open(self) -> list[str]:
        if not self.streaming:
            return []
        ids = self.return_token_ids
        return [R.sse(R.chat_chunk(self.env, {"role": "assistant", "content": ""}, None, None, self.include_usage,
                                   [] if ids else None, index, self.prompt_token_ids if ids and index == 0 else None))
                for index in range(self.num_choices)]

    def delta(self, d: StreamDelta, events: list[Event]) -> list[str]:
        self.keep(d)
        self.events[d.index] += events
        if not self.streaming:
            return []
        out = []
        lp = R.chat_logprobs(d.token_ids, d.logprobs, self.k) if self.k is not None and d.logprobs else None
        finish = finish_reason(d.output, self.parsers[d.index].num_tool_calls, d.index)
        ids = d.token_ids if self.return_token_ids else None
        deltas = R.chat_deltas(events)
        if not deltas and (lp or finish or ids):
            deltas = [{}]
        for i, delta in enumerate(deltas):
            first, last = i == 0, i == len(deltas) - 1
            out.append(R.sse(R.chat_chunk(self.env, delta, lp if first else None, finish if last else None,
                                          self.include_usage, ids if first else None, d.index)))
        if d.final and self.include_usage:
            out.append(R.sse(R.usage_chunk(self.env, "chat.completion.chunk", d.output)))
        return out

    def body(self) -> dict:
        out = self.final
        lp = [R.chat_logprobs(self.token_ids[c.index], self.logprobs[c.index], self.k) if self.k is not None
              else None for c in out.outputs]
        parsed = [assemble(self.events[c.index], self.parsers[c.index].has_reasoning) for c in out.outputs]
        return R.chat_body(self.env, out, lp, self.return_token_ids, parsed)

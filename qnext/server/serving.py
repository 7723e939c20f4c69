"""Completions and chat completions: a request body in, a JSON body or a server-sent event stream out."""
from __future__ import annotations

import asyncio
import collections
from typing import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from qnext.engine.llm_engine import validate_prompt
from qnext.outputs import RequestOutput
from qnext.sampling_params import SamplingParams
from qnext.server import responses as R
from qnext.server.chat_request import ChatTranslator, ChoiceParsers, finish_reason, parsed_deltas
from qnext.server.engine_loop import AsyncEngine, EngineStepError, EngineStoppedError, QueueFullError
from qnext.server.errors import APIError, bad_request, from_validation_error
from qnext.server.prompt_bound import PromptBound
from qnext.server.protocol import ChatCompletionRequest, CompletionRequest
from qnext.server.request_stream import RequestStream

DISCONNECT_POLL_SECONDS = 0.1
RETRY_AFTER_SECONDS = 1


def step_failed(e: Exception) -> APIError:
    return APIError(500, str(e), type="server_error", code="engine_step_failed")


class OpenAIServing:
    def __init__(self, async_engine: AsyncEngine, model_name: str, *, aliases: Sequence[str] = (),
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        engine = async_engine.engine
        self.async_engine = async_engine
        self.model_name = model_name
        self.model_names = tuple(dict.fromkeys([model_name, *aliases]))     # what clients may send as `model`
        self.tokenizer = engine.tokenizer       # thread-safe on its own; the engine itself is not touched here
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.prompt_bound = PromptBound(self.tokenizer, self.max_model_len)
        self.translator = ChatTranslator(self.tokenizer, tool_call_parser=tool_call_parser,
                                         reasoning_parser=reasoning_parser,
                                         check_structured=getattr(engine, "validate_structured_outputs", None))

    # ---- endpoints ---------------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        self._check_model(req.model)
        params = req.sampling_params()
        prompt = req.prompt_input()
        if isinstance(prompt, str):
            text, token_ids = prompt, await asyncio.to_thread(self._encode, prompt)
        else:
            text, token_ids = None, prompt
        stream = await self._admit(R.new_id("cmpl"), text, token_ids, params)
        env = R.Envelope("cmpl", self.model_name)
        if req.stream:
            return event_stream(self._completion_events(stream, env, params.logprobs, req), stream)
        out, token_ids, logprobs = await collect(stream, request)
        if out is None:
            return Response(status_code=499)
        lp = [R.completion_logprobs(token_ids[c.index], logprobs[c.index], params.logprobs)
              if params.logprobs is not None else None for c in out.outputs]
        return JSONResponse(R.completion_body(env, out, lp, req.return_token_ids))

    async def chat_completions(self, request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest)
        self._check_model(req.model)
        inputs = req.chat_inputs()
        self.prompt_bound.check_messages(inputs.messages)
        chat = await asyncio.to_thread(self.translator.translate, inputs, req.sampling_params())
        stream = await self._admit(R.new_id("chatcmpl"), chat.prompt, chat.prompt_token_ids, chat.params, clamp=True)
        env = R.Envelope("chatcmpl", self.model_name)
        parsers = ChoiceParsers(chat.new_output_parser)
        k = chat.params.logprobs
        if req.stream:
            return event_stream(self._chat_events(stream, env, k, req, parsers, chat.prompt_token_ids), stream)
        out, token_ids, logprobs = await collect(stream, request)
        if out is None:
            return Response(status_code=499)
        lp = [R.chat_logprobs(token_ids[c.index], logprobs[c.index], k) if k is not None else None
              for c in out.outputs]
        parsed = [parsers[c.index].parse_whole(c.text) for c in out.outputs]
        return JSONResponse(R.chat_body(env, out, lp, req.return_token_ids, parsed))

    # ---- the request side: prompt, checks, admission -------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this checkpoint has no tokenizer.json; send the prompt as a list of token ids",
                              "prompt")
        self.prompt_bound.check(text)
        return self.tokenizer.encode(text)

    def _check_lengths(self, token_ids: list[int], params: SamplingParams, clamp: bool = False) -> None:
        """clamp: max_tokens is an upper bound, cut to the room the prompt leaves in max_model_len (chat-style
        APIs); else prompt + max_tokens past max_model_len is a 400 (/v1/completions)."""
        n, limit = len(token_ids), self.max_model_len
        if clamp and n >= limit:
            raise bad_request(f"the prompt has {n} tokens, which leaves no room for output in max_model_len "
                              f"{limit}; shorten the conversation", "messages")
        try:
            validate_prompt(token_ids, params, self.vocab_size, limit)
        except ValueError as e:
            raise bad_request(str(e), "prompt") from None
        if clamp and (params.max_tokens is None or params.max_tokens > limit - n):
            params.max_tokens = limit - n
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise bad_request(f"the prompt has {n} tokens and max_tokens is {params.max_tokens}: "
                              f"{n + params.max_tokens} tokens, more than max_model_len {limit}; ask for at most "
                              f"{limit - n} tokens", "max_tokens")

    async def _admit(self, request_id: str, text: str | None, token_ids: list[int],
                     params: SamplingParams, clamp: bool = False) -> RequestStream:
        self._check_lengths(token_ids, params, clamp)
        prompt = {"prompt": text, "prompt_token_ids": token_ids}
        try:
            return await self.async_engine.add(request_id, prompt, params)
        except QueueFullError as e:
            raise APIError(503, str(e), type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from e
        except EngineStoppedError as e:
            raise APIError(503, str(e), type="server_error", code="engine_stopped") from e
        except EngineStepError as e:
            raise step_failed(e) from e
        except ValueError as e:
            raise bad_request(str(e)) from e

    # ---- streams -------------------------------------------------------------------------------------------
    async def _completion_events(self, stream: RequestStream, env: R.Envelope, k: int | None,
                                 req: CompletionRequest) -> AsyncIterator[str]:
        text_offset = {}                    # per choice
        async for d in stream:
            lp = None
            if k is not None and d.logprobs:
                lp = R.completion_logprobs(d.token_ids, d.logprobs, k, text_offset.get(d.index, 0))
                text_offset[d.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            finish = d.output.outputs[d.index].finish_reason
            ids = d.token_ids if req.return_token_ids else None
            if d.text or lp or finish or ids:
                yield R.sse(R.completion_chunk(env, d.text, lp, finish, req.include_usage, ids, d.index))
            if d.final and req.include_usage:
                yield R.sse(R.usage_chunk(env, "text_completion", d.output))

    async def _chat_events(self, stream: RequestStream, env: R.Envelope, k: int | None,
                           req: ChatCompletionRequest, parsers: ChoiceParsers,
                           prompt_token_ids: list[int]) -> AsyncIterator[str]:
        for index in range(req.n):
            yield R.sse(R.chat_chunk(env, {"role": "assistant", "content": ""}, None, None, req.include_usage,
                                     [] if req.return_token_ids else None, index,
                                     prompt_token_ids if req.return_token_ids and index == 0 else None))
        async for d, events in parsed_deltas(stream, parsers):
            lp = R.chat_logprobs(d.token_ids, d.logprobs, k) if k is not None and d.logprobs else None
            finish = finish_reason(d.output, parsers[d.index].num_tool_calls, d.index)
            ids = d.token_ids if req.return_token_ids else None
            deltas = R.chat_deltas(events)
            if not deltas and (lp or finish or ids):
                deltas = [{}]
            for i, delta in enumerate(deltas):
                first, last = i == 0, i == len(deltas) - 1
                yield R.sse(R.chat_chunk(env, delta, lp if first else None, finish if last else None,
                                         req.include_usage, ids if first else None, d.index))
            if d.final and req.include_usage:
                yield R.sse(R.usage_chunk(env, "chat.completion.chunk", d.output))


async def parse(request: Request, model: type[BaseModel]):
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise from_validation_error(e) from e


def event_stream(events: AsyncIterator[str], stream: RequestStream) -> StreamingResponse:
    return StreamingResponse(_terminated(events, stream), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _terminated(events: AsyncIterator[str], stream: RequestStream) -> AsyncIterator[str]:
    """The events, then `data: [DONE]`; a request the engine failed ends with an error event instead. However the
    stream ends (finished, failed, or the client left and the response was cancelled), the request is closed,
    which aborts it in the engine if it was still live."""
    try:
        async for event in events:
            yield event
        yield R.sse("[DONE]")
    except (EngineStepError, EngineStoppedError) as e:
        error = step_failed(e) if isinstance(e, EngineStepError) else APIError(503, str(e), type="server_error")
        yield R.sse(error.body())
    finally:
        stream.close()
        await events.aclose()


async def collect(stream: RequestStream, request: Request
                  ) -> tuple[RequestOutput | None, dict[int, list[int]], dict[int, list]]:
    """Runs a non-streamed request to its end -> (final output, token ids and logprob entries per choice index).
    Aborts it and returns (None, ...) if the client disconnects first; an engine failure raises a 500."""
    token_ids, logprobs, final = collections.defaultdict(list), collections.defaultdict(list), []

    async def drain():
        async for d in stream:
            token_ids[d.index].extend(d.token_ids)
            logprobs[d.index].extend(d.logprobs or [])
            if d.final:
                final.append(d.output)

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if not task.done() and await request.is_disconnected():
                return None, token_ids, logprobs
        task.result()
    except EngineStepError as e:
        raise step_failed(e) from e
    except EngineStoppedError as e:
        raise APIError(503, str(e), type="server_error", code="engine_stopped") from e
    finally:
        task.cancel()
        stream.close()
    return final[0], token_ids, logprobs

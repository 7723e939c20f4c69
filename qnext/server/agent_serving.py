"""The agent APIs: Anthropic Messages (/v1/messages, /v1/messages/count_tokens) and OpenAI Responses
(/v1/responses). Each translates its body into an OpenAI-shaped chat request, which goes through the chat pipeline
(chat_request: prompt, SamplingParams, output parser) and the engine like any chat request; agent_stream drives the
parser's events into the API's own shapes.

Room left: agents ask for very large max_tokens (Claude Code 32000 and more, whatever the model). On these routes
max_tokens is clamped to the room the prompt leaves in max_model_len (as llama.cpp and vLLM's Anthropic routes do);
only a prompt that leaves no room at all is a 400."""
from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from qnext.sampling_params import SamplingParams
from qnext.server import anthropic_request, responses_request
from qnext.server.agent_stream import run_to_end, streaming_response
from qnext.server.anthropic_response import AnthropicMessageBuilder
from qnext.server.chat_request import ChatInputs, ChatRequest
from qnext.server.errors import APIError, bad_request
from qnext.server.responses_response import ResponseBuilder, new_id
from qnext.server.responses_store import ResponseStore
from qnext.server.sampling_extras import EXTRA_FIELDS

# Request fields a Responses object repeats back.
_RESPONSE_ECHO = ("instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p",
                  "max_output_tokens", "previous_response_id", "reasoning", "text", "truncation", "metadata",
                  "store", "user")


async def json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", "body") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", "body")
    return body


_INPUT_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
                 "chat_template_kwargs")


def sampling_params(chat_body: dict) -> SamplingParams:
    """The sampling fields of a translated body (max_tokens None: as many as fit)."""
    try:
        extras = {k: chat_body[k] for k in EXTRA_FIELDS if k in chat_body}
        return SamplingParams(temperature=chat_body.get("temperature", 1.0), top_p=chat_body.get("top_p", 1.0),
                              top_k=chat_body.get("top_k") or 0, stop=chat_body.get("stop"),
                              max_tokens=chat_body.get("max_tokens"), **extras)
    except ValueError as e:       # SamplingParams says "<field> must be ..."
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from None


class AgentServing:
    def __init__(self, serving, store_size: int = 256):
        self.serving = serving           # OpenAIServing: model names, the chat translator, prompt bound, admission
        self.translator = serving.translator
        self.store = ResponseStore(store_size)

    # ---- shared ------------------------------------------------------------------------------------------------
    def _model(self, body: dict) -> str:
        model = body.get("model")
        if model is None:
            raise bad_request("model is required", "model")
        self.serving._check_model(model)
        return model

    async def _prepare(self, chat_body: dict, clamp: bool = True) -> ChatRequest:
        """The chat pipeline's request for chat_body, with max_tokens clamped to the room the prompt leaves."""
        self.serving.prompt_bound.check_messages(chat_body["messages"])
        inputs = ChatInputs(**{k: chat_body[k] for k in _INPUT_FIELDS if k in chat_body})
        chat = await asyncio.to_thread(self.translator.translate, inputs, sampling_params(chat_body))
        n, limit = len(chat.prompt_token_ids), self.serving.max_model_len
        if not clamp:
            return chat
        if n >= limit:
            raise bad_request(f"the prompt has {n} tokens, which leaves no room for output in max_model_len "
                              f"{limit}; shorten the conversation", "messages")
        if chat.params.max_tokens is None or chat.params.max_tokens > limit - n:
            chat.params.max_tokens = limit - n
        return chat

    async def _admit(self, prefix: str, chat: ChatRequest):
        return await self.serving._admit(new_id(prefix), chat.prompt, chat.prompt_token_ids, chat.params)

    # ---- Anthropic Messages ------------------------------------------------------------------------------------
    async def messages(self, request: Request) -> Response:
        body = await json_body(request)
        model = self._model(body)
        chat_body = anthropic_request.chat_request(body)
        prepared = await self._prepare(chat_body)
        builder = AnthropicMessageBuilder(model, chat_body.get("stop"))
        stream = await self._admit("msg", prepared)
        parser = prepared.new_output_parser()
        if body.get("stream"):
            return streaming_response(stream, parser, builder)
        if not await run_to_end(stream, parser, builder, request):
            return Response(status_code=499)
        return JSONResponse(builder.message())

    async def count_tokens(self, request: Request) -> Response:
        body = await json_body(request)
        self._model(body)
        prepared = await self._prepare(anthropic_request.chat_request(body, count_only=True), clamp=False)
        return JSONResponse({"input_tokens": len(prepared.prompt_token_ids)})

    # ---- OpenAI Responses --------------------------------------------------------------------------------------
    async def responses(self, request: Request) -> Response:
        body = await json_body(request)
        model = self._model(body)
        history = None
        previous = body.get("previous_response_id")
        if previous is not None:
            history = self.store.get(previous)
            if history is None:
                raise APIError(400, f"previous_response_id {previous!r} is not known to this server (it keeps the "
                               f"last {self.store.capacity} responses in memory, and none across restarts); send "
                               "the whole conversation as input instead", param="previous_response_id",
                               code="previous_response_not_found")
        chat_body, freeform = responses_request.chat_request(body, history)
        prepared = await self._prepare(chat_body)
        echo = {k: body.get(k) for k in _RESPONSE_ECHO}
        echo.update(tools=body.get("tools") or [], tool_choice=body.get("tool_choice") or "auto",
                    parallel_tool_calls=body.get("parallel_tool_calls", True), store=body.get("store", True))
        tokenizer = self.serving.tokenizer
        builder = ResponseBuilder(model, echo, freeform, lambda text: len(tokenizer.encode(text, False)))
        stream = await self._admit("resp", prepared)
        parser = prepared.new_output_parser()
        remember = body.get("store", True) is not False

        def on_done():
            if remember:
                self.store.put(builder.id, chat_body["messages"], builder.items)
        if body.get("stream"):
            return streaming_response(stream, parser, builder, on_done)
        if not await run_to_end(stream, parser, builder, request):
            return Response(status_code=499)
        on_done()
        return JSONResponse(builder.response())

"""The agent APIs: Anthropic Messages (/v1/messages, /v1/messages/count_tokens) and OpenAI Responses
(/v1/responses). Each request module translates its body into ChatInputs and SamplingParams; the one admission
renders the chat and takes it into the engine (max_tokens clamped to the room the prompt leaves), and the one stream
driver runs the output through the API's sink (anthropic_response, responses_response)."""
from __future__ import annotations

import math

import pydantic_core
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from qnext.lora.registry import LoRARequest
from qnext.sampling_params import SamplingParams
from qnext.server import anthropic_request, responses_request
from qnext.server.admission import Admission
from qnext.server.anthropic_response import AnthropicMessageBuilder
from qnext.server.errors import APIError, bad_request
from qnext.server.responses_response import ResponseBuilder
from qnext.server.responses_store import ResponseStore
from qnext.server.stream_driver import ChoiceParsers, respond

# Request fields a Responses object repeats back.
_RESPONSE_ECHO = ("instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p",
                  "max_output_tokens", "previous_response_id", "reasoning", "text", "truncation", "metadata",
                  "store", "user")


async def json_body(request: Request) -> dict:
    return json_object(await request.body())


def json_object(raw: bytes) -> dict:
    """A body of JSON text, parsed as strictly as the OpenAI routes' models parse theirs: no NaN or Infinity, no
    lone UTF-16 surrogate in a string (neither can be answered back in JSON, and the tokenizer refuses the
    latter), no number beyond a float's range."""
    try:
        body = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", "body") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", "body")
    _check_finite(body, "")
    return body


def _check_finite(value, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"{where or 'the body'}: a number beyond the range of a 64-bit float", where or "body")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{where}.{k}" if where else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{where}.{i}" if where else str(i))


class AgentServing:
    def __init__(self, admission: Admission, store_size: int = 256):
        self.admission = admission
        self.store = ResponseStore(store_size)

    def _model(self, body: dict) -> tuple[str, LoRARequest | None]:
        """The body's model and the LoRA adapter it names (None: the base model)."""
        model = body.get("model")
        if model is None:
            raise bad_request("model is required", "model")
        return model, self.admission.check_model(model)

    # ---- Anthropic Messages ------------------------------------------------------------------------------------
    async def messages(self, request: Request) -> Response:
        body = await json_body(request)
        model, lora = self._model(body)
        inputs, params = anthropic_request.translate(body)
        chat = await self.admission.chat(inputs, params)
        stream = await self.admission.admit_chat("msg", chat, lora)
        sink = AnthropicMessageBuilder(model, params.stop)
        return await respond(stream, ChoiceParsers(chat.new_output_parser), sink, request,
                             streaming=bool(body.get("stream")))

    async def count_tokens(self, request: Request) -> Response:
        body = await json_body(request)
        self._model(body)
        chat = await self.admission.chat(anthropic_request.chat_inputs(body), SamplingParams(max_tokens=None))
        return JSONResponse({"input_tokens": len(chat.prompt_token_ids)})

    # ---- OpenAI Responses --------------------------------------------------------------------------------------
    async def responses(self, request: Request) -> Response:
        body = await json_body(request)
        model, lora = self._model(body)
        history = None
        previous = body.get("previous_response_id")
        if previous is not None:
            history = self.store.get(previous)
            if history is None:
                raise APIError(400, f"previous_response_id {previous!r} is not known to this server (it keeps the "
                               f"last {self.store.capacity} responses in memory, and none across restarts); send "
                               "the whole conversation as input instead", param="previous_response_id",
                               code="previous_response_not_found")
        inputs, params, freeform = responses_request.translate(body, history)
        chat = await self.admission.chat(inputs, params)
        echo = {k: body.get(k) for k in _RESPONSE_ECHO}
        echo.update(tools=body.get("tools") or [], tool_choice=body.get("tool_choice") or "auto",
                    parallel_tool_calls=body.get("parallel_tool_calls", True), store=body.get("store", True))
        tokenizer = self.admission.tokenizer
        sink = ResponseBuilder(model, echo, freeform, lambda text: len(tokenizer.encode(text, False)))
        stream = await self.admission.admit_chat("resp", chat, lora)

        def on_done():
            if body.get("store", True) is not False:
                self.store.put(sink.id, inputs.messages, sink.items)
        return await respond(stream, ChoiceParsers(chat.new_output_parser), sink, request,
                             streaming=bool(body.get("stream")), on_done=on_done)

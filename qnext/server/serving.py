"""Completions and chat completions: a request body in, a JSON body or a server-sent event stream out. The body
becomes typed inputs and SamplingParams (protocol.py), the one admission takes them into the engine, and the one
stream driver runs the output through the OpenAI sinks."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from qnext.server import responses as R
from qnext.server.admission import Admission
from qnext.server.errors import from_validation_error
from qnext.server.openai_sinks import ChatSink, CompletionSink
from qnext.server.protocol import ChatCompletionRequest, CompletionRequest
from qnext.server.stream_driver import ChoiceParsers, respond


class OpenAIServing:
    def __init__(self, admission: Admission):
        self.admission = admission

    async def completions(self, request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        lora = self.admission.check_model(req.model)
        params = req.sampling_params()
        prompt = req.prompt_input()
        if isinstance(prompt, str):
            text, token_ids = prompt, await self.admission.encode(prompt)
        else:
            text, token_ids = None, prompt
        stream = await self.admission.admit("cmpl", text, token_ids, params, clamp=False, lora=lora)
        sink = CompletionSink(R.Envelope("cmpl", self.admission.response_model(lora)), req.stream, params.logprobs,
                              req.include_usage, req.return_token_ids)
        return await respond(stream, None, sink, request, streaming=req.stream)

    async def chat_completions(self, request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest)
        lora = self.admission.check_model(req.model)
        chat = await self.admission.chat(req.chat_inputs(), req.sampling_params())
        stream = await self.admission.admit_chat("chatcmpl", chat, lora)
        parsers = ChoiceParsers(chat.new_output_parser)
        sink = ChatSink(R.Envelope("chatcmpl", self.admission.response_model(lora)), req.stream, chat.params.logprobs,
                        req.include_usage, req.return_token_ids, parsers, req.n, chat.prompt_token_ids)
        return await respond(stream, parsers, sink, request, streaming=req.stream)


async def parse(request: Request, model: type[BaseModel]):
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise from_validation_error(e) from e

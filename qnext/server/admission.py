"""The one way into the engine for every API: the served model's names, the prompt (a chat rendered by the
checkpoint's template, or a text), the room the prompt leaves in max_model_len, and the engine loop's add.

    lora = admission.check_model(req.model)                        # 404 naming the served names; a LoRA adapter
    chat = await admission.chat(inputs, params)                     # ChatInputs + SamplingParams -> ChatRequest
    stream = await admission.admit_chat("chatcmpl", chat, lora)

clamp (admit_chat: chat completions, Anthropic Messages, Responses): max_tokens is an upper bound, cut to the room
the prompt leaves (agents send one large cap whatever the context); without it (/v1/completions) prompt +
max_tokens past max_model_len is a 400. Either way a prompt that leaves no room at all is a 400 naming both numbers."""
from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from typing import Sequence

from qnext.engine.intake import validate_prompt
from qnext.lora.registry import LoRARequest
from qnext.sampling_params import SamplingParams
from qnext.server.chat_request import ChatInputs, ChatRequest, ChatTranslator
from qnext.server.engine_front import EngineFront
from qnext.server.engine_errors import EngineStepError, EngineStoppedError, QueueFullError, RequestError
from qnext.server.errors import APIError, bad_request, engine_error
from qnext.server.lora_adapters import ServedAdapters
from qnext.server.pd_serving import PD_REQUEST
from qnext.server.prompt_bound import PromptBound
from qnext.server.request_stream import RequestStream
from qnext.vision.media import MediaLimits, has_media


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Admission:
    def __init__(self, async_engine: EngineFront, model_name: str, *, aliases: Sequence[str] = (),
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 media_limits: MediaLimits = MediaLimits(), adapters: ServedAdapters | None = None):
        """adapters: the LoRA adapters served by name (server/lora_adapters.py; None: LoRA is off)."""
        model = async_engine.served_model       # the engine itself is not touched here
        self.async_engine = async_engine
        self.model_name = model_name
        self.model_names = tuple(dict.fromkeys([model_name, *aliases]))     # what clients may send as `model`
        self.adapters = adapters
        self.tokenizer = model.tokenizer        # thread-safe on its own
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size
        self.prompt_bound = PromptBound(self.tokenizer, self.max_model_len)
        self.translator = ChatTranslator(self.tokenizer, tool_call_parser=tool_call_parser,
                                         reasoning_parser=reasoning_parser,
                                         check_structured=model.check_structured, vision=model.vision,
                                         media_limits=media_limits,
                                         max_model_len=self.max_model_len)
        # chats with pictures are translated here, so that they never hold up tokenization's threads
        self.media_pool = concurrent.futures.ThreadPoolExecutor(media_limits.workers,
                                                                thread_name_prefix="qnext-media")

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 for a name this server does not serve."""
        if model is None or model in self.model_names:
            return None
        served = self.adapters.get(model) if self.adapters is not None else None
        if served is not None:
            return served.request
        names = [*self.model_names, *(self.adapters.names() if self.adapters is not None else ())]
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{', '.join(repr(n) for n in names)}", param="model", code="model_not_found")

    def response_model(self, lora: LoRARequest | None) -> str:
        """The `model` a response reports: the adapter's name, else the base model's (as vLLM)."""
        return lora.lora_name if lora is not None else self.model_name

    async def chat(self, inputs: ChatInputs, params: SamplingParams) -> ChatRequest:
        """The prompt, constraint and parsers of a chat (messages whose text alone cannot fit are refused before
        the template renders them); a chat with pictures is translated on the media pool."""
        self.prompt_bound.check_messages(inputs.messages)
        if has_media(inputs.messages):
            return await asyncio.get_running_loop().run_in_executor(self.media_pool, self.translator.translate,
                                                                    inputs, params)
        return await asyncio.to_thread(self.translator.translate, inputs, params)

    async def encode(self, text: str) -> list[int]:
        return await asyncio.to_thread(self._encode, text)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this checkpoint has no tokenizer.json; send the prompt as a list of token ids",
                              "prompt")
        self.prompt_bound.check(text)
        return self.tokenizer.encode(text)

    def fit(self, token_ids: list[int], params: SamplingParams, *, clamp: bool, param: str = "messages") -> None:
        """The room check (module docstring); with clamp, params.max_tokens is set to what fits."""
        n, limit = len(token_ids), self.max_model_len
        if n >= limit:
            raise bad_request(f"the prompt has {n} tokens, which leaves no room for output in max_model_len "
                              f"{limit}; shorten it", param)
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

    async def admit_chat(self, id_prefix: str, chat: ChatRequest, lora: LoRARequest | None = None) -> RequestStream:
        """A chat of any API: max_tokens is an upper bound (clamped)."""
        return await self.admit(id_prefix, chat.prompt, chat.prompt_token_ids, chat.params, clamp=True,
                                multi_modal_data=chat.multi_modal_data, lora=lora)

    async def admit(self, id_prefix: str, text: str | None, token_ids: list[int], params: SamplingParams, *,
                    clamp: bool, multi_modal_data: dict | None = None,
                    lora: LoRARequest | None = None) -> RequestStream:
        """A new request in the engine, once the engine loop has taken it. lora: its adapter (check_model's)."""
        self.fit(token_ids, params, clamp=clamp, param="messages" if clamp else "prompt")
        prompt = {"prompt": text, "prompt_token_ids": token_ids}
        if multi_modal_data:
            prompt["multi_modal_data"] = multi_modal_data
        if lora is not None:
            prompt["lora_request"] = lora          # travels with the prompt to the engine (LLMEngine.add_request)
        request_id = new_request_id(id_prefix)
        pd = PD_REQUEST.get()           # a PD router's request (server/pd_serving.py): its id, its prefill source
        try:
            if pd is not None:
                request_id = pd.request_id
                prompt["pd"] = await pd.with_source()      # (a decode server reads its bundle's metadata)
            return await self.async_engine.add(request_id, prompt, params)
        except (QueueFullError, EngineStoppedError, EngineStepError, RequestError, ValueError) as e:
            raise engine_error(e) from e

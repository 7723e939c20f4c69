"""OpenAI request bodies (plus vLLM's extra sampling fields) and their mapping onto SamplingParams.

Models are strict (a string is not a number) and forbid unknown fields, so a misspelt parameter is a 400 rather
than silently ignored. Fields OpenAI has but this server does not implement are accepted only at their neutral
value; anything else is a 400 that names the field."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qnext.sampling_params import SamplingParams
from qnext.server.chat_request import ChatInputs
from qnext.server.errors import bad_request
from qnext.server.sampling import sampling_params

MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields (the OpenAI client sends them through `extra_body`)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    thinking_token_budget: int | None = None

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _num_logprobs(self) -> int | None:
        return None

    def check_supported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def sampling_params(self) -> SamplingParams:
        self.check_supported()
        max_tokens = self._max_tokens()
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        return sampling_params(
            type(self).model_fields,
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=self._num_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            thinking_token_budget=self.thinking_token_budget,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: Any = None                    # a string or a list of token ids; a batch of one is accepted too
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported by this server", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request(f"best_of must be 1 (got {self.best_of})", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}", "logprobs")

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_input(self) -> str | list[int]:
        """The single prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]                                  # a batch of one
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt is empty", "prompt")
            return p
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise bad_request(f"a batch of {len(p)} prompts was sent; this server takes one prompt per request",
                              "prompt")
        if p is None:
            raise bad_request("prompt is required", "prompt")
        raise bad_request("prompt must be a non-empty string or a non-empty list of integer token ids", "prompt")


class ChatMessage(BaseModel):
    # Other keys (tool_calls, tool_call_id, reasoning_content, name, ...) go through to the chat template.
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    # vLLM's extra fields
    structured_outputs: dict[str, Any] | None = None     # one of json, regex, choice, grammar, json_object
    include_reasoning: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}",
                                  "top_logprobs")
            if not self.logprobs:
                raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_inputs(self) -> ChatInputs:
        """The request's chat part, for ChatTranslator (messages as plain dicts, unknown keys kept)."""
        messages = [{**(m.model_extra or {}), "role": m.role, "content": m.content} for m in self.messages]
        return ChatInputs(messages=messages, tools=self.tools, tool_choice=self.tool_choice,
                          parallel_tool_calls=self.parallel_tool_calls, response_format=self.response_format,
                          structured_outputs=self.structured_outputs, chat_template_kwargs=self.chat_template_kwargs,
                          include_reasoning=self.include_reasoning, add_generation_prompt=self.add_generation_prompt)

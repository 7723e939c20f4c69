"""What an openai client reads from a server for one conversation (chat, the same chat streamed, a forced tool
call), greedy: for tests that compare a deployment with one process serving the same checkpoint."""
from __future__ import annotations

import json

import openai

GREEDY = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


def answers(base_url: str, model: str, messages: list[dict]) -> dict:
    """The chat's text and completion tokens, the streamed text, the forced tool calls, and the chat's prompt and
    cached token counts."""
    c = client(base_url)
    chat = c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, extra_body=GREEDY)
    stream = c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, stream=True,
                                       extra_body=GREEDY)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    tool = c.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                     tools=[WEATHER_TOOL], tool_choice="required", extra_body=GREEDY).choices[0]
    details = chat.usage.prompt_tokens_details
    return {"chat": chat.choices[0].message.content, "usage": chat.usage.completion_tokens, "streamed": streamed,
            "tool_calls": [(t.function.name, json.loads(t.function.arguments)) for t in tool.message.tool_calls or []],
            "prompt_tokens": chat.usage.prompt_tokens, "cached_tokens": details.cached_tokens if details else 0}

"""The request bodies of qnext's HTTP APIs as JSON schemas, in one OpenAPI document (`openapi_document`).

They describe what a client of each API sends (OpenAI Chat Completions and Completions, Anthropic Messages and
count_tokens, OpenAI Responses), so that schemathesis can generate bodies that fit ("positive") and bodies that do
not ("negative"). Bodies that fit are meant to reach the engine and stay cheap there: few small messages,
max_tokens of at most MAX_TOKENS, n of at most 3, `additionalProperties: false` on the request objects (the negative
bodies then carry unknown fields). Picture URLs come from media_samples.py; JSON schemas (response formats, tool
parameters) from SCHEMA_SAMPLES, some of them invalid, or any object at all."""
from __future__ import annotations

from typing import Any

from qnext.testing.api_fuzz.media_samples import (BAD_IMAGE_URLS, BASE64_DATA, GOOD_IMAGE_URLS, IMAGE_MEDIA_TYPES,
                                                  VIDEO_URLS)

MODEL = "qnext-tiny-demo"
# "$ref" as it is written in the samples: schemathesis would resolve a real one wherever it stands, even inside an
# enum's values; mutations.restore_refs puts "$ref" back in the generated body.
REF = "__ref__"
MAX_TOKENS = 8
TOOL_NAMES = ["get_weather", "search", "a.b:c-d_e"]

SCHEMA_SAMPLES: list[Any] = [
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
     "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2},
    {"type": "string", "pattern": "^[a-z]{1,5}$"},
    {"type": "object", "properties": {"x": {REF: "#/$defs/x"}}, "$defs": {"x": {"type": "boolean"}}},
    {"type": "object", "properties": {"x": {REF: "#/$defs/missing"}}},
    {"type": "nonsense"},
    {"type": "string", "pattern": "(unclosed"},
    {"type": "integer", "minimum": 10, "maximum": 1},
    {"enum": []},
    {"anyOf": []},
    {"not": {}},
    {"type": "object", "required": ["a"], "properties": {"a": False}},
    {"type": "string", "format": "email", "minLength": 1000000},
    {},
    True,
    False,
]
REGEX_SAMPLES = ["[a-z]+", "(yes|no)", "\\d{3}-\\d{4}", "(", "a{99999}", ".*", "[", "\\"]
GRAMMAR_SAMPLES = ['start: "yes" | "no"', "root ::= [a-z]+", "start: ", "this is not a grammar", 'start: x\nx: "a" x']


def _enum(values: list) -> dict:
    return {"enum": list(values)}


def _obj(properties: dict, required: tuple[str, ...] = (), *, closed: bool = True) -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    return schema


def _array(items: dict, max_items: int, min_items: int = 0) -> dict:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def _any_of(*schemas: dict) -> dict:
    return {"anyOf": list(schemas)}


STRING = {"type": "string", "maxLength": 40}
BOOL = {"type": "boolean"}
JSON_SCHEMA = _any_of(_enum(SCHEMA_SAMPLES), {"type": "object"})
SMALL_MAX_TOKENS = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS}
STOP = _any_of(STRING, _array(STRING, 4))
IMAGE_URL = _any_of(_enum(GOOD_IMAGE_URLS), _enum(BAD_IMAGE_URLS))       # half of them good
TOOL_NAME = _enum(TOOL_NAMES)           # negative bodies bring other names

# vLLM's extra sampling fields (OpenAI routes; the agent routes take most of them too, sampling.py)
EXTRA_SAMPLING = {
    "seed": {"type": "integer"},
    "top_k": {"type": "integer", "minimum": -1, "maximum": 50},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": 2},
    "ignore_eos": BOOL,
    "thinking_token_budget": {"type": "integer", "minimum": 0, "maximum": MAX_TOKENS},
}
OPENAI_SAMPLING = {
    "model": _enum([MODEL]),
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 3},
    "stream": BOOL,
    "stream_options": _obj({"include_usage": BOOL, "continuous_usage_stats": BOOL}),
    "stop": STOP,
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number"}, "maxProperties": 0},   # only {}
    "user": STRING,
    "stop_token_ids": _array({"type": "integer", "minimum": 0, "maximum": 600}, 3),
    "skip_special_tokens": BOOL,
    "include_stop_str_in_output": BOOL,
    "return_token_ids": BOOL,
    **EXTRA_SAMPLING,
}


# ---- OpenAI Chat Completions ------------------------------------------------------------------------------------
def _openai_tool() -> dict:
    function = _obj({"name": TOOL_NAME, "description": STRING, "parameters": JSON_SCHEMA, "strict": BOOL},
                    ("name",))
    return _obj({"type": _enum(["function"]), "function": function}, ("type", "function"))


def _chat_parts() -> dict:
    text = _obj({"type": _enum(["text"]), "text": STRING}, ("type", "text"))
    image = _obj({"type": _enum(["image_url"]), "image_url": _obj({"url": IMAGE_URL,
                                                                    "detail": _enum(["auto", "low", "high"])},
                                                                   ("url",))}, ("type", "image_url"))
    video = _obj({"type": _enum(["video_url"]), "video_url": _obj({"url": _enum(VIDEO_URLS)}, ("url",))},
                 ("type", "video_url"))
    return _array(_any_of(text, text, image, video), 3, 1)


def _chat_message() -> dict:
    content = _any_of(STRING, _chat_parts())
    call = _obj({"id": STRING, "type": _enum(["function"]),
                 "function": _obj({"name": TOOL_NAME, "arguments": _any_of(_enum(['{"city": "Oslo"}', "{}", "[1]",
                                                                                  "not json"]), STRING)},
                                  ("name", "arguments"))}, ("id", "type", "function"))
    user = _obj({"role": _enum(["user"]), "content": content, "name": STRING}, ("role", "content"))
    return _any_of(
        user, user,
        _obj({"role": _enum(["assistant"]), "content": _any_of(STRING, {"type": "null"}),
              "tool_calls": _array(call, 2), "reasoning_content": STRING}, ("role",)),
        _obj({"role": _enum(["tool"]), "content": content, "tool_call_id": STRING}, ("role", "content")),
    )


def _chat_messages() -> dict:
    """A system or developer message only first (the Qwen templates refuse one anywhere else)."""
    system = _obj({"role": _enum(["system", "developer"]), "content": _any_of(STRING, _chat_parts())},
                  ("role", "content"))
    first = _any_of(system, _chat_message())
    return {"type": "array", "prefixItems": [first], "items": _chat_message(), "minItems": 1, "maxItems": 4}


def _response_format() -> dict:
    return _any_of(
        _obj({"type": _enum(["text", "json_object"])}, ("type",)),
        _obj({"type": _enum(["json_schema"]),
              "json_schema": _obj({"name": STRING, "schema": JSON_SCHEMA, "strict": BOOL}, ("name", "schema"))},
             ("type", "json_schema")),
    )


def _structured_outputs() -> dict:
    return _any_of(
        _obj({"json": JSON_SCHEMA}, ("json",)),
        _obj({"regex": _enum(REGEX_SAMPLES)}, ("regex",)),
        _obj({"choice": _array(STRING, 3)}, ("choice",)),
        _obj({"grammar": _enum(GRAMMAR_SAMPLES)}, ("grammar",)),
        _obj({"json_object": BOOL}, ("json_object",)),
    )


def _needs(field: str, value: Any) -> dict:
    """A dependentSchemas entry: the field is sent only with `field` set to `value`."""
    return {"properties": {field: {"const": value}}, "required": [field]}


def chat_completion_schema() -> dict:
    tool_choice = _any_of(_enum(["none", "auto", "required"]),
                          _obj({"type": _enum(["function"]), "function": _obj({"name": TOOL_NAME}, ("name",))},
                               ("type", "function")))
    schema = _obj({
        **OPENAI_SAMPLING,
        "messages": _chat_messages(),
        "max_tokens": SMALL_MAX_TOKENS,
        "max_completion_tokens": SMALL_MAX_TOKENS,
        "logprobs": BOOL,
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "tools": _array(_openai_tool(), 3),
        "tool_choice": tool_choice,
        "response_format": _response_format(),
        "parallel_tool_calls": BOOL,
        "chat_template_kwargs": _obj({"enable_thinking": BOOL}),
        "add_generation_prompt": BOOL,
        "metadata": {"type": "object", "additionalProperties": STRING},
        "store": BOOL,
        "service_tier": STRING,
        "structured_outputs": _structured_outputs(),
        "include_reasoning": BOOL,
    }, ("messages",))
    schema["dependentSchemas"] = {"stream_options": _needs("stream", True), "top_logprobs": _needs("logprobs", True)}
    return schema


# ---- OpenAI Completions -----------------------------------------------------------------------------------------
def completion_schema() -> dict:
    token_ids = _array({"type": "integer", "minimum": 0, "maximum": 600}, 8, 1)
    prompt = _any_of(STRING, token_ids, _array(STRING, 2, 1), _array(token_ids, 2, 1))
    schema = _obj({
        **OPENAI_SAMPLING,
        "prompt": prompt,
        "max_tokens": SMALL_MAX_TOKENS,
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "echo": BOOL,
        "suffix": STRING,
        "best_of": {"type": "integer", "minimum": 1, "maximum": 2},
    }, ("prompt",))
    schema["dependentSchemas"] = {"stream_options": _needs("stream", True)}
    return schema


# ---- Anthropic Messages -----------------------------------------------------------------------------------------
_CACHE_CONTROL = _obj({"type": _enum(["ephemeral"])}, ("type",))


def _anthropic_message() -> dict:
    text = _obj({"type": _enum(["text"]), "text": STRING, "cache_control": _CACHE_CONTROL}, ("type", "text"))
    source = _any_of(
        _obj({"type": _enum(["base64"]), "media_type": _enum(IMAGE_MEDIA_TYPES), "data": _enum(BASE64_DATA)},
             ("type", "media_type", "data")),
        _obj({"type": _enum(["url"]), "url": IMAGE_URL}, ("type", "url")),
    )
    image = _obj({"type": _enum(["image"]), "source": source}, ("type", "source"))
    tool_use = _obj({"type": _enum(["tool_use"]), "id": STRING, "name": TOOL_NAME,
                     "input": {"type": "object", "additionalProperties": STRING}}, ("type", "id", "name", "input"))
    document = _obj({"type": _enum(["document"]), "source": {"type": "object"}}, ("type",))
    result_content = _any_of(STRING, _array(_any_of(text, image, document), 2))
    tool_result = _obj({"type": _enum(["tool_result"]), "tool_use_id": STRING, "content": result_content,
                        "is_error": BOOL}, ("type", "tool_use_id"))
    thinking = _obj({"type": _enum(["thinking"]), "thinking": STRING, "signature": STRING}, ("type", "thinking"))
    redacted = _obj({"type": _enum(["redacted_thinking"]), "data": STRING}, ("type", "data"))
    user = _array(_any_of(text, text, image, tool_result), 3, 1)
    assistant = _array(_any_of(text, text, tool_use, thinking, redacted), 3, 1)
    return _any_of(_obj({"role": _enum(["user"]), "content": _any_of(STRING, user)}, ("role", "content")),
                   _obj({"role": _enum(["assistant"]), "content": _any_of(STRING, assistant)}, ("role", "content")))


def _anthropic_body(with_sampling: bool) -> dict:
    message = _anthropic_message()
    tool = _obj({"name": TOOL_NAME, "description": STRING, "input_schema": JSON_SCHEMA,
                 "type": _enum(["custom"]), "cache_control": _CACHE_CONTROL}, ("name", "input_schema"))
    tool_choice = _any_of(_obj({"type": _enum(["auto", "any", "none"]), "disable_parallel_tool_use": BOOL},
                               ("type",)),
                          _obj({"type": _enum(["tool"]), "name": TOOL_NAME, "disable_parallel_tool_use": BOOL},
                               ("type", "name")))
    thinking = _any_of(_obj({"type": _enum(["enabled"]), "budget_tokens": {"type": "integer", "minimum": 0,
                                                                           "maximum": MAX_TOKENS}}, ("type",)),
                       _obj({"type": _enum(["disabled", "adaptive"])}, ("type",)))
    properties = {
        "model": _enum([MODEL]),
        "messages": _array(message, 4, 1),
        "system": _any_of(STRING, _array(_obj({"type": _enum(["text"]), "text": STRING,
                                               "cache_control": _CACHE_CONTROL}, ("type", "text")), 2)),
        "tools": _array(tool, 3),
        "tool_choice": tool_choice,
        "thinking": thinking,
    }
    if not with_sampling:
        return _obj(properties, ("model", "messages"))
    properties.update({
        "max_tokens": SMALL_MAX_TOKENS,
        "stream": BOOL,
        "stop_sequences": _array(STRING, 3),
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": 50},
        "metadata": _obj({"user_id": STRING}),
        **EXTRA_SAMPLING,
    })
    return _obj(properties, ("model", "max_tokens", "messages"))


# ---- OpenAI Responses -------------------------------------------------------------------------------------------
def _responses_items() -> dict:
    text_part = _obj({"type": _enum(["input_text", "output_text", "text"]), "text": STRING}, ("type", "text"))
    image_part = _obj({"type": _enum(["input_image"]), "image_url": IMAGE_URL,
                       "detail": _enum(["auto", "low", "high"])}, ("type",))
    content = _any_of(STRING, _array(_any_of(text_part, text_part, image_part), 3, 1))
    message = _obj({"type": _enum(["message"]), "role": _enum(["user", "assistant", "system", "developer"]),
                    "content": content}, ("role", "content"))
    call = _obj({"type": _enum(["function_call"]), "call_id": STRING, "name": TOOL_NAME,
                 "arguments": _any_of(_enum(['{"city": "Oslo"}', "{}", "not json"]), STRING)},
                ("type", "call_id", "name"))
    output = _obj({"type": _enum(["function_call_output", "custom_tool_call_output"]), "call_id": STRING,
                   "output": content}, ("type", "call_id", "output"))
    custom_call = _obj({"type": _enum(["custom_tool_call"]), "call_id": STRING, "name": TOOL_NAME,
                        "input": STRING}, ("type", "call_id", "name"))
    reasoning = _obj({"type": _enum(["reasoning"]),
                      "summary": _array(_obj({"type": _enum(["summary_text"]), "text": STRING}, ("type", "text")), 2),
                      "content": _array(_obj({"type": _enum(["reasoning_text"]), "text": STRING}, ("type", "text")),
                                        2)}, ("type",))
    return _any_of(STRING, _array(_any_of(message, message, call, output, custom_call, reasoning), 4, 1))


def _responses_tools() -> dict:
    function = _obj({"type": _enum(["function"]), "name": TOOL_NAME, "description": STRING,
                     "parameters": JSON_SCHEMA, "strict": BOOL}, ("type", "name"))
    grammar = _obj({"type": _enum(["grammar"]), "syntax": _enum(["lark", "regex"]),
                    "definition": _enum(GRAMMAR_SAMPLES)}, ("type",))
    custom = _obj({"type": _enum(["custom"]), "name": TOOL_NAME, "description": STRING,
                   "format": _any_of(grammar, _obj({"type": _enum(["text"])}, ("type",)))}, ("type", "name"))
    hosted = _obj({"type": _enum(["web_search", "web_search_preview"])}, ("type",))
    namespace = _obj({"type": _enum(["namespace"]), "name": STRING, "tools": _array(_any_of(function, custom), 2)},
                     ("type", "tools"))
    return _array(_any_of(function, custom, hosted, namespace), 3)


def responses_schema() -> dict:
    text_format = _any_of(
        _obj({"type": _enum(["text", "json_object"])}, ("type",)),
        _obj({"type": _enum(["json_schema"]), "name": STRING, "schema": JSON_SCHEMA, "strict": BOOL}, ("type",)),
    )
    tool_choice = _any_of(_enum(["auto", "none", "required"]),
                          _obj({"type": _enum(["function", "custom"]), "name": TOOL_NAME}, ("type", "name")))
    return _obj({
        "model": _enum([MODEL]),
        "input": _responses_items(),
        "instructions": STRING,
        "max_output_tokens": SMALL_MAX_TOKENS,
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "tools": _responses_tools(),
        "tool_choice": tool_choice,
        "parallel_tool_calls": BOOL,
        "text": _obj({"format": text_format}),
        "reasoning": _obj({"effort": _enum(["none", "minimal", "low", "medium", "high"]),
                           "summary": _enum(["auto", "concise", "detailed"])}),
        "store": BOOL,
        "stream": BOOL,
        "metadata": {"type": "object", "additionalProperties": STRING},
        "truncation": _enum(["auto", "disabled"]),
        "user": STRING,
        **EXTRA_SAMPLING,
    }, ("model", "input"))


# ---- the document -----------------------------------------------------------------------------------------------
# API name -> (route, the body's schema)
ROUTES = {
    "chat": ("/v1/chat/completions", chat_completion_schema),
    "completions": ("/v1/completions", completion_schema),
    "messages": ("/v1/messages", lambda: _anthropic_body(with_sampling=True)),
    "count_tokens": ("/v1/messages/count_tokens", lambda: _anthropic_body(with_sampling=False)),
    "responses": ("/v1/responses", responses_schema),
}


def openapi_document() -> dict:
    """An OpenAPI 3.0 document with one POST operation per API, whose JSON body is that API's schema."""
    paths = {}
    for route, schema in ROUTES.values():
        paths[route] = {"post": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema()}}},
            "responses": {"200": {"description": "the answer"}, "400": {"description": "a bad request"}},
        }}
    return {"openapi": "3.1.0", "info": {"title": "qnext request bodies", "version": "1"}, "paths": paths}

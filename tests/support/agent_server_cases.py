"""Requests and checks shared by the agent server tests (one module per chat-template format)."""
from __future__ import annotations

import contextlib

import json
import re

import jsonschema

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 10},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"type": "string", "enum": ["C", "F"]},
    "detailed": {"type": "boolean"}},
    "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 8},
                                          "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["answer", "confidence"], "additionalProperties": False}
SYSTEM = ("You are a helpful assistant for travellers. You answer questions about the weather, the sea and the "
          "ships, and you call tools when you need facts.")
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the weather in Paris?"}]
REGEX = r"(yes|no) [0-9]{1,3}"
CHOICES = ["lighthouse", "harbour", "ship"]

BLOCK_SIZE = 16


def agent_server_args(model: str) -> list[str]:
    """No warm-up and one request at a time: a module compiles only a few step shapes, on first use (concurrent
    requests would compile a decode shape per batch size)."""
    return ["--served-model-name", model, "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
            "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE), "--no-warm-up", "--log-level", "warning"]


@contextlib.contextmanager
def agent_server(checkpoint, model: str, log_dir):
    """`qnext serve` on checkpoint as `model`, and an openai client for it (the module's one server)."""
    import openai

    from qnext.server.launch import running_server

    with running_server([str(checkpoint), *agent_server_args(model)], timeout=300, log_path=log_dir / "server.log",
                        env={"JAX_PLATFORMS": "cpu"}) as proc, \
            openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", timeout=120, max_retries=0) as client:
        yield client


def write_checkpoint(path, family: str, **kwargs):
    """A tiny checkpoint whose eos is the tokenizer's `<|im_end|>`, as in Qwen releases (the default tiny config's
    eos id 2 is the byte token "#", which a grammar allows inside strings), with room for tool schemas."""
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint
    from qnext.testing.tiny_tokenizer import tiny_eos_token_id

    return write_tiny_checkpoint(path, family, max_position_embeddings=2048, eos_token_id=tiny_eos_token_id(512),
                                 **kwargs)


def forced_request(i: int) -> tuple[str, dict]:
    """The i-th request of a mixed forced-output workload -> (kind, create() keyword arguments)."""
    base = {"messages": MESSAGES, "temperature": 1.0, "max_tokens": 200, "seed": 5000 + i}
    kind = ("required", "named", "json_schema", "regex", "required", "named", "choice", "json_schema", "required",
            "named", "regex", "json_schema")[i % 12]
    if kind == "required":
        # one request may make several calls (~100 tokens each; random weights often go on to the next call)
        parallel = i == 0
        return kind, {**base, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel,
                      "max_tokens": 1100 if parallel else 200}
    if kind == "named":
        return kind, {**base, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}}
    if kind == "json_schema":
        return kind, {**base, "response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": ANSWER, "strict": True}}}
    if kind == "regex":
        return kind, {**base, "extra_body": {"structured_outputs": {"regex": REGEX}}}
    return kind, {**base, "extra_body": {"structured_outputs": {"choice": CHOICES}}}


def check_forced(kind: str, kwargs: dict, response) -> None:
    """The response of forced_request: complete, parsed, valid."""
    choice = response.choices[0]
    message = choice.message
    context = f"{kind}: {message.model_dump()} finish={choice.finish_reason}"
    if kind in ("required", "named"):
        assert choice.finish_reason == "tool_calls", context
        assert message.tool_calls and not message.content, context
        if not kwargs.get("parallel_tool_calls", True) or kind == "named":
            assert len(message.tool_calls) == 1, context
        for call in message.tool_calls:
            assert call.type == "function" and call.id, context
            assert kind == "required" or call.function.name == "search", context
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        return
    assert choice.finish_reason == "stop" and not message.tool_calls, context
    if kind == "json_schema":
        jsonschema.validate(json.loads(message.content), ANSWER)
    elif kind == "regex":
        assert re.fullmatch(REGEX, message.content), context
    else:
        assert message.content in CHOICES, context


def check_many_forced(client, model: str, count: int) -> None:
    """The first `count` requests of the forced-output workload, each complete, parsed and valid."""
    for i in range(count):
        kind, kwargs = forced_request(i)
        check_forced(kind, kwargs, client.chat.completions.create(model=model, **kwargs))


def assemble_stream(chunks) -> dict:
    """Streamed chat chunks -> {"content", "reasoning", "tool_calls": [(name, arguments)], "finish_reason"},
    checking OpenAI's tool-call delta shapes on the way (id, type and name first, then argument fragments)."""
    content, reasoning, calls, finish = [], [], {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        if extra.get("reasoning_content"):
            reasoning.append(extra["reasoning_content"])
        if delta.content:
            content.append(delta.content)
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
            else:
                assert tc.id is None and tc.function.name is None, tc
                calls[tc.index][1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return {"content": "".join(content), "reasoning": "".join(reasoning) if reasoning else None,
            "tool_calls": [tuple(calls[i]) for i in sorted(calls)], "finish_reason": finish}

"""An Anthropic Messages request body -> the chat's ChatInputs (OpenAI-shaped messages and tools) and its
SamplingParams.

system (a string or text blocks) -> one system message; content blocks: `text` -> content, `thinking` ->
`reasoning_content`, `tool_use` -> the assistant's `tool_calls`, `tool_result` -> `tool` messages (placed before the
user's text, answering the previous assistant turn); `tools` [{name, description, input_schema}] -> function tools;
tool_choice auto / any / tool / none -> "auto" / "required" / a named function / "none"; `thinking` enabled /
disabled -> the template's enable_thinking (Claude Code's `adaptive` counts as enabled), and `budget_tokens` ->
thinking_token_budget (the engine forces `</think>` once it is spent). A `system` message inside
`messages` (Claude Code sends one) becomes a user turn at its place: the Qwen templates take a system message only
first, and folding it into the system prompt would change the prompt's prefix and lose the prefix cache.
`cache_control` is accepted anywhere and ignored (qnext caches every prefix on its own); `metadata` and fields this
server does not know (Claude Code's context_management, output_config, ...) are ignored."""
from __future__ import annotations

import json
from typing import Any

from qnext.sampling_params import SamplingParams
from qnext.server.chat_request import ChatInputs
from qnext.server.errors import bad_request
from qnext.server.sampling import sampling_extras, sampling_params


def _require(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise bad_request(message, param)


def _text_of_blocks(blocks: Any, param: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(blocks, str):
        return blocks
    _require(isinstance(blocks, list), f"{param} must be a string or a list of content blocks", param)
    texts = []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        _require(kind == "text", f"{param}[{i}] is a {kind!r} block; only text blocks are supported here",
                 f"{param}.{i}")
        _require(isinstance(block.get("text"), str), f"{param}[{i}].text must be a string", f"{param}.{i}.text")
        texts.append(block["text"])
    return "\n".join(texts)


def _image_part(block: dict, where: str) -> dict:
    """An Anthropic image block (base64 or url source) as an OpenAI image_url part (qnext/vision/media.py reads it)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        _require(isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str),
                 f"{where}.source needs a media_type and base64 data", f"{where}.source")
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url":
        _require(isinstance(source.get("url"), str), f"{where}.source.url must be a string", f"{where}.source")
        url = source["url"]
    else:
        raise bad_request(f"{where}.source.type of an image block must be 'base64' or 'url', got {kind!r}",
                          f"{where}.source")
    return {"type": "image_url", "image_url": {"url": url}}


# A tool's result may hold a document (Claude Code's Read of a PDF): the model cannot read it, but the turn must go
# on, so it is named in the text instead of refusing the whole conversation.
DOCUMENT_OMITTED = "[document omitted: this server reads no documents]"


def _parts(blocks: list[tuple[int, Any]], param: str, kinds: str, in_tool_result: bool = False
           ) -> list[dict] | str:
    """(index, block) pairs of text and image blocks as OpenAI content parts (a plain string when there is no
    image)."""
    parts = []
    for i, block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"{param}.{i}"
        if in_tool_result and kind == "document":
            parts.append({"type": "text", "text": DOCUMENT_OMITTED})
        elif kind == "text":
            _require(isinstance(block.get("text"), str), f"{where}.text must be a string", where)
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(block, where))
        else:
            raise bad_request(f"{where} is a {kind!r} block; {kinds}", where)
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _tool_result(block: dict, param: str) -> dict:
    _require(isinstance(block.get("tool_use_id"), str), f"{param}.tool_use_id must be a string", param)
    content = block.get("content", "")
    if isinstance(content, list):
        content = _parts(list(enumerate(content)), f"{param}.content", "a tool_result holds text and image blocks",
                         in_tool_result=True)
    elif content is None:
        content = ""
    _require(isinstance(content, (str, list)), f"{param}.content must be a string or a list of content blocks",
             f"{param}.content")
    if block.get("is_error"):
        content = f"Error: {content}" if isinstance(content, str) else [{"type": "text", "text": "Error:"}, *content]
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tool_use(block: dict, param: str) -> dict:
    _require(isinstance(block.get("id"), str) and isinstance(block.get("name"), str),
             f"{param} needs a string id and name", param)
    arguments = block.get("input", {})
    _require(isinstance(arguments, dict), f"{param}.input must be an object", f"{param}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _user_messages(content: Any, param: str) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    _require(isinstance(content, list), f"{param} must be a string or a list of content blocks", param)
    results, others = [], []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            results.append(_tool_result(block, f"{param}.{i}"))
        else:
            others.append((i, block))
    if not others:
        return results or [{"role": "user", "content": ""}]
    return results + [{"role": "user", "content": _parts(others, param,
                                                         "user turns take text, image and tool_result blocks")}]


def _assistant_message(content: Any, param: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    _require(isinstance(content, list), f"{param} must be a string or a list of content blocks", param)
    texts, reasoning, calls = [], [], []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"{param}.{i}"
        if kind == "text":
            _require(isinstance(block.get("text"), str), f"{where}.text must be a string", f"{where}.text")
            texts.append(block["text"])
        elif kind == "thinking":
            thinking = block.get("thinking")
            _require(thinking is None or isinstance(thinking, str), f"{where}.thinking must be a string",
                     f"{where}.thinking")
            reasoning.append(thinking or "")
        elif kind == "redacted_thinking":
            continue                                 # opaque: nothing to show the model
        elif kind == "tool_use":
            calls.append(_tool_use(block, where))
        else:
            raise bad_request(f"{where} is a {kind!r} block; assistant turns take text, thinking and tool_use "
                              "blocks", where)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(body: dict) -> list[dict]:
    """system + messages -> OpenAI-shaped chat messages."""
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = _text_of_blocks(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    messages = body.get("messages")
    _require(isinstance(messages, list) and len(messages) > 0, "messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        _require(isinstance(m, dict), f"messages[{i}] must be an object", f"messages.{i}")
        role, param = m.get("role"), f"messages.{i}.content"
        if role == "user":
            out.extend(_user_messages(m.get("content"), param))
        elif role == "assistant":
            out.append(_assistant_message(m.get("content"), param))
        elif role == "system":          # Claude Code's mid-conversation system notes: a user turn keeps the prefix
            out.append({"role": "user", "content": _text_of_blocks(m.get("content"), param)})
        else:
            raise bad_request(f"messages[{i}].role must be 'user', 'assistant' or 'system', got {role!r}",
                              f"messages.{i}.role")
    return out


def chat_tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if not tools:
        return None
    _require(isinstance(tools, list), "tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        _require(isinstance(tool, dict) and isinstance(tool.get("name"), str), f"{where} needs a string name", where)
        kind = tool.get("type", "custom")
        if kind != "custom" or "input_schema" not in tool:
            raise bad_request(f"{where} ({tool['name']!r}) is a {kind!r} tool; this server runs no server tools: "
                              "declare client tools with an input_schema", where)
        _require(isinstance(tool["input_schema"], dict), f"{where}.input_schema must be an object", where)
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(body: dict, has_tools: bool) -> tuple[Any, bool | None]:
    """-> (OpenAI tool_choice, parallel_tool_calls)."""
    choice = body.get("tool_choice")
    if choice is None:
        return None, None
    _require(isinstance(choice, dict), "tool_choice must be an object such as {\"type\": \"auto\"}", "tool_choice")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("any", "tool"):
        _require(has_tools, f"tool_choice {kind!r} needs tools", "tool_choice")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        _require(isinstance(choice.get("name"), str), "tool_choice of type 'tool' needs a name", "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice.type")


def enable_thinking(body: dict) -> bool | None:
    thinking = body.get("thinking")
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind in ("enabled", "adaptive"):
        return True
    if kind == "disabled":
        return False
    raise bad_request(f"thinking.type must be 'enabled' or 'disabled', got {kind!r}", "thinking.type")


def _number(body: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    _require(value is None or (isinstance(value, kind) and not isinstance(value, bool)),
             f"{name} must be a number" if kind is not int else f"{name} must be an integer", name)
    return value


def chat_inputs(body: dict) -> ChatInputs:
    """The conversation, tools and template switches (all /v1/messages/count_tokens needs)."""
    _require(isinstance(body, dict), "the request body must be a JSON object", "body")
    messages = chat_messages(body)
    tools = chat_tools(body)
    tool_choice, parallel = chat_tool_choice(body, bool(tools))
    thinking = enable_thinking(body)
    return ChatInputs(messages=messages, tools=tools, tool_choice=tool_choice,
                      parallel_tool_calls=parallel,
                      chat_template_kwargs={"enable_thinking": thinking} if thinking is not None else None)


def sampling(body: dict) -> SamplingParams:
    fields: dict[str, Any] = {}
    thinking = body.get("thinking") if enable_thinking(body) else None
    budget = thinking.get("budget_tokens") if thinking else None
    if budget is not None:        # a hard cap: </think> is forced once it is spent (vLLM's thinking_token_budget)
        _require(isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0,
                 f"thinking.budget_tokens must be a non-negative integer, got {budget!r}", "thinking.budget_tokens")
        fields["thinking_token_budget"] = budget
    max_tokens = _number(body, "max_tokens", int)
    _require(max_tokens is not None, "max_tokens is required", "max_tokens")
    _require(max_tokens >= 1, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    for name in ("temperature", "top_p"):
        value = _number(body, name, (int, float))
        if value is not None:
            fields[name] = float(value)
    fields["top_k"] = _number(body, "top_k", int) or 0
    fields.update(sampling_extras(body))
    stop = body.get("stop_sequences")
    if stop:
        _require(isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
                 "stop_sequences must be a list of non-empty strings", "stop_sequences")
        fields["stop"] = stop
    return sampling_params(max_tokens=max_tokens, **fields)


def translate(body: dict) -> tuple[ChatInputs, SamplingParams]:
    """The whole translation: the chat and its sampling (max_tokens as asked; admission clamps it)."""
    inputs = chat_inputs(body)
    return inputs, sampling(body)

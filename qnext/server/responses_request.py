"""An OpenAI Responses request body -> the chat's ChatInputs (OpenAI-shaped messages and tools) and its
SamplingParams.

`instructions` and every system / developer message become the one system message (the Qwen templates accept a
system message only first; Codex sends its instructions and developer notes that way). Input items: messages
(content a string or input_text / output_text parts), `function_call` -> the assistant's `tool_calls`,
`function_call_output` -> `tool` messages, `reasoning` -> the next assistant turn's `reasoning_content`; Codex's
`custom_tool_call` / `custom_tool_call_output` the same way. Tools: flat `function` tools, and `custom` (freeform)
tools served as a function with one string parameter `input` (FREEFORM_PARAMETER) whose value is the free text;
`namespace` tools (Codex groups some tools so) flattened into their function tools; `web_search`, a hosted tool Codex
always declares, left out (the server cannot search); any other tool type is a 400 naming it."""
from __future__ import annotations

import json
from typing import Any

from qnext.sampling_params import SamplingParams
from qnext.server.chat_request import ChatInputs
from qnext.server.errors import bad_request
from qnext.server.sampling import sampling_extras, sampling_params

FREEFORM_PARAMETER = "input"
SKIPPED_TOOL_TYPES = ("web_search", "web_search_preview")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _require(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise bad_request(message, param)


def _text(content: Any, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    _require(isinstance(content, list), f"{param} must be a string or a list of content parts", param)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise bad_request(f"{param}[{i}] is a {kind!r} part; this server reads text parts only "
                              f"({', '.join(_TEXT_PARTS[:2])})", f"{param}.{i}")
    return "\n".join(texts)


def _content(content: Any, param: str) -> str | list[dict]:
    """A user message's or a tool output's content: text, or OpenAI chat parts when it holds `input_image` parts
    (image_url a data URL, or http(s) where the server fetches them)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content, param)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            url = part.get("image_url")
            _require(isinstance(url, str), f"{param}[{i}].image_url must be a URL string (a data: URL); file_id "
                     "images are not stored on this server", f"{param}.{i}.image_url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise bad_request(f"{param}[{i}] is a {kind!r} part; this server reads input_text and input_image "
                              "parts", f"{param}.{i}")
    return parts


def freeform_function(tool: dict, where: str) -> dict:
    """A Codex `custom` tool as a function whose one string argument is the tool's free-text input."""
    description = tool.get("description") or ""
    _require(isinstance(description, str), f"{where}.description must be a string", f"{where}.description")
    fmt = tool.get("format") or {}
    _require(isinstance(fmt, dict), f"{where}.format must be an object such as {{\"type\": \"text\"}}",
             f"{where}.format")
    _require(isinstance(fmt.get("definition") or "", str), f"{where}.format.definition must be a string",
             f"{where}.format.definition")
    if fmt.get("type") == "grammar" and fmt.get("definition"):
        description += (f"\n\nThe `{FREEFORM_PARAMETER}` argument is free text in this {fmt.get('syntax', '')} "
                        f"grammar:\n{fmt['definition']}")
    schema = {"type": "object", "properties": {FREEFORM_PARAMETER: {"type": "string"}},
              "required": [FREEFORM_PARAMETER], "additionalProperties": False}
    return {"name": tool["name"], "description": description.strip(), "parameters": schema}


def chat_tools(body: dict) -> tuple[list[dict] | None, set[str]]:
    """-> (OpenAI chat tools, the names of freeform tools)."""
    tools = body.get("tools")
    if not tools:
        return None, set()
    _require(isinstance(tools, list), "tools must be a list", "tools")
    out, freeform = [], set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            inner, inner_freeform = chat_tools({"tools": tool.get("tools") or []})
            out += inner or []
            freeform |= inner_freeform
        elif kind in SKIPPED_TOOL_TYPES:
            continue
        elif kind == "function":
            _require(isinstance(tool.get("name"), str), f"{where}.name must be a string", f"{where}.name")
            function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object",
                                                                                      "properties": {}}}
            if tool.get("description"):
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
        elif kind == "custom":
            _require(isinstance(tool.get("name"), str), f"{where}.name must be a string", f"{where}.name")
            out.append({"type": "function", "function": freeform_function(tool, where)})
            freeform.add(tool["name"])
        else:
            raise bad_request(f"{where} is a {kind!r} tool; this server runs function and custom tools only "
                              "(hosted tools such as web_search are not available)", f"{where}.type")
    return out or None, freeform


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") and isinstance(choice.get("name"),
                                                                                                 str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                      "tool_choice")


class _Conversation:
    """Items -> chat messages: consecutive calls join one assistant message; reasoning waits for its turn."""

    def __init__(self):
        self.system: list[str] = []
        self.messages: list[dict] = []
        self._reasoning: list[str] = []

    def _assistant(self) -> dict:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or last.get("_closed"):
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        if self._reasoning:
            last["reasoning_content"] = "\n".join(self._reasoning)
            self._reasoning = []
        return last

    def message(self, role: str, text: str | list[dict]) -> None:
        if role in ("system", "developer"):
            self.system.append(text)
        elif role == "assistant":
            message = self._assistant()
            if message.get("tool_calls"):        # text after calls is a new turn
                message["_closed"] = True
                message = self._assistant()
            message["content"] += text
        else:
            self.messages.append({"role": role, "content": text})

    def call(self, call_id: str, name: str, arguments: str) -> None:
        self._assistant().setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})

    def output(self, call_id: str, text: str | list[dict]) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})

    def reasoning(self, text: str) -> None:
        self._reasoning.append(text)

    def chat_messages(self) -> list[dict]:
        out = [{"role": "system", "content": "\n\n".join(self.system)}] if self.system else []
        return out + [{k: v for k, v in m.items() if k != "_closed"} for m in self.messages]


def add_items(conversation: _Conversation, items: Any) -> None:
    if isinstance(items, str):
        conversation.message("user", items)
        return
    _require(isinstance(items, list), "input must be a string or a list of items", "input")
    for i, item in enumerate(items):
        where = f"input.{i}"
        _require(isinstance(item, dict), f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            _require(role in ("user", "assistant", "system", "developer"),
                     f"{where}.role must be user, assistant, system or developer, got {role!r}", f"{where}.role")
            read = _content if role == "user" else _text
            conversation.message(role, read(item.get("content"), f"{where}.content"))
        elif kind in ("function_call", "custom_tool_call"):
            _require(isinstance(item.get("call_id"), str) and isinstance(item.get("name"), str),
                     f"{where} needs a string call_id and name", where)
            if kind == "function_call":
                arguments = item.get("arguments") or "{}"
            else:
                arguments = json.dumps({FREEFORM_PARAMETER: item.get("input") or ""}, ensure_ascii=False)
            conversation.call(item["call_id"], item["name"], arguments)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            _require(isinstance(item.get("call_id"), str), f"{where}.call_id must be a string", f"{where}.call_id")
            conversation.output(item["call_id"], _content(item.get("output"), f"{where}.output"))
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _text(parts, f"{where}.content")
            if text:
                conversation.reasoning(text)
        else:
            raise bad_request(f"{where} is a {kind!r} item; this server takes message, function_call, "
                              "function_call_output, custom_tool_call(_output) and reasoning items", f"{where}.type")


def conversation_messages(items: list[dict]) -> list[dict]:
    """Response output items (they have the shape of input items) -> the chat messages they add."""
    conversation = _Conversation()
    add_items(conversation, [{k: v for k, v in item.items() if not k.startswith("_")} for item in items])
    return conversation.chat_messages()


def enable_thinking(body: dict) -> bool | None:
    reasoning = body.get("reasoning")
    if not isinstance(reasoning, dict) or reasoning.get("effort") is None:
        return None
    return reasoning["effort"] not in ("none", "minimal")


def response_format(body: dict) -> dict | None:
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    _require(fmt is None or isinstance(fmt, dict), "text.format must be an object such as {\"type\": \"text\"}",
             "text.format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                       "schema": fmt.get("schema") or {},
                                                       "strict": fmt.get("strict", False)}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise bad_request(f"text.format.type must be text, json_schema or json_object, got {fmt.get('type')!r}",
                      "text.format")


def translate(body: dict, history: list[dict] | None = None) -> tuple[ChatInputs, SamplingParams, set[str]]:
    """-> (the chat, its sampling (max_tokens None: as many as fit), the freeform tool names). `history`: the chat
    messages of the previous_response_id's conversation (its system message included)."""
    _require(isinstance(body, dict), "the request body must be a JSON object", "body")
    conversation = _Conversation()
    if body.get("instructions"):
        _require(isinstance(body["instructions"], str), "instructions must be a string", "instructions")
        conversation.system.append(body["instructions"])
    for m in history or []:
        if m["role"] == "system":
            if not body.get("instructions"):        # a new request's instructions replace the old ones
                conversation.system.append(m["content"])
        else:
            conversation.messages.append(dict(m, _closed=True))
    _require(body.get("input") is not None, "input is required", "input")
    add_items(conversation, body["input"])
    messages = conversation.chat_messages()
    _require(any(m["role"] != "system" for m in messages), "input has no user message", "input")
    tools, freeform = chat_tools(body)
    parallel = body.get("parallel_tool_calls")
    _require(parallel is None or isinstance(parallel, bool), "parallel_tool_calls must be a boolean",
             "parallel_tool_calls")
    thinking = enable_thinking(body)
    inputs = ChatInputs(messages=messages, tools=tools, tool_choice=chat_tool_choice(body.get("tool_choice")),
                        parallel_tool_calls=parallel, response_format=response_format(body),
                        chat_template_kwargs={"enable_thinking": thinking} if thinking is not None else None)
    return inputs, sampling(body), freeform


def sampling(body: dict) -> SamplingParams:
    fields: dict[str, Any] = {}
    limit = body.get("max_output_tokens")
    _require(limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1),
             f"max_output_tokens must be an integer of at least 1, got {limit!r}", "max_output_tokens")
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            _require(isinstance(value, (int, float)) and not isinstance(value, bool), f"{name} must be a number",
                     name)
            fields[name] = float(value)
    fields["top_k"] = body.get("top_k") or 0
    fields.update(sampling_extras(body))
    return sampling_params(max_tokens=limit, **fields)

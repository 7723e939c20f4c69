"""The one translation of a chat-style request into what the engine and the output parser need.

Every chat API of the server (OpenAI chat completions; Anthropic Messages and Responses translate their bodies
into the same ChatInputs first) goes through `ChatTranslator.translate` (admission.py calls it):

    inputs = ChatInputs(messages=[...], tools=[...], tool_choice="required", ...)      # OpenAI shapes
    chat = translator.translate(inputs, sampling_params)      # APIError (400) naming what is wrong
    parser = chat.new_output_parser()                         # ReasoningDelta, ContentDelta, ToolCall* events

What it decides: the prompt (the checkpoint's chat template with the tools, the assistant calls and tool results,
chat_template_kwargs such as enable_thinking); whether the output starts inside `<think>`; the constraint
(`response_format`, `structured_outputs`, or the grammar of a forced tool call for tool_choice `required` / a named
function), set to start after `</think>` when the output starts in reasoning; and which parsers read the output.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable

import jinja2

from qnext.agents import OutputParser, default_reasoning_parser, default_tool_parser, prompt_ends_in_reasoning
from qnext.agents.reasoning import REASONING_PARSERS, THINK_END
from qnext.agents.tool_grammar import ToolGrammarError, tool_call_grammar
from qnext.agents.tool_parsers import TOOL_PARSERS
from qnext.sampling_params import SamplingParams, StructuredOutputsParams
from qnext.engine.visual_request import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START
from qnext.server.errors import bad_request
from qnext.server.pictures import PictureInputs
from qnext.vision.media import MediaError, MediaLimits, MediaPart, openai_part_media

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass
class ChatInputs:
    """A chat request in OpenAI's shapes (chat completions' field names)."""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None      # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None              # None: true
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None     # vLLM's field: one of json, regex, choice, grammar, ...
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    add_generation_prompt: bool = True


@dataclasses.dataclass
class ChatRequest:
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams                  # with structured_outputs set when the output is constrained
    reasoning: bool                         # the output starts inside `<think>`
    tool_parser: str | None                 # the format tool calls are parsed in; None: calls stay content
    tools: list[dict[str, Any]]
    tool_choice: str                        # "none" | "auto" | "required" | "function"
    include_reasoning: bool
    multi_modal_data: dict | None = None    # the pictures, preprocessed, for the engine (prompt order per kind)

    def new_output_parser(self) -> OutputParser:
        """Calls come out whole: a call is sent once it has ended, and one cut off by max_tokens never is."""
        return OutputParser(reasoning=self.reasoning, tool_parser=self.tool_parser, tools=self.tools,
                            include_reasoning=self.include_reasoning, whole_calls=True)


class ChatTranslator:
    """One per served checkpoint. tool_call_parser / reasoning_parser: names, or None for the defaults read from
    the chat template ("none" turns one off). check_structured(params): the engine's check of a constraint
    (ValueError naming the problem), or None to leave it to admission. max_model_len: a prompt whose pictures
    cannot fit it is refused before they are decoded (server/pictures.py; None: left to admission)."""

    def __init__(self, tokenizer, *, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 check_structured: Callable[[SamplingParams], None] | None = None, vision=None,
                 media_limits: MediaLimits = MediaLimits(), max_model_len: int | None = None):
        template = tokenizer.chat_template if tokenizer is not None else None
        if tool_call_parser not in (None, "none", *TOOL_PARSERS):
            raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; known: {sorted(TOOL_PARSERS)}")
        if reasoning_parser not in (None, "none", *REASONING_PARSERS):
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {list(REASONING_PARSERS)}")
        self.tokenizer = tokenizer
        self.tool_call_parser = default_tool_parser(template) if tool_call_parser is None else tool_call_parser
        self.reasoning_parser = default_reasoning_parser(template) if reasoning_parser is None else reasoning_parser
        if self.tool_call_parser == "none":
            self.tool_call_parser = None
        if self.reasoning_parser == "none":
            self.reasoning_parser = None
        self.think_end_id = tokenizer.token_to_id(THINK_END) if tokenizer is not None else None
        self._check_structured = check_structured
        self.pictures = PictureInputs(vision, media_limits, self.count_tokens if tokenizer is not None else None,
                                      max_model_len)

    def translate(self, inputs: ChatInputs, params: SamplingParams) -> ChatRequest:
        tools = check_tools(inputs.tools)
        choice, forced_name = check_tool_choice(inputs.tool_choice, tools)
        if tools and choice != "none" and self.tool_call_parser is None:
            raise bad_request("this checkpoint's chat template has no tool-call format; start the server with "
                              f"--tool-call-parser ({' or '.join(TOOL_PARSERS)}) to use tools", "tools")
        constraint, param = structured_request(inputs.response_format, inputs.structured_outputs)
        if constraint is not None and choice in ("required", "function"):
            raise bad_request(f"{param} and tool_choice={_choice_text(inputs.tool_choice)} both constrain the output; "
                              "send one of them", param)
        kwargs = dict(inputs.chat_template_kwargs or {})
        media: list[MediaPart] = []
        messages = template_messages(inputs.messages, media)
        prompt = self.render(messages, tools, inputs.add_generation_prompt, kwargs)
        multi_modal_data = None
        if media:
            prompt, multi_modal_data = self.pictures.expand(prompt, media)
        token_ids = self.encode(prompt)
        reasoning = self.reasoning_parser is not None and inputs.add_generation_prompt \
            and prompt_ends_in_reasoning(prompt)
        if choice in ("required", "function"):
            parallel = inputs.parallel_tool_calls is not False and choice == "required"
            try:
                grammar = tool_call_grammar(tools, self.tool_call_parser, name=forced_name, parallel=parallel)
            except ToolGrammarError as e:
                raise bad_request(str(e), "tools") from None
            constraint, param = {"grammar": grammar}, "tools"
        if constraint is not None:
            start_after = [self.think_end_id] if reasoning and self.think_end_id is not None else None
            try:
                spec = StructuredOutputsParams(**constraint, start_after=start_after)
                params = dataclasses.replace(params, structured_outputs=spec)
                if self._check_structured is not None:
                    self._check_structured(params)
            except ValueError as e:
                raise bad_request(f"{param}: {e}", param) from None
        return ChatRequest(prompt, token_ids, params, reasoning,
                           self.tool_call_parser if tools and choice != "none" else None, tools, choice,
                           inputs.include_reasoning, multi_modal_data)

    def render(self, messages: list[dict], tools: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise bad_request("this checkpoint has no chat template; use /v1/completions", "messages")
        if tools:
            kwargs["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise bad_request(f"the chat template could not render these messages: {e}", "messages") from e

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))


# ---- checks ----------------------------------------------------------------------------------------------------------
def check_tools(tools: list | None) -> list[dict]:
    """OpenAI function tools, checked: 400 naming the first one the server cannot serve."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{i}] must be an object", f"tools.{i}")
        if tool.get("type", "function") != "function":
            raise bad_request(f"tools[{i}] has type {tool.get('type')!r}; this server serves only tools of type "
                              "'function'", f"tools.{i}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{i}].function must be an object with a name", f"tools.{i}.function")
        if not FUNCTION_NAME.fullmatch(fn["name"]):
            raise bad_request(f"tools[{i}].function.name {fn['name']!r} must be 1-128 letters, digits, _ . : or -",
                              f"tools.{i}.function.name")
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              f"tools.{i}.function.parameters")
        out.append({"type": "function", "function": fn})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise bad_request(f"tools has two functions with the same name: {names}", "tools")
    return out


def check_tool_choice(tool_choice, tools: list[dict]) -> tuple[str, str | None]:
    """-> ("none" | "auto" | "required" | "function", the forced function's name)."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise bad_request("tool_choice 'required' needs at least one tool in tools", "tool_choice")
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad_request("tool_choice must name the function: {'type': 'function', 'function': {'name': ...}}",
                              "tool_choice")
        if name not in names:
            known = ", ".join(names) if names else "no tools were given"
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools ({known})",
                              "tool_choice")
        return "function", name
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                      f"{{'name': ...}}}}, got {tool_choice!r}", "tool_choice")


def _choice_text(tool_choice) -> str:
    return repr(tool_choice) if isinstance(tool_choice, str) else "a named function"


def structured_request(response_format: dict | None, structured_outputs: dict | None) -> tuple[dict | None, str]:
    """response_format or vLLM's structured_outputs -> (StructuredOutputsParams fields, the request field)."""
    fmt = None
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format json_schema needs json_schema.schema, a JSON schema object",
                                  "response_format")
            fmt = {"json": schema}
        elif kind == "json_object":
            fmt = {"json_object": True}
        elif kind != "text":
            raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                              "response_format")
    if structured_outputs:
        if fmt is not None:
            raise bad_request("response_format and structured_outputs both constrain the output; send one",
                              "structured_outputs")
        unknown = sorted(set(structured_outputs) - set(STRUCTURED_FIELDS))
        if unknown:
            raise bad_request(f"structured_outputs has unknown fields {unknown}; it takes one of "
                              f"{', '.join(STRUCTURED_FIELDS)}", "structured_outputs")
        return dict(structured_outputs), "structured_outputs"
    return fmt, "response_format"


# ---- messages -----------------------------------------------------------------------------------------------------
def template_messages(messages: list[dict[str, Any]], media: list[MediaPart] | None = None) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template takes them: content as one string, `developer` as `system`, tool-call
    arguments as objects (OpenAI sends them as JSON text), `reasoning` also as `reasoning_content`. Pictures
    (image_url / video_url parts) become the Qwen3.5 template's placeholder, `<|vision_start|><|image_pad|>
    <|vision_end|>`, in place, and are appended to `media` in prompt order."""
    out = []
    media = [] if media is None else media
    for i, m in enumerate(messages):
        message = dict(m)
        if message.get("role") == "developer":
            message["role"] = "system"
        message["content"] = message_text(message.get("content"), i, media)
        if message.get("role") == "assistant":
            if "reasoning_content" not in message and isinstance(message.get("reasoning"), str):
                message["reasoning_content"] = message["reasoning"]
            calls = message.get("tool_calls")
            if calls is not None and not isinstance(calls, list):
                raise bad_request(f"messages[{i}].tool_calls must be a list of tool calls, got "
                                  f"{type(calls).__name__}", f"messages.{i}.tool_calls")
            if calls:
                message["tool_calls"] = [_call_for_template(c, i, j) for j, c in enumerate(calls)]
        out.append(message)
    return out


def _call_for_template(call: Any, i: int, j: int) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                          f"messages.{i}.tool_calls")
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise bad_request(f"{where}.function.arguments is not valid JSON: {e}", f"messages.{i}.tool_calls") \
                from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.function.arguments must be a JSON object", f"messages.{i}.tool_calls")
    return {**call, "function": {**fn, "arguments": arguments}}


def message_text(content: Any, index: int, media: list[MediaPart]) -> str:
    """Text parts joined by newlines; a picture's placeholder joins its neighbours directly (as the real
    template renders a content list)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        pieces: list[tuple[bool, str]] = []     # (is text, rendered)
        for j, part in enumerate(content):
            try:
                picture = openai_part_media(part, f"messages.{index}.content.{j}") if isinstance(part, dict) else None
            except MediaError as e:
                raise bad_request(str(e), e.where) from None
            if picture is not None:
                media.append(picture)
                pieces.append((False, VISION_START + (IMAGE_PAD if picture.kind == "image" else VIDEO_PAD)
                               + VISION_END))
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages[{index}].content[{j}] is a {kind!r} part; the parts supported are "
                                  "text, image_url and video_url", f"messages.{index}.content")
            pieces.append((True, part["text"]))
        return "".join(("\n" if k and is_text and pieces[k - 1][0] else "") + text
                       for k, (is_text, text) in enumerate(pieces))
    raise bad_request(f"messages[{index}].content must be a string or a list of content parts, "
                      f"got {type(content).__name__}", f"messages.{index}.content")

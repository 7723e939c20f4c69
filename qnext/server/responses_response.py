"""The chat pipeline's output events -> an OpenAI Responses `response`: its stream events (each with a
sequence_number) as they happen, and the whole response object at the end.

Output items in order: `reasoning` (reasoning_text parts), `message` (one output_text part), `function_call`, or
`custom_tool_call` for a freeform tool (its `input` is the free text). Stream: response.created,
response.in_progress; per item response.output_item.added ... response.output_item.done, with
response.content_part.added / response.output_text.delta / .done / response.content_part.done for text,
response.reasoning_text.delta / .done for reasoning, response.function_call_arguments.delta / .done (or
response.custom_tool_call_input.delta / .done); then response.completed, or response.incomplete when the output
hit max_output_tokens."""
from __future__ import annotations

import json
import time
import uuid

from qnext.server.event_sink import EventSink, Finish
from qnext.server.responses_request import FREEFORM_PARAMETER


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(finish: Finish | None, num_prompt_tokens: int, num_cached_tokens: int, num_reasoning_tokens: int) -> dict:
    output = finish.num_output_tokens if finish else 0
    return {"input_tokens": num_prompt_tokens, "input_tokens_details": {"cached_tokens": num_cached_tokens},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
            "total_tokens": num_prompt_tokens + output}


class ResponseBuilder(EventSink):
    """`echo`: the request fields a response object repeats (instructions, tools, tool_choice, ...).
    `count_tokens(text)` counts the reasoning text's tokens for output_tokens_details."""

    def __init__(self, model: str, echo: dict, freeform_tools: set[str], count_tokens=lambda text: 0):
        self.id, self.model, self.created_at = new_id("resp"), model, int(time.time())
        self.echo, self.freeform, self.count_tokens = echo, freeform_tools, count_tokens
        self.items: list[dict] = []
        self._open: str | None = None                 # kind of the item being streamed
        self._calls: dict[int, int] = {}              # tool call index -> output index
        self._seq = 0
        self._prompt = (0, 0)
        self.finish: Finish | None = None

    # ---- events ------------------------------------------------------------------------------------------------
    def _event(self, kind: str, **payload) -> str:
        data = {"type": kind, "sequence_number": self._seq, **payload}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _item_ref(self, index: int) -> dict:
        return {"item_id": self.items[index]["id"], "output_index": index}

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        index, kind, events = len(self.items) - 1, self._open, []
        item = self.items[index]
        self._open = None
        if kind == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", **self._item_ref(index), content_index=0,
                                   text=part["text"], logprobs=[]),
                       self._event("response.content_part.done", **self._item_ref(index), content_index=0,
                                   part=part)]
        elif kind == "reasoning":
            events.append(self._event("response.reasoning_text.done", **self._item_ref(index), content_index=0,
                                      text=item["content"][0]["text"]))
        item["status"] = "completed"
        return events + [self._event("response.output_item.done", output_index=index, item=self._public(item))]

    def _add_item(self, kind: str, item: dict) -> list[str]:
        events = self._close()
        self.items.append(item)
        self._open = kind
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=self._public(item)))
        if kind == "message":
            events.append(self._event("response.content_part.added", **self._item_ref(index), content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": []}))
        return events

    @staticmethod
    def _public(item: dict) -> dict:
        return {k: v for k, v in item.items() if not k.startswith("_")}

    # ---- EventSink --------------------------------------------------------------------------------------------
    def start(self, num_prompt_tokens: int, num_cached_tokens: int) -> list[str]:
        self._prompt = (num_prompt_tokens, num_cached_tokens)
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def reasoning(self, text: str) -> list[str]:
        events = [] if self._open == "reasoning" else self._add_item("reasoning", {
            "type": "reasoning", "id": new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
        self.items[-1]["content"][0]["text"] += text
        return events + [self._event("response.reasoning_text.delta", **self._item_ref(len(self.items) - 1),
                                     content_index=0, delta=text)]

    def content(self, text: str) -> list[str]:
        events = [] if self._open == "message" else self._add_item("message", {
            "type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
            "content": [{"type": "output_text", "text": "", "annotations": []}]})
        self.items[-1]["content"][0]["text"] += text
        return events + [self._event("response.output_text.delta", **self._item_ref(len(self.items) - 1),
                                     content_index=0, delta=text, logprobs=[])]

    def tool_start(self, index: int, call_id: str, name: str) -> list[str]:
        if name in self.freeform:
            item = {"type": "custom_tool_call", "id": new_id("ctc"), "call_id": call_id, "name": name,
                    "input": "", "status": "in_progress"}
        else:
            item = {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name,
                    "arguments": "", "status": "in_progress"}
        events = self._add_item("tool", item)
        self._calls[index] = len(self.items) - 1
        return events

    def tool_args(self, index: int, fragment: str) -> list[str]:
        item = self.items[self._calls[index]]
        if item["type"] == "custom_tool_call":      # the free text is known only once the JSON is whole (tool_end)
            return []
        item["arguments"] += fragment
        return [self._event("response.function_call_arguments.delta", **self._item_ref(self._calls[index]),
                            delta=fragment)]

    def tool_end(self, index: int, arguments: str) -> list[str]:
        out_index = self._calls[index]
        item, ref = self.items[out_index], self._item_ref(out_index)
        if item["type"] == "custom_tool_call":
            item["input"] = freeform_input(arguments)
            events = [self._event("response.custom_tool_call_input.delta", **ref, delta=item["input"]),
                      self._event("response.custom_tool_call_input.done", **ref, input=item["input"])]
        else:
            item["arguments"] = arguments
            events = [self._event("response.function_call_arguments.done", **ref, name=item["name"],
                                  arguments=arguments)]
        return events + (self._close() if self._open == "tool" else [])

    def end(self, finish: Finish) -> list[str]:
        self.finish = finish
        events = self._close()
        body = self.response()
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return events + [self._event(kind, response=body)]

    def error(self, error) -> list[str]:
        body = self.response("failed")
        body["error"] = {"code": error.code or "server_error", "message": error.message}
        return [self._event("response.failed", response=body)]

    # ---- the whole response ------------------------------------------------------------------------------------
    def body(self) -> dict:
        return self.response()

    def response(self, status: str | None = None) -> dict:
        incomplete = self.finish is not None and self.finish.finish_reason == "length"
        status = status or ("incomplete" if incomplete else "completed")
        reasoning = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": [self._public(i) for i in self.items], "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": usage(self.finish, *self._prompt, self.count_tokens(reasoning) if reasoning else 0)
                if status != "in_progress" else None, **self.echo}
        return body

    def output_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")


def freeform_input(arguments: str) -> str:
    """A freeform tool's free text out of the function arguments it was generated as."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(FREEFORM_PARAMETER), str):
        return value[FREEFORM_PARAMETER]
    return arguments

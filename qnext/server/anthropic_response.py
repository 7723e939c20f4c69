"""The chat pipeline's output events -> an Anthropic Messages response: the stream's events as they happen, and
the whole message at the end (a non-streamed request runs the same builder and keeps only the message).

Stream: message_start, then per content block (thinking / text / tool_use, in output order) content_block_start,
content_block_delta (thinking_delta + a closing signature_delta, text_delta, input_json_delta), content_block_stop;
then message_delta (stop_reason, usage) and message_stop."""
from __future__ import annotations

import json
import uuid

from qnext.server.event_sink import EventSink, Finish
from qnext.server.api_shapes import anthropic_error_body

# qnext keeps no signature secret: thinking blocks carry this marker so that clients which require a signature
# have one; a signature sent back in history is ignored.
THINKING_SIGNATURE = "qnext"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def sse_event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


def usage(finish: Finish | None, num_prompt_tokens: int, num_cached_tokens: int) -> dict:
    """Anthropic's split of the prompt: input_tokens are those computed for this request, cache_read_input_tokens
    those served from the prefix cache; qnext writes caches on its own, so nothing counts as a cache write."""
    return {"input_tokens": num_prompt_tokens - num_cached_tokens, "output_tokens": finish.num_output_tokens
            if finish else 0, "cache_read_input_tokens": num_cached_tokens, "cache_creation_input_tokens": 0}


class AnthropicMessageBuilder(EventSink):
    def __init__(self, model: str, stop_sequences: list[str] | None = None):
        self.id, self.model = new_message_id(), model
        self.stop_sequences = stop_sequences or []
        self.blocks: list[dict] = []                  # the message's content, built as events arrive
        self._open: str | None = None                 # kind of the block being streamed
        self._tool_blocks: dict[int, int] = {}         # tool call index -> block index
        self._prompt = (0, 0)                          # (prompt tokens, cached tokens)
        self.finish: Finish | None = None

    def _skeleton(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage(None, *self._prompt)}

    # ---- blocks ------------------------------------------------------------------------------------------------
    def _close(self) -> list[str]:
        if self._open is None:
            return []
        index, events = len(self.blocks) - 1, []
        if self._open == "thinking":
            self.blocks[index]["signature"] = THINKING_SIGNATURE
            events.append(sse_event("content_block_delta", {
                "index": index, "delta": {"type": "signature_delta", "signature": THINKING_SIGNATURE}}))
        self._open = None
        return events + [sse_event("content_block_stop", {"index": index})]

    def _open_block(self, kind: str, block: dict) -> list[str]:
        events = self._close()
        self.blocks.append(block)
        self._open = kind
        start = dict(block, signature="") if kind == "thinking" else dict(block)
        if kind == "tool_use":
            start["input"] = {}
        return events + [sse_event("content_block_start", {"index": len(self.blocks) - 1, "content_block": start})]

    # ---- EventSink --------------------------------------------------------------------------------------------
    def start(self, num_prompt_tokens: int, num_cached_tokens: int) -> list[str]:
        self._prompt = (num_prompt_tokens, num_cached_tokens)
        return [sse_event("message_start", {"message": self._skeleton()})]

    def reasoning(self, text: str) -> list[str]:
        events = [] if self._open == "thinking" else self._open_block("thinking", {"type": "thinking",
                                                                                   "thinking": ""})
        self.blocks[-1]["thinking"] += text
        return events + [sse_event("content_block_delta", {
            "index": len(self.blocks) - 1, "delta": {"type": "thinking_delta", "thinking": text}})]

    def content(self, text: str) -> list[str]:
        events = [] if self._open == "text" else self._open_block("text", {"type": "text", "text": ""})
        self.blocks[-1]["text"] += text
        return events + [sse_event("content_block_delta", {
            "index": len(self.blocks) - 1, "delta": {"type": "text_delta", "text": text}})]

    def tool_start(self, index: int, call_id: str, name: str) -> list[str]:
        events = self._open_block("tool_use", {"type": "tool_use", "id": call_id, "name": name, "input": ""})
        self._tool_blocks[index] = len(self.blocks) - 1
        return events

    def tool_args(self, index: int, fragment: str) -> list[str]:
        block = self._tool_blocks[index]
        self.blocks[block]["input"] += fragment
        return [sse_event("content_block_delta", {"index": block,
                                                  "delta": {"type": "input_json_delta", "partial_json": fragment}})]

    def tool_end(self, index: int, arguments: str) -> list[str]:
        block = self.blocks[self._tool_blocks[index]]
        block["input"] = _arguments_object(arguments)
        return self._close() if self._open == "tool_use" else []

    def end(self, finish: Finish) -> list[str]:
        self.finish = finish
        events = self._close()
        reason, sequence = self.stop_reason()
        return events + [sse_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                     "usage": usage(finish, *self._prompt)}),
                         sse_event("message_stop", {})]

    def error(self, error) -> list[str]:
        return [sse_event("error", {"error": anthropic_error_body(error.status, error.message)["error"]})]

    # ---- the whole message -------------------------------------------------------------------------------------
    def stop_reason(self) -> tuple[str, str | None]:
        f = self.finish
        if f is not None and f.finish_reason == "length":      # even after whole calls: the output was cut
            return "max_tokens", None
        if self._tool_blocks:
            return "tool_use", None
        if f is not None and isinstance(f.stop_reason, str) and f.stop_reason in self.stop_sequences:
            return "stop_sequence", f.stop_reason
        return "end_turn", None

    def body(self) -> dict:
        return self.message()

    def message(self) -> dict:
        body = self._skeleton()
        reason, sequence = self.stop_reason()
        body.update(content=list(self.blocks), stop_reason=reason, stop_sequence=sequence,
                    usage=usage(self.finish, *self._prompt))
        return body


def _arguments_object(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}

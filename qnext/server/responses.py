"""OpenAI response bodies and stream chunks built from engine outputs (plain dicts, serialised once)."""
from __future__ import annotations

import json
import time
import uuid

from qnext.agents.events import ContentDelta, Event, ParsedOutput, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from qnext.outputs import Logprob, RequestOutput, SampleLogprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict | str) -> str:
    """One server-sent event carrying JSON (or the literal [DONE])."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(out: RequestOutput) -> dict:
    """OpenAI usage plus the qnext extension prompt_tokens_details.recomputed_tokens: prompt tokens whose KV
    matched the prefix cache but were computed again because no state snapshot of the linear-attention layers
    was left at that point (a hybrid-model prefix miss)."""
    prompt = len(out.prompt_token_ids)
    completion = len(out.outputs[0].token_ids)
    recomputed = out.metrics.num_lost_to_missing_state_tokens if out.metrics is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens, "recomputed_tokens": recomputed}}


class Envelope:
    """id / created / model shared by every body or chunk of one response."""

    def __init__(self, prefix: str, model: str):
        self.id, self.created, self.model = new_id(prefix), int(time.time()), model

    def body(self, object_type: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": object_type, "created": self.created, "model": self.model,
                "choices": choices, **extra}


# ---- logprobs ----------------------------------------------------------------------------------------------------
def _token_text(lp: Logprob, token_id: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entry.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    return [(t, lp) for t, lp in ranked if lp.rank is not None and lp.rank <= k][:k]


def chat_logprobs(token_ids: list[int], logprobs: SampleLogprobs, k: int) -> dict:
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        lp = entry[token_id]
        text = _token_text(lp, token_id)
        content.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": _token_text(t_lp, t), "logprob": t_lp.logprob,
                                          "bytes": list(_token_text(t_lp, t).encode())} for t, t_lp in _top(entry, k)]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], logprobs: SampleLogprobs, k: int, text_offset: int = 0) -> dict:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        lp = entry[token_id]
        text = _token_text(lp, token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top = {_token_text(t_lp, t): t_lp.logprob for t, t_lp in _top(entry, k)}
        top.setdefault(text, lp.logprob)                  # the sampled token, as vLLM reports it
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


# ---- whole responses -----------------------------------------------------------------------------------------------
# return_token_ids (vLLM's extension): the prompt's token ids in the body, the generated ones in the choice.
def completion_body(env: Envelope, out: RequestOutput, logprobs: dict | None, return_token_ids: bool) -> dict:
    c = out.outputs[0]
    choice = {"index": 0, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
              "stop_reason": c.stop_reason, **({"token_ids": list(c.token_ids)} if return_token_ids else {})}
    ids = {"prompt_token_ids": list(out.prompt_token_ids)} if return_token_ids else {}
    return env.body("text_completion", [choice], usage=usage(out), **ids)


def chat_message(parsed: ParsedOutput) -> dict:
    """The assistant message: content (None when the output is only tool calls), reasoning under both names
    (`reasoning_content` as SGLang and most clients read it, `reasoning` as vLLM and Codex do), tool_calls."""
    message = {"role": "assistant", "content": parsed.content or (None if parsed.tool_calls else "")}
    if parsed.reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                            "arguments": c.arguments}}
                                 for c in parsed.tool_calls]
    return message


def chat_body(env: Envelope, out: RequestOutput, logprobs: dict | None, return_token_ids: bool,
              parsed: ParsedOutput) -> dict:
    c = out.outputs[0]
    reason = "tool_calls" if c.finish_reason == "stop" and parsed.tool_calls else c.finish_reason
    choice = {"index": 0, "message": chat_message(parsed), "logprobs": logprobs,
              "finish_reason": reason, "stop_reason": c.stop_reason,
              **({"token_ids": list(c.token_ids)} if return_token_ids else {})}
    ids = {"prompt_token_ids": list(out.prompt_token_ids)} if return_token_ids else {}
    return env.body("chat.completion", [choice], usage=usage(out), **ids)


# ---- stream chunks -------------------------------------------------------------------------------------------------
# token_ids: the chunk's new tokens, when the request asked for return_token_ids (else None: left out).
def completion_chunk(env: Envelope, text: str, logprobs: dict | None, finish_reason: str | None,
                     with_usage_field: bool, token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
              **({"token_ids": token_ids} if token_ids is not None else {})}
    return env.body("text_completion", [choice], **({"usage": None} if with_usage_field else {}))


def chat_chunk(env: Envelope, delta: dict, logprobs: dict | None, finish_reason: str | None,
               with_usage_field: bool, token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
              **({"token_ids": token_ids} if token_ids is not None else {})}
    return env.body("chat.completion.chunk", [choice], **({"usage": None} if with_usage_field else {}))


def chat_deltas(events: list[Event]) -> list[dict]:
    """Parser events as chat-completion chunk deltas: text as `content` / `reasoning_content` + `reasoning`; a tool
    call as its id and name first (arguments ""), then its arguments in JSON fragments (OpenAI's shapes)."""
    deltas = []
    for e in events:
        if isinstance(e, ContentDelta):
            deltas.append({"content": e.text})
        elif isinstance(e, ReasoningDelta):
            deltas.append({"reasoning_content": e.text, "reasoning": e.text})
        elif isinstance(e, ToolCallStart):
            deltas.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                           "function": {"name": e.name, "arguments": ""}}]})
        elif isinstance(e, ToolCallArgsDelta):
            deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.fragment}}]})
    return deltas


def usage_chunk(env: Envelope, object_type: str, out: RequestOutput) -> dict:
    return env.body(object_type, [], usage=usage(out))

"""The agent workload of scripts/bench_serving.py: tool-using sessions as a coding agent sends them.

A session opens with a long system prompt (about `system_tokens` tokens) and `num_tools` tool schemas, both shared
by every session (as every session of one agent shares them). Each of its `turns` user turns is followed by
`calls_per_turn` requests with `tool_choice: "required"`: the reply is a forced tool call, the bench appends it
(with its reasoning) and a tool result, and asks again. A new user turn makes the template drop the reasoning of
the turns before it, so the first request of a turn diverges from "previous prompt + output" right after the last
assistant header; the later calls of a turn only extend the conversation.

Why a prompt token was not served from the cache, per request (`explain_recompute`):
- new: after the longest common prefix with any sequence (prompt + output) the server had finished before this
  request was sent: text the cache has never seen. Split in two: `appended`, when the prompt keeps the session's
  previous prompt whole and differs only from its output on (the template's rendering of the assistant turn, the
  tool result, the next generation prompt), and `rerendered`, when it diverges inside the previous prompt (a new
  user turn: the template re-renders the history without the old reasoning, so everything after the first
  dropped `<think>` is new to the cache);
- straddle: inside the block that straddles that divergence point (KV is cached in whole blocks), plus the last
  prompt token, which is always computed;
- missing_state: KV matched but recomputed for want of a state snapshot (the server's `recomputed_tokens`);
- other: the rest of the reusable block-aligned prefix the server did not serve (evicted, or a request that was
  sent before an earlier one had published its blocks).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

TOOL_NAMES = ("read_file", "write_file", "list_dir", "run_shell", "search_code", "git_diff", "run_tests",
              "web_search", "get_weather", "create_ticket", "send_message", "query_db")


def tool_schemas(num_tools: int) -> list[dict]:
    """`num_tools` function tools in OpenAI's shape, with bounded arguments (maxLength, enums, integer ranges) so
    that a forced call on random weights ends within a few dozen tokens."""
    text = {"type": "string", "maxLength": 16}
    shapes = [
        {"path": text},
        {"path": text, "content": text},
        {"path": text, "recursive": {"type": "boolean"}},
        {"command": text, "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}},
        {"query": text, "max_results": {"type": "integer", "minimum": 1, "maximum": 50}},
        {"ref": text},
        {"selector": text, "verbose": {"type": "boolean"}},
        {"query": text},
        {"city": text, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        {"title": text, "priority": {"type": "string", "enum": ["low", "medium", "high"]}},
        {"to": text, "body": text},
        {"sql": text, "limit": {"type": "integer", "minimum": 1, "maximum": 1000}},
    ]
    tools = []
    for i in range(num_tools):
        name = TOOL_NAMES[i % len(TOOL_NAMES)] + ("" if i < len(TOOL_NAMES) else f"_{i // len(TOOL_NAMES)}")
        props = shapes[i % len(shapes)]
        tools.append({"type": "function", "function": {
            "name": name, "description": f"{name.replace('_', ' ')}: one step of the agent's work",
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1],
                           "additionalProperties": False}}})
    return tools


@dataclass
class AgentWorkload:
    sessions: int = 6
    turns: int = 6
    calls_per_turn: int = 2
    system_tokens: int = 4000
    num_tools: int = 12
    max_tokens: int = 192          # the bench's --call-max-tokens
    thinking_token_budget: int = 16
    seed: int = 0

    def system_prompt(self, words: tuple[str, ...]) -> str:
        rng = random.Random(self.seed)
        # the tiny test tokenizer splits these words into ~2.9 tokens each (measured); the server reports the
        # real count, and the 12 tool schemas add ~3k tokens more
        body = " ".join(rng.choice(words) for _ in range(int(self.system_tokens / 2.9)))
        return "You are a coding agent. Use the tools to do the user's task step by step.\n" + body

    def user_message(self, session: int, turn: int, words: tuple[str, ...]) -> str:
        rng = random.Random(hash((self.seed, session, turn)) & 0xFFFFFFFF)
        return f"Task {session}.{turn}: " + " ".join(rng.choice(words) for _ in range(12))

    def request_body(self, model: str, messages: list[dict], tools: list[dict], seed: int) -> dict:
        return {"model": model, "messages": messages, "tools": tools, "tool_choice": "required",
                "parallel_tool_calls": False,
                "max_tokens": self.max_tokens, "temperature": 1.0, "seed": seed, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True,
                "thinking_token_budget": self.thinking_token_budget,
                "chat_template_kwargs": {"enable_thinking": True}}


def tool_result_message(call: dict, turn: int) -> dict:
    return {"role": "tool", "tool_call_id": call["id"],
            "content": f"ok: {call['function']['name']} finished step {turn} with 3 lines of output"}


@dataclass
class SentRequest:
    """What the bench knows of one request after it finished: its prompt and output ids, the server's counts."""
    prompt_ids: list[int]
    output_ids: list[int]
    cached: int
    missing_state: int
    session: int = -1
    reasons: dict = field(default_factory=dict)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def explain_recompute(requests: list[SentRequest], finished_before: list[list[int]], block_size: int,
                      earlier: list[SentRequest] = ()) -> dict:
    """Sums, over all requests, the prompt tokens served from the cache and the tokens computed, by reason (see
    the module docstring). `finished_before[i]`: indices of the requests that had finished when request i was
    sent; `earlier`: requests that finished before all of them (a warm-up)."""
    totals = {"prompt": 0, "cached": 0, "new": 0, "appended": 0, "rerendered": 0, "straddle": 0,
              "missing_state": 0, "other": 0}
    for i, r in enumerate(requests):
        n = len(r.prompt_ids)
        before = [requests[j] for j in finished_before[i]] + list(earlier)
        seen = max((common_prefix(r.prompt_ids, b.prompt_ids + b.output_ids) for b in before), default=0)
        seen = min(seen, n)
        reusable = (min(seen, n - 1) // block_size) * block_size
        previous = next((requests[j] for j in range(i - 1, -1, -1) if requests[j].session == r.session), None)
        extends = previous is not None and r.prompt_ids[:len(previous.prompt_ids)] == previous.prompt_ids
        r.reasons = {"new": n - seen, "appended": (n - seen) if extends else 0,
                     "rerendered": 0 if extends else n - seen, "straddle": seen - reusable, "cached": r.cached,
                     "missing_state": r.missing_state,
                     "other": max(reusable - r.cached - r.missing_state, 0)}
        totals["prompt"] += n
        for k, v in r.reasons.items():
            totals[k] += v
    return totals

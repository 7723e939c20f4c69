"""vLLM's extra sampling fields, accepted on the agent APIs too (clients send them through `extra_body`):
seed, min_tokens, ignore_eos, min_p, repetition_penalty, thinking_token_budget (and top_k on Responses, which has
none of its own). Anthropic's `thinking.budget_tokens` becomes thinking_token_budget (anthropic_request.py)."""
from __future__ import annotations

from qnext.server.errors import bad_request

EXTRA_FIELDS = {"seed": int, "min_tokens": int, "ignore_eos": bool, "min_p": (int, float),
                "repetition_penalty": (int, float), "thinking_token_budget": int}


def sampling_extras(body: dict) -> dict:
    out = {}
    for name, kind in EXTRA_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise bad_request(f"{name} must be {'a bool' if kind is bool else 'a number'}, got {value!r}", name)
        out[name] = value
    return out

"""SamplingParams from a request's fields, for every API; and vLLM's extra sampling fields, which the agent APIs
accept too (clients send them through `extra_body`): seed, min_tokens, ignore_eos, min_p, repetition_penalty,
thinking_token_budget (and top_k on Responses, which has none of its own)."""
from __future__ import annotations

from typing import Collection

from qnext.sampling_params import SamplingParams
from qnext.server.errors import bad_request

EXTRA_FIELDS = {"seed": int, "min_tokens": int, "ignore_eos": bool, "min_p": (int, float),
                "repetition_penalty": (int, float), "thinking_token_budget": int}


def sampling_params(request_fields: Collection[str] | None = None, **fields) -> SamplingParams:
    """SamplingParams(**fields); its "<field> must be ..." becomes a 400 naming the field (when the request has a
    field of that name: `request_fields`, None for any)."""
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise bad_request(str(e), field if request_fields is None or field in request_fields else None) from None


def sampling_extras(body: dict) -> dict:
    """The extra fields present in a JSON body, type-checked."""
    out = {}
    for name, kind in EXTRA_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise bad_request(f"{name} must be {'a bool' if kind is bool else 'a number'}, got {value!r}", name)
        out[name] = value
    return out

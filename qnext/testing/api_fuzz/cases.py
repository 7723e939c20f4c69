"""Fuzz cases: request bodies for one API, generated from its schema (request_schemas.py) by schemathesis, positive
and negative mixed, then spiked and cost-capped (mutations.py), each with how its client reads the answer."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from typing import Any

from qnext.optional import optional_import
from qnext.testing.api_fuzz.mutations import RAW_BODIES, cost_capped, restore_refs, spiked, whole_numbers_as_ints
from qnext.testing.api_fuzz.request_schemas import ROUTES, openapi_document

APIS = tuple(ROUTES)
# The read-only routes: a few GETs each run, with odd query strings.
SPIKED_SHARE, RAW_SHARE, CLOSED_EARLY_SHARE = 0.2, 0.02, 0.15
GET_ROUTES = ("/v1/models", "/health", "/metrics", "/v1/models?x=%ff", "/health?verbose=1")


@dataclasses.dataclass
class FuzzCase:
    api: str
    method: str
    route: str
    body: bytes | None
    kind: str                        # "positive" or "negative" (schemathesis), + "+spike" when spiked; or "raw"
    stream: bool = False             # the body asks for a stream (read as server-sent events)
    close_after: int | None = None   # stop reading after this many bytes and close the connection (None: read all)

    def describe(self, limit: int = 2000) -> str:
        body = "" if self.body is None else self.body.decode("utf-8", "backslashreplace")
        if len(body) > limit:
            body = body[:limit] + f"... ({len(body)} bytes)"
        close = f", closed after {self.close_after} bytes" if self.close_after is not None else ""
        return f"{self.method} {self.route} [{self.kind}{close}] {body}"


def encode_body(body: Any) -> bytes:
    """JSON text as a client writes it (UTF-8); ASCII escapes where the text holds lone surrogates; NaN and
    Infinity as Python writes them (not JSON, but some clients send them)."""
    if isinstance(body, bytes):
        return body
    try:
        return json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(body).encode("ascii")


PURPOSE = "API fuzzing (scripts/fuzz_api.py)"


def _schemathesis_body(case) -> Any:
    not_set = optional_import("schemathesis.core", "fuzz", PURPOSE).NOT_SET
    return None if case.body is not_set else case.body


def case_strategy(api: str) -> "st.SearchStrategy[FuzzCase]":
    st = optional_import("hypothesis.strategies", "fuzz", PURPOSE)
    schemathesis = optional_import("schemathesis", "fuzz", PURPOSE)
    GenerationMode = optional_import("schemathesis.generation.modes", "fuzz", PURPOSE).GenerationMode

    route = ROUTES[api][0]
    operation = schemathesis.openapi.from_dict(openapi_document())[route]["POST"]
    positive = operation.as_strategy(generation_mode=GenerationMode.POSITIVE).map(
        lambda c: ("positive", _schemathesis_body(c)))
    negative = operation.as_strategy(generation_mode=GenerationMode.NEGATIVE).map(
        lambda c: ("negative", _schemathesis_body(c)))

    @st.composite
    def cases(draw) -> FuzzCase:
        kind, body = draw(st.one_of(positive, positive, negative))       # about 2 positive : 1 negative
        # The shares below from a generator seeded by the body: hypothesis's own draws lean to their minimum.
        rng = random.Random(hashlib.sha256(repr(body).encode("utf-8", "surrogatepass")).digest())
        if not isinstance(body, bytes):
            body = restore_refs(body)
        if kind == "positive":
            body = whole_numbers_as_ints(body)
        if body is not None and not isinstance(body, bytes) and rng.random() < SPIKED_SHARE:
            body, kind = spiked(body, rng), kind + "+spike"
        if rng.random() < RAW_SHARE:
            body, kind = rng.choice(RAW_BODIES), "raw"
        body = cost_capped(api, body, rng)
        stream = isinstance(body, dict) and body.get("stream") is True
        close_after = rng.randint(0, 400) if rng.random() < CLOSED_EARLY_SHARE else None
        return FuzzCase(api, "POST", route, None if body is None else encode_body(body), kind, stream, close_after)

    return cases()


def get_cases() -> list[FuzzCase]:
    return [FuzzCase("get", "GET", route, None, "positive") for route in GET_ROUTES]


def generate_cases(api: str, count: int, seed_value: int = 0) -> list[FuzzCase]:
    """`count` cases for `api` (one of APIS), the same ones for the same seed."""
    hypothesis = optional_import("hypothesis", "fuzz", PURPOSE)
    out: list[FuzzCase] = []

    @hypothesis.seed(seed_value)
    @hypothesis.settings(max_examples=count, phases=[hypothesis.Phase.generate], database=None, deadline=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case_strategy(api))
    def collect(case: FuzzCase) -> None:
        out.append(case)

    collect()
    return out[:count]

"""Per-request sampling parameters, with vLLM's names, defaults and meanings."""

from __future__ import annotations

import json
from dataclasses import dataclass

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, vLLM's names; exactly one of the five kinds. The engine compiles it with
    llguidance (qnext/structured/) and masks every token the constraint does not allow (docs/structured.md)."""
    json: str | dict | None = None       # a JSON schema, as a dict or its JSON text
    regex: str | None = None             # the whole output fully matches it
    choice: list[str] | None = None      # the output is exactly one of these strings
    grammar: str | None = None           # a Lark grammar in llguidance's dialect (GBNF is accepted too)
    json_object: bool = False            # any JSON object
    # Token ids: the output is free until it has emitted this exact id sequence (e.g. `</think>`'s id), then the
    # constraint applies from the next token. None: constrained from the first token.
    start_after: list[int] | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                decoded = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(decoded, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a dict or its JSON text, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object not in (False, True):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if self.start_after is not None:
            ids = list(self.start_after) if isinstance(self.start_after, (list, tuple)) else []
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError(f"structured_outputs.start_after must be a non-empty list of token ids, "
                                 f"got {self.start_after!r}")
            self.start_after = ids

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token, plus the sampled token's own
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    # Output tokens the model may spend inside its reasoning when the prompt leaves it inside `<think>`; then
    # `</think>` is forced (qnext/structured/thinking_budget.py). None: no cap.
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - {*STRUCTURED_KINDS, "start_after"}
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {sorted(unknown)}; it takes one of "
                                 f"{', '.join(STRUCTURED_KINDS)} and optionally start_after")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def uses_top_k_top_p(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    def _validate(self) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        check(is_int(self.n) and self.n >= 1, "n", "a positive integer")
        check(self.temperature >= 0.0, "temperature", ">= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(is_int(self.top_k) and self.top_k >= -1, "top_k", "-1, 0 (off) or a positive integer")
        check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        check(self.seed is None or is_int(self.seed), "seed", "an integer or None")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "> 0")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "a non-empty string or a list of them")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "a list of non-negative token ids")
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", "a positive integer or None")
        check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        check(self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0), "logprobs",
              "None or a non-negative integer")
        check(self.thinking_token_budget is None or (is_int(self.thinking_token_budget)
                                                     and self.thinking_token_budget >= 0),
              "thinking_token_budget", "None or a non-negative integer")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "None or a StructuredOutputsParams")

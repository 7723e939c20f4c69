"""Per-request sampling parameters, with vLLM's names, defaults and meanings."""

from __future__ import annotations

from dataclasses import dataclass

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
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

"""What a request returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token under the raw model distribution
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the top-k tokens and the sampled one).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (a structured output's grammar
                                      # reached a dead end; stop_reason says why); None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for eos

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_lost_to_missing_state_tokens: int = 0   # prompt tokens whose KV matched the cache but were recomputed for
                                                # want of a state snapshot (a hybrid prefix miss)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


def logprobs_entry(token_id: int, logprob: float, rank: int, top_ids: Sequence[int],
                   top_logprobs: Sequence[float], num_logprobs: int,
                   decode: Callable[[int], str] | None = None) -> dict[int, Logprob]:
    """The vLLM logprobs dict of one generated token: its top `num_logprobs` entries (ranks 1..k) plus the
    sampled token with its own rank. `top_ids`/`top_logprobs` are the sampler's sorted top-K
    (K >= num_logprobs)."""
    entry = {int(t): Logprob(float(lp), i + 1, decode(int(t)) if decode else None)
             for i, (t, lp) in enumerate(zip(top_ids[:num_logprobs], top_logprobs[:num_logprobs]))}
    entry[int(token_id)] = Logprob(float(logprob), int(rank), decode(int(token_id)) if decode else None)
    return entry

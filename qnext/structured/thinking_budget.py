"""`thinking_token_budget` (vLLM's name): a cap on the tokens a request may spend reasoning.

When the prompt leaves the model inside its reasoning (the prompt's last `<think>` comes after its last
`</think>`, as Qwen3.5's generation prompt does with thinking on), the first `budget` output tokens are free; if
the model has not closed its reasoning by then, the engine forces the end sequence (`</think>`), one token per step
through the sampler's bitmask, and the output goes on as usual (a grammar with `start_after` starts right there).
A prompt that is not inside reasoning makes the budget a no-op. Like StructuredState, it advances once per
appended output token, so a preempted request that recomputes its output keeps it as it is.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

THINK_START, THINK_END = "<think>", "</think>"


def prompt_inside_reasoning(prompt_ids: Sequence[int], start_id: int, end_id: int) -> bool:
    last_start = max((i for i, t in enumerate(prompt_ids) if t == start_id), default=-1)
    last_end = max((i for i, t in enumerate(prompt_ids) if t == end_id), default=-1)
    return last_start > last_end


class ThinkingBudget:
    def __init__(self, budget: int, end_ids: Sequence[int], inside: bool):
        self.budget = budget
        self.end_ids = tuple(end_ids)
        self.inside = inside                # the output is still inside the reasoning
        self.num_reasoning_tokens = 0
        self._tail: list[int] = []

    def advance(self, token_id: int) -> None:
        if not self.inside:
            return
        self.num_reasoning_tokens += 1
        self._tail = (self._tail + [token_id])[-len(self.end_ids):]
        if tuple(self._tail) == self.end_ids:
            self.inside = False

    @property
    def forced_token(self) -> int | None:
        """The token the next step must sample, or None while the budget lasts (or once the reasoning ended)."""
        if not self.inside or self.num_reasoning_tokens < self.budget:
            return None
        # continue a partly written end sequence: the longest tail that is a prefix of it
        for k in range(min(len(self._tail), len(self.end_ids) - 1), 0, -1):
            if tuple(self._tail[-k:]) == self.end_ids[:k]:
                return self.end_ids[k]
        return self.end_ids[0]


def force_rows(bitmask: np.ndarray, forced: Sequence[tuple[int, int]]) -> None:
    """Sets each listed row of a [N, ceil(V / 32)] int32 bitmask to allow exactly its one token."""
    for row, token_id in forced:
        bitmask[row] = 0
        bitmask[row, token_id >> 5] = np.uint32(1 << (token_id & 31)).view(np.int32)

"""Drafts chosen from outside the MTP head, for measuring and testing speculative decoding: after every step, each
running sequence that holds drafts gets `drafts_for(seq)` instead (the head still runs and writes its KV). With the
target's own next tokens every draft agrees (the speedup's ceiling); with tokens that never agree, every one is
rejected."""
from __future__ import annotations

from typing import Callable

from qnext.engine.sequence import Sequence


def override_drafts(llm, drafts_for: Callable[[Sequence], list[int]]) -> Callable[[], None]:
    """Installs the override on llm's engine; returns the function that removes it."""
    scheduler = llm.engine.scheduler
    postprocess = scheduler.postprocess

    def overriding(plan, result):
        updated, generated = postprocess(plan, result)
        for seq in scheduler.running:
            if seq.draft_token_ids:
                seq.draft_token_ids = drafts_for(seq)
        return updated, generated

    scheduler.postprocess = overriding
    return lambda: setattr(scheduler, "postprocess", postprocess)


def continuation_drafts(continuations: dict[tuple, list[int]], k: int) -> Callable[[Sequence], list[int]]:
    """The next k tokens of each prompt's known continuation (padded with 0 past its end)."""
    def drafts_for(seq: Sequence) -> list[int]:
        future = continuations[tuple(seq.prompt_token_ids)][len(seq.output_token_ids):][:k]
        return future + [0] * (k - len(future))
    return drafts_for

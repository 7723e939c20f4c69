"""Drafts chosen from outside the MTP head, for measuring and testing speculative decoding: an engine made with
`drafter=oracle_drafter(drafts_for)` gives each row that drafts `drafts_for(prompt, output)` after every step
instead of the head's (output: its tokens once the step's are appended). The head does not run (Drafter.uses_head):
a speculative step is the verify pass alone, as for drafts taken from the text. With the target's own next tokens
every draft agrees (the ceiling of the verify step); with tokens that never agree, every one is rejected."""
from __future__ import annotations

from typing import Callable

from qnext.engine.drafter import Drafter
from qnext.engine.plan import StepPlan, StepResult

DraftsFor = Callable[[list[int], list[int]], list[int]]


class OracleDrafter(Drafter):
    uses_head = False

    def __init__(self, cfg, mtp, config, drafts_for: DraftsFor):
        super().__init__(cfg, mtp, config)
        self.drafts_for = drafts_for

    def propose(self, plan: StepPlan, result: StepResult) -> dict[str, list[int]]:
        drafts = {}
        for i, it in enumerate(plan.items):
            rid = it.seq.request_id
            if rid not in result.drafts:
                continue
            new = [result.sampled[rid].token_id] if plan.multi is None else \
                [int(t) for t in result.tokens[:int(result.ran[i]), i]]
            drafts[rid] = self.drafts_for(it.seq.prompt_token_ids, it.seq.output_token_ids + new)
        return drafts


def oracle_drafter(drafts_for: DraftsFor) -> Callable[..., OracleDrafter]:
    """The engine option `drafter` for an OracleDrafter with `drafts_for`."""
    return lambda cfg, mtp, config: OracleDrafter(cfg, mtp, config, drafts_for)


def continuation_drafts(continuations: dict[tuple, list[int]], k: int) -> DraftsFor:
    """The next k tokens of each prompt's known continuation (padded with 0 past its end or for an unknown prompt)."""
    def drafts_for(prompt: list[int], output: list[int]) -> list[int]:
        future = continuations.get(tuple(prompt), [])[len(output):][:k]
        return future + [0] * (k - len(future))
    return drafts_for

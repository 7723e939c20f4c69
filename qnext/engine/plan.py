"""What the scheduler hands the runner for one step, and what the runner hands back.

A StepPlan is complete and plain: every sequence's token span, block table, state rows and capture rows are
copied into it (no live views of the cache manager's state), the bucket it runs in is chosen, and the cache's
device buffers are lent to it. The runner only lays it out, runs it and samples; the scheduler's postprocess
takes the StepResult back and gives the buffers back to their owner.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cache.device_buffers import CacheBuffers
from qnext.engine.sampled_token import SampledToken
from qnext.engine.sequence import Sequence
from qnext.model.buckets import Bucket
from qnext.model.step_inputs import Segment


@dataclasses.dataclass
class ScheduledSequence:
    seq: Sequence
    segment: Segment               # tokens [start, end) with their block table, state rows and capture rows
    samples: bool                  # the step computes the sequence's last known token, so it yields the next one
    forks: list[Sequence] = dataclasses.field(default_factory=list)   # the request's other samples: each draws
                                   # its first token from this item's logits and is forked after the step (n > 1)

    @property
    def start(self) -> int:
        return self.segment.start

    @property
    def end(self) -> int:
        return self.segment.start + len(self.segment.token_ids)


@dataclasses.dataclass
class MultiStepPlan:
    """Several decode steps in one call (num_scheduler_steps): per item, the tokens it may run (budget), the
    snapshot row for each step whose token completes a block ({step: row}) and the token ids that stop it."""

    steps: list[int]
    captures: list[dict[int, int]]
    stop_ids: list[list[int]]


@dataclasses.dataclass
class StepPlan:
    items: list[ScheduledSequence]
    bucket: Bucket
    buffers: CacheBuffers           # lent by the cache manager; donated to the step
    multi: MultiStepPlan | None = None
    # MTP speculative decoding (spec_step.py): every item verifies its drafts; `multi` then holds each item's
    # window budget (steps: tokens it may keep), its snapshot capture and its stop ids
    speculative: bool = False
    drafts: list[list[int]] | None = None


@dataclasses.dataclass
class StepResult:
    buffers: CacheBuffers                                   # the step's new cache buffers, for their owner
    sampled: dict[str, SampledToken] = dataclasses.field(default_factory=dict)    # single step: request -> token
    tokens: np.ndarray | None = None                        # multi-step: [K, items] int32
    ran: np.ndarray | None = None                           # multi-step: [items] tokens each item ran
    drafts: dict[str, list[int]] = dataclasses.field(default_factory=dict)   # MTP: request -> its next k drafts
    # multi-token steps whose rows asked for logprobs (speculative): numpy fields of sampler.SamplerOutput, each
    # [K, items, ...] like `tokens`; None: logprob 0 and rank 1, as the sampler reports without logprobs
    logprobs: object | None = None

    def item_tokens(self, i: int) -> list[SampledToken]:
        """A multi-token step's tokens for item i, in order, with their logprobs."""
        ran = int(self.ran[i])
        if self.logprobs is None:
            return [SampledToken(int(t), 0.0, 1, None, None) for t in self.tokens[:ran, i]]
        return [SampledToken.from_output(self.logprobs, (j, i)) for j in range(ran)]

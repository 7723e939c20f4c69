"""Continuous batching: which sequences run this step and how many tokens each, under a token budget.

Running sequences go first (decode tokens and continuing prefill chunks, oldest first), then waiting ones are
admitted while the budget, `max_num_seqs`, the step's group capacity and the cache allow. A running sequence
that cannot get a KV block preempts the newest running sequence (by recompute: its cache is released and it
goes back to the front of the queue; its output so far is kept and recomputed as part of its prompt).
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable

from cache import CacheManager
from qnext.engine.config import EngineConfig
from qnext.engine.sequence import Sequence, SequenceStatus


@dataclasses.dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int                 # new tokens run this step: [num_computed, num_computed + num_tokens)
    capture_positions: list[int]    # state captures inside (start, end]

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def end(self) -> int:
        return self.seq.num_computed_tokens + self.num_tokens

    @property
    def samples(self) -> bool:
        """The step computes the sequence's last known token, so it yields the next one."""
        return self.end == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CacheManager, new_layout: Callable[[], Any]):
        self.config = config
        self.cache = cache
        self.new_layout = new_layout    # the runner's running check that a step fits a compiled shape
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSequence]:
        scheduled: list[ScheduledSequence] = []
        layout = self.new_layout()
        budget = self.config.max_num_batched_tokens       # tokens left in this step

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue                                  # preempted earlier in this loop
            item = self._plan(seq, budget)
            preemptions = self.num_preemptions
            reserved = self._reserve_blocks(item, scheduled)
            if self.num_preemptions != preemptions:       # victims' items left `scheduled`
                budget = self.config.max_num_batched_tokens - sum(s.num_tokens for s in scheduled)
            if not reserved:
                continue                                  # seq itself was preempted
            if not layout.try_add(item):
                break
            scheduled.append(item)
            budget -= item.num_tokens

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            admission = self.cache.admit(seq.request_id, seq.token_ids)
            if admission is None:
                break
            self._start(seq, admission)
            item = self._plan(seq, budget)
            if not layout.try_add(item):
                self._release(seq)
                seq.status = SequenceStatus.WAITING
                break
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(item)
            budget -= item.num_tokens
        return scheduled

    def finish(self, seq: Sequence) -> None:
        """Releases a finished sequence's cache (published blocks and snapshots stay cached)."""
        self.cache.free(seq.request_id, seq.token_ids, seq.num_computed_tokens, finished=True)
        self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self._release(seq)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # ---------------------------------------------------------------------------------------------------------
    def _plan(self, seq: Sequence, budget: int) -> ScheduledSequence:
        n = min(seq.num_remaining_tokens, budget)
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        captures = [p for p in seq.capture_positions if start < p <= end]
        if n == 1 and end % self.config.block_size == 0 and self.cache.uses_snapshots:
            captures.append(end)                            # decode reaches a block boundary
        return ScheduledSequence(seq, n, sorted(set(captures)))

    def _reserve_blocks(self, item: ScheduledSequence, scheduled: list[ScheduledSequence]) -> bool:
        """Blocks for the item's tokens; preempts the newest running sequences until they fit."""
        seq = item.seq
        while not self.cache.append_slots(seq.request_id, item.end):
            victim = self.running[-1]
            self._preempt(victim)
            scheduled[:] = [s for s in scheduled if s.seq is not victim]
            if victim is seq:
                return False
        return True

    def _start(self, seq: Sequence, admission) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = admission.num_cached_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = admission.num_cached_tokens
            seq.num_lost_to_missing_state_tokens = admission.kv_matched_tokens - admission.num_cached_tokens
        seq.state_row = admission.state_row
        seq.read_row = -1 if admission.restore_row is None else admission.restore_row
        seq.capture_positions = tuple(self.cache.capture_positions(seq.request_id))
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.perf_counter()

    def _release(self, seq: Sequence) -> None:
        self.cache.free(seq.request_id, seq.token_ids, seq.num_computed_tokens, finished=False)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

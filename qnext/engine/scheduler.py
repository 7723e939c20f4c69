"""Continuous batching and the host side of a step: the scheduler builds and owns the cache manager (from
engine/cache_setup.py's CacheSetup), plans each step completely (StepPlan) and post-processes its result.

Running sequences go first (decode tokens and continuing prefill chunks, oldest first), then waiting ones are
admitted while the token budget, `max_num_seqs`, a compiled step shape and the cache allow. A running sequence
that cannot get a KV block preempts the newest running sequence (by recompute: its cache is released and it goes
back to the front of the queue; its output so far is kept and recomputed as part of its prompt).

With a host tier the cache manager decides copies between the device buffers and host memory (offloads at
eviction, loads at admission); the scheduler runs them (cache/device_buffers.py) whenever it lends the buffers
out, so each runs before the step that could overwrite its source or needs its target.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING

from cache import CacheManager
from cache.device_buffers import CacheBuffers, HostTierBuffers, apply_fork_copies
from cache.persisted_cache import load_prefix_cache
from qnext.engine.config import EngineConfig
from qnext.engine.plan import MultiStepPlan, ScheduledSequence, StepPlan, StepResult
from qnext.engine.postprocess import Stop, append_sampled, append_window, device_stop_ids, mark_finished
from qnext.engine.sampling_inputs import stateless
from qnext.engine.sequence import Sequence, SequenceStatus
from qnext.model.buckets import BucketTable
from qnext.model.step_inputs import Segment

if TYPE_CHECKING:
    from qnext.engine.cache_setup import CacheSetup

logger = logging.getLogger("qnext.engine")


@dataclasses.dataclass
class _Work:
    seq: Sequence
    start: int
    num_tokens: int
    captures: list[int]           # state captures inside (start, end]: prompt capture plan + decode boundary

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CacheSetup, buckets: BucketTable, *,
                 eos_token_ids: Seq[int], vocab_size: int, max_model_len: int,
                 host_buffers: HostTierBuffers | None = None):
        self.config = config
        self.cache = CacheManager(cache.config)     # its only owner and caller; it owns the device buffers
        self.cache.attach_buffers(cache.buffers)
        self.host_buffers = host_buffers      # the host tier's arrays (None: no host tier)
        if cache.prefix_cache_dir is not None:
            self._load_prefix_cache(cache.prefix_cache_dir, cache.fingerprint)
        self.buckets = buckets
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self._release(seq)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        mark_finished(seq, ("abort", None))

    # ---- planning ---------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when nothing can run."""
        work = self._pick()
        if not work:
            return None
        speculative = self._speculative_ok(work)
        if speculative:
            multi = self._multi_step_plan(work, self.config.num_speculative_tokens + 1)
        else:
            multi = self._multi_step_plan(work) if self._multi_step_ok(work) else None
        rows = {} if multi is not None else self._reserve_capture_rows(work)
        items = []
        for w in work:
            read_row, write_row = self.cache.state_rows(w.seq.request_id)
            captures = {p: rows.get((w.seq.request_id, p), 0) for p in w.captures}
            segment = Segment(token_ids=w.seq.token_slice(w.start, w.end), start=w.start,
                              block_table=list(self.cache.block_table(w.seq.request_id)), read_row=read_row,
                              write_row=write_row, captures=captures)
            samples = w.end == w.seq.num_tokens
            items.append(ScheduledSequence(w.seq, segment, samples, list(w.seq.pending_forks) if samples else []))
        bucket = self.buckets.bucket_for([it.segment for it in items])
        drafts = [list(w.seq.draft_token_ids) for w in work] if speculative else None
        return StepPlan(items, bucket, self.lend_buffers(), multi, speculative, drafts)

    def _pick(self) -> list[_Work]:
        work: list[_Work] = []
        layout = self.buckets.new_layout()
        budget = self.config.max_num_batched_tokens       # tokens left in this step

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue                                  # preempted earlier in this loop
            w = self._work(seq, seq.num_computed_tokens, budget)
            preemptions = self.num_preemptions
            reserved = self._reserve_blocks(w, work)
            if self.num_preemptions != preemptions:       # victims' work left `work`
                budget = self.config.max_num_batched_tokens - sum(x.num_tokens for x in work)
            if not reserved:
                continue                                  # seq itself was preempted
            if not layout.try_add(w.start, w.num_tokens, w.captures):
                break
            work.append(w)
            budget -= w.num_tokens

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            forks = len(seq.pending_forks)      # n > 1: rows and blocks for the other samples come with it
            if len(self.running) + 1 + forks > self.config.max_num_seqs:
                break
            admission = self.cache.admit(seq.request_id, seq.token_ids, num_forks=forks, turn_starts=seq.turn_starts,
                                         images=seq.visuals.spans if seq.visuals is not None else ())
            if admission is None:
                break
            w = self._work(seq, admission.num_cached_tokens, budget)
            if not layout.try_add(w.start, w.num_tokens, w.captures):
                # No compiled shape holds it this step: the admission is rolled back, and nothing of it (cached
                # tokens, times) is recorded on the sequence; the next admission may match differently.
                self.cache.free(seq.request_id, seq.token_view, admission.num_cached_tokens)
                break
            self.waiting.popleft()
            self._start(seq, admission)
            self.running.append(seq)
            work.append(w)
            budget -= w.num_tokens
        return work

    def _work(self, seq: Sequence, start: int, budget: int) -> _Work:
        n = min(seq.num_tokens - start, budget)
        end = start + n
        if n == 1:
            captures = [end] if end % self.config.block_size == 0 and self.cache.uses_snapshots else []
        else:
            captures = [p for p in self.cache.capture_positions(seq.request_id) if start < p <= end]
        return _Work(seq, start, n, captures)

    def _reserve_blocks(self, w: _Work, work: list[_Work]) -> bool:
        """Blocks for the work's tokens; preempts the newest running sequences until they fit."""
        while not self.cache.append_slots(w.seq.request_id, w.end):
            victim = self.running[-1]
            self._preempt(victim)
            work[:] = [x for x in work if x.seq is not victim]
            if victim is w.seq:
                return False
        return True

    def _reserve_capture_rows(self, work: list[_Work]) -> dict[tuple[str, int], int]:
        """Snapshot rows for this step's capture positions: the prompt's planned captures, or the decode tracking
        row at a block boundary. A position without a row (pool exhausted) captures nothing."""
        rows = {}
        for w in work:
            rid = w.seq.request_id
            for p in w.captures:
                row = (self.cache.decode_capture_row(rid, p) if w.num_tokens == 1
                       else self.cache.reserve_capture(rid, p))
                if row is not None:
                    rows[(rid, p)] = row
        return rows

    def _multi_step_ok(self, work: list[_Work]) -> bool:
        """Several decode steps may run in one call when every item decodes (its prompt computed), and its
        sampling needs no per-step host state (no logprobs, penalties or suppressed ids). Stop strings may run:
        the host appends the tokens one at a time and drops those after a stop string (append_window)."""
        if self.config.num_scheduler_steps < 2:
            return False
        return all(w.num_tokens == 1 and w.end == w.seq.num_tokens and w.start >= len(w.seq.prompt_token_ids)
                   and w.seq.visuals is None          # its positions carry the MRoPE delta, laid out per step
                   and stateless(w.seq.params, len(w.seq.output_token_ids), self.eos_token_ids, self.vocab_size)
                   for w in work)

    def _speculative_ok(self, work: list[_Work]) -> bool:
        """An MTP speculative step runs when every item decodes, holds its k drafts, and could run multi-step
        (its next tokens depend only on its logits and position) or differs only by penalties (applied per window
        position) or logprobs (the verify pass reports them per window position), and the step has no more rows
        than speculative_config's disable_by_batch_size."""
        k = self.config.num_speculative_tokens
        if self.config.speculation_disabled_at(len(work)):
            return False
        return bool(k) and all(len(w.seq.draft_token_ids) == k and not w.seq.pending_forks and w.seq.visuals is None
                               for w in work) and all(
            w.num_tokens == 1 and w.end == w.seq.num_tokens and w.start >= len(w.seq.prompt_token_ids)
            and stateless(w.seq.params, len(w.seq.output_token_ids), self.eos_token_ids, self.vocab_size,
                          penalties_ok=True, logprobs_ok=True)
            for w in work)

    def _multi_step_plan(self, work: list[_Work], window: int | None = None) -> MultiStepPlan:
        """Each row runs at most `window` tokens (num_scheduler_steps; a speculative step's k + 1), what its
        max_tokens and max_model_len leave and what its KV blocks hold (extended here when the cache has blocks
        free, never by preempting); block boundaries inside its window capture into its decode tracking row."""
        k_max, bs, cache = window or self.config.num_scheduler_steps, self.config.block_size, self.cache
        plan = MultiStepPlan([], [], [])
        for w in work:
            seq, p, rid = w.seq, w.seq.params, w.seq.request_id
            n = min(k_max, self.max_model_len - seq.num_tokens)
            if p.max_tokens is not None:
                n = min(n, p.max_tokens - len(seq.output_token_ids))
            if not cache.append_slots(rid, w.start + n):           # blocks for the extra tokens, if free
                n = max(1, min(n, len(cache.block_table(rid)) * bs - w.start))
            if p.stop:
                # the host may drop the tokens after a stop string (append_window), and with them any state the
                # window captured past the first: a boundary is captured at the window's first step only (its
                # input token is always kept), so the window ends before a later one and the next window starts
                # on it. Otherwise the tracking row would be overwritten by a state the host cannot record.
                n = next((e - w.start - 1 for e in range(w.start + 2, w.start + n + 1) if e % bs == 0), n)
            ends = [e for e in range(w.start + 1, w.start + n + 1) if e % bs == 0]   # boundaries computed
            row = cache.decode_tracking_row(rid) if ends and cache.uses_snapshots else None
            plan.steps.append(n)
            plan.captures.append({e - w.start - 1: row for e in ends} if row is not None else {})
            plan.stop_ids.append(device_stop_ids(p, self.eos_token_ids))
            w.captures = []                                 # captures come per step, from the plan
        return plan

    # ---- after the step ---------------------------------------------------------------------------------------
    def postprocess(self, plan: StepPlan, result: StepResult) -> tuple[list[Sequence], int]:
        """Commits what the step computed (publishes full blocks and captured snapshots), appends the sampled
        tokens, checks stops and finishes. Returns the sequences that produced tokens or finished, and the number
        of tokens generated."""
        self.cache.return_buffers(result.buffers)
        updated, generated = [], 0
        for i, it in enumerate(plan.items):
            seq = it.seq
            before = len(seq.output_token_ids)
            if plan.multi is None:
                seq.num_computed_tokens = it.end
                token = result.sampled.get(seq.request_id)
                produced = token is not None
                stop = append_sampled(seq, token, self.eos_token_ids, self.max_model_len) if produced else None
            else:
                ran = int(result.ran[i])
                reached = [step for step in plan.multi.captures[i] if step < ran]
                if reached:                  # the tracking row now holds the state after this many tokens
                    self.cache.decode_capture_row(seq.request_id, it.start + max(reached) + 1)
                stop = append_window(seq, result.item_tokens(i), self.eos_token_ids, self.max_model_len)
                seq.num_computed_tokens = seq.num_tokens - 1     # the last token is sampled, not yet run
                produced = True
            seq.draft_token_ids = result.drafts.get(seq.request_id, [])
            self.cache.commit(seq.request_id, seq.token_view, seq.num_computed_tokens)
            forked = self._fork(seq, it.forks, result) if it.forks else []
            if stop is not None:
                self._finish(seq, stop)
            if produced:
                updated.append(seq)
                generated += len(seq.output_token_ids) - before
            updated += forked
            generated += len(forked)
        return updated, generated

    def _fork(self, seq: Sequence, forks: list[Sequence], result: StepResult) -> list[Sequence]:
        """After the step that computed seq's whole prompt: its other samples share its prompt's KV and copy its
        state (cache/forks.py), take the first tokens drawn for them from the same logits, and run from now on."""
        seq.pending_forks = []
        for child in forks:
            self.cache.fork(seq.request_id, child.request_id)
            self._start(child, None)
            child.num_computed_tokens = seq.num_computed_tokens
            self.running.append(child)
            stop = append_sampled(child, result.sampled[child.request_id], self.eos_token_ids, self.max_model_len)
            if stop is not None:
                self._finish(child, stop)
        return forks

    # ---- the cache, for front ends ------------------------------------------------------------------------------
    @property
    def cache_stats(self):
        return self.cache.stats

    def cache_usage(self) -> dict:
        """Pool occupancy now: shares (0-1) of KV blocks in use, live state rows in use, snapshot rows in use; the
        KV blocks holding a cached prefix; and the host tier's KV blocks and snapshots held (0 without one)."""
        c, blocks, pool = self.cache, self.cache.blocks, self.cache.snapshots
        live = c.config.num_live_slots
        return {"kv_cache_usage": blocks.num_used / max(1, blocks.num_blocks - 1),      # block 0 is the dummy
                "kv_blocks_cached": blocks.num_cached,
                "state_slots_usage": (live - c.num_free_slots) / max(1, live),
                "snapshot_pool_usage": pool.num_in_use / pool.capacity if pool.capacity else 0.0,
                "host_kv_blocks_cached": len(c.tier.blocks), "host_snapshots_cached": len(c.tier.snapshots)}

    def clear_prefix_cache(self) -> None:
        """Drops every cached KV block and, with them, every snapshot, in every tier (nothing may be running)."""
        self.cache.clear_prefix_cache()

    def _load_prefix_cache(self, directory: str, fingerprint: dict) -> None:
        """Loads a cache file written for the same fingerprint into the host tier (docs/cache.md, Persistence)."""
        blocks, snapshots = load_prefix_cache(directory, self.cache, self.host_buffers, fingerprint)
        if blocks:
            logger.info("prefix cache: %d KV blocks and %d snapshots loaded from %s into the host tier", blocks,
                        snapshots, Path(directory))

    def lend_buffers(self) -> CacheBuffers:
        """The cache's buffers for a step, after the copies between tiers decided so far have run on them."""
        buffers = apply_fork_copies(self.cache.take_fork_copies(), self.cache.lend_buffers())   # first: cache/forks.py
        transfers = self.cache.take_transfers()
        if transfers:
            if self.host_buffers is None:
                raise RuntimeError("the cache manager has a host tier but the scheduler has no host buffers")
            buffers = self.host_buffers.apply(transfers, buffers, self.cache.stats.tiers)
        return buffers

    def flush_transfers(self) -> None:
        """Runs the pending copies between tiers now (before the cache is written to disk)."""
        self.return_buffers(self.lend_buffers())

    def return_buffers(self, buffers: CacheBuffers) -> None:
        self.cache.return_buffers(buffers)

    # ---------------------------------------------------------------------------------------------------------
    def _start(self, seq: Sequence, admission) -> None:
        """admission None: a fork, which starts where its parent is (Scheduler._fork)."""
        seq.status = SequenceStatus.RUNNING
        if admission is None:
            seq.num_cached_tokens = seq.num_cached_tokens or 0
            seq.first_scheduled_time = seq.first_scheduled_time or time.perf_counter()
            return
        seq.num_computed_tokens = admission.num_cached_tokens
        if seq.num_cached_tokens is None:          # the first admission that ran is what the user sees
            seq.num_cached_tokens = admission.num_cached_tokens
            seq.num_lost_to_missing_state_tokens = admission.kv_matched_tokens - admission.num_cached_tokens
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.perf_counter()

    def _finish(self, seq: Sequence, stop: Stop) -> None:
        """Releases a finished sequence's cache (published blocks and snapshots stay cached)."""
        mark_finished(seq, stop)
        self._release(seq)
        self.running.remove(seq)

    def _release(self, seq: Sequence) -> None:
        self.cache.free(seq.request_id, seq.token_view, seq.num_computed_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

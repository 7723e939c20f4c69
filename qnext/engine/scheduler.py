"""Continuous batching and the host side of a step: the scheduler plans each step completely (StepPlan) with the
cache manager (engine/engine_cache.py holds it) and post-processes its result.

Running sequences go first (decode tokens and continuing prefill chunks, oldest first), then waiting ones are
admitted while the token budget, `max_num_seqs`, a compiled step shape and the cache allow; a waiting prompt whose
prefix an admitted sequence is still computing waits for it (and lets the ones behind it in), then restores there. A running sequence
that cannot get a KV block preempts the newest running sequence (by recompute: its cache is released and it goes
back to the front of the queue; its output so far is kept and recomputed as part of its prompt).

Multi-step and speculative windows are planned in engine/window_plan.py. With a host tier the cache manager decides
copies between the device buffers and host memory (offloads at eviction, loads at admission); EngineCache runs them
whenever the buffers are lent to a step.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Sequence as Seq

from qnext.engine.config import EngineConfig
from qnext.engine.engine_cache import EngineCache
from qnext.engine.plan import ScheduledSequence, StepPlan, StepResult
from qnext.engine.postprocess import Stop, append_sampled, append_window, mark_finished
from qnext.engine.sequence import Sequence, SequenceStatus
from qnext.engine.sequence_features import SequenceFeature, computed_elsewhere
from qnext.engine.window_plan import Work, multi_step_ok, speculative_ok, window_plan
from qnext.model.buckets import BucketTable
from qnext.model.step_inputs import Segment


class Scheduler:
    def __init__(self, config: EngineConfig, cache: EngineCache, buckets: BucketTable, *,
                 eos_token_ids: Seq[int], vocab_size: int, max_model_len: int):
        self.config = config
        self.engine_cache = cache
        self.cache = cache.manager            # plans and commits go to the manager directly
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
            for feature in seq.features:
                feature.dropped(self.cache, seq)
            seq.features = []
        mark_finished(seq, ("abort", None))

    # ---- planning ---------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when nothing can run."""
        work = self._pick()
        if not work:
            return None
        c, eos, vocab = self.config, self.eos_token_ids, self.vocab_size
        speculative = speculative_ok(work, c, eos, vocab)
        if speculative or multi_step_ok(work, c, eos, vocab):
            window = [1 + len(w.seq.draft_token_ids) for w in work] if speculative else None
            multi = window_plan(work, self.cache, c, eos, self.max_model_len, window)
        else:
            multi = None
        rows = {} if multi is not None else self._reserve_capture_rows(work)
        items = []
        for w in work:
            read_row, write_row = self.cache.state_rows(w.seq.request_id)
            captures = {p: rows.get((w.seq.request_id, p), 0) for p in w.captures}
            segment = Segment(token_ids=w.seq.token_slice(w.start, w.end), start=w.start,
                              block_table=list(self.cache.block_table(w.seq.request_id)), read_row=read_row,
                              write_row=write_row, captures=captures,
                              lora_slot=w.seq.lora.slot if w.seq.lora is not None else 0)
            samples = w.end == w.seq.num_tokens
            items.append(ScheduledSequence(w.seq, segment, samples, list(w.seq.pending_forks) if samples else []))
        bucket = self.buckets.bucket_for([it.segment for it in items])
        k = c.max_draft_tokens                  # rows drafting fewer (suffix, ngram, grammar) pad; window.steps bounds
        drafts = [list(w.seq.draft_token_ids) + [0] * (k - len(w.seq.draft_token_ids)) for w in work] \
            if speculative else None
        return StepPlan(items, bucket, self.engine_cache.lend_buffers(), multi, speculative, drafts)

    def _pick(self) -> list[Work]:
        work: list[Work] = []
        layout = self.buckets.new_layout()
        budget = self.config.max_num_batched_tokens       # tokens left in this step
        asked, held = self._held_for_siblings()

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

        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if seq in held or (seq not in asked and self._sibling(seq) is not None):
                continue
            forks = len(seq.pending_forks)      # n > 1: rows and blocks for the other samples come with it
            if len(self.running) + 1 + forks > self.config.max_num_seqs:
                break
            if seq.lora is not None and not seq.lora.bind():
                continue                        # every LoRA slot holds another adapter of unfinished requests
            arrived = computed_elsewhere(seq)
            if arrived is not None:
                if not self._admit_computed(seq, arrived, budget, layout, work):
                    break
                budget -= 1
                continue
            admission = self.cache.admit(seq.request_id, seq.token_ids, num_forks=forks, turn_starts=seq.turn_starts,
                                         images=seq.visuals.spans if seq.visuals is not None else (),
                                         hash_root=seq.lora.hash_root if seq.lora is not None else None)
            if admission is None:
                break
            w = self._work(seq, admission.num_cached_tokens, budget)
            if not layout.try_add(w.start, w.num_tokens, w.captures):
                # No compiled shape holds it this step: the admission is rolled back, and nothing of it (cached
                # tokens, times) is recorded on the sequence; the next admission may match differently.
                self.cache.free(seq.request_id, seq.token_view, admission.num_cached_tokens)
                break
            self.waiting.remove(seq)
            asked = set()                       # a prompt behind it may share its prefix: ask again
            self._start(seq, admission)
            self.running.append(seq)
            work.append(w)
            budget -= w.num_tokens
        return work

    def _held_for_siblings(self) -> tuple[set[Sequence], set[Sequence]]:
        """(asked, held): of the waiting prompts that the free seats could admit, those that an admitted sequence is
        still computing a shared prefix of (cache manager's `sibling_prefix`). They wait for it instead of computing
        the prefix in parallel, and it captures a snapshot where they part. Asked before the running sequences' work
        is planned, so that this step's work of the sibling already captures there."""
        seats = self.config.max_num_seqs - len(self.running)
        asked = set(list(self.waiting)[:seats])
        return asked, {seq for seq in asked if self._sibling(seq) is not None}

    def _sibling(self, seq: Sequence):
        if computed_elsewhere(seq) is not None:
            return None
        return self.cache.sibling_prefix(seq.token_ids, seq.visuals.spans if seq.visuals is not None else (),
                                         seq.lora.hash_root if seq.lora is not None else None)

    def _admit_computed(self, seq: Sequence, arrived: SequenceFeature, budget: int, layout,
                        work: list[Work]) -> bool:
        """Admits a request whose prompt came computed (a PD decode engine's transfer): its next step runs from
        there (engine/sequence_features.py)."""
        w = self._work(seq, arrived.computed_tokens, budget)
        if not layout.try_add(w.start, w.num_tokens, w.captures):
            return False
        admission = arrived.admit(self.cache, self.engine_cache, seq)
        if admission is None:
            return False
        seq.features.remove(arrived)          # a preemption recomputes the prompt like any other
        self.waiting.remove(seq)
        self._start(seq, admission)
        self.running.append(seq)
        work.append(w)
        return True

    def _work(self, seq: Sequence, start: int, budget: int) -> Work:
        n = min(seq.num_tokens - start, budget)
        end = start + n
        if n == 1:
            captures = [end] if end % self.config.block_size == 0 and self.cache.uses_snapshots else []
        else:
            captures = [p for p in self.cache.capture_positions(seq.request_id) if start < p <= end]
        return Work(seq, start, n, captures)

    def _reserve_blocks(self, w: Work, work: list[Work]) -> bool:
        """Blocks for the work's tokens; preempts the newest running sequences until they fit."""
        while not self.cache.append_slots(w.seq.request_id, w.end):
            victim = self.running[-1]
            self._preempt(victim)
            work[:] = [x for x in work if x.seq is not victim]
            if victim is w.seq:
                return False
        return True

    def _reserve_capture_rows(self, work: list[Work]) -> dict[tuple[str, int], int]:
        """Snapshot rows for this step's capture positions: the prompt's planned captures, or the decode tracking
        row at a block boundary. A position without a row (pool exhausted) captures nothing. With a narrow snapshot
        pool, a capture inside a segment (not at its end) is staged in a float32 row (qnext/model/snapshot_staging.py):
        at most num_staging_rows of them a step, the others capture nothing."""
        rows = {}
        staging, staged = self.cache.config.num_staging_rows, 0
        for w in work:
            rid = w.seq.request_id
            for p in w.captures:
                mid = bool(staging) and w.num_tokens > 1 and p < w.end
                if mid and staged == staging:
                    continue
                row = (self.cache.decode_capture_row(rid, p) if w.num_tokens == 1
                       else self.cache.reserve_capture(rid, p))
                if row is not None:
                    rows[(rid, p)] = row
                    staged += mid
        return rows

    # ---- after the step ---------------------------------------------------------------------------------------
    def postprocess(self, plan: StepPlan, result: StepResult) -> tuple[list[Sequence], int]:
        """Commits what the step computed (publishes full blocks and captured snapshots), appends the sampled
        tokens, checks stops and finishes. Returns the sequences that produced tokens or finished, and the number
        of tokens generated."""
        self.engine_cache.return_buffers(result.buffers)
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
            if plan.multi is None and produced and stop is None:    # a feature may end it here (PD prefill)
                for feature in seq.features:
                    stop = stop or feature.after_sample(seq, result.sampled[seq.request_id], self.cache)
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

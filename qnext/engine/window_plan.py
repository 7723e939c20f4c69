"""Whether a step's rows run a window of several tokens in one call (multi-step decode, or an MTP speculative
step's k + 1), and the window each row runs (MultiStepPlan). The scheduler asks; nothing here holds state."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from cache import CacheManager
from qnext.engine.config import EngineConfig
from qnext.engine.plan import MultiStepPlan
from qnext.engine.postprocess import device_stop_ids
from qnext.engine.sampling_inputs import stateless
from qnext.engine.sequence import Sequence


@dataclasses.dataclass
class Work:
    """One sequence's tokens [start, start + num_tokens) in the step being planned."""
    seq: Sequence
    start: int
    num_tokens: int
    captures: list[int]           # state captures inside (start, end]: prompt capture plan + decode boundary

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def decodes(self) -> bool:
        """One new token at the end of a computed prompt."""
        return (self.num_tokens == 1 and self.end == self.seq.num_tokens
                and self.start >= len(self.seq.prompt_token_ids))


def multi_step_ok(work: list[Work], config: EngineConfig, eos_token_ids: Seq[int], vocab_size: int) -> bool:
    """Several decode steps may run in one call when every item decodes (its prompt computed), and its sampling
    needs no per-step host state (no logprobs, penalties or suppressed ids). Stop strings may run: the host appends
    the tokens one at a time and drops those after a stop string (append_window). Sequences with pictures may run:
    their MRoPE positions advance on device with the token positions (multi_step.py)."""
    if config.num_scheduler_steps < 2:
        return False
    return all(w.decodes and stateless(w.seq.params, len(w.seq.output_token_ids), eos_token_ids, vocab_size)
               for w in work)


def speculative_ok(work: list[Work], config: EngineConfig, eos_token_ids: Seq[int], vocab_size: int) -> bool:
    """A speculative step runs when every item decodes, holds its drafts (MTP: k of them; suffix / ngram: 0 to k, and
    the step at least as many drafts as rows, so that a window over rows with few drafts pays for itself), and could
    run multi-step (its next tokens depend only on its logits and position) or differs only by penalties (applied
    per window position) or logprobs (the verify pass reports them per window position), and the step has no more
    rows than speculative_config's disable_by_batch_size."""
    k = config.num_speculative_tokens
    if not k or config.speculation_disabled_at(len(work)):
        return False
    counts = [len(w.seq.draft_token_ids) for w in work]
    if config.uses_mtp_head:
        if any(n != k for n in counts):
            return False
    elif sum(counts) < len(work) or max(counts) > k:
        return False
    return all(not w.seq.pending_forks and w.decodes
               and stateless(w.seq.params, len(w.seq.output_token_ids), eos_token_ids, vocab_size,
                             penalties_ok=True, logprobs_ok=True)
               for w in work)


def window_plan(work: list[Work], cache: CacheManager, config: EngineConfig, eos_token_ids: Seq[int],
                max_model_len: int, window: list[int] | None = None) -> MultiStepPlan:
    """Each row runs at most its `window` tokens (None: num_scheduler_steps; a speculative step's 1 + its drafts), what
    its max_tokens and max_model_len leave and what its KV blocks hold (extended here when the cache has blocks free,
    never by preempting); block boundaries inside its window capture into its decode tracking row."""
    bs = config.block_size
    plan = MultiStepPlan([], [], [])
    for i, w in enumerate(work):
        k_max = config.num_scheduler_steps if window is None else window[i]
        seq, p, rid = w.seq, w.seq.params, w.seq.request_id
        n = min(k_max, max_model_len - seq.num_tokens)
        if p.max_tokens is not None:
            n = min(n, p.max_tokens - len(seq.output_token_ids))
        if not cache.append_slots(rid, w.start + n):           # blocks for the extra tokens, if free
            n = max(1, min(n, len(cache.block_table(rid)) * bs - w.start))
        if p.stop:
            # the host may drop the tokens after a stop string (append_window), and with them any state the window
            # captured past the first: a boundary is captured at the window's first step only (its input token is
            # always kept), so the window ends before a later one and the next window starts on it. Otherwise the
            # tracking row would be overwritten by a state the host cannot record.
            n = next((e - w.start - 1 for e in range(w.start + 2, w.start + n + 1) if e % bs == 0), n)
        ends = [e for e in range(w.start + 1, w.start + n + 1) if e % bs == 0]   # boundaries computed
        row = cache.decode_tracking_row(rid) if ends and cache.uses_snapshots else None
        plan.steps.append(n)
        plan.captures.append({e - w.start - 1: row for e in ends} if row is not None else {})
        plan.stop_ids.append(device_stop_ids(p, eos_token_ids))
        w.captures = []                                 # captures come per step, from the plan
    return plan

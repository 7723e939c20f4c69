"""The MTP drafter behind the runner (docs/speculative.md): the head's params (with the draft map's ids), the
speculative step that verifies each row's window and drafts again, the catch-up after any other step, and their
warm-up. The engine hands one to the runner at construction when it speculates. `propose` is the seam for drafts
chosen elsewhere: a subclass returns its own (qnext/bench/oracle_drafts.py), and the target still verifies them."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from cache.device_buffers import CacheBuffers
from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.engine.plan import ScheduledSequence, StepPlan, StepResult
from qnext.engine.sampler import SamplingTensors
from qnext.engine.spec_step import ChainInputs, make_mtp_catch_up, make_mtp_kv_catch_up, make_spec_step, \
    verify_inputs, window_length
from qnext.engine.window import WindowInputs
from qnext.model.buckets import Bucket
from qnext.model.draft_vocab import load_token_map
from qnext.model.step_inputs import StepInputs


class Drafter:
    uses_hidden_states = True             # the runner's plain step returns the target's hidden states for the head
    uses_head = True     # False: `propose` chooses every draft, so the head never runs (nor writes its KV)

    def __init__(self, cfg: ModelConfig, mtp, config: EngineConfig):
        """mtp: the head's params (qnext/model/mtp.py), on the device in the engine's dtype."""
        token_map = config.speculative_token_map
        if token_map is not None:              # drafts over the map's ids only (model/draft_vocab.py)
            mtp = dict(mtp, draft_token_ids=jnp.asarray(load_token_map(token_map, cfg.vocab_size)))
        self.cfg, self.config, self.mtp = cfg, config, mtp
        self.num_speculative_tokens = k = config.num_speculative_tokens
        self.width = k + 1                     # a window: the row's last token and its k drafts
        self._verify = make_spec_step(cfg, k, config.block_size, with_head=self.uses_head)
        self._catch_up = make_mtp_catch_up(cfg, k, config.block_size)
        self._kv_catch_up = make_mtp_kv_catch_up(cfg) if config.speculative_max_rows is not None else None

    def layout(self, items: list[ScheduledSequence], bucket: Bucket, window: WindowInputs) -> StepInputs:
        """The verify layout of a speculative step: row i's window is its token and the drafts it may keep."""
        length = window_length(self.num_speculative_tokens, self.cfg.backend, bucket.sizes.num_decode)
        return verify_layout(items, bucket, window, length, self.config.block_size)

    def run(self, params, buffers: CacheBuffers, inputs: StepInputs, window: WindowInputs,
            sampling: SamplingTensors | None, num_logprobs: int | None):
        """The speculative step (spec_step.make_spec_step) -> (tokens [D, k + 1], ran [D], buffers, next drafts
        [D, k], logprobs)."""
        tokens, ran, drafts, buffers, logprobs = self._verify(params, self.mtp, buffers, inputs, window, sampling,
                                                              num_logprobs=num_logprobs)
        return tokens, ran, buffers, drafts, logprobs

    def catch_up(self, params, plan: StepPlan, inputs: StepInputs, hidden, result: StepResult):
        """The head's slots for the positions a plain step computed, and k drafts for each item that sampled
        (spec_step.make_mtp_catch_up). Returns (buffers, {request_id: drafts}). A step with more rows than
        disable_by_batch_size writes the head's KV only: its rows would not speculate next step either, and a row
        without drafts gets them from the catch-up of its first step in a batch small enough."""
        if not self.uses_head:                 # `propose` fills every sampling row's drafts
            return result.buffers, {it.seq.request_id: [] for it in plan.items if it.samples}
        sizes = plan.bucket.sizes
        next_ids = np.zeros(sizes.num_tokens, np.int32)
        flat = 0
        for it in plan.items:
            n = len(it.segment.token_ids)
            following = it.seq.token_slice(it.start + 1, it.end + 1)      # the prompt's, or nothing at the end
            if it.samples:
                following = following + [result.sampled[it.seq.request_id].token_id]
            next_ids[flat:flat + n] = following[:n]
            flat += n
        if self.config.speculation_disabled_at(len(plan.items)):
            return self._kv_catch_up(params, self.mtp, result.buffers, inputs, next_ids, hidden), {}
        tables = np.zeros((sizes.num_logits, sizes.max_blocks), np.int32)
        running = np.zeros(sizes.num_logits, bool)
        for m, it in enumerate(plan.items):
            tables[m, :len(it.segment.block_table)] = it.segment.block_table
            running[m] = it.samples
        drafts, buffers = self._catch_up(params, self.mtp, result.buffers, inputs, next_ids, hidden,
                                         ChainInputs(block_table=tables, running=running))
        drafts = np.asarray(drafts).tolist()
        return buffers, {it.seq.request_id: drafts[m] for m, it in enumerate(plan.items) if it.samples}

    def propose(self, plan: StepPlan, result: StepResult) -> dict[str, list[int]]:
        """The drafts each row holds for its next step ({request_id: k ids}): the head's (result.drafts)."""
        return result.drafts

    def free(self, request_id: str) -> None:
        """The request ended (the head keeps nothing per request on the host)."""

    def warm_up(self, params, bucket: Bucket, inputs: StepInputs, hidden, buffers: CacheBuffers) -> CacheBuffers:
        """Compiles the catch-up after a plain step of `bucket` (inputs, hidden: that step's), on idle inputs that
        write nothing but the dummy block. The speculative step warms up with the runner's other windows."""
        if not self.uses_head:
            return buffers
        s = bucket.sizes
        chain = ChainInputs(block_table=np.zeros((s.num_logits, s.max_blocks), np.int32),
                            running=np.zeros(s.num_logits, bool))
        next_ids = np.zeros(s.num_tokens, np.int32)
        _, buffers = self._catch_up(params, self.mtp, buffers, inputs, next_ids, hidden, chain)
        if self._kv_catch_up is not None and self.config.speculation_disabled_at(s.num_logits):
            buffers = self._kv_catch_up(params, self.mtp, buffers, inputs, next_ids, hidden)
        return buffers


def verify_layout(items: list[ScheduledSequence], bucket: Bucket, window: WindowInputs, length: int,
                  block_size: int) -> StepInputs:
    """A verify window's inputs, `length` positions a row: row i's window is its token and window.steps[i] - 1
    drafts (the MTP head's or the host's)."""
    s = bucket.sizes
    windows = [[it.segment.token_ids[0]] + window.drafts[i, :window.steps[i] - 1].tolist()
               for i, it in enumerate(items)]
    inputs = verify_inputs(windows, [it.segment.read_row for it in items], [it.segment.write_row for it in items],
                           [it.segment.block_table for it in items], [it.start for it in items], s.num_decode,
                           length, s.max_blocks, block_size)
    return _with_mrope_delta(inputs, items, windows, length)


def _with_mrope_delta(inputs: StepInputs, items: list[ScheduledSequence], windows: list[list[int]],
                      length: int) -> StepInputs:
    """The verify layout with MRoPE positions when a row's sequence has pictures: its window's tokens are text past
    the prompt, at token index + the sequence's position delta on all three axes (the target's layers and the
    head's slots rotate by them; the head's later drafts in the chain go by token index, which only costs
    acceptance). Unchanged for text-only rows."""
    if all(it.seq.visuals is None for it in items):
        return inputs
    rope = np.broadcast_to(np.asarray(inputs.positions, np.int32), (3, inputs.positions.shape[0])).copy()
    for i, (it, window) in enumerate(zip(items, windows)):
        if it.seq.visuals is not None:
            rope[:, i * length:i * length + len(window)] += it.seq.visuals.delta
    return inputs.replace(rope_positions=rope)

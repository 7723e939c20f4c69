"""Suffix and n-gram drafting behind the runner's drafter seam (docs/speculative.md, "Suffix and n-gram drafting"):
drafts come from the text on the host (suffix_cache.SuffixCache), a number per row per step of the index's choosing
(0 to k), and the target verifies them in one window (draft_verify.py) with the same exact state rollback as MTP.
No head runs and the cache holds no extra KV layer.

A step's verify window is as wide as its longest row needs (1 + most drafts, rounded up to a power of two, at most
k + 1), so rows with fewer drafts pay padding positions only up to it; each row keeps at most 1 + its own drafts
(window.steps), reads its own state row and writes the state after its own last kept position to its own row."""
from __future__ import annotations

import numpy as np

from cache.device_buffers import CacheBuffers
from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.engine.draft_gate import AcceptanceGate
from qnext.engine.draft_verify import make_draft_verify_step
from qnext.engine.drafter import _with_mrope_delta
from qnext.engine.plan import ScheduledSequence, StepPlan, StepResult
from qnext.engine.sampler import SamplingTensors
from qnext.engine.spec_step import verify_inputs, window_length
from qnext.engine.suffix_cache import SuffixCache
from qnext.engine.window import WindowInputs
from qnext.model.buckets import Bucket
from qnext.model.step_inputs import StepInputs


class SuffixDrafter:
    uses_hidden_states = False            # the runner's plain step returns no hidden states for it

    def __init__(self, cfg: ModelConfig, config: EngineConfig, gate: AcceptanceGate | None = None):
        self.cfg, self.config = cfg, config
        self.options = config.host_drafting
        self.num_speculative_tokens = k = config.num_speculative_tokens
        self.width = k + 1
        self.max_width = window_length(k, cfg.backend)
        o = self.options
        if o.method == "suffix":
            self.cache = SuffixCache(o.max_cached_requests)
        else:                                   # ngram: the request's own text only, keyed by its shortest match
            self.cache = SuffixCache(0, key_lengths=(o.prompt_lookup_min,))
        self.gate = gate if gate is not None else AcceptanceGate()
        self._verify = make_draft_verify_step(cfg)

    def _length(self, steps) -> int:
        """The step's window: 1 + its most drafts, a power of two (few compilations), within the largest window."""
        most = max(2, int(np.max(steps, initial=0)))
        return min(self.max_width, 1 << (most - 1).bit_length())

    def layout(self, items: list[ScheduledSequence], bucket: Bucket, window: WindowInputs) -> StepInputs:
        """The verify layout: row i's window is its token and its window.steps[i] - 1 drafts."""
        s = bucket.sizes
        windows = [[it.segment.token_ids[0]] + window.drafts[i, :window.steps[i] - 1].tolist()
                   for i, it in enumerate(items)]
        length = self._length(window.steps)
        inputs = verify_inputs(windows, [it.segment.read_row for it in items], [it.segment.write_row for it in items],
                               [it.segment.block_table for it in items], [it.start for it in items], s.num_decode,
                               length, s.max_blocks, self.config.block_size)
        return _with_mrope_delta(inputs, items, windows, length)

    def run(self, params, buffers: CacheBuffers, inputs: StepInputs, window: WindowInputs,
            sampling: SamplingTensors | None, num_logprobs: int | None):
        """-> (tokens [D, W], ran [D], buffers, next drafts [D, 0] (the host proposes them), logprobs)."""
        length = inputs.prefill.token_index.shape[1]
        window = window.replace(drafts=window.drafts[:, :length - 1], capture_row=window.capture_row[:, :length])
        tokens, ran, buffers, logprobs = self._verify(params, buffers, inputs, window, sampling,
                                                      num_logprobs=num_logprobs)
        return tokens, ran, buffers, np.zeros((len(window.steps), 0), np.int32), logprobs

    def propose(self, plan: StepPlan, result: StepResult) -> dict[str, list[int]]:
        """Each row that produced tokens: its drafts for the next step (0 to k of them), from its text so far."""
        drafts = {}
        for i, it in enumerate(plan.items):
            seq, rid = it.seq, it.seq.request_id
            if plan.multi is None:
                if rid not in result.sampled:
                    continue
                new = [result.sampled[rid].token_id]
            else:
                ran = int(result.ran[i])
                new = [int(t) for t in result.tokens[:ran, i]]
                if plan.speculative:
                    self.gate.record(rid, drafted=plan.multi.steps[i] - 1, kept=ran - 1)
            self.cache.update(rid, seq.prompt_token_ids, seq.output_token_ids + new)
            if self.gate.allows(rid):
                room = self.num_speculative_tokens
                if seq.params.max_tokens is not None:
                    room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - len(new) - 1)
                drafts[rid] = self._draft(rid, room) if room > 0 else []
        return drafts

    def _draft(self, request_id: str, num_tokens: int) -> list[int]:
        o = self.options
        if o.method == "suffix":
            return self.cache.speculate(request_id, num_tokens, o.max_spec_factor, o.min_token_prob,
                                        o.max_tree_depth).tokens
        context = self.cache.context(request_id)
        return self.cache.local[request_id].lookup(context, num_tokens, o.prompt_lookup_min, o.prompt_lookup_max)

    def free(self, request_id: str) -> None:
        self.cache.free(request_id)
        self.gate.free(request_id)

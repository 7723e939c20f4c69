"""Drafts chosen on the host, verified in one window without a head (draft_verify.py), and grammar fast-forward
(docs/structured.md, "Fast-forward"): a row whose grammar forces its next tokens (llguidance's fast-forward tokens:
a forced tool call's `<tool_call>\\n<function=NAME>`, a schema's keys and punctuation) drafts them, and the target
verifies them as any draft, each window position masked by the grammar's state after the drafts before it. So the
tokens, their logprobs and the recurrent state are plain decoding's, and a forced run of n tokens takes about
n / (k + 1) steps instead of n.

`HostDrafter` alone is the engine's drafter when it has no speculative_config (and grammar_fast_forward is on): only
grammar rows draft. SuffixDrafter (suffix_drafter.py) extends it with drafts from the text for every row; a grammar
row that is forced drafts the forced tokens, else the text's.

A step's verify window is as wide as its longest row needs (1 + most drafts, rounded up to a power of two, at most
k + 1), so rows with fewer drafts pay padding positions only up to it; each row keeps at most 1 + its own drafts
(window.steps), reads its own state row and writes the state after its own last kept position to its own row."""
from __future__ import annotations

import numpy as np

from cache.device_buffers import CacheBuffers
from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.engine.draft_verify import make_draft_verify_step
from qnext.engine.drafter import verify_layout
from qnext.engine.plan import ScheduledSequence, StepPlan, StepResult
from qnext.engine.sampler import SamplingTensors
from qnext.engine.sequence import Sequence
from qnext.engine.spec_step import window_length
from qnext.engine.window import WindowInputs
from qnext.model.buckets import Bucket
from qnext.model.step_inputs import StepInputs


class HostDrafter:
    uses_hidden_states = False            # the runner's plain step returns no hidden states for it

    def __init__(self, cfg: ModelConfig, config: EngineConfig):
        self.cfg, self.config = cfg, config
        self.num_speculative_tokens = k = config.max_draft_tokens
        self.width = k + 1
        self.max_width = window_length(k, cfg.backend)
        self.grammar_fast_forward = config.grammar_fast_forward_active
        self._verify = make_draft_verify_step(cfg)
        self._forced: set[str] = set()       # requests whose last drafts are their grammar's forced tokens

    def _length(self, steps) -> int:
        """The step's window: 1 + its most drafts, a power of two (few compilations), within the largest window."""
        most = max(2, int(np.max(steps, initial=0)))
        return min(self.max_width, 1 << (most - 1).bit_length())

    def layout(self, items: list[ScheduledSequence], bucket: Bucket, window: WindowInputs) -> StepInputs:
        """The verify layout: row i's window is its token and its window.steps[i] - 1 drafts."""
        return verify_layout(items, bucket, window, self._length(window.steps), self.config.block_size)

    def run(self, params, buffers: CacheBuffers, inputs: StepInputs, window: WindowInputs,
            sampling: SamplingTensors | None, num_logprobs: int | None):
        """-> (tokens [D, W], ran [D], buffers, next drafts [D, 0] (the host proposes them), logprobs)."""
        length = inputs.prefill.token_index.shape[1]
        bitmask = window.token_bitmask
        window = window.replace(drafts=window.drafts[:, :length - 1], capture_row=window.capture_row[:, :length],
                                token_bitmask=None if bitmask is None else bitmask[:, :length])
        tokens, ran, buffers, logprobs = self._verify(params, buffers, inputs, window, sampling,
                                                      num_logprobs=num_logprobs)
        return tokens, ran, buffers, np.zeros((len(window.steps), 0), np.int32), logprobs

    def propose(self, plan: StepPlan, result: StepResult) -> dict[str, list[int]]:
        """Each row that produced tokens: its drafts for the next step (0 to k of them): what its grammar forces
        after them, else `text_drafts`."""
        drafts = {}
        for i, it in enumerate(plan.items):
            seq, rid = it.seq, it.seq.request_id
            if plan.multi is None:
                if rid not in result.sampled:
                    continue
                new = [result.sampled[rid].token_id]
            else:
                new = [int(t) for t in result.tokens[:int(result.ran[i]), i]]
            self.observe(plan, i, new)
            room = self.num_speculative_tokens
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - len(new) - 1)
            forced = self.forced_drafts(seq, new, room)
            if forced:
                self._forced.add(rid)
            else:
                self._forced.discard(rid)
            drafts[rid] = forced or self.text_drafts(rid, room)
        return drafts

    def forced_drafts(self, seq: Sequence, new: list[int], room: int) -> list[int]:
        """The tokens the row's grammar forces once `new` is appended (at most `room`); [] without a grammar, with
        grammar_fast_forward off, or where the row's next step could not verify drafts (a thinking budget)."""
        if (not self.grammar_fast_forward or room <= 0 or seq.structured is None
                or seq.params.thinking_token_budget is not None):
            return []
        return seq.structured.forced_after(new)[:room]

    def observe(self, plan: StepPlan, i: int, new: list[int]) -> None:
        """Item i of the step produced `new` (SuffixDrafter indexes them); nothing here."""

    def text_drafts(self, request_id: str, room: int) -> list[int]:
        """Drafts from the text, at most `room` (SuffixDrafter's); none here."""
        return []

    def drafts_were_forced(self, request_id: str) -> bool:
        """Whether the request's last proposal was its grammar's forced tokens."""
        return request_id in self._forced

    def free(self, request_id: str) -> None:
        self._forced.discard(request_id)

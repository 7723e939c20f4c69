"""A request as the engine tracks it: tokens, progress through prefill, its output so far and its detokenizer.

Its cache facts (block table, state rows, capture plan) live in the cache manager's record of the same request,
which the scheduler reads when it plans a step: one fact, one owner.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING

from qnext.outputs import SampleLogprobs
from qnext.sampling_params import SamplingParams
from qnext.structured.matcher import StructuredState
from qnext.structured.thinking_budget import ThinkingBudget
from qnext.tokenizer import IncrementalDetokenizer

from qnext.engine.sequence_features import SequenceFeature

if TYPE_CHECKING:
    from qnext.lora.registry import AdapterUse
    from qnext.engine.visual_request import SequenceVisuals


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    request_index: int
    prompt: str | None = None
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None     # served from cache at the first admission that ran; what the user sees
    num_lost_to_missing_state_tokens: int = 0   # KV matched at that admission but recomputed for want of a state
    detokenizer: IncrementalDetokenizer | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    structured: StructuredState | None = None   # the grammar's matcher when params.structured_outputs is set
    thinking: ThinkingBudget | None = None      # when params.thinking_token_budget is set
    turn_starts: tuple[int, ...] = ()           # positions of the prompt's last chat-turn starts (`<|im_start|>`)
    lora: "AdapterUse | None" = None            # its LoRA adapter's device slot and cache key (qnext/lora)
    visuals: "SequenceVisuals | None" = None   # its images / videos (engine/visual_request.py); None: text only
    # Parallel sampling (n > 1): every sample of a request is a Sequence; `group` (shared by all of them) lists
    # them by index, sample 0 first. Sample 0 is admitted and prefills the prompt; the others wait in its
    # `pending_forks` until that step, which draws their first tokens from the same logits and forks them.
    index: int = 0
    group: list["Sequence"] | None = None
    # MTP speculative decoding: the head's drafts for the tokens after the last one (valid right after the step
    # that returned them; [] when that step drafted nothing for this sequence)
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    pending_forks: list["Sequence"] = dataclasses.field(default_factory=list)
    # Per-request features with hooks the scheduler calls (engine/sequence_features.py), e.g. prefill/decode
    # disaggregation's (engine/pd_features.py)
    features: list[SequenceFeature] = dataclasses.field(default_factory=list)

    @property
    def first(self) -> "Sequence":
        """Sample 0 of this sequence's request: whose id, prompt and metrics the request's output carries."""
        return self.group[0] if self.group else self

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a decode step needs one token)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def token_view(self) -> "TokenView":
        """token_ids without the copy: length and slices (what the cache manager reads at each commit), where
        `token_ids` builds prompt + output anew (~11 us a call at 4k tokens, per row and step)."""
        return TokenView(self)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to run through the model before the next sample (1 when decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


class TokenView:
    """Read-only view of a sequence's prompt + output tokens: len(), one index or a step-1 slice."""

    __slots__ = ("_seq",)

    def __init__(self, seq: Sequence):
        self._seq = seq

    def __len__(self) -> int:
        return self._seq.num_tokens

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self._seq.token_ids[index]
            return self._seq.token_slice(start, max(start, stop))
        n = len(self)
        if not -n <= index < n:
            raise IndexError("token index out of range")
        return self._seq.token_slice(index % n, index % n + 1)[0]

"""Engine counters: requests, tokens, and where a step's wall time goes (host phases and the device), plus a
count of XLA compilations (jax.monitoring), so that benchmarks read the engine instead of patching it."""
from __future__ import annotations

import dataclasses
import threading

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compilations = 0
_lock = threading.Lock()


def _on_event(event: str, duration: float, **kwargs) -> None:
    global _compilations
    if event == _COMPILE_EVENT:
        with _lock:
            _compilations += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compilations() -> int:
    """XLA compilations in this process so far."""
    return _compilations


@dataclasses.dataclass
class EngineStats:
    num_steps: int = 0               # engine.step() calls that ran a plan
    num_model_steps: int = 0         # model forward passes (a multi-step call runs several)
    num_scheduled_sequences: int = 0   # summed over steps: sequences and new tokens each step ran
    num_scheduled_tokens: int = 0
    num_prompt_tokens: int = 0
    num_prefill_tokens: int = 0      # prompt tokens run through the model (a request's n samples: its prompt once)
    num_generated_tokens: int = 0
    num_transferred_requests: int = 0   # prefill/decode disaggregation, decode side: requests prefilled elsewhere,
    transfer_bytes: int = 0             # the bytes fetched for them, and the minimum (missing KV blocks + one state)
    transfer_min_bytes: int = 0
    transfer_seconds: float = 0.0       # spent fetching them (by whichever thread fetched)
    step_seconds: float = 0.0        # wall time of engine.step(), everything included
    schedule_seconds: float = 0.0    # host: admission, blocks, capture rows, the plan
    layout_seconds: float = 0.0      # host: StepInputs from the plan
    device_seconds: float = 0.0      # the jitted step, until its logits (or tokens) are ready
    sample_seconds: float = 0.0      # sampling dispatch and reading tokens back
    postprocess_seconds: float = 0.0   # host: commit, append, stop checks, detokenising, finishing
    structured_mask_seconds: float = 0.0   # host: structured-output token bitmasks (overlaps the device step)
    num_structured_masks: int = 0    # rows masked by a grammar, summed over steps
    num_spec_rows: int = 0           # MTP: rows of speculative steps (each verifies its drafts)
    num_draft_tokens: int = 0        # drafts verified
    num_accepted_draft_tokens: int = 0   # drafts kept
    num_tower_runs: int = 0          # vision: pictures encoded by the tower (each a miss of the encoder cache)
    tower_seconds: float = 0.0       # their wall time, to the device result
    num_encoder_cache_hits: int = 0  # pictures whose tower output came from the encoder cache
    num_visual_tokens: int = 0       # pad tokens given the tower's output in steps
    compilations_at_start: int = dataclasses.field(default_factory=compilations)

    def add_phases(self, *, layout: float = 0.0, device: float = 0.0, sample: float = 0.0,
                   model_steps: int = 0) -> None:
        self.layout_seconds += layout
        self.device_seconds += device
        self.sample_seconds += sample
        self.num_model_steps += model_steps

    def record_step(self, items, generated: int, t0: float, t1: float, t2: float, t3: float) -> None:
        """One engine.step(): its ScheduledSequences, the tokens it generated, and its clock at the start, after
        scheduling, after the runner and at the end."""
        self.num_steps += 1
        self.num_scheduled_sequences += len(items)
        self.num_scheduled_tokens += sum(len(it.segment.token_ids) for it in items)
        self.num_prefill_tokens += sum(max(0, min(it.end, len(it.seq.prompt_token_ids)) - it.start) for it in items)
        self.num_generated_tokens += generated
        self.schedule_seconds += t1 - t0
        self.postprocess_seconds += t3 - t2
        self.step_seconds += t3 - t0

    def add_speculative(self, *, rows: int, drafts: int, accepted: int) -> None:
        """A speculative step: its rows, the drafts they verified and the drafts they kept."""
        self.num_spec_rows += rows
        self.num_draft_tokens += drafts
        self.num_accepted_draft_tokens += accepted

    @property
    def num_compilations(self) -> int:
        """XLA compilations in this process since the engine started (warm-up included)."""
        return compilations() - self.compilations_at_start

    @property
    def acceptance_length(self) -> float:
        """Tokens a speculative row keeps per verify pass (1 + accepted drafts), over every speculative row."""
        return 0.0 if not self.num_spec_rows else 1.0 + self.num_accepted_draft_tokens / self.num_spec_rows

    @property
    def host_overhead(self) -> float:
        """Share of the step's wall time spent outside the jitted step."""
        return 0.0 if self.step_seconds == 0 else 1.0 - self.device_seconds / self.step_seconds

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("compilations_at_start")
        return {**out, "num_compilations": self.num_compilations, "host_overhead": self.host_overhead,
                "acceptance_length": self.acceptance_length}

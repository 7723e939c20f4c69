"""The extension point for per-request features: a Sequence carries a list of feature objects (`Sequence.features`),
and the scheduler calls their hooks at fixed points instead of testing a field per feature. A feature keeps its own
state; each hook's default leaves the scheduler's course as it is for a plain request.

The points:
- admission: a feature whose `computed_tokens` is not None brings the prompt's cache with it (computed elsewhere):
  the scheduler admits the sequence through its `admit` (not the cache's prefix match), runs it from there, and never
  holds it back for a sibling computing the same prefix; the feature is dropped once admitted (a preemption then
  recomputes the prompt like any other);
- abort while waiting: `dropped` releases what the feature holds in the cache;
- after a one-token step sampled a token that did not end the request: `after_sample` may end it there (a stop).
  Not called for the tokens of a multi-step window (num_scheduler_steps > 1, MTP): a feature that must see every
  token does not get them there yet.

The PD features (engine/pd_features.py) are the first: a decode engine's transferred prompt, a prefill engine's
export. Kept free of imports of the engine's modules: sequence.py imports this one."""
from __future__ import annotations

from typing import Any

Stop = tuple[str, Any]      # (finish_reason, stop_reason), as engine/postprocess.py's Stop


class SequenceFeature:
    computed_tokens: int | None = None   # prompt tokens whose cache comes with the request (None: computed here)

    def admit(self, manager, engine_cache, seq):
        """Admits `seq` with its computed tokens (cache.Admission, None when the cache has no room now: the hold is
        kept, and it is asked again at a later step). Only for a feature with computed_tokens."""
        raise NotImplementedError(f"{type(self).__name__} brings no computed prompt")

    def dropped(self, manager, seq) -> None:
        """`seq` was aborted before its admission."""

    def after_sample(self, seq, token, manager) -> Stop | None:
        """A step sampled `token` (a SampledToken) for `seq`, and nothing ended the request: a stop ends it now."""
        return None


def computed_elsewhere(seq) -> SequenceFeature | None:
    """The feature that brings seq's prompt computed, if any."""
    return next((f for f in seq.features if f.computed_tokens is not None), None)

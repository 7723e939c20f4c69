"""One sampled token as the host sees it: id, logprob, rank and the top alternatives (plain numpy; imported by the
step's plan and by the PD transfer, which carries a prefill's first token)."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SampledToken:
    token_id: int
    logprob: float
    rank: int
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None

    @classmethod
    def from_output(cls, out, index) -> "SampledToken":
        """Entry `index` of a host copy of a sampler.SamplerOutput (top ids and logprobs None when it has none)."""
        top = out.top_ids.shape[-1] > 0
        return cls(int(out.token_ids[index]), float(out.logprobs[index]), int(out.ranks[index]),
                   out.top_ids[index] if top else None, out.top_logprobs[index] if top else None)

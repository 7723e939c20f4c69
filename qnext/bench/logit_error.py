"""How far a narrower dtype's logits are from float32's, scored through the engine's own step."""
from __future__ import annotations

import numpy as np


def logit_error(path, dtype: str, vocab: int, rng, length: int = 256) -> dict:
    """How far `dtype`'s logits are from float32's on one random prompt of `length` tokens (every position, scored
    through the engine's own step): the largest and RMS absolute difference, the RMS relative to the logits' own
    RMS, and the share of positions whose argmax (the greedy token) agrees."""
    from qnext.model.scoring import load_model

    ids = rng.integers(3, vocab - 8, length).tolist()
    ref = load_model(path, "float32").logits(ids)
    got = load_model(path, dtype).logits(ids)
    err = np.abs(got - ref)
    rms = float(np.sqrt(np.mean(err ** 2)))
    return {"tokens": length, "max_abs": float(err.max()), "rms_abs": rms,
            "rms_relative": rms / float(np.sqrt(np.mean(ref ** 2))),
            "argmax_agreement": float(np.mean(got.argmax(-1) == ref.argmax(-1)))}

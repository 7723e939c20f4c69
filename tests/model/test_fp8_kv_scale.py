"""The fp8 KV cache's scale (engine option kv_cache_scale): pages hold k / s and v / s, and s comes back in the
softmax scale and the output, so any reasonable s gives the full-width logits within e4m3's rounding."""
from __future__ import annotations

import dataclasses

import numpy as np

from qnext.model.scoring import Model, load_model


def test_fp8_kv_logits_follow_the_full_width_cache_at_any_scale(tiny_checkpoint):
    base = load_model(tiny_checkpoint("qwen3_5", seed=2))
    ids = np.random.default_rng(0).integers(3, 500, 40).tolist()
    full = base.logits(ids)
    errors = {}
    for scale in (1.0, 0.25):
        model = Model(dataclasses.replace(base.config, kv_cache_scale=scale), base.params, base.dtype,
                      kv_cache_dtype="fp8")
        errors[scale] = np.abs(model.logits(ids) - full).max()
    # measured 0.040 at both scales (the logits span ~9: e4m3's rounding of k and v); were the scale not folded
    # back, the 0.25 run's attention scores and outputs would come out 4x too large
    assert 0 < errors[1.0] < 0.1 and 0 < errors[0.25] < 0.1, errors
    assert errors[1.0] != errors[0.25]          # the scale changed what the pages hold

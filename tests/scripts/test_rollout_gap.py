"""scripts/rollout_gap.py measures today's gaps; this asserts only what holds today (float32, a short rollout):
the tokens agree in every schedule and the log-probs agree to float32 rounding, not bit for bit in general
(docs/determinism.md)."""
from __future__ import annotations

import numpy as np

import qnext.flax as qflax
from scripts.rollout_gap import measure, report


def test_float32_rollout_tokens_agree_across_schedules_and_with_the_flax_scores(tiny_checkpoint):
    model = qflax.from_pretrained(tiny_checkpoint("qwen3_5"))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.vocab_size, 60).tolist()
    companions = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (5, 17, 33, 40, 9, 60, 21)]
    runs = measure(model, prompt, companions, max_tokens=6, temperature=1.0)
    assert set(runs) == {"alone, cold", "prefix-cache hit", "batch of 8", "prefill budget 32", "flax token_logprobs"}
    base_tokens, base = runs["alone, cold"]
    assert len(base_tokens) == 6 and np.all(base < 0)
    for case, (tokens, logprobs) in runs.items():
        assert tokens == base_tokens, case
        assert np.abs(logprobs - base).max() < 1e-4, (case, np.abs(logprobs - base).max())
    assert len(report(runs, "float32")) == 4

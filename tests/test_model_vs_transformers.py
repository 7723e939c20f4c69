"""qnext's step computes the logits of transformers on perturbed tiny checkpoints of every family."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

import qnext  # noqa: E402
from tests.hf_reference import FAMILIES, build_hf_model, hf_logits, save_hf_model  # noqa: E402

PROMPT_LENGTHS = (1, 7, 64, 100)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    hf = build_hf_model(request.param, seed=3)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, qnext.load_model(path)


def test_full_prompt_logits_match_transformers(pair):
    hf, model = pair
    rng = np.random.default_rng(0)
    for n in PROMPT_LENGTHS:
        ids = rng.integers(0, model.config.vocab_size, n)
        ours, ref = model.logits(ids), hf_logits(hf, ids)
        assert ours.shape == ref.shape == (n, model.config.vocab_size)
        assert np.abs(ours - ref).max() < 1e-4, f"length {n}: max |diff| {np.abs(ours - ref).max()}"
        assert np.abs(ref).max() > 0.1, "logits too small to detect convention bugs"

"""qnext's step computes the logits of transformers on perturbed tiny checkpoints of every family."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

import qnext  # noqa: E402
from tests.support.hf_reference import FAMILIES, build_hf_model, hf_logits, save_hf_model  # noqa: E402

PROMPT_LENGTHS = (1, 7, 64, 100)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    hf = build_hf_model(request.param, seed=3)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, qnext.load_model(path), path


def test_full_prompt_logits_match_transformers(pair):
    hf, model, _ = pair
    rng = np.random.default_rng(0)
    for n in PROMPT_LENGTHS:
        ids = rng.integers(0, model.config.vocab_size, n)
        ours, ref = model.logits(ids), hf_logits(hf, ids)
        assert ours.shape == ref.shape == (n, model.config.vocab_size)
        assert np.abs(ours - ref).max() < 1e-4, f"length {n}: max |diff| {np.abs(ours - ref).max()}"
        assert np.abs(ref).max() > 0.1, "logits too small to detect convention bugs"


@pytest.mark.parametrize("family,options", [("qwen3_next", {}), ("qwen3_5", {"vlm": True}),
                                            ("qwen3_5_moe", {"fused_experts": True})])
def test_our_tiny_checkpoints_are_real_hf_checkpoints(tiny_checkpoint, family, options):
    """The checkpoint writer used by the demo and tests produces what transformers loads and agrees with."""
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(family, **options)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = qnext.load_model(path)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 37)
    np.testing.assert_allclose(model.logits(ids), hf_logits(hf, ids), atol=1e-4)


def test_bfloat16_error_is_no_worse_than_transformers_bfloat16(pair):
    import copy

    import torch

    hf, f32, path = pair
    bf16 = qnext.load_model(path, dtype="bfloat16")
    assert bf16.params["embed"].dtype == np.dtype("bfloat16")
    ids = np.random.default_rng(2).integers(0, f32.config.vocab_size, 24)
    ref = hf_logits(hf, ids)
    # Median over tokens of the per-token max error: MoE routing flips under bf16 make single tokens chaotic
    # in both engines.
    hf_error = np.median(np.abs(hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids) - ref).max(-1))
    our_error = np.median(np.abs(bf16.logits(ids) - ref).max(-1))
    assert our_error <= 2 * hf_error + 1e-3, (our_error, hf_error)

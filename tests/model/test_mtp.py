"""The MTP head: its weights survive save -> load in the checkpoint's HF names (all three families), and the
speculative reference loop (qnext/engine/spec_decode_reference.py) emits plain greedy decoding's tokens with the
head's drafts, with drafts forced all accepted and with drafts forced all rejected."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from qnext.config import ModelConfig
from qnext.engine.spec_decode_reference import mtp_draft, plain_greedy, speculative_greedy
from qnext.model.loader import load_params
from qnext.model.mtp import init_mtp_params, load_mtp_params, save_mtp_params
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

PROMPT, MAX_TOKENS, K, LENGTH = [5, 17, 300, 42, 7, 99], 10, 2, 24


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_mtp_weights_save_and_load(family, tmp_path):
    path = write_tiny_checkpoint(tmp_path, family)
    cfg = ModelConfig.from_pretrained(path)
    params = load_params(path, cfg)
    assert load_mtp_params(path, cfg) is None                      # none shipped: no head
    mtp = init_mtp_params(params, cfg, jax.random.key(0))
    mtp = jax.tree.map(lambda x: x + 0.01 * np.arange(x.size, dtype=np.float32).reshape(x.shape) % 1.0, mtp)
    save_mtp_params(path, mtp, cfg)
    loaded = load_mtp_params(path, cfg)
    assert jax.tree.structure(loaded) == jax.tree.structure(mtp)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(mtp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again = load_params(path, cfg)                                 # the decoder's loader ignores the head's file
    np.testing.assert_array_equal(np.asarray(again["embed"]), np.asarray(params["embed"]))


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5")
    cfg = ModelConfig.from_pretrained(path)
    params = load_params(path, cfg)
    return cfg, params, plain_greedy(params, cfg, PROMPT, MAX_TOKENS, LENGTH)


def test_greedy_with_mtp_drafts_equals_plain_greedy(model):
    cfg, params, want = model
    mtp = init_mtp_params(params, cfg, jax.random.key(1))
    got, accepted = speculative_greedy(params, cfg, PROMPT, MAX_TOKENS, K, mtp_draft(params, mtp, cfg, LENGTH),
                                       LENGTH)
    assert got == want
    assert all(0 <= a <= K for a in accepted)


@pytest.mark.parametrize("forced", ["accept", "reject"])
def test_forced_acceptance_equals_plain_greedy(model, forced):
    cfg, params, want = model

    def oracle(tokens, hidden, k):                 # the target's own next tokens (+1: never its pick)
        full = plain_greedy(params, cfg, tokens, k, LENGTH)
        return full if forced == "accept" else [(full[0] + 1) % cfg.vocab_size] * k

    got, accepted = speculative_greedy(params, cfg, PROMPT, MAX_TOKENS, K, oracle, LENGTH)
    assert got == want
    assert set(accepted) == ({K} if forced == "accept" else {0})

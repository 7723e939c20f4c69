"""qnext.flax.token_logprobs: each next token's log-prob [B, T-1], the hand-written training loss's quantity."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qnext.flax as qflax

LENGTH = 40


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return qflax.from_pretrained(tiny_checkpoint("qwen3_5"))


def batch(vocab_size):
    """Two rows with different contents; row 1 is shorter, left-padded by 7."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, vocab_size, (2, LENGTH)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :7] = 0
    return jnp.asarray(ids), jnp.asarray(mask)


scored = nnx.jit(qflax.token_logprobs)


def hand_written(model, ids, mask):
    """The README training loop's hand-written form: log_softmax of the logits, gathered at the next tokens."""
    logp = jax.nn.log_softmax(model(ids, mask)[:, :-1])
    return jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]


readme_form = nnx.jit(hand_written)


def test_equals_log_softmax_of_the_logits_at_the_next_tokens(model):
    ids, mask = batch(model.config.vocab_size)
    ours = np.asarray(scored(model, ids, mask))
    assert ours.shape == (2, LENGTH - 1) and ours.dtype == np.float32
    ref = np.asarray(readme_form(model, ids, mask))
    real = np.asarray((mask[:, :-1] != 0) & (mask[:, 1:] != 0))
    assert np.array_equal(ours[real], ref[real])           # the same computation: bit for bit
    assert np.all(ours[~real] == 0.0)                      # padding targets / contexts score 0
    # an independent check in float64 numpy, and the rows really differ
    logits = np.asarray(nnx.jit(lambda m, i, k: m(i, k))(model, ids, mask), np.float64)[:, :-1]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = np.take_along_axis(logits, np.asarray(ids)[:, 1:, None], -1)[..., 0] - lse
    assert np.abs(ours[real] - want[real]).max() < 1e-5
    assert np.abs(ours[0, 10:] - ours[1, 10:]).max() > 1e-2


def test_rows_score_as_they_would_alone_and_unmasked_call_scores_every_token(model):
    ids, mask = batch(model.config.vocab_size)
    both = np.asarray(scored(model, ids, mask))
    alone = np.asarray(scored(model, ids[1:, 7:], None))   # row 1 without its padding, no mask
    assert alone.shape == (1, LENGTH - 8)
    # the batch's row equals the row alone up to float32 rounding (bit equality across batch shapes is not promised
    # today: docs/determinism.md)
    assert np.abs(both[1, 7:] - alone[0]).max() < 1e-5, np.abs(both[1, 7:] - alone[0]).max()


def test_jit_and_grad_match_the_hand_written_loss(model):
    ids, mask = batch(model.config.vocab_size)
    weights = jnp.asarray(np.random.default_rng(0).normal(size=(2, LENGTH - 1)), jnp.float32)
    real = ((mask[:, :-1] != 0) & (mask[:, 1:] != 0)).astype(jnp.float32)

    def grads(score):
        return nnx.jit(lambda m: nnx.grad(lambda m: (weights * score(m)).sum())(m))(model)

    ours = jax.tree.leaves(nnx.to_pure_dict(grads(lambda m: qflax.token_logprobs(m, ids, mask))))
    ref = jax.tree.leaves(nnx.to_pure_dict(grads(lambda m: hand_written(m, ids, mask) * real)))
    assert len(ours) == len(ref) > 0
    assert any(float(jnp.abs(g).max()) > 0 for g in ours)
    for a, b in zip(ours, ref):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_bad_input_is_rejected_with_a_clear_error(model):
    with pytest.raises(ValueError, match="batch, length"):
        qflax.token_logprobs(model, jnp.zeros((5,), jnp.int32))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        qflax.token_logprobs(model, jnp.zeros((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        qflax.token_logprobs(model, jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="attention_mask shape"):
        qflax.token_logprobs(model, jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 3), jnp.int32))

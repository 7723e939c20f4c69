"""The Flax model computes transformers' logits and the engine's, honours left padding, and its params are the
engine's weights pytree."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")

import qnext  # noqa: E402
import qnext.flax as qflax  # noqa: E402
from pallas_kernels.gated_delta_rule import gated_delta_rule_token_scan  # noqa: E402
from qnext.model.dense_delta_rule import dense_gated_delta_rule  # noqa: E402
from qnext.model.weights import map_specs, param_specs  # noqa: E402
from tests.support.flax_fixtures import PAD, forward, hf_checkpoint, left_padded_batch  # noqa: E402
from tests.support.hf_reference import FAMILIES  # noqa: E402


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_and_the_engine_and_ignore_left_padding(family):
    import torch

    hf, path = hf_checkpoint(family)
    model = qflax.from_pretrained(path)
    ids, mask = left_padded_batch(model.config.vocab_size)
    ours = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
    assert ours.shape == ids.shape + (model.config.vocab_size,) and ours.dtype == np.float32
    with torch.no_grad():
        ref = hf(torch.tensor(ids[:1])).logits[0].float().numpy()
    assert np.abs(ref).max() > 0.1, "logits too small to detect convention bugs"
    assert np.abs(ours[0] - ref).max() < 1e-4, np.abs(ours[0] - ref).max()
    engine = qnext.load_model(path).logits(ids[0])
    assert np.abs(ours[0] - engine).max() < 1e-4, np.abs(ours[0] - engine).max()
    # row 1 is row 0's prompt after PAD padding tokens: the same logits at its real tokens
    assert np.abs(ours[1, PAD:] - ours[0, :-PAD]).max() < 2e-5, np.abs(ours[1, PAD:] - ours[0, :-PAD]).max()


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_params_are_the_modules_arrays_in_the_contract_layout(family):
    model = qflax.from_pretrained(hf_checkpoint(family)[1])
    cfg, params = qflax.engine_params(model)
    specs = param_specs(cfg)
    assert jax.tree.structure(params) == jax.tree.structure(map_specs(lambda _, s: 0, specs))
    got = [(a.shape, a.dtype) for a in jax.tree.leaves(params)]
    assert got == jax.tree.leaves(map_specs(lambda _, s: (s.shape, np.dtype(s.dtype)), specs),
                                  is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[1], np.dtype))
    assert params["embed"] is model.embed[...]                        # a view: the module's own arrays
    assert params["layers"][0]["attn"]["in_proj"] is model.layers[0].attn.in_proj[...]
    model.final_norm[...] = model.final_norm[...] + 1                 # a change to the module shows in the view
    assert qflax.engine_params(model)[1]["final_norm"] is model.final_norm[...]


def test_tied_embeddings_have_one_param_used_as_lm_head(tiny_checkpoint):
    model = qflax.from_pretrained(tiny_checkpoint("qwen3_5", tie_word_embeddings=True))
    assert not hasattr(model, "lm_head")
    _, params = qflax.engine_params(model)
    assert params["lm_head"] is params["embed"]


def _delta_rule_inputs(b, length, hk, hv, dk, dv, seed=0):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((b, length, hk, dk)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.standard_normal((b, length, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 2.0, (b, length, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (b, length, hv)).astype(np.float32)
    return q, k, v, g, beta


# chunk 8: three chunks, the last one short, inverted by forward substitution alone; chunk 32: 16-row blocks merged
@pytest.mark.parametrize("length, chunk", [(23, 8), (70, 32)])
def test_dense_delta_rule_matches_the_token_recurrence(length, chunk):
    b = 2
    q, k, v, g, beta = _delta_rule_inputs(b, length, 2, 4, 8, 6)
    out = np.asarray(jax.jit(dense_gated_delta_rule, static_argnames="chunk")(q, k, v, g, beta, chunk=chunk))
    scan = jax.jit(gated_delta_rule_token_scan)
    for row in range(b):
        np.testing.assert_allclose(out[row], np.asarray(scan(q[row], k[row], v[row], g[row], beta[row])[0]),
                                   atol=1e-5)


def test_delta_rule_gradient_calls_no_triangular_solve():
    """A training step must not reach LAPACK's strsm on CPU: a batch-16 step could hang there with both XLA worker
    threads waiting inside it. The gradient still matches the token recurrence's."""
    inputs = _delta_rule_inputs(2, 40, 2, 4, 8, 6, seed=1)

    def loss(fn, *args):
        return jnp.sum(jnp.sin(fn(*args)))

    grad = jax.grad(lambda *a: loss(lambda *x: dense_gated_delta_rule(*x, chunk=32), *a), argnums=(0, 1, 2, 3, 4))
    assert "triangular_solve" not in str(jax.make_jaxpr(grad)(*inputs))
    scan = jax.vmap(lambda *x: gated_delta_rule_token_scan(*x)[0])
    expected = jax.grad(lambda *a: loss(scan, *a), argnums=(0, 1, 2, 3, 4))(*inputs)
    for got, want in zip(jax.jit(grad)(*inputs), expected):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-4)


def test_rejects_a_mask_of_another_shape():
    model = qflax.from_pretrained(hf_checkpoint("qwen3_5")[1])
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 5), jnp.int32))

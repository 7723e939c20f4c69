"""`token_logprobs(model, token_ids, attention_mask)`: each next token's log-probability under the Flax model,
the quantity a trainer scores rollouts with (the engine's sampler reports the same formula for a sampled token:
`jax.nn.log_softmax` of the float32 raw logits, gathered at the token; qnext/engine/sampler.py `token_logprobs`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(model, token_ids, attention_mask=None):
    """log p(token_ids[:, t+1] | token_ids[:, :t+1]) for t in 0..T-2: float32 [B, T-1].

    token_ids [B, T] int; attention_mask [B, T] (1 for tokens, 0 for left padding; None: all tokens). Entries whose
    target or context token is padding are 0 (the first real token of a left-padded row has no context).
    Jittable (nnx.jit, or inside a jitted loss) and differentiable with respect to the model's params: it is
    `jax.nn.log_softmax(model(ids, mask)[:, :-1])` gathered at `ids[:, 1:]`, nothing more, so a loss written with
    it computes exactly what the hand-written form computes."""
    ids = jnp.asarray(token_ids)
    if ids.ndim != 2:
        raise ValueError(f"token_ids must be [batch, length]; got shape {ids.shape}")
    if ids.shape[1] < 2:
        raise ValueError(f"token_ids needs at least 2 tokens a row to score a next token; got length {ids.shape[1]}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"token_ids must be integer token ids; got dtype {ids.dtype}")
    mask = jnp.ones_like(ids) if attention_mask is None else jnp.asarray(attention_mask)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {mask.shape} differs from token_ids shape {ids.shape}")
    logits = model(ids, mask)[:, :-1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    if attention_mask is None:
        return chosen
    scored = (mask[:, :-1] != 0) & (mask[:, 1:] != 0)
    return jnp.where(scored, chosen, 0.0)

"""The greedy token of logits rows: the engine's step, its sampler, multi-step and speculative steps and the MTP
head's drafts all pick with it, so that every greedy path breaks ties the same way (the first maximum)."""
from __future__ import annotations

import jax.numpy as jnp


def first_argmax(x):
    """jnp.argmax over the last axis (first index of the maximum) as two plain reductions: XLA:CPU's fused
    (value, index) reduce is ~2x slower over a vocabulary row."""
    v = x.shape[-1]
    hit = x == x.max(axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.float32), jnp.inf), axis=-1), v - 1
                       ).astype(jnp.int32)

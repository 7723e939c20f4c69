"""SwiGLU MLP and the sparse MoE block with a sigmoid-gated shared expert."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from qnext.config import ModelConfig


def swiglu(x, gate_up, down):
    gate, up = jnp.split(x @ gate_up, 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ down


def moe(p, x, cfg: ModelConfig):
    """Router softmax in f32 over all experts, then top-k (renormalised when norm_topk_prob), cast to the model
    dtype. Tokens are sorted by expert and run through grouped matmuls (`ragged_dot`)."""
    t, h = x.shape
    e, top_k = cfg.num_experts, cfg.num_experts_per_tok
    probs = jax.nn.softmax((x @ p["router"]).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)                                    # [T, k]
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights.astype(x.dtype)

    flat_expert = experts.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token_of = order // top_k
    group_sizes = jnp.bincount(flat_expert, length=e).astype(jnp.int32)
    gate, up = jnp.split(jax.lax.ragged_dot(x[token_of], p["experts_gate_up"], group_sizes), 2, axis=-1)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["experts_down"], group_sizes)  # [T*k, H]
    out = out * weights.reshape(-1)[order][:, None]
    routed = jnp.zeros((t, h), out.dtype).at[token_of].add(out)

    shared = swiglu(x, p["shared_gate_up"], p["shared_down"])
    return routed + jax.nn.sigmoid(x @ p["shared_gate"]) * shared


def feed_forward(p, x, cfg: ModelConfig, layer: int):
    if cfg.is_moe_layer(layer):
        return moe(p, x, cfg)
    return swiglu(x, p["gate_up"], p["down"])

"""SwiGLU MLP and the sparse MoE block with a sigmoid-gated shared expert."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from qnext.config import ModelConfig
from qnext.ops.fp8_weight import Fp8Weight
from qnext.ops.linear import linear
from qnext.model.tensor_parallel import AXIS


def swiglu(x, gate_up, down):
    """x: [..., H]; gate_up: [2I, H] (gate | up); down: [H, I]."""
    gate, up = jnp.split(linear(x, gate_up), 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, down)


MOE_BLOCK_ROWS = 16


def grouped_matmul(rows, weights, group_sizes, ragged: bool):
    """rows [M, K] sorted by group, weights [G, K, N], group_sizes [G] -> [M, N]: row i uses its group's matrix.

    ragged (on GPU): XLA's ragged_dot. Elsewhere ragged_dot is far too slow (~0.5 GFLOP/s on CPU), so each group is
    padded to blocks of MOE_BLOCK_ROWS rows that share one matrix, and the blocks run as one batched matmul:
    at most M / B + G blocks, exact, wasting at most G * B rows. An Fp8Weight stack is widened to the rows' dtype
    first (fp8_weight.py)."""
    if isinstance(weights, Fp8Weight):
        weights = weights.dequantized(rows.dtype)
    if ragged:
        return jax.lax.ragged_dot(rows, weights, group_sizes)
    m, g, b = rows.shape[0], weights.shape[0], MOE_BLOCK_ROWS
    # rows past sum(group_sizes) (expert parallelism: copies for other devices' experts) are dropped: written
    # nowhere, read back as zeros
    num_blocks = m // b + g
    padded = -(-group_sizes // b) * b
    padded_start = jnp.cumsum(padded) - padded
    start = jnp.cumsum(group_sizes) - group_sizes
    group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")   # group of each sorted row
    dest = jnp.where(group < g, padded_start[jnp.minimum(group, g - 1)] + jnp.arange(m) - start[group % g],
                     num_blocks * b)
    blocks = jnp.zeros((num_blocks * b, rows.shape[1]), rows.dtype).at[dest].set(rows, mode="drop")
    block_group = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(num_blocks) * b, side="right")
    block_group = jnp.minimum(block_group, g - 1)                                    # trailing empty blocks
    out = jnp.einsum("nbk,nkj->nbj", blocks.reshape(num_blocks, b, -1), weights[block_group])
    return jnp.take(out.reshape(num_blocks * b, -1), dest, axis=0, mode="fill", fill_value=0)


def moe(p, x, cfg: ModelConfig):
    """x: [..., H]. Router softmax in f32 over all experts, then top-k (renormalised when norm_topk_prob), cast to
    the model dtype. Token copies are sorted by expert and run through grouped matmuls.

    Expert parallelism (cfg.expert_parallel, tensor_parallel.py): this device holds experts [r e, (r+1) e) of the
    router's E, e = cfg.num_experts; the copies routed elsewhere sort last, outside every group, and add nothing.
    The result is this device's partial sum (its experts and its part of the shared expert), all-reduced after."""
    lead, h = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, h)
    t = x.shape[0]
    e, top_k = cfg.num_experts, cfg.num_experts_per_tok
    probs = jax.nn.softmax(linear(x, p["router"]).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)                                    # [T, k]
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights.astype(x.dtype)

    flat_expert = experts.reshape(-1)
    if cfg.expert_parallel:
        flat_expert = flat_expert - jax.lax.axis_index(AXIS) * e
        flat_expert = jnp.where((flat_expert >= 0) & (flat_expert < e), flat_expert, e)     # e: another device's
    order = jnp.argsort(flat_expert, stable=True)
    token_of = order // top_k
    group_sizes = jnp.bincount(flat_expert, length=e + 1)[:e].astype(jnp.int32)
    ragged = cfg.with_backend().backend == "gpu"
    gate, up = jnp.split(grouped_matmul(x[token_of], p["experts_gate_up"], group_sizes, ragged), 2, axis=-1)
    out = grouped_matmul(jax.nn.silu(gate) * up, p["experts_down"], group_sizes, ragged)      # [T*k, H]
    local = jnp.arange(out.shape[0]) < jnp.sum(group_sizes)                                  # [T*k] sorted
    out = jnp.where(local[:, None], out * weights.reshape(-1)[order][:, None], 0)
    routed = jnp.zeros((t, h), out.dtype).at[token_of].add(out)

    shared = swiglu(x, p["shared_gate_up"], p["shared_down"])
    return (routed + jax.nn.sigmoid(linear(x, p["shared_gate"])) * shared).reshape(lead + (h,))


def feed_forward(p, x, cfg: ModelConfig, layer: int):
    """x: [..., H] -> [..., H]: the layer's MoE block or dense SwiGLU MLP. Shared by the engine and qnext/flax."""
    if cfg.is_moe_layer(layer):
        return moe(p, x, cfg)
    return swiglu(x, p["gate_up"], p["down"])

"""The speculative verify step's model pass: D rows of L tokens each (the last accepted token and its drafts), every
token's logits, and every position's recurrent and conv state kept aside instead of written.

Which of the L positions a row keeps is known only after the acceptance rule has read the logits, so the Gated
DeltaNet layers do not touch the state rows here: `verify_deltanet` runs the delta rule token by token from the
row's read state and returns the state after each position (L arrays [D, Hv, dk, dv] float32) and the conv window
([D, K-1+L, conv_dim]: the state after position j is window[:, j+1 : j+K]); `commit_positions` then writes the
kept position's state into the live row (and into a snapshot row when a block boundary was reached at or before
it). Full-attention layers write KV for all L positions as a prefill group does; a rejected position's KV lies
past the sequence's length, is never read, and is overwritten by the next step. (The alternative, writing the
states of accepted tokens by running them again, costs a second pass of the whole model over them.)

Layout (StepInputs, built by qnext/engine/spec_step.py): no decode rows; one prefill group per row with
token_index [D, L] = row-major flat tokens, `length` the row's valid tokens (0 for a padding row), read_row /
write_row its state rows; padding tokens point at KV slot 0 (the dummy block).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from cache.device_buffers import CacheBuffers
from qnext.config import ModelConfig
from qnext.model.deltanet import deltanet_output, deltanet_projections, delta_rule_inputs
from qnext.model.groups import to_prefill
from pallas_kernels.causal_conv1d import conv_silu
from pallas_kernels.gated_delta_rule import expand_heads

def delta_rule_positions(q, k, v, g, beta, state0):
    """q, k [D, L, Hk, dk]; v [D, L, Hv, dv]; g, beta [D, L, Hv]; state0 [D, Hv, dk, dv] float32.
    Returns (o [D, L, Hv, dv] float32, states: the L states [D, Hv, dk, dv] after each position). The batched decode
    kernel's math (pallas_kernels/gated_delta_rule.py: S^T k and S^T q in one pass over S before the update, as a
    multiply-reduce: XLA:CPU runs batched small dots far slower), one token at a time, unrolled (L is k + 1)."""
    hv = v.shape[2]
    f32 = jnp.float32
    q, k = expand_heads(q.astype(f32), hv), expand_heads(k.astype(f32), hv)
    v, decay, beta = v.astype(f32), jnp.exp(g.astype(f32))[..., None], beta.astype(f32)[..., None]
    s, outs, states = state0.astype(f32), [], []
    for t in range(q.shape[1]):
        k_t, q_t = k[:, t], q[:, t]                                          # [D, Hv, dk]
        reads = jnp.sum(jnp.stack([k_t, q_t], axis=-2)[..., None] * s[:, :, None], axis=-2)   # [D, Hv, 2, dv]
        delta = beta[:, t] * (v[:, t] - decay[:, t] * reads[:, :, 0])
        outs.append(decay[:, t] * reads[:, :, 1] + jnp.sum(k_t * q_t, axis=-1, keepdims=True) * delta)
        s = decay[:, t, ..., None] * s + k_t[..., :, None] * delta[..., None, :]
        states.append(s)
    return jnp.stack(outs, axis=1), states


def verify_deltanet(p, x, conv_state, recurrent_state, inputs, cfg: ModelConfig):
    """A Gated DeltaNet layer over the verify layout. Returns (out [T, H], (conv pool, window), (recurrent pool,
    states)): the pools untouched, each paired with what commit_positions writes into it later (decoder_stack
    carries the pairs in the buffers' places)."""
    pre = inputs.prefill
    mixed, z, b, a = deltanet_projections(p, x, cfg)
    read = jnp.maximum(pre.read_row, 0)                 # row 0 is the zero state
    halo = conv_state[read].astype(mixed.dtype)         # [D, K-1, C]
    window = jnp.concatenate([halo, to_prefill(mixed, inputs)], axis=1)
    mixed_p = conv_silu(window, p["conv_weight"]).astype(mixed.dtype)
    q, k, v, g, beta = delta_rule_inputs(mixed_p, to_prefill(b, inputs), to_prefill(a, inputs), p, cfg)
    o, states = delta_rule_positions(q, k, v, g, beta, recurrent_state[read])
    d, length = o.shape[:2]
    flat = o.reshape((d * length,) + o.shape[2:])[: x.shape[0]]     # row-major groups are the flat tokens
    return deltanet_output(p, flat, z, x.dtype, cfg), (conv_state, window), (recurrent_state, states)


def commit_positions(buffers: CacheBuffers, keep, write_row, capture_at, capture_row) -> CacheBuffers:
    """`buffers` as decoder_stack returns them with verify_deltanet: conv entries (pool, window), recurrent entries
    (pool, states). Writes, per row, the state after position keep[i] (its last kept token) into write_row[i],
    and the state after position capture_at[i] into capture_row[i] when capture_row[i] > 0 and capture_at[i] <=
    keep[i] (with a narrow snapshot pool, capture rows are pool ids: narrowed into the pool). Rows with write_row 0
    (padding) write nothing: row 0 stays the zero state. Returns plain buffers."""
    first = buffers.conv[0][0].shape[0] if buffers.snapshot_recurrent else 0   # pool ids from here (0: no pool)
    live = jnp.where(write_row > 0, write_row, -1)
    capture = jnp.where((capture_row > 0) & (capture_at <= keep) & (write_row > 0), capture_row - first, -1)
    pools = zip(buffers.snapshot_conv, buffers.snapshot_recurrent) if first else [(None, None)] * len(buffers.conv)
    new_conv, new_recurrent, new_pool_conv, new_pool_recurrent = [], [], [], []
    for (conv, window), (recurrent, states), (pool_conv, pool_recurrent) in zip(buffers.conv, buffers.recurrent,
                                                                                 pools):
        halo = conv.shape[1]

        def put(conv, recurrent, row, j):         # the state after position j of row i into conv / recurrent[row[i]]
            idx = (jnp.clip(j, 0, len(states) - 1) + 1)[:, None] + jnp.arange(halo)[None, :]
            after = jnp.take_along_axis(window, idx[..., None], axis=1)      # [D, K-1, C]: inputs through j
            chosen = functools.reduce(lambda acc, t: jnp.where((j == t)[:, None, None, None], states[t], acc),
                                      range(1, len(states)), states[0])       # [D, Hv, dk, dv]: state j of row i
            target = jnp.where(row >= 0, row, conv.shape[0])          # out of bounds: dropped
            return (conv.at[target].set(after.astype(conv.dtype), mode="drop"),
                    recurrent.at[target].set(chosen.astype(recurrent.dtype), mode="drop"))

        conv, recurrent = put(conv, recurrent, live, keep)
        if pool_conv is None:
            conv, recurrent = put(conv, recurrent, capture, capture_at)
        else:
            pool_conv, pool_recurrent = put(pool_conv, pool_recurrent, capture, capture_at)
            new_pool_conv.append(pool_conv)
            new_pool_recurrent.append(pool_recurrent)
        new_conv.append(conv)
        new_recurrent.append(recurrent)
    return buffers.replace(conv=tuple(new_conv), recurrent=tuple(new_recurrent),
                           snapshot_conv=tuple(new_pool_conv), snapshot_recurrent=tuple(new_pool_recurrent))

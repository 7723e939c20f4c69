"""The speculative verify step's model pass: D rows of L tokens each (the last accepted token and its drafts), every
token's logits, and every position's recurrent and conv state kept aside instead of written.

Which of the L positions a row keeps is known only after the acceptance rule has read the logits, so the Gated
DeltaNet layers do not touch the state rows here: `verify_deltanet` runs the delta rule token by token from the
row's read state and returns the state after each position ([L, D, Hv, dk, dv] float32) and the conv window
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

import jax
import jax.numpy as jnp

from cache.device_buffers import CacheBuffers
from qnext.config import ModelConfig
from qnext.model.deltanet import deltanet_output, deltanet_projections, delta_rule_inputs
from qnext.model.groups import to_prefill

_HIGHEST = jax.lax.Precision.HIGHEST


def _expand_heads(x, num_v_heads):
    r = num_v_heads // x.shape[-2]
    return x if r == 1 else jnp.repeat(x, r, axis=-2)


def _conv_silu(ext, weight):
    """ext [D, L + K - 1, C], weight [C, K] -> silu(causal conv) [D, L, C] float32 (as the conv kernels)."""
    width = weight.shape[1]
    length = ext.shape[-2] - width + 1
    w = weight.astype(jnp.float32)
    acc = sum(ext[..., j:j + length, :].astype(jnp.float32) * w[:, j] for j in range(width))
    return jax.nn.silu(acc)


def delta_rule_positions(q, k, v, g, beta, state0):
    """q, k [D, L, Hk, dk]; v [D, L, Hv, dv]; g, beta [D, L, Hv]; state0 [D, Hv, dk, dv] float32.
    Returns (o [D, L, Hv, dv] float32, states [L, D, Hv, dk, dv]: the state after each position). The math of
    the recurrent decode kernel, one token at a time (pallas_kernels/gated_delta_rule.py)."""
    hv = v.shape[2]
    f32 = jnp.float32
    q, k = _expand_heads(q.astype(f32), hv), _expand_heads(k.astype(f32), hv)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs                                   # [D, Hv, ...]
        s = s * jnp.exp(g_t)[..., None, None]
        delta = b_t[..., None] * (v_t - jnp.einsum("dhk,dhkv->dhv", k_t, s, precision=_HIGHEST))
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, (jnp.einsum("dhk,dhkv->dhv", q_t, s, precision=_HIGHEST), s)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v.astype(f32), g.astype(f32), beta.astype(f32)))
    _, (o, states) = jax.lax.scan(step, state0.astype(f32), xs)
    return jnp.moveaxis(o, 0, 1), states


def verify_deltanet(p, x, conv_state, recurrent_state, inputs, cfg: ModelConfig):
    """A Gated DeltaNet layer over the verify layout. Returns (out [T, H], (conv pool, window), (recurrent pool,
    states)): the pools untouched, each paired with what commit_positions writes into it later (decoder_stack
    carries the pairs in the buffers' places)."""
    pre = inputs.prefill
    mixed, z, b, a = deltanet_projections(p, x, cfg)
    read = jnp.maximum(pre.read_row, 0)                 # row 0 is the zero state
    halo = conv_state[read].astype(mixed.dtype)         # [D, K-1, C]
    window = jnp.concatenate([halo, to_prefill(mixed, inputs)], axis=1)
    mixed_p = _conv_silu(window, p["conv_weight"]).astype(mixed.dtype)
    q, k, v, g, beta = delta_rule_inputs(mixed_p, to_prefill(b, inputs), to_prefill(a, inputs), p, cfg)
    o, states = delta_rule_positions(q, k, v, g, beta, recurrent_state[read])
    d, length = o.shape[:2]
    flat = o.reshape((d * length,) + o.shape[2:])[: x.shape[0]]     # row-major groups are the flat tokens
    return deltanet_output(p, flat, z, x.dtype, cfg), (conv_state, window), (recurrent_state, states)


def commit_positions(buffers: CacheBuffers, keep, write_row, capture_at, capture_row) -> CacheBuffers:
    """`buffers` as decoder_stack returns them with verify_deltanet: conv entries (pool, window), recurrent entries
    (pool, states). Writes, per row, the state after position keep[i] (its last kept token) into write_row[i],
    and the state after position capture_at[i] into capture_row[i] when capture_row[i] > 0 and capture_at[i] <=
    keep[i]. Rows with write_row 0 (padding) write nothing: row 0 stays the zero state. Returns plain buffers."""
    rows = jnp.arange(keep.shape[0])
    live = jnp.where(write_row > 0, write_row, -1)
    capture = jnp.where((capture_row > 0) & (capture_at <= keep) & (write_row > 0), capture_row, -1)
    new_conv, new_recurrent = [], []
    for (conv, window), (recurrent, states) in zip(buffers.conv, buffers.recurrent):
        halo = conv.shape[1]

        def conv_after(j):                        # [D, K-1, C]: the last K-1 inputs through position j
            idx = (j + 1)[:, None] + jnp.arange(halo)[None, :]
            return jnp.take_along_axis(window, idx[..., None], axis=1).astype(conv.dtype)

        for row, j in ((live, keep), (capture, capture_at)):
            safe = jnp.clip(j, 0, states.shape[0] - 1)
            target = jnp.where(row > 0, row, conv.shape[0])          # out of bounds: dropped
            conv = conv.at[target].set(conv_after(safe), mode="drop")
            recurrent = recurrent.at[target].set(states[safe, rows].astype(recurrent.dtype), mode="drop")
        new_conv.append(conv)
        new_recurrent.append(recurrent)
    return CacheBuffers(kv=buffers.kv, conv=tuple(new_conv), recurrent=tuple(new_recurrent))

"""The speculative verify step's model pass: D rows of L tokens each (the last accepted token and its drafts), every
token's logits, and what gives the recurrent and conv state after any position kept aside instead of written.

Which of the L positions a row keeps is known only after the acceptance rule has read the logits, so the Gated
DeltaNet layers do not touch the state rows here: `verify_deltanet` runs the delta rule over the window from the
row's read state, reading that state once, and keeps the window's keys and deltas (WindowDeltas: the state after
any position is the read state decayed plus a sum of L rank-one terms) and the conv window ([D, K-1+L, conv_dim]:
the state after position j is window[:, j+1 : j+K]); `commit_positions` then forms the kept position's state and
writes it into the live row (and into a snapshot row when a block boundary was reached at or before
it). Full-attention layers write KV for all L positions as a prefill group does; a rejected position's KV lies
past the sequence's length, is never read, and is overwritten by the next step. (The alternative, writing the
states of accepted tokens by running them again, costs a second pass of the whole model over them.)

Layout (StepInputs, built by qnext/engine/spec_step.py): no decode rows; one prefill group per row with
token_index [D, L] = row-major flat tokens, `length` the row's valid tokens (0 for a padding row), read_row /
write_row its state rows; padding tokens point at KV slot 0 (the dummy block).
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from cache.device_buffers import CacheBuffers
from qnext.config import ModelConfig
from qnext.model.deltanet import deltanet_output, deltanet_projections, delta_rule_inputs
from qnext.model.groups import to_prefill
from pallas_kernels.causal_conv1d import conv_silu
from pallas_kernels.gated_delta_rule import expand_heads

class WindowDeltas(NamedTuple):
    """What a Gated DeltaNet layer keeps of a verify window for its rollback: the state after any position j of
    the window is  S_j = e^{G_j} S_0 + sum_{i <= j} e^{G_j - G_i} k_i delta_i^T  (the recurrence unrolled from the
    row's read state S_0), so S_0 and the window's keys, deltas and cumulative decays give every position's state
    and nothing is kept per position that is as large as a state."""

    state0: jnp.ndarray   # [D, Hv, dk, dv] float32: the row's state before the window
    k: jnp.ndarray        # [D, Hv, L, dk] float32 (expanded to the value heads)
    delta: jnp.ndarray    # [D, Hv, L, dv] float32: beta_i (v_i - (e^{g_i} S_{i-1})^T k_i), the update's value
    decay: jnp.ndarray    # [D, Hv, L] float32: G_i, the inclusive cumulative sum of g over the window

    def state_after(self, j):
        """j [D] int32 -> the state after window position j of each row [D, Hv, dk, dv] float32."""
        length = self.decay.shape[-1]
        g_j = jnp.take_along_axis(self.decay, jnp.broadcast_to(j[:, None, None], self.decay.shape[:2] + (1,)),
                                  axis=-1)                                                  # [D, Hv, 1]
        upto = jnp.arange(length)[None, None, :] <= j[:, None, None]
        weight = jnp.where(upto, jnp.exp(jnp.where(upto, g_j - self.decay, 0.0)), 0.0)     # [D, Hv, L]
        increments = jnp.sum((weight[..., None] * self.k)[..., :, :, None] * self.delta[..., :, None, :], axis=2)
        return jnp.exp(g_j)[..., None] * self.state0 + increments


def delta_rule_window(q, k, v, g, beta, state0):
    """q, k [D, L, Hk, dk]; v [D, L, Hv, dv]; g, beta [D, L, Hv]; state0 [D, Hv, dk, dv] float32.
    Returns (o [D, L, Hv, dv] float32, WindowDeltas). The decode kernel's recurrence (pallas_kernels/
    gated_delta_rule.py) over L = k + 1 tokens, written so that the state is read once and never rewritten:
    with G the inclusive cumsum of g,
        delta_i = beta_i (v_i - e^{G_i} S_0^T k_i - sum_{j<i} e^{G_i - G_j} (k_i . k_j) delta_j)
        o_i     = e^{G_i} S_0^T q_i + sum_{j<=i} e^{G_i - G_j} (q_i . k_j) delta_j
    (S_{i-1} expanded from S_0). S_0^T k_i and S_0^T q_i for all i are one multiply-reduce pass over S_0 (XLA:CPU
    runs batched small dots far slower); the rest is L x L work per head. A token-by-token form that writes and
    keeps the state after every position moves (2 L + 1) states per layer and row instead of one."""
    hv = v.shape[2]
    f32 = jnp.float32
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)                                  # [D, L, Hv, ...] -> [D, Hv, L, ...]
    q, k = (heads_first(expand_heads(x.astype(f32), hv)) for x in (q, k))        # [D, Hv, L, dk]
    v, g, beta = heads_first(v.astype(f32)), heads_first(g.astype(f32)), heads_first(beta.astype(f32))
    length = q.shape[2]
    s0 = state0.astype(f32)
    reads = jnp.sum(jnp.concatenate([k, q], axis=2)[..., None] * s0[:, :, None], axis=-2)   # [D, Hv, 2L, dv]
    read_k, read_q = reads[:, :, :length], reads[:, :, length:]
    big_g = jnp.cumsum(g, axis=-1)                                                 # [D, Hv, L]
    causal = jnp.tril(jnp.ones((length, length), bool))
    gamma = jnp.where(causal, jnp.exp(jnp.where(causal, big_g[..., :, None] - big_g[..., None, :], 0.0)), 0.0)
    kk = jnp.sum(k[..., :, None, :] * k[..., None, :, :], axis=-1) * gamma        # [D, Hv, L, L]
    qk = jnp.sum(q[..., :, None, :] * k[..., None, :, :], axis=-1) * gamma
    eg = jnp.exp(big_g)[..., None]                                                 # [D, Hv, L, 1]
    deltas = []
    for i in range(length):
        known = v[:, :, i] - eg[:, :, i] * read_k[:, :, i]
        for j in range(i):
            known = known - kk[:, :, i, j, None] * deltas[j]
        deltas.append(beta[:, :, i, None] * known)
    delta = jnp.stack(deltas, axis=2)                                              # [D, Hv, L, dv]
    o = eg * read_q + jnp.sum(qk[..., None] * delta[:, :, None], axis=-2)          # [D, Hv, L, dv]
    return heads_first(o), WindowDeltas(s0, k, delta, big_g)


def verify_deltanet(p, x, conv_state, recurrent_state, inputs, cfg: ModelConfig):
    """A Gated DeltaNet layer over the verify layout. Returns (out [T, H], (conv pool, window), (recurrent pool,
    WindowDeltas)): the pools untouched, each paired with what commit_positions writes into it later (decoder_stack
    carries the pairs in the buffers' places)."""
    pre = inputs.prefill
    mixed, z, b, a = deltanet_projections(p, x, cfg)
    read = jnp.maximum(pre.read_row, 0)                 # row 0 is the zero state
    halo = conv_state[read].astype(mixed.dtype)         # [D, K-1, C]
    window = jnp.concatenate([halo, to_prefill(mixed, inputs)], axis=1)
    mixed_p = conv_silu(window, p["conv_weight"]).astype(mixed.dtype)
    q, k, v, g, beta = delta_rule_inputs(mixed_p, to_prefill(b, inputs), to_prefill(a, inputs), p, cfg)
    o, deltas = delta_rule_window(q, k, v, g, beta, recurrent_state[read])
    d, length = o.shape[:2]
    flat = o.reshape((d * length,) + o.shape[2:])[: x.shape[0]]     # row-major groups are the flat tokens
    return deltanet_output(p, flat, z, x.dtype, cfg), (conv_state, window), (recurrent_state, deltas)


def commit_positions(buffers: CacheBuffers, keep, write_row, capture_at, capture_row) -> CacheBuffers:
    """`buffers` as decoder_stack returns them with verify_deltanet: conv entries (pool, window), recurrent entries
    (pool, WindowDeltas). Writes, per row, the state after position keep[i] (its last kept token) into write_row[i],
    and the state after position capture_at[i] into capture_row[i] when capture_row[i] > 0 and capture_at[i] <=
    keep[i] (with a narrow snapshot pool, capture rows are pool ids: narrowed into the pool). Rows with write_row 0
    (padding) write nothing: row 0 stays the zero state. Returns plain buffers."""
    first = buffers.conv[0][0].shape[0] if buffers.snapshot_recurrent else 0   # pool ids from here (0: no pool)
    live = jnp.where(write_row > 0, write_row, -1)
    capture = jnp.where((capture_row > 0) & (capture_at <= keep) & (write_row > 0), capture_row - first, -1)
    pools = zip(buffers.snapshot_conv, buffers.snapshot_recurrent) if first else [(None, None)] * len(buffers.conv)
    new_conv, new_recurrent, new_pool_conv, new_pool_recurrent = [], [], [], []
    for (conv, window), (recurrent, deltas), (pool_conv, pool_recurrent) in zip(buffers.conv, buffers.recurrent,
                                                                                 pools):
        halo = conv.shape[1]

        def put(conv, recurrent, row, j):         # the state after position j of row i into conv / recurrent[row[i]]
            j = jnp.clip(j, 0, deltas.decay.shape[-1] - 1)
            idx = (j + 1)[:, None] + jnp.arange(halo)[None, :]
            after = jnp.take_along_axis(window, idx[..., None], axis=1)      # [D, K-1, C]: inputs through j
            chosen = deltas.state_after(j)                                   # [D, Hv, dk, dv]: state j of row i
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

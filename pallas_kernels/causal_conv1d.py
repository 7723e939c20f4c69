"""Causal depthwise conv1d + SiLU over state rows: chunked (prefill groups) and single-step (decode) forms.

Math, per channel c with kernel width K:  y_t[c] = silu( sum_{j<K} w[c, j] * x_{t-K+1+j}[c] ),
where inputs before the segment start come from the conv state: the last K-1 inputs the sequence has seen
(zeros for a fresh sequence). The conv state is stored time-major, [R, K-1, D], one row per live sequence or
snapshot; row 0 is the zero state, never written (see docs/CONTRACTS.md). After a group of n tokens the new state is the last K-1
entries of [halo | x_0..x_{n-1}], where halo is the state entering the group.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _initial_windows(conv_state, read_row):
    """[N, K-1, D] state entering each group's segment; row -1 means zeros."""
    return conv_state[jnp.maximum(read_row, 0)]                 # row 0 is the zero state: -1 reads it too


def _write_rows(conv_state, tails, write_row, is_last, capture_row):
    tails = tails.astype(conv_state.dtype)
    nowhere = conv_state.shape[0]                 # out of bounds: dropped; row 0 stays the zero state
    conv_state = conv_state.at[jnp.where(is_last & (write_row > 0), write_row, nowhere)].set(tails, mode="drop")
    return conv_state.at[jnp.where(capture_row > 0, capture_row, nowhere)].set(tails, mode="drop")


def conv_silu(ext, weight):
    """ext [..., L + K - 1, D], weight [D, K] -> silu(conv) [..., L, D] in float32."""
    width = weight.shape[1]
    length = ext.shape[-2] - width + 1
    w = weight.astype(jnp.float32)
    acc = sum(ext[..., j:j + length, :].astype(jnp.float32) * w[:, j] for j in range(width))
    return jax.nn.silu(acc)


def causal_conv1d_chunked_reference(x, weight, conv_state, length, read_row, write_row, capture_row, is_first,
                                    is_last):
    """x: [N, C, D] groups; weight: [D, K]; conv_state: [R, K-1, D]; length, rows: [N]; is_first/is_last: [N] bool.
    Returns (y [N, C, D] in x.dtype, new conv_state)."""
    n, c, d = x.shape
    halo_len = weight.shape[1] - 1
    init = _initial_windows(conv_state, read_row).astype(x.dtype)
    # A group's halo is its segment's initial window (first group) or the previous group's tail, the last K-1
    # entries of [halo | x]. A tail comes from x alone when the group has >= K-1 rows; a shorter group (a cut at a
    # snapshot capture) takes the rest from its own halo. Each group has >= 1 row, so K-1 rounds of "halo <- tail of
    # the previous group" settle every chain, with only [N, K-1, D] arrays in the loop (a scan over the groups
    # carried [C + K-1, D] windows and ran ~5x slower on CPU).
    tail_pos = length[:, None] + jnp.arange(halo_len)[None, :]                 # [N, K-1] positions in [halo | x]
    from_x = jnp.take_along_axis(x, jnp.clip(tail_pos - halo_len, 0, c - 1)[..., None], axis=1)
    halo = init

    def tails_of(halo):
        from_halo = jnp.take_along_axis(halo, jnp.clip(tail_pos, 0, halo_len - 1)[..., None], axis=1)
        return jnp.where((tail_pos >= halo_len)[..., None], from_x, from_halo)

    for _ in range(halo_len):
        previous = jnp.concatenate([jnp.zeros_like(halo[:1]), tails_of(halo)[:-1]], axis=0)
        halo = jnp.where(is_first[:, None, None], init, previous)
    y = conv_silu(jnp.concatenate([halo, x], axis=1), weight)
    valid = jnp.arange(c)[None, :, None] < length[:, None, None]
    y = jnp.where(valid, y, 0.0).astype(x.dtype)
    return y, _write_rows(conv_state, tails_of(halo), write_row, is_last, capture_row)


def causal_conv1d_update_reference(x, weight, conv_state, read_row, write_row, capture_row):
    """One token per row. x: [N, D]; returns (y [N, D], new conv_state)."""
    window = jnp.concatenate([_initial_windows(conv_state, read_row).astype(x.dtype), x[:, None, :]], axis=1)
    # The output and the new state both read this one window: otherwise, with one row (a dynamic update), XLA:CPU
    # re-reads the state for the output and copies the whole pool twice to update it in place (49 rows: 0.3 -> 0.05
    # ms a layer); no change from 2 rows on.
    window = jax.lax.optimization_barrier(window)
    y = conv_silu(window, weight)[:, 0].astype(x.dtype)
    return y, _write_rows(conv_state, window[:, 1:], write_row, jnp.ones_like(read_row, bool), capture_row)

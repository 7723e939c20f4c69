"""Pallas (Triton backend) causal depthwise conv1d + SiLU over state rows; math as in causal_conv1d.py.

Chunked kernel (`causal_conv1d_chunked`):
- Grid (D / BD). One program owns BD channels and walks all N groups in order with a fori_loop, carrying the
  halo (the last K-1 inputs of its segment, K-1 vectors [BD] kept separately: K-1 is not a power of two) from
  group to group; a group with is_first takes its halo from read_row (zeros for -1).
- Per group: x [C, BD] is loaded once; the shifted inputs x_{t-s} (s = 1..K-1) are S_s x with S_s the [C, C]
  shift matrix (a 2-D dot, exact: one product by 1.0 per entry, ieee for f32), plus the halo on rows t < s.
  y = silu(sum_j w[:, j] x_{t-K+1+j}) in float32, zero on rows >= length.
- The new halo is the last K-1 entries of [halo | x_0..x_{length-1}], picked by masked reductions.
  It goes to write_row when is_last and to capture_row when it is not 0 (pool aliased input/output; writes to the
  dummy row 0 are skipped).

Update kernel (`causal_conv1d_update`): grid (N, D / BD); window = [state rows (K-1 vectors) | x]; one output
vector per program, state rows shifted by one and written to write_row and capture_row.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _silu(x):
    return x / (1.0 + jnp.exp(-x))


def _block_d(d, cap):
    """Largest power of two <= cap dividing d (channel block)."""
    block = 1
    while block < cap and d % (block * 2) == 0:
        block *= 2
    if block < 16:
        raise ValueError(f"causal_conv1d kernel: the channel count must be a multiple of 16, got {d}")
    return block


def _load_halo(state_ref, row, cols, width, dtype):
    """K-1 vectors [BD] of row `row` (zeros for -1), rounded to the activation dtype as the reference does."""
    r = jnp.maximum(row, 0)
    return [jnp.where(row >= 0, state_ref[r, j, cols].astype(dtype), 0).astype(jnp.float32)
            for j in range(width - 1)]


def _store_halo(state_ref, halo, write_row, write, capture_row, cols):
    for row, enabled in ((write_row, write & (write_row != 0)), (capture_row, capture_row != 0)):
        @pl.when(enabled)
        def _():
            for j, h in enumerate(halo):
                state_ref[row, j, cols] = h.astype(state_ref.dtype)


def _chunked_kernel(len_ref, read_ref, write_ref, cap_ref, first_ref, last_ref, x_ref, w_ref, state_in_ref, y_ref,
                    state_ref, *, block_d, width):
    del state_in_ref  # aliased with state_ref
    cols = pl.ds(pl.program_id(0) * block_d, block_d)
    num_groups, c, _ = x_ref.shape
    w = [w_ref[cols, j].astype(jnp.float32) for j in range(width)]                  # K vectors [BD]
    t_idx = jax.lax.broadcasted_iota(jnp.int32, (c, block_d), 0)
    row_i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    row_j = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def body(n, halo):
        read = read_ref[n]
        halo = jax.lax.cond(first_ref[n] != 0, lambda: _load_halo(state_ref, read, cols, width, x_ref.dtype),
                            lambda: halo)
        length = len_ref[n]
        x = x_ref[n, :, cols]                                                          # [C, BD]
        acc = w[width - 1] * x.astype(jnp.float32)
        for s in range(1, width):
            shift = jnp.where(row_i - s == row_j, 1.0, 0.0).astype(x.dtype)
            xs = jax.lax.dot(shift, x, precision=precision, preferred_element_type=jnp.float32)
            for t in range(min(s, c)):
                xs = jnp.where(t_idx == t, halo[width - 1 + t - s][None, :], xs)
            acc = acc + w[width - 1 - s] * xs
        y = jnp.where(t_idx < length, _silu(acc), 0.0)
        y_ref[n, :, cols] = y.astype(y_ref.dtype)
        xf = x.astype(jnp.float32)
        new_halo = []
        for j in range(width - 1):
            pos = length + j                                            # index into [halo | x]
            from_x = jnp.sum(jnp.where(t_idx == pos - (width - 1), xf, 0.0), axis=0)
            from_halo = from_x
            for i in range(width - 1):
                from_halo = jnp.where(pos == i, halo[i], from_halo)
            new_halo.append(from_halo)
        _store_halo(state_ref, new_halo, write_ref[n], last_ref[n] != 0, cap_ref[n], cols)
        return new_halo

    jax.lax.fori_loop(0, num_groups, body, [jnp.zeros((block_d,), jnp.float32)] * (width - 1))


@functools.partial(jax.jit, static_argnames=("interpret",))
def causal_conv1d_chunked(x, weight, conv_state, length, read_row, write_row, capture_row, is_first, is_last, *,
                          interpret=False):
    """x: [N, C, D]; weight: [D, K]; conv_state: [R, K-1, D]; rows: [N]. Returns (y [N, C, D] x.dtype, conv_state)."""
    n, c, d = x.shape
    if c < 16 or c & (c - 1):
        raise ValueError(f"causal_conv1d_chunked kernel: the group length C must be a power of two >= 16, got {c}")
    block_d = _block_d(d, 64)
    ints = tuple(a.astype(jnp.int32) for a in (length, read_row, write_row, capture_row, is_first, is_last))
    args = ints + (x, weight, conv_state)
    kernel = functools.partial(_chunked_kernel, block_d=block_d, width=weight.shape[1])
    return _conv_call(kernel, args, (d // block_d,), "causal_conv1d_chunked", interpret)


def _conv_call(kernel, args, grid, name, interpret):
    """Both conv kernels: whole arrays as blocks, outputs (y like x, conv_state aliased with the last input)."""
    x, conv_state = args[-3], args[-1]
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)),
        grid=grid,
        in_specs=[_whole(a.shape) for a in args],
        out_specs=(_whole(x.shape), _whole(conv_state.shape)),
        input_output_aliases={len(args) - 1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=name,
    )(*args)


def _update_kernel(read_ref, write_ref, cap_ref, x_ref, w_ref, state_in_ref, y_ref, state_ref, *, block_d, width):
    del state_in_ref  # aliased with state_ref
    n = pl.program_id(0)
    cols = pl.ds(pl.program_id(1) * block_d, block_d)
    window = _load_halo(state_ref, read_ref[n], cols, width, x_ref.dtype) + [x_ref[n, cols].astype(jnp.float32)]
    acc = sum(w_ref[cols, j].astype(jnp.float32) * window[j] for j in range(width))
    y_ref[n, cols] = _silu(acc).astype(y_ref.dtype)
    _store_halo(state_ref, window[1:], write_ref[n], True, cap_ref[n], cols)


@functools.partial(jax.jit, static_argnames=("interpret",))
def causal_conv1d_update(x, weight, conv_state, read_row, write_row, capture_row, *, interpret=False):
    """x: [N, D]; weight: [D, K]; conv_state: [R, K-1, D]; rows: [N]. Returns (y [N, D] x.dtype, conv_state)."""
    n, d = x.shape
    block_d = _block_d(d, 256)
    ints = tuple(a.astype(jnp.int32) for a in (read_row, write_row, capture_row))
    args = ints + (x, weight, conv_state)
    kernel = functools.partial(_update_kernel, block_d=block_d, width=weight.shape[1])
    return _conv_call(kernel, args, (n, d // block_d), "causal_conv1d_update", interpret)

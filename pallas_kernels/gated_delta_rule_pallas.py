"""Pallas (Triton backend) gated delta rule for NVIDIA GPUs: chunked prefill and recurrent decode.

Math, row semantics and the chunked (WY / UT) form are in gated_delta_rule.py; these kernels compute the same
thing with the state in float32 registers.

Chunked kernel (`chunk_gated_delta_rule`):
- Grid (Hv, dv / BV), BV = min(dv, 32). One program owns one value head and one BV-wide slice of its state
  S [dk, BV] and walks all N groups in order with a fori_loop, so a segment's state is carried group to group
  without leaving registers. At a group with is_first it loads S from its read_row (zeros for -1).
- Per group (C rows, padded rows masked by `length`): G = cumsum(g); Gamma = exp(G_i - G_j) on i >= j (masked
  before exp); T = (I + strict_lower(beta K K^T * Gamma))^-1 by forward substitution, one row per step
  (T[i] = e_i - L[i] T, rows j < i already final); W = T diag(beta exp G) K, U = T diag(beta) V[:, BV];
  V' = U - W S; O = diag(exp G) Q S + ((Q K^T) * Gamma) V'; S <- exp(G_last) S + (diag(exp(G_last - G)) K)^T V'.
  All dots are 2-D with float32 accumulation (ieee for f32 operands); K K^T and Q K^T keep the input dtype.
- End states go straight into the state pool (aliased input/output): to write_row when is_last, and to
  capture_row when it is not 0. Writes to the dummy row 0 are skipped (its content is undefined).
- The per-group triangular solve is recomputed by each of the dv / BV programs of a head; in exchange there is a
  single launch and no intermediate W/U/state tensors in HBM.

Recurrent kernel (`recurrent_gated_delta_rule`): grid (N, Hv, dv / BV); each program loads S[read_row] [dk, BV],
applies one token (decay, delta, rank-1 update, read-out) with vector ops and writes write_row and capture_row.

Pool hazard: reads and writes share one buffer. A row written in a call must not be read later in the same call
by another segment (the scheduler never restores from a row it captures into, or writes, in the same step).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _is_pow2(x):
    return x >= 1 and x & (x - 1) == 0


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _dot(a, b, contract):
    """2-D dot with float32 accumulation; ieee precision when an operand is float32."""
    precision = jax.lax.Precision.HIGHEST if jnp.float32 in (a.dtype, b.dtype) else None
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _check_dims(dk, dv, what):
    if not (_is_pow2(dk) and _is_pow2(dv) and dk >= 16 and dv >= 16):
        raise ValueError(f"{what} kernel: dk and dv must be powers of two >= 16, got dk={dk}, dv={dv}")


def _load_state(state_ref, row, h, cols):
    """[dk, BV] slice of row `row` of the pool; row -1 means zeros."""
    s = state_ref[jnp.maximum(row, 0), h, :, cols]
    return jnp.where(row >= 0, s, 0.0)


def _store_state(state_ref, s, write_row, write, capture_row, h, cols):
    @pl.when(write & (write_row != 0))
    def _():
        state_ref[write_row, h, :, cols] = s

    @pl.when(capture_row != 0)
    def _():
        state_ref[capture_row, h, :, cols] = s


def _unit_lower_inverse(lower):
    """(I + lower)^-1 for a strictly lower-triangular [C, C] matrix, by forward substitution."""
    c = lower.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)
    idx = jax.lax.broadcasted_iota(jnp.int32, (c,), 0)

    def body(i, t):
        l_i = jnp.sum(jnp.where(rows == i, lower, 0.0), axis=0)           # [C]: l_i[j] = L[i, j]
        row = jnp.where(idx == i, 1.0, 0.0) - jnp.sum(l_i[:, None] * t, axis=0)
        return jnp.where(rows == i, row[None, :], t)

    return jax.lax.fori_loop(1, c, body, eye)


def _chunk_kernel(len_ref, read_ref, write_ref, cap_ref, first_ref, last_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                  state_in_ref, o_ref, state_ref, *, ratio, block_v):
    del state_in_ref  # aliased with state_ref
    h, vb = pl.program_id(0), pl.program_id(1)
    hk = h // ratio
    cols = pl.ds(vb * block_v, block_v)
    num_groups, c, _, dk = q_ref.shape
    t_idx = jax.lax.broadcasted_iota(jnp.int32, (c,), 0)
    row_i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    row_j = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    incl = row_i >= row_j
    strict = row_i > row_j

    def body(n, s):                                                                # s: [dk, BV] f32
        read = read_ref[n]
        s = jax.lax.cond(first_ref[n] != 0, lambda: _load_state(state_ref, read, h, cols), lambda: s)
        valid = t_idx < len_ref[n]
        q = jnp.where(valid[:, None], q_ref[n, :, hk, :], 0).astype(q_ref.dtype)  # [C, dk]
        k = jnp.where(valid[:, None], k_ref[n, :, hk, :], 0).astype(k_ref.dtype)
        v = v_ref[n, :, h, cols].astype(jnp.float32)                                # [C, BV]
        g = jnp.where(valid, g_ref[n, :, h].astype(jnp.float32), 0.0)               # [C]
        beta = jnp.where(valid, beta_ref[n, :, h].astype(jnp.float32), 0.0)
        big_g = jnp.cumsum(g)
        gamma = jnp.where(incl, jnp.exp(jnp.where(incl, big_g[:, None] - big_g[None, :], 0.0)), 0.0)
        lower = jnp.where(strict, beta[:, None] * _dot(k, k, ((1,), (1,))) * gamma, 0.0)
        t_mat = _unit_lower_inverse(lower)
        kf = k.astype(jnp.float32)
        u = _dot(t_mat, beta[:, None] * v, ((1,), (0,)))                             # [C, BV]
        w = _dot(t_mat, (beta * jnp.exp(big_g))[:, None] * kf, ((1,), (0,)))        # [C, dk]
        v_new = u - _dot(w, s, ((1,), (0,)))
        qk = _dot(q, k, ((1,), (1,))) * gamma
        o = (jnp.exp(big_g)[:, None] * _dot(q.astype(jnp.float32), s, ((1,), (0,)))
             + _dot(qk, v_new, ((1,), (0,))))
        o_ref[n, :, h, cols] = jnp.where(valid[:, None], o, 0.0)
        g_last = jnp.sum(jnp.where(t_idx == c - 1, big_g, 0.0))                    # padded rows have g = 0
        kd = jnp.exp(g_last - big_g)[:, None] * kf
        s = jnp.exp(g_last) * s + _dot(kd, v_new, ((0,), (0,)))
        _store_state(state_ref, s, write_ref[n], last_ref[n] != 0, cap_ref[n], h, cols)
        return s

    jax.lax.fori_loop(0, num_groups, body, jnp.zeros((dk, block_v), jnp.float32))


@functools.partial(jax.jit, static_argnames=("interpret",))
def chunk_gated_delta_rule(q, k, v, g, beta, length, state, read_row, write_row, capture_row, is_first, is_last, *,
                           interpret=False):
    """q, k: [N, C, Hk, dk]; v: [N, C, Hv, dv]; g, beta: [N, C, Hv]; state: [R, Hv, dk, dv] f32; rows: [N].
    Returns (o [N, C, Hv, dv] float32, new state pool)."""
    n, c, hk, dk = q.shape
    hv, dv = v.shape[2:]
    _check_dims(dk, dv, "chunk_gated_delta_rule")
    if not (_is_pow2(c) and c >= 16):
        raise ValueError(f"chunk_gated_delta_rule kernel: the group length C must be a power of two >= 16, got {c}")
    block_v = min(dv, 32)
    q, k = (x.astype(jnp.promote_types(q.dtype, k.dtype)) for x in (q, k))
    i32 = jnp.int32
    ints = tuple(x.astype(i32) for x in (length, read_row, write_row, capture_row, is_first, is_last))
    args = ints + (q, k, v, g, beta, state)
    kernel = functools.partial(_chunk_kernel, ratio=hv // hk, block_v=block_v)
    o, state = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n, c, hv, dv), jnp.float32), jax.ShapeDtypeStruct(state.shape, state.dtype)),
        grid=(hv, dv // block_v),
        in_specs=[_whole(a.shape) for a in args],
        out_specs=(_whole((n, c, hv, dv)), _whole(state.shape)),
        input_output_aliases={len(args) - 1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="chunk_gated_delta_rule",
    )(*args)
    return o, state


def _recurrent_kernel(read_ref, write_ref, cap_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, state_in_ref, o_ref,
                      state_ref, *, ratio, block_v):
    del state_in_ref  # aliased with state_ref
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // ratio
    cols = pl.ds(vb * block_v, block_v)
    q = q_ref[n, hk, :].astype(jnp.float32)                                         # [dk]
    k = k_ref[n, hk, :].astype(jnp.float32)
    v = v_ref[n, h, cols].astype(jnp.float32)                                       # [BV]
    s = _load_state(state_ref, read_ref[n], h, cols) * jnp.exp(g_ref[n, h].astype(jnp.float32))
    delta = beta_ref[n, h].astype(jnp.float32) * (v - jnp.sum(k[:, None] * s, axis=0))
    s = s + k[:, None] * delta[None, :]
    o_ref[n, h, cols] = jnp.sum(q[:, None] * s, axis=0)
    _store_state(state_ref, s, write_ref[n], True, cap_ref[n], h, cols)


@functools.partial(jax.jit, static_argnames=("interpret",))
def recurrent_gated_delta_rule(q, k, v, g, beta, state, read_row, write_row, capture_row, *, interpret=False):
    """q, k: [N, Hk, dk]; v: [N, Hv, dv]; g, beta: [N, Hv]; state: [R, Hv, dk, dv] f32; rows: [N].
    Returns (o [N, Hv, dv] float32, new state pool)."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1:]
    _check_dims(dk, dv, "recurrent_gated_delta_rule")
    block_v = min(dv, 32)
    ints = tuple(x.astype(jnp.int32) for x in (read_row, write_row, capture_row))
    args = ints + (q, k, v, g, beta, state)
    kernel = functools.partial(_recurrent_kernel, ratio=hv // hk, block_v=block_v)
    o, state = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n, hv, dv), jnp.float32), jax.ShapeDtypeStruct(state.shape, state.dtype)),
        grid=(n, hv, dv // block_v),
        in_specs=[_whole(a.shape) for a in args],
        out_specs=(_whole((n, hv, dv)), _whole(state.shape)),
        input_output_aliases={len(args) - 1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="recurrent_gated_delta_rule",
    )(*args)
    return o, state

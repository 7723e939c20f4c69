"""Pallas (Triton backend) gated delta rule for NVIDIA GPUs: chunked prefill and recurrent decode.

Math, row semantics and the chunked (WY / UT) form are in gated_delta_rule.py; these kernels compute the same
thing with the state in float32 registers.

Chunked form (`chunk_gated_delta_rule`), two kernels as in FLA's split of the work:
1. WY kernel, grid (N, Hv), fully parallel. Per group and value head (C rows, padded rows masked by `length`):
   G = cumsum(g); Gamma = exp(G_i - G_j) below the diagonal (masked before exp);
   T = (I + strict_lower(beta K K^T * Gamma))^-1 by forward substitution, one row per step
   (T[i] = e_i - L[i] T, rows j < i already final); W = T diag(beta exp G) K [C, dk], U = T diag(beta) V [C, dv].
   Writes W, U, G in float32 ([N, Hv, C, d]: about 2 * (dk + dv) * 4 bytes per token and value head).
2. State kernel, grid (Hv, dv / BV), BV = min(dv, 32): the only sequential part, dots only. One program owns one
   value head and a BV-wide slice of its state S [dk, BV] in float32 registers and walks all N groups in order,
   so a segment's state is carried group to group without leaving registers; a group with is_first loads S from
   its read_row (zeros for -1). Per group: V' = U - W S; O = diag(exp G) Q S + ((Q K^T) * Gamma) V';
   S <- exp(G_last) S + (diag(exp(G_last - G)) K)^T V'. End states go straight into the state pool (aliased
   input/output): to write_row when is_last and to capture_row when it is not 0; writes to the dummy row 0 are
   skipped (its content is undefined).
All dots are 2-D with float32 accumulation (ieee for f32 operands); K K^T and Q K^T keep the input dtype.

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


def _wy_kernel(len_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, gcum_ref):
    """One (group, value head): G = cumsum(g), T = (I + strict_lower(beta K K^T Gamma))^-1,
    W = T diag(beta e^G) K, U = T diag(beta) V."""
    c = k_ref.shape[0]
    valid = jax.lax.broadcasted_iota(jnp.int32, (c,), 0) < len_ref[pl.program_id(0)]
    k = jnp.where(valid[:, None], k_ref[...], 0).astype(k_ref.dtype)                 # [C, dk]
    g = jnp.where(valid, g_ref[...].astype(jnp.float32), 0.0)                          # [C]
    beta = jnp.where(valid, beta_ref[...].astype(jnp.float32), 0.0)
    big_g = jnp.cumsum(g)
    row_i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    row_j = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    strict = row_i > row_j
    gamma = jnp.exp(jnp.where(strict, big_g[:, None] - big_g[None, :], 0.0))
    lower = jnp.where(strict, beta[:, None] * _dot(k, k, ((1,), (1,))) * gamma, 0.0)
    t_mat = _unit_lower_inverse(lower)
    u_ref[...] = _dot(t_mat, beta[:, None] * v_ref[...].astype(jnp.float32), ((1,), (0,)))
    w_ref[...] = _dot(t_mat, (beta * jnp.exp(big_g))[:, None] * k.astype(jnp.float32), ((1,), (0,)))
    gcum_ref[...] = big_g


def _state_kernel(len_ref, read_ref, write_ref, cap_ref, first_ref, last_ref, q_ref, k_ref, w_ref, u_ref, gcum_ref,
                  state_in_ref, o_ref, state_ref, *, ratio, block_v):
    """One (value head, V-block), all groups in order: the only sequential part, dots only."""
    del state_in_ref  # aliased with state_ref
    h, vb = pl.program_id(0), pl.program_id(1)
    hk = h // ratio
    cols = pl.ds(vb * block_v, block_v)
    num_groups, c, _, dk = q_ref.shape
    t_idx = jax.lax.broadcasted_iota(jnp.int32, (c,), 0)
    incl = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0) >= jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)

    def body(n, s):                                                                    # s: [dk, BV] f32
        read = read_ref[n]
        s = jax.lax.cond(first_ref[n] != 0, lambda: _load_state(state_ref, read, h, cols), lambda: s)
        valid = t_idx < len_ref[n]
        q = jnp.where(valid[:, None], q_ref[n, :, hk, :], 0).astype(q_ref.dtype)      # [C, dk]
        k = jnp.where(valid[:, None], k_ref[n, :, hk, :], 0).astype(k_ref.dtype)
        big_g = gcum_ref[n, h, :]                                                      # [C], flat after length
        gamma = jnp.where(incl, jnp.exp(jnp.where(incl, big_g[:, None] - big_g[None, :], 0.0)), 0.0)
        v_new = u_ref[n, h, :, cols] - _dot(w_ref[n, h, :, :], s, ((1,), (0,)))         # [C, BV]
        qk = _dot(q, k, ((1,), (1,))) * gamma
        o = (jnp.exp(big_g)[:, None] * _dot(q.astype(jnp.float32), s, ((1,), (0,)))
             + _dot(qk, v_new, ((1,), (0,))))
        o_ref[n, :, h, cols] = jnp.where(valid[:, None], o, 0.0)
        g_last = jnp.sum(jnp.where(t_idx == c - 1, big_g, 0.0))
        kd = jnp.exp(g_last - big_g)[:, None] * k.astype(jnp.float32)
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
    ratio = hv // hk
    q, k = (x.astype(jnp.promote_types(q.dtype, k.dtype)) for x in (q, k))
    ints = tuple(x.astype(jnp.int32) for x in (length, read_row, write_row, capture_row, is_first, is_last))
    f32 = jnp.float32

    w, u, gcum = pl.pallas_call(                                                       # parallel over (group, head)
        _wy_kernel,
        out_shape=(jax.ShapeDtypeStruct((n, hv, c, dk), f32), jax.ShapeDtypeStruct((n, hv, c, dv), f32),
                   jax.ShapeDtypeStruct((n, hv, c), f32)),
        grid=(n, hv),
        in_specs=[_whole((n,)),
                  pl.BlockSpec((None, c, None, dk), lambda i, h: (i, 0, h // ratio, 0)),
                  pl.BlockSpec((None, c, None, dv), lambda i, h: (i, 0, h, 0)),
                  pl.BlockSpec((None, c, None), lambda i, h: (i, 0, h)),
                  pl.BlockSpec((None, c, None), lambda i, h: (i, 0, h))],
        out_specs=(pl.BlockSpec((None, None, c, dk), lambda i, h: (i, h, 0, 0)),
                   pl.BlockSpec((None, None, c, dv), lambda i, h: (i, h, 0, 0)),
                   pl.BlockSpec((None, None, c), lambda i, h: (i, h, 0))),
        compiler_params=pltriton.CompilerParams(num_warps=4 if c * max(dk, dv) <= 64 * 64 else 8, num_stages=1),
        interpret=interpret,
        name="gdr_chunk_wy",
    )(ints[0], k, v, g, beta)

    block_v = min(dv, 32)
    args = ints + (q, k, w, u, gcum, state)
    o, state = pl.pallas_call(                                                         # sequential over groups
        functools.partial(_state_kernel, ratio=ratio, block_v=block_v),
        out_shape=(jax.ShapeDtypeStruct((n, c, hv, dv), f32), jax.ShapeDtypeStruct(state.shape, state.dtype)),
        grid=(hv, dv // block_v),
        in_specs=[_whole(a.shape) for a in args],
        out_specs=(_whole((n, c, hv, dv)), _whole(state.shape)),
        input_output_aliases={len(args) - 1: 1},
        # One stage: double-buffering q, k, W (f32 [C, dk] each) for the next group could exceed shared memory.
        compiler_params=pltriton.CompilerParams(num_warps=4 if c * dk <= 64 * 64 else 8, num_stages=1),
        interpret=interpret,
        name="gdr_chunk_state",
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

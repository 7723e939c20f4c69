"""Gated delta rule over state rows: chunked (prefill) and recurrent (decode) forms.

Math (per value head h, state S in R^{dk x dv}, float32; v head h reads q/k head h // r, r = Hv / Hk):
    S <- exp(g_t) * S                      decay first
    delta_t = beta_t * (v_t - S^T k_t)     prediction from the decayed state
    S <- S + k_t delta_t^T                 rank-1 update
    o_t = S^T q_t                          read after the update (token t sees itself)
q and k arrive L2-normalised, q already scaled by dk^-1/2; g <= 0 is the log decay, beta in (0, 1).

Chunked form (chunk of C rows i, j; S the state entering the chunk; G the inclusive cumsum of g):
    Gamma_ij = exp(G_i - G_j) for i >= j else 0          (masked before exp: no overflow)
    T = (I + strict_lower(diag(beta) K K^T * Gamma))^-1    (unit lower triangular, the UT/WY transform)
    U = T diag(beta) V,   W = T diag(beta exp(G)) K,   V' = U - W S
    O = diag(exp(G)) Q S + ((Q K^T) * Gamma) V'
    S_next = exp(G_last) S + (diag(exp(G_last - G)) K)^T V'
The C x C parts (T, Q K^T * Gamma) are computed for all chunks at once; the sequential loop over chunks forms each
chunk's C x d operands (W, U, the decayed q and k) while they are in cache and runs the S-dependent matmuls (the
split of FLA's kernels, intra-chunk then state passing, except that on CPU forming W and U for every chunk up
front streamed ~90 MB per layer through memory at 1024 tokens: 69-76 -> ~52 ms a layer, bit-identical).

Rows layout (see docs/CONTRACTS.md): the state pool has R rows [R, Hv, dk, dv]; row 0 is the zero state (writes
meant for nowhere are dropped or write zeros there). Each group (one chunk of one sequence's segment) reads its
initial state from `read_row` when it is the first group of its segment (-1 or 0 means a zero state), writes its
end state to `write_row` when it is the last, and to `capture_row` (0 = none) always. Groups of one segment are
consecutive and in order.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST
_IN_PLACE_ROW_BYTES = 1 << 16      # decode: state rows from this size are updated in place (see below)


def expand_heads(x, num_v_heads):
    """[..., Hk, d] -> [..., Hv, d]: v head h uses q/k head h // r (repeat_interleave, not tile)."""
    r = num_v_heads // x.shape[-2]
    return x if r == 1 else jnp.repeat(x, r, axis=-2)


def _big_rows(pool) -> bool:
    return pool[0].size * pool.dtype.itemsize >= _IN_PLACE_ROW_BYTES


def _gather_rows(pool, rows):
    """States for `rows` ([N]); row -1 (or 0) means a zero state. Small rows only (the batched decode path)."""
    # Row 0 is the zero state (nothing writes it), so -1 and 0 both read zeros with a plain gather (a gather with
    # mode="fill" or a select after it costs ~5x more on CPU).
    return pool[jnp.maximum(rows, 0)]


def _scatter_rows(pool, states, write_row, capture_row):
    """New states go to the live row and to the capture row; writes to row 0 (padding, no capture) are dropped, so
    row 0 stays the zero state. Small rows only (the batched decode path)."""
    nowhere = pool.shape[0]
    pool = pool.at[jnp.where(write_row > 0, write_row, nowhere)].set(states, mode="drop")
    return pool.at[jnp.where(capture_row > 0, capture_row, nowhere)].set(states, mode="drop")


def _put_row(pool, s, row):
    """pool[row] = s for row > 0; row 0 (nothing to write) is rewritten with zeros, which keeps it the zero state."""
    return jax.lax.dynamic_update_index_in_dim(pool, jnp.where(row > 0, s, 0.0).astype(pool.dtype), row, 0)


def _copy_rows(pool, src, dst):
    """pool[dst[i]] = pool[src[i]] for the i with dst[i] > 0, one row at a time over only those rows (a step
    captures few of its rows' states: a masked scatter would move every row)."""
    order = jnp.argsort(dst <= 0, stable=True)            # rows to write first
    count = jnp.sum(dst > 0)

    def put(carry):
        j, pool = carry
        i = order[j]
        row = jax.lax.dynamic_index_in_dim(pool, src[i], keepdims=False)
        return j + 1, jax.lax.dynamic_update_index_in_dim(pool, row, dst[i], 0)

    return jax.lax.while_loop(lambda c: c[0] < count, put, (jnp.int32(0), pool))[1]


def _mm(a, b):
    return jnp.matmul(a, b, precision=_HIGHEST)


def _mm_nt(a, b):
    """a [..., m, d] @ b[..., n, d]^T without materialising the transpose."""
    return jnp.einsum("...md,...nd->...mn", a, b, precision=_HIGHEST)


def _forward_substitute(lower):
    """(I + lower)^-1 for strictly lower-triangular [..., c, c], row by row: row i = e_i - L[i] T."""
    eye = jnp.eye(lower.shape[-1], dtype=lower.dtype)

    def row(i, t):
        return t.at[..., i, :].set(eye[i] - jnp.einsum("...j,...jk->...k", lower[..., i, :], t, precision=_HIGHEST))

    return jax.lax.fori_loop(1, lower.shape[-1], row, jnp.broadcast_to(eye, lower.shape))


def unit_lower_inverse(lower, base=16):
    """(I + lower)^-1 for strictly lower-triangular [..., C, C]: diagonal blocks of `base` rows by forward
    substitution (all blocks at once), then merged pairwise with [[A, 0], [B, D]]^-1 = [[A^-1, 0],
    [-D^-1 B A^-1, D^-1]]. About 5x faster on CPU than row-by-row substitution over C = 64."""
    c = lower.shape[-1]
    if c <= base or c % 2:
        return _forward_substitute(lower)
    h = c // 2
    halves = unit_lower_inverse(jnp.stack([lower[..., :h, :h], lower[..., h:, h:]]), base)
    a_inv, d_inv = halves[0], halves[1]
    below = -_mm(_mm(d_inv, lower[..., h:, :h]), a_inv)
    top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([below, d_inv], axis=-1)], axis=-2)


def chunk_gated_delta_rule_reference(q, k, v, g, beta, length, state, read_row, write_row, capture_row,
                                     is_first, is_last):
    """Pure-jnp chunked gated delta rule over groups; the CPU fast path and the Pallas oracle.

    q, k: [N, C, Hk, dk]  v: [N, C, Hv, dv]  g, beta: [N, C, Hv]  length: [N] valid rows per group
    state: [R, Hv, dk, dv] float32; read_row, write_row, capture_row: [N] int32; is_first, is_last: [N] bool
    Returns (o [N, C, Hv, dv] float32, new state pool).
    """
    n, c, _, dk = q.shape
    hv = v.shape[2]
    valid = jnp.arange(c)[None, :] < length[:, None]                       # [N, C]
    f32 = jnp.float32
    r = hv // q.shape[2]
    # Heads first: [N, H, C, d]. Products of q and k are taken per key head, then shared by its r value heads.
    q, k = (jnp.swapaxes(jnp.where(valid[..., None, None], x.astype(f32), 0.0), 1, 2) for x in (q, k))
    kk, qk = (jnp.repeat(_mm_nt(x, k), r, axis=1) for x in (k, q))          # [N, Hv, C, C]
    v = jnp.swapaxes(v.astype(f32), 1, 2)
    g = jnp.swapaxes(jnp.where(valid[..., None], g.astype(f32), 0.0), 1, 2)
    beta = jnp.swapaxes(jnp.where(valid[..., None], beta.astype(f32), 0.0), 1, 2)
    big_g = jnp.cumsum(g, axis=-1)                                          # [N, Hv, C]
    causal = jnp.tril(jnp.ones((c, c), bool))
    gamma = jnp.exp(jnp.where(causal, big_g[..., :, None] - big_g[..., None, :], -jnp.inf))  # incl. diagonal
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    lower = jnp.where(strict, beta[..., :, None] * kk * gamma, 0.0)
    t_mat = unit_lower_inverse(lower)
    qk = qk * gamma
    g_last = big_g[..., -1]                                                 # padded rows have g = 0
    live = jnp.where(is_last & (write_row > 0), write_row, 0)     # end state -> live row (last group only)
    read = jnp.maximum(read_row, 0)                               # row 0 is the zero state

    # Sequential over groups. A group's V block is read, then replaced in place by its output (no zero-filled output
    # buffer), and its end state goes straight into the pool rows it is written to (no stack of every group's
    # state). Its C x d operands are formed here, per group, while they are in cache.
    def group(i, carry):
        prev, pool, out = carry
        init = jax.lax.dynamic_index_in_dim(pool, read[i], keepdims=False).astype(f32)
        s_in = jnp.where(is_first[i], init, prev)
        kr, qr = jnp.repeat(k[i], r, axis=0), jnp.repeat(q[i], r, axis=0)     # [Hv, C, dk]
        eg = jnp.exp(big_g[i])[..., None]                                   # e^G [Hv, C, 1]
        w = _mm(t_mat[i], (beta[i][..., None] * eg) * kr)                   # W = T diag(beta e^G) K
        u = _mm(t_mat[i], beta[i][..., None] * out[i])                      # U = T diag(beta) V
        v_new = u - _mm(w, s_in)                                            # V' = U - W S
        o = _mm(eg * qr, s_in) + _mm(qk[i], v_new)                          # e^G Q S + (QK^T * Gamma) V'
        kd = jnp.exp(g_last[i][:, None] - big_g[i])[..., None] * kr         # diag(e^(G_last - G)) K
        s_out = jnp.exp(g_last[i])[:, None, None] * s_in + jnp.einsum(      # e^G_last S + Kd^T V'
            "hck,hcv->hkv", kd, v_new, precision=_HIGHEST)
        pool = _put_row(_put_row(pool, s_out, live[i]), s_out, capture_row[i])
        return s_out, pool, jax.lax.dynamic_update_index_in_dim(out, o, i, 0)

    # The loop stops after the last group with tokens: a bucket's trailing padding groups would only rewrite row 0
    # (a 1024-token step with 9 of 40 groups padding: 80 -> 72 ms a layer). Two groups per iteration when N is even
    # (a padding group run inside the last pair is harmless: zero length, no rows to write).
    used = jnp.max(jnp.where(length > 0, jnp.arange(1, n + 1), 0))
    carry = (jnp.zeros((hv, dk, v.shape[-1]), f32), state, v)
    if n % 2 == 0:
        _, state, o = jax.lax.fori_loop(0, (used + 1) // 2, lambda j, c: group(2 * j + 1, group(2 * j, c)), carry)
    else:
        _, state, o = jax.lax.fori_loop(0, used, group, carry)
    o = jnp.where(valid[:, None, :, None], o, 0.0)
    return jnp.swapaxes(o, 1, 2), state


def recurrent_gated_delta_rule_reference(q, k, v, g, beta, state, read_row, write_row, capture_row):
    """One token per row (decode). q, k: [N, Hk, dk]  v: [N, Hv, dv]  g, beta: [N, Hv]; rows as in the chunked form
    with is_first = is_last = True. Returns (o [N, Hv, dv] float32, new state pool).

    Per row:  S^T k and S^T q in one pass over S (the state BEFORE the update; memory-bound on CPU), then
    delta = beta (v - e^g S^T k),  o = e^g S^T q + (k.q) delta,  S' = e^g S + k delta^T.
    Big states (real models: Hv*dk*dv floats = 1 MiB a row) run one (row, value head) pair at a time in place, in
    a loop over the live rows only: each head's dk x dv block (64 KiB) is read, updated and written back while it is
    in cache. On XLA:CPU that is ~2x faster than whole rows at a time (whose 1 MiB slice copies and batched small
    dots run far below memory bandwidth) and ~6x faster than gathering all rows, a batched update and a scatter.
    Small states (tests, tiny models) run batched, where the loop's per-iteration overhead would dominate.
    Padding rows (write_row 0) write nothing; their outputs are unused (zeros on the in-place path, the zero
    state's output on the batched one). Contract for both: no row reads a row another row of the same call writes
    (live rows are distinct; restored snapshot rows are not written)."""
    hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    f32 = jnp.float32
    q, k = expand_heads(q.astype(f32), hv), expand_heads(k.astype(f32), hv)
    v, beta = v.astype(f32), beta.astype(f32)
    decay = jnp.exp(g.astype(f32))                                           # [N, Hv]
    if not _big_rows(state):
        return _recurrent_batched(q, k, v, decay[..., None], beta, state, read_row, write_row, capture_row)
    live = write_row > 0
    order = jnp.argsort(~live, stable=True)                                  # live rows first

    def head(j, carry):
        pool, o = carry
        i, h = order[j // hv], j % hv
        s = jax.lax.dynamic_slice(pool, (jnp.maximum(read_row[i], 0), h, 0, 0), (1, 1, dk, dv))[0, 0].astype(f32)
        # S^T k, S^T q [2, dv], written as a multiply-reduce: XLA:CPU still runs it as a dot (bit-identical) but
        # slices the block once for the reads and the update, not twice (16 rows, one layer: 3.2 -> 2.9 ms).
        reads = jnp.sum(s[None] * jnp.stack([k[i, h], q[i, h]])[:, :, None], axis=1)
        delta = beta[i, h] * (v[i, h] - decay[i, h] * reads[0])
        o = o.at[i, h].set(decay[i, h] * reads[1] + jnp.dot(k[i, h], q[i, h], precision=_HIGHEST) * delta)
        new = decay[i, h] * s + k[i, h][:, None] * delta[None, :]
        return jax.lax.dynamic_update_slice(pool, new[None, None].astype(pool.dtype), (write_row[i], h, 0, 0)), o

    # Not unrolled: unrolled, XLA:CPU fuses an update into its pool write, the next read then needs the old pool,
    # and it copies the whole pool (a 2-row step 45 -> 260 ms, measured).
    state, o = jax.lax.fori_loop(0, jnp.sum(live) * hv, head, (state, jnp.zeros(v.shape, f32)))
    return o, _copy_rows(state, write_row, capture_row)


def _recurrent_batched(q, k, v, decay, beta, state, read_row, write_row, capture_row):
    s = _gather_rows(state, read_row)
    # S^T k and S^T q [N, Hv, 2, dv] as a multiply-reduce, not a batched dot: XLA:CPU pays per batch of its dots
    # (tiny model, one layer: 16 rows 44 -> 10 us, 64 rows 194 -> 31 us; tiny b64 decode call of 8 steps ~46 ->
    # ~34 ms, side by side).
    reads = jnp.sum(jnp.stack([k, q], axis=-2)[..., None] * s[:, :, None], axis=-2)
    delta = beta[..., None] * (v - decay * reads[:, :, 0])
    o = decay * reads[:, :, 1] + jnp.sum(k * q, axis=-1, keepdims=True) * delta
    s = decay[..., None] * s + k[..., :, None] * delta[..., None, :]
    return o, _scatter_rows(state, s, write_row, capture_row)


def gated_delta_rule_token_scan(q, k, v, g, beta, initial_state=None):
    """Token-by-token oracle for ONE sequence: q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv].
    Returns (o [T, Hv, dv], final state [Hv, dk, dv]), all float32."""
    hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    q, k = expand_heads(q.astype(jnp.float32), hv), expand_heads(k.astype(jnp.float32), hv)
    s0 = jnp.zeros((hv, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[:, None, None]
        delta = b_t[:, None] * (v_t - jnp.einsum("hk,hkv->hv", k_t, s, precision=_HIGHEST))
        s = s + k_t[:, :, None] * delta[:, None, :]
        return s, jnp.einsum("hk,hkv->hv", q_t, s, precision=_HIGHEST)

    s, o = jax.lax.scan(step, s0, (q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)))
    return o, s

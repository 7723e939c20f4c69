"""The gated delta rule over dense batches [B, T], differentiable: the training path's DeltaNet core.

Same math as pallas_kernels/gated_delta_rule.py (its module docstring states it), in the chunked form with a zero
initial state: per chunk of C rows, G the inclusive cumsum of g,
    Gamma_ij = exp(G_i - G_j) for i >= j else 0            (masked before exp: no overflow, no NaN gradient)
    A = I + strict_lower(diag(beta) K K^T * Gamma)
    U = A^-1 diag(beta) V,   W = A^-1 diag(beta exp(G)) K    (unit lower-triangular solves)
    V' = U - W S,   O = diag(exp(G)) Q S + ((Q K^T) * Gamma) V',   S <- exp(G_last) S + (diag(exp(G_last - G)) K)^T V'
The engine's version works on state rows and stops its loop at the last live group (a while loop, which reverse
mode cannot differentiate); this one is a `lax.scan` over the chunks of every row at once, with the engine's
triangular inverse (forward substitution over 16-row blocks, merged by matmuls: a fixed-trip loop, so it has a
VJP). Not `triangular_solve`: on XLA:CPU that calls LAPACK's strsm, and a batch-16 training step on a 2-core host
could hang with both XLA worker threads inside it. The Pallas kernels have no VJP, so training uses this on GPU
too. A row's tail is padded with q = k = v = beta = g = 0, which leaves the state exact.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule import unit_lower_inverse

_HIGHEST = jax.lax.Precision.HIGHEST
CHUNK = 64


def _to_chunks(x, num_chunks, chunk):
    """[B, T, H, ...] -> [NC, B, H, C, ...] float32, zero-padded to NC * C rows."""
    b, t = x.shape[:2]
    x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, num_chunks * chunk - t)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape((b, num_chunks, chunk) + x.shape[2:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)


def dense_gated_delta_rule(q, k, v, g, beta, chunk: int = CHUNK):
    """q, k: [B, T, Hk, dk] (L2-normalised, q scaled by dk^-1/2); v: [B, T, Hv, dv]; g, beta: [B, T, Hv].
    Zero initial state; v head h reads q/k head h // (Hv / Hk). Returns o [B, T, Hv, dv] float32."""
    return dense_gated_delta_rule_with_state(q, k, v, g, beta, None, chunk)[0]


def dense_gated_delta_rule_with_state(q, k, v, g, beta, state, chunk: int = CHUNK):
    """dense_gated_delta_rule from `state` [B, Hv, dk, dv] (None: zeros). Returns (o [B, T, Hv, dv], the end state
    [B, Hv, dk, dv]), float32."""
    b, t, hk, _ = q.shape
    hv = v.shape[2]
    c = min(chunk, t)
    num_chunks = -(-t // c)
    q, k = (jnp.repeat(x, hv // hk, axis=2) for x in (q, k))
    q, k, v, g, beta = (_to_chunks(x, num_chunks, c) for x in (q, k, v, g, beta))   # [NC, B, Hv, C, ...]
    big_g = jnp.cumsum(g, axis=-1)                                                  # [NC, B, Hv, C]
    causal = jnp.tril(jnp.ones((c, c), bool))
    gamma = jnp.exp(jnp.where(causal, big_g[..., :, None] - big_g[..., None, :], -jnp.inf))
    kk = jnp.einsum("...id,...jd->...ij", k, k, precision=_HIGHEST)
    lower = jnp.where(jnp.tril(causal, -1), beta[..., :, None] * kk * gamma, 0.0)
    eg = jnp.exp(big_g)[..., None]                                                  # [NC, B, Hv, C, 1]
    # U and W in one solve: A^-1 [diag(beta) V | diag(beta e^G) K]
    rhs = jnp.concatenate([beta[..., None] * v, beta[..., None] * eg * k], axis=-1)
    u_w = jnp.matmul(unit_lower_inverse(lower), rhs, precision=_HIGHEST)
    u, w = u_w[..., :v.shape[-1]], u_w[..., v.shape[-1]:]
    qk = jnp.einsum("...id,...jd->...ij", q, k, precision=_HIGHEST) * gamma
    g_last = big_g[..., -1]                                                         # [NC, B, Hv]
    k_decayed = jnp.exp(g_last[..., None] - big_g)[..., None] * k

    def step(s, xs):                                                                # s: [B, Hv, dk, dv]
        u_c, w_c, eq_c, qk_c, kd_c, gl_c = xs
        v_new = u_c - jnp.matmul(w_c, s, precision=_HIGHEST)
        o = jnp.matmul(eq_c, s, precision=_HIGHEST) + jnp.matmul(qk_c, v_new, precision=_HIGHEST)
        s = jnp.exp(gl_c)[..., None, None] * s + jnp.einsum("...ck,...cv->...kv", kd_c, v_new, precision=_HIGHEST)
        return s, o

    s0 = jnp.zeros((b, hv, k.shape[-1], v.shape[-1]), jnp.float32) if state is None else state.astype(jnp.float32)
    s_end, o = jax.lax.scan(step, s0, (u, w, eg * q, qk, k_decayed, g_last))        # [NC, B, Hv, C, dv]
    o = jnp.moveaxis(o, 0, 1).swapaxes(2, 3).reshape(b, num_chunks * c, hv, -1)
    return o[:, :t], s_end
